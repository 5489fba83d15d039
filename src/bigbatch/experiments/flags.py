"""A command's options as one settings class: flags, help, a study file's table, checks.

``compare``, ``tune``, ``critical-batch`` and ``federated`` each take their options as
the fields of one frozen dataclass of :func:`bigbatch.knobs.setting` fields (default,
bounds, help written once). From them come the flags (``--min-fidelity`` for
``min_fidelity``), the help, docs/cli.md's table (:func:`options_table`), the command's
``--config`` table (``[tune]``, ``[compare]``, ...) and the checks: one
:class:`~bigbatch.experiments.config.ConfigError` naming the option and the value. A
flag overrides the file's table, which overrides the default.
"""

# (a generator such as tyro would own the whole parser and print errors in several lines;
# this needs ~100)

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import Field, fields
from typing import Any, TypeVar

from .._checks import did_you_mean
from ..knobs import FieldKind, check_settings
from .config import ConfigError

__all__ = ["add_flags", "checked", "given", "options_table", "settings_from"]

_T = TypeVar("_T")


def _options(cls: type) -> dict[str, Field]:
    return {f.name: f for f in fields(cls) if "knob" in f.metadata}


def flag(f: Field) -> str:
    """The field's flag: its ``flag`` metadata, else ``--`` and its name with dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_named(cls: type, name: str) -> str:
    # the flag of cls's option called name (a field's name and its flag may differ)
    return flag(_options(cls)[name])


def shown(value: Any) -> str:
    """A default as the command line writes it."""
    if isinstance(value, (tuple, list)):
        return ",".join(shown(v) for v in value) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def add_flags(
    parser: argparse.ArgumentParser, cls: type, *, skip: Sequence[str] = (), when: str = ""
) -> None:
    """One flag per option of ``cls`` (but ``skip``), its help ending in the default and
    opening with ``when`` (the flag of another option it serves); a flag not given is
    None, so a file's table shows through (:func:`given`)."""
    for f in _options(cls).values():
        if f.name in skip:
            continue
        knob = f.metadata["knob"]
        text = f"{when}{knob.help} (default {shown(f.default)})".replace("%", "%%")
        if FieldKind.of(f).item == "bool":
            parser.add_argument(flag(f), dest=f.name, action="store_true", default=None, help=text)
            continue
        parser.add_argument(flag(f), dest=f.name, metavar=_metavar(f), help=text)


def _metavar(f: Field) -> str:
    """What a flag's value looks like: ``N``, ``X``, ``N1,N2,...``, ``a|b|c``."""
    kind, choices = FieldKind.of(f), f.metadata["knob"].choices
    if choices:
        return "|".join(choices)
    letter = {"int": "N", "float": "X"}.get(kind.item, "TEXT")
    return f"{letter}1,{letter}2,..." if kind.listed else letter


def _parsed(f: Field, text: str, name: str, *, item: bool = False) -> Any:
    """A flag's (or a table's) text as the field's type (``item``: as one item of a list);
    one :class:`ConfigError` naming the flag (or the option). ``none`` is an empty list, or
    None where the field allows."""
    kind = FieldKind.of(f)
    listed = kind.listed and not item
    convert = {"int": int, "float": float}.get(kind.item, str)
    if text.strip().lower() == "none" and (listed or kind.optional):
        return () if listed else None
    try:
        if listed:
            parts = [part.strip() for part in text.split(",")]
            if not all(parts):  # an empty item: a typo, not "nothing here"
                raise ValueError(text)
            return tuple(convert(part) for part in parts)
        return convert(text)
    except ValueError:
        what = {"int": "whole number", "float": "number"}.get(kind.item, "text")
        many = f"comma-separated {what}s" if listed else f"a {what}"
        raise ConfigError(f"{name} takes {many}, got {text!r}") from None


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``cls`` given as flags, as their types."""
    out = {}
    for name, f in _options(cls).items():
        text = getattr(args, name, None)
        if text is not None:
            out[name] = text if isinstance(text, bool) else _parsed(f, text, flag(f))
    return out


def settings_from(
    cls: type[_T],
    section: str,
    table: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
    *,
    also: Sequence[str] = (),
) -> _T:
    """``cls`` from its defaults, a file's ``[section]`` table over them and the flags
    given (:func:`given`) over that. An unknown name in the table is one error naming it
    and the names the table takes (``also``: those another part of the command reads); a
    value its bounds refuse, one naming where it was given (``[tune] seed``, ``--search-seed``)."""
    known = _options(cls)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for name, value in (table or {}).items():
        if name not in known:
            names = ", ".join([*also, *known])
            hint = did_you_mean(name, known)
            raise ConfigError(f"unknown option {name!r} in [{section}]: it takes {names}{hint}")
        where[name] = f"[{section}] {name}"
        values[name] = _as_kind(known[name], value, where[name])
    for name, value in (flags or {}).items():
        values[name], where[name] = value, flag(known[name])
    try:
        return cls(**values)
    except ConfigError as err:
        message = str(err)
        name = message.split(" ", 1)[0]
        if name not in where:
            raise
        raise ConfigError(where[name] + message[len(name) :]) from None


def _as_kind(f: Field, value: Any, name: str) -> Any:
    """A table's value as the field's type: text parsed as a flag's would be (a list of
    text item by item), one item a list of one; an error names the option as ``name``."""
    if isinstance(value, str):
        return _parsed(f, value, name)
    if not FieldKind.of(f).listed:
        return value
    if not isinstance(value, (list, tuple)):
        return (value,)
    return tuple(_parsed(f, v, name, item=True) if isinstance(v, str) else v for v in value)


def checked(settings: Any) -> None:
    """Check ``settings``' options against their bounds (from ``__post_init__``): a
    :class:`ConfigError` naming the option and the value."""
    try:
        check_settings(settings)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def options_table(cls: type) -> str:
    """The options of ``cls`` as ``docs/cli.md`` lists them: flag, meaning, default."""
    rows = ["| option | meaning | default |", "|---|---|---|"]
    for f in _options(cls).values():
        written = flag(f) if FieldKind.of(f).item == "bool" else f"{flag(f)} {_metavar(f)}"
        cells = (written, f.metadata["knob"].help, shown(f.default))
        rows.append("| `{}` | {} | `{}` |".format(*(c.replace("|", "\\|") for c in cells)))
    return "\n".join(rows)
