"""Command-line flags from nested dataclass configs: one flag per chosen field, its --help the field's entry
in its class's docstring, its default the default config's value; the parsed flags build the config back.

The dataclass configs of this repository (MaskConfig, GRPOConfig, DemoConfig, MaskrollConfig) document
their fields in the class docstring, one `name: text` entry each (`a / b: text` documents both), so the
text a reader of the class sees is the --help a user sees (an inherited field's entry is its base's, unless
the subclass words it again). A field is named by its path from the root
config ("grpo.mask.method"); its flag is its own name (--method), so the chosen fields' names must be
unique. Types: Literal → choices, bool → a switch (--x when the default is False, --no-x when True),
int / float / str / Path (or `... | None`) → that type.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

_ENTRY = re.compile(r"^([a-z_][a-z0-9_]*(?: / [a-z_][a-z0-9_]*)*): (.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """name → the text of its `name: text` entry in `cls`'s docstring (continuation lines indented), or
    in the nearest base class's that has one: inherited fields keep their docs, and a subclass may word an
    inherited field's entry again (StageConfig and the stages' configs)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # the bases first: a subclass's entries replace theirs
        docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The `name: text` entries of the docstring `cls` itself declares (not one inherited)."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in inspect.cleandoc(cls.__dict__.get("__doc__") or "").splitlines():
        if m := _ENTRY.match(line):
            names = m.group(1).split(" / ")
            for name in names:
                docs[name] = m.group(2).strip()
        elif names and line.startswith(" ") and line.strip():
            for name in names:
                docs[name] += " " + line.strip()
        else:
            names = []
    return docs


def _owner(root: type, path: str) -> tuple[type, str]:
    """The dataclass that declares the field at `path`, and the field's name."""
    *parents, name = path.split(".")
    cls = root
    for parent in parents:
        cls = typing.get_type_hints(cls)[parent]
    return cls, name


def _value_at(config: object, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def add_flags(parser: argparse.ArgumentParser, default: object, paths: Sequence[str]) -> None:
    """A flag for each field path of `default`'s class, in order, defaulting to `default`'s value."""
    root = type(default)
    seen: set[str] = set()
    for path in paths:
        cls, name = _owner(root, path)
        if name in seen:
            raise ValueError(f"two flags named --{name.replace('_', '-')} ({path})")
        seen.add(name)
        hint = _without_none(typing.get_type_hints(cls)[name])
        value = _value_at(default, path)
        help_ = field_docs(cls).get(name)
        flag = "--" + name.replace("_", "-")
        if hint is bool:
            if value:
                parser.add_argument(f"--no-{flag[2:]}", dest=name, action="store_false", help=help_)
            else:
                parser.add_argument(flag, dest=name, action="store_true", help=help_)
        elif typing.get_origin(hint) is Literal:
            parser.add_argument(flag, choices=typing.get_args(hint), default=value, help=help_)
        elif hint in (int, float, str, Path):
            parser.add_argument(flag, type=hint, default=value, help=help_)
        else:
            raise TypeError(f"no flag for {path}: {hint}")


def from_flags(root: type, args: argparse.Namespace, paths: Sequence[str]) -> Any:
    """`root` built from the parsed flags: each nested config is constructed anew (never `replace`d, so
    that values it derives from its fields, like MaskConfig's δ per divergence, follow the flags), and
    fields without a flag keep their defaults."""
    values = {path: getattr(args, _owner(root, path)[1]) for path in paths}
    return _build(root, values, "")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in fields(cls):
        path = prefix + f.name
        if path in values:
            kw[f.name] = values[path]
        elif is_dataclass(hints[f.name]) and any(p.startswith(path + ".") for p in values):
            kw[f.name] = _build(hints[f.name], values, path + ".")
    return cls(**kw)


def parse_stage_config(cls: type, prog: str, description: str, paths: Sequence[str], argv: list[str]) -> Any:
    """A stage's config (`maskroll reward`, `maskroll teacher`) from its flags. --help shows every flag
    with its default although some have none (the config's required fields, $MASKROLL_REDIS_URL unset):
    the defaults come from an unvalidated instance; the config built from the parsed flags is validated,
    and an invalid value exits 2 with its message."""
    import dataclasses

    defaults = object.__new__(cls)
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        object.__setattr__(defaults, f.name, value)
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(p, defaults, paths)
    a = p.parse_args(argv)
    try:
        return from_flags(cls, a, paths)
    except ValueError as e:
        p.error(str(e))
        raise  # p.error exits
