"""The drafters, by name. Each module of this package that defines `DRAFTER` (a drafters.base.DrafterKind) is one
drafter, named as its module: its config and flags, its checks, what it needs of memory and of the target's prefill,
how it prepares (its own prefill, or a KV selection), how it proposes, its hooks, its summary and its term in the
cost model. A new drafter is one module here (and its test): nothing else names it.

Modules are listed without importing them, and a drafter's module is imported when it is asked for by name
(`get`): a run of one drafter, a record, a sweep point. What needs every drafter (`registry`: the run parser with
each drafter's flags, `compare`, a sweep's keys, an alias or an option looked up across drafters) imports them all,
which is why no drafter module imports an optional kernel library at its top (errors.require does it where used)."""
from __future__ import annotations

import functools
import importlib
import pkgutil

from magicdec.errors import MagicDecError


@functools.lru_cache(maxsize=1)
def modules() -> tuple[str, ...]:
    """This package's module names, in name order, none imported: the drafters' and their shared parts'."""
    return tuple(sorted(info.name for info in pkgutil.iter_modules(__path__)))


@functools.lru_cache(maxsize=None)
def _kind(module: str):
    """A module's DRAFTER, imported now, or None (a shared part: base, model_draft, head_draft)."""
    kind = getattr(importlib.import_module(f"{__name__}.{module}"), "DRAFTER", None)
    if kind is not None and kind.name != module:
        raise TypeError(f"drafter {kind.name!r} is defined in {__name__}.{module}: a drafter's module is named as it "
                        "is (so that it is imported by name)")
    return kind


def registry() -> dict:
    """name -> DrafterKind, every drafter, in name order (imports every module of the package)."""
    return {m: kind for m in modules() if (kind := _kind(m)) is not None}


def names() -> list[str]:
    return list(registry())


def having(capability: str) -> list[str]:
    """The drafters whose kind says yes to `capability` (a DrafterKind attribute: supports_trees, ...)."""
    return [n for n, kind in registry().items() if getattr(kind, capability)]


def canonical(name: str) -> str:
    """A drafter's name from its name or an alias (the seed's `longspec` for the standalone draft); `baseline` as is.
    A name imports its own module only; an alias, found on no module, is looked up across every drafter."""
    if name == "baseline":
        return name
    if name in modules() and _kind(name) is not None:
        return name
    for kind in registry().values():
        if name in kind.aliases:
            return kind.name
    raise MagicDecError(f"unknown drafter {name!r}: choose baseline or one of {', '.join(names())}")


def get(name: str):
    return _kind(canonical(name))


def owners(key: str) -> list[str]:
    """The drafters whose config has the option `key`."""
    from magicdec import options
    return [n for n, kind in registry().items() if key in options.keys(kind.Config)]
