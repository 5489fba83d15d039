"""How a component exposes its constructor's arguments as configuration keys: a
``CONFIG`` of :class:`Knob`, or a dataclass of :func:`setting` fields (:func:`settings`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, TypeVar

from ._checks import check_flag, check_number, choice

__all__ = [
    "FieldKind",
    "Knob",
    "check_settings",
    "setting",
    "settings",
    "signature_defaults",
]

#: a knob whose default the signature does not give (a required argument)
NO_DEFAULT = inspect.Parameter.empty


@dataclass(frozen=True)
class Knob:
    """One constructor argument as a config key."""

    #: the constructor's argument
    param: str
    #: what the key means, one line
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    #: ``high`` itself refused
    high_open: bool = False
    #: the config's value for "not set" where the signature has none to give (e.g. 0 for a
    #: length the run derives from its budget)
    unset: Any = None
    #: a run's default where it must differ from the library's (the help says why)
    run_default: Any = None
    #: for a text value with a grammar (a duration, a table of points): the parser whose
    #: ``ValueError`` names what it could not read; the config keeps the text
    parse: Callable[[str], Any] | None = None

    def check(self, name: str, value: Any, kind: str) -> Any:
        """``value`` checked as a ``kind`` ("int", "float", "bool", "str") against the bounds:
        one ``ValueError`` naming ``name``; a number returns as a float, a whole one as itself."""
        if self.choices is not None:
            return choice(name, value, self.choices)
        if kind == "bool":
            return check_flag(name, value)
        if kind in ("int", "float"):
            return check_number(
                name,
                value,
                low=-math.inf if self.low is None else self.low,
                high=math.inf if self.high is None else self.high,
                low_open=self.low_open,
                high_open=self.high_open,
                whole=kind == "int",
            )
        if kind == "str" and not isinstance(value, str):
            raise ValueError(f"{name} must be text, got {value!r}")
        return value


def signature_defaults(component: Any, knobs: Mapping[str, Knob]) -> dict[str, Any]:
    """Each key's default from ``component``'s constructor (``NO_DEFAULT`` where required)."""
    parameters = inspect.signature(component).parameters
    out = {}
    for key, knob in knobs.items():
        default = parameters[knob.param].default
        if knob.run_default is not None:
            default = knob.run_default
        out[key] = knob.unset if default is None else default
    return out


_T = TypeVar("_T")


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    key: str | None = None,
    flag: str | None = None,
    **bounds: Any,
) -> Any:
    """A dataclass field: its default, ``help``, bounds (:class:`Knob`'s), and where a config
    sets it its ``key`` (and a command option's ``flag``)."""
    knob = Knob("", help, **bounds)
    return field(default=default, metadata={"knob": knob, "key": key, "flag": flag})


def settings(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a dataclass of its :func:`setting` fields (compared by identity) with
    ``CONFIG``; its ``__post_init__`` calls :func:`check_settings` first."""
    cls = dataclass(eq=False)(cls)
    config = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("key"):
            config[f.metadata["key"]] = replace(f.metadata["knob"], param=f.name)
    cls.CONFIG = config  # type: ignore[attr-defined]
    return cls


@dataclass(frozen=True)
class FieldKind:
    """A setting's item type, whether it is a ``tuple[X, ...]`` and whether None is allowed."""

    item: str
    listed: bool = False
    optional: bool = False

    @classmethod
    def of(cls, f: Field) -> FieldKind:
        # text where the module defers annotations, else the type: ``tuple[int, ...]`` and
        # ``float | None`` write themselves out, ``int`` is a class with a name
        text = f.type.__name__ if isinstance(f.type, type) else str(f.type)
        optional = text.endswith(" | None")
        text = text.removesuffix(" | None")
        listed = text.startswith("tuple[") and text.endswith(", ...]")
        item = text.removeprefix("tuple[").removesuffix(", ...]") if listed else text
        return cls(item, listed, optional)


def check_settings(component: Any) -> None:
    """Check every :func:`setting` field of ``component`` by its annotated type and bounds:
    one ``ValueError`` naming the argument and the value; numbers stored as floats."""
    for f in fields(component):
        knob = f.metadata.get("knob")
        if knob is None:
            continue
        value, kind = getattr(component, f.name), FieldKind.of(f)
        if kind.optional and value is None:
            continue
        if kind.listed:
            if not isinstance(value, (tuple, list)):
                raise ValueError(f"{f.name} must be a list, got {value!r}")
            value = tuple(knob.check(f.name, v, kind.item) for v in value)
        else:
            value = knob.check(f.name, value, kind.item)
        object.__setattr__(component, f.name, value)
