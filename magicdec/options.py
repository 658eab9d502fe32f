"""Options: the fields of the run config's frozen dataclasses, each declared once with its help text, and turned into
command-line flags, sweep TOML keys and record entries from that one declaration.

An option's key is its field name; its flag is `--key` (or the `flag` it names, e.g. `--no_fuse` for `fuse`), plus
any aliases. Every flag's argparse default is SUPPRESS, so a parsed namespace holds only what the user typed: the
dataclass defaults (and a script's own, e.g. TriForce's) are applied when the config is built, and `--help` shows
them.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Callable

from magicdec.errors import MagicDecError


def option(default, help: str, *aliases: str, parse: Callable | None = None, nargs: str | None = None,
           choices=None, metavar: str | None = None, flag: str | None = None, consts: dict | None = None):
    """A config field that is also a flag and a TOML key. `parse` turns one command-line word into a value (by
    default: the type of the default, str where it is None); `nargs="+"` makes the value a tuple; `consts` maps
    extra flags that set a fixed value (`--compile` sets step_mode "compile")."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, aliases=aliases, parse=parse, nargs=nargs, choices=choices, metavar=metavar, flag=flag,
        consts=consts or {}))


def fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or f"--{f.name}"


def is_switch(f: dataclasses.Field) -> bool:
    return isinstance(f.default, bool)


def parser_of(f: dataclasses.Field) -> Callable:
    if f.metadata["parse"]:
        return f.metadata["parse"]
    d = f.default[0] if isinstance(f.default, tuple) and f.default else f.default
    return {int: int, float: float, Path: Path}.get(type(d), str) if d is not None else str


def shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return str(value)


def add_flags(group, cls, defaults: dict, taken: dict[str, str], owners: dict[str, list[str]] | None = None,
              only=None) -> None:
    """cls's options as flags of an argparse group; `defaults` are those shown in --help (a script's own over the
    dataclass's); `taken` maps flags already added to their keys (an option two drafters share is one flag);
    `owners` names the drafters that take each key, shown in its help; `only`: these keys alone."""
    for f in fields(cls):
        if flag_of(f) in taken or (only is not None and f.name not in only):
            continue
        default = defaults.get(f.name, f.default)
        text = f.metadata["help"]
        if owners and f.name in owners:
            text += f" [{', '.join(owners[f.name])}]"
        if default is not None and default is not False and default != () and not (is_switch(f) and f.metadata["flag"]):
            text += f" (default: {shown(default)})"
        names = [flag_of(f), *f.metadata["aliases"]]
        if is_switch(f):
            group.add_argument(*names, dest=f.name, action="store_const", const=not f.default if f.metadata["flag"]
                               else True, default=argparse.SUPPRESS, help=text)
        else:
            group.add_argument(*names, dest=f.name, type=parser_of(f), nargs=f.metadata["nargs"],
                               choices=f.metadata["choices"], metavar=f.metadata["metavar"],
                               default=argparse.SUPPRESS, help=text)
        for const_flag, value in f.metadata["consts"].items():
            group.add_argument(const_flag, dest=f.name, action="store_const", const=value, default=argparse.SUPPRESS,
                               help=f"the same as {flag_of(f)} {value}")
        for name in names + list(f.metadata["consts"]):
            taken[name] = f.name


def coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    """A value from a TOML file or a record, as the field holds it: a word parsed as the command line would, a
    number kept a number, a list a tuple where the option takes several values. Bad types: one line naming them."""
    def bad(why):
        raise MagicDecError(f"{where}{f.name} = {value!r}: {why}")

    if is_switch(f):
        if not isinstance(value, bool):
            bad("must be true or false")
        return value
    if value is None:
        return None
    if f.metadata["nargs"]:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(one(f, v, bad) for v in items)
    if isinstance(value, (list, tuple, dict)):
        bad("takes one value here, not a list (a list in a sweep's grid is an axis: one value per point)")
    return one(f, value, bad)


def number_type(f: dataclasses.Field):
    """int or float where the option is a number, else None: its parser's (int, float, or a parser's `number`:
    gamma's, which also takes the word auto, has none), or its default's type."""
    parse = f.metadata["parse"]
    if parse is not None:
        return parse if parse in (int, float) else getattr(parse, "number", None)
    d = f.default[0] if isinstance(f.default, tuple) and f.default else f.default
    return type(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def one(f: dataclasses.Field, value, bad):
    parse, number = parser_of(f), number_type(f)
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        bad("has the wrong type")
    if number and not isinstance(value, (int, float)):
        bad(f"must be a number ({number.__name__})")
    if number is int and isinstance(value, float) and not value.is_integer():
        bad("must be an integer")
    try:
        out = parse(value if not isinstance(value, (int, float)) or parse in (int, float) else str(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        bad(str(e))
    if f.metadata["choices"] and out not in f.metadata["choices"]:
        bad(f"must be one of {', '.join(map(str, f.metadata['choices']))}")
    return out


def build(cls, given: dict, defaults: dict, where: str = "", **resolved):
    """cls from the given options over `defaults` over its own defaults; `resolved` are values computed by the
    caller (device-dependent defaults) that fill a field left at None."""
    values = {}
    for f in fields(cls):
        if f.name in given:
            values[f.name] = coerce(f, given[f.name], where)
        elif f.name in defaults:
            values[f.name] = coerce(f, defaults[f.name], where)
        else:
            values[f.name] = f.default
        if values[f.name] is None and f.name in resolved:
            values[f.name] = resolved[f.name]
    return cls(**values)


def as_options(obj) -> dict:
    """A config dataclass as its option dict (JSON-ready: paths as strings, tuples as lists)."""
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v
    return {f.name: plain(getattr(obj, f.name)) for f in fields(type(obj))}


def as_flags(given: dict) -> list[str]:
    """Option values as the command line that asks for them: a switch (True) bare, False or None left out, a list
    as its values."""
    out = []
    for key, value in given.items():
        if value is None or value is False:
            continue
        out += [f"--{key}"] + ([] if value is True else [str(v) for v in value] if isinstance(value, (list, tuple))
                               else [str(value)])
    return out


def keys(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def flag(key: str, *classes) -> str:
    """The flag a user types for an option key."""
    for cls in classes:
        for f in fields(cls):
            if f.name == key:
                return flag_of(f)
    return f"--{key}"
