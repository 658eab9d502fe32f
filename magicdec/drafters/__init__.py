"""The drafters, by name. Each module of this package that defines `DRAFTER` (a drafters.base.DrafterKind) is one
drafter: its config and flags, its checks, what it needs of memory and of the target's prefill, how it prepares
(its own prefill, or a KV selection), how it proposes, its hooks, its summary and its term in the cost model. The
modules are found by listing the package, so a new drafter is one module here (and its test): nothing else names it.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

from magicdec.errors import MagicDecError


@functools.lru_cache(maxsize=1)
def registry() -> dict:
    """name -> DrafterKind, every module of this package that defines DRAFTER, in name order."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        kind = getattr(module, "DRAFTER", None)
        if kind is not None:
            found[kind.name] = kind
    return found


def names() -> list[str]:
    return list(registry())


def canonical(name: str) -> str:
    """A drafter's name from its name or an alias (the seed's `longspec` for the standalone draft); `baseline` as is."""
    if name == "baseline":
        return name
    for kind in registry().values():
        if name == kind.name or name in kind.aliases:
            return kind.name
    raise MagicDecError(f"unknown drafter {name!r}: choose baseline or one of {', '.join(names())}")


def get(name: str):
    return registry()[canonical(name)]


def owners(key: str) -> list[str]:
    """The drafters whose config has the option `key`."""
    from magicdec import options

    return [n for n, kind in registry().items() if key in options.keys(kind.Config)]
