"""How a component exposes its constructor's arguments as configuration keys.

A component (a batch controller, an optimizer wrapper, a compression state)
lists the arguments a run's configuration may set in a ``CONFIG`` mapping
from key to :class:`Knob`. The key's default is the argument's default in
the constructor's signature, so every knob has one default, in one place;
the key's help and bounds sit beside it. The command line's schema is
generated from these declarations (``bigbatch.experiments.config``), the way
timm's registry keeps models as data.

A component whose constructor only stores its settings declares them once, as
the fields of a dataclass (:func:`settings`): each field's default, bounds and
help sit in one :func:`setting`, from which come the constructor, its checks
(:func:`check_settings`, naming the argument and the value), its ``repr`` (the
constructor call) and, for the fields with a config key, ``CONFIG``.
"""

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
        """``value`` checked against these bounds as a ``kind`` ("int", "float", "bool",
        "str"; any with ``choices``): one ``ValueError`` naming ``name`` and the value; a
        number is returned as a float, a whole number as itself."""
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
    """Each key's default from ``component``'s constructor (``NO_DEFAULT`` where required,
    the knob's ``unset`` value where the signature's default is None)."""
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
    """A setting as a dataclass field: its default, and beside it its ``help``, its bounds
    (``low``, ``high``, ``low_open``, ``high_open``, ``choices``: :class:`Knob`'s) and, where
    a run's config sets it, its config ``key`` (a component's: the part after its prefix,
    ``initial`` for ``batch.initial``; a run key's section field: the whole key); a
    command's option may name its ``flag`` where it is not the field's name
    (``bigbatch.experiments.flags``)."""
    knob = Knob("", help, **bounds)
    return field(default=default, metadata={"knob": knob, "key": key, "flag": flag})


def settings(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a dataclass of its :func:`setting` fields (compared by identity: it
    may hold state beside them) with ``CONFIG``, its config keys, generated from them.

    Its ``__post_init__`` calls :func:`check_settings` first, then builds its state."""
    cls = dataclass(eq=False)(cls)
    config = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("key"):
            config[f.metadata["key"]] = replace(f.metadata["knob"], param=f.name)
    cls.CONFIG = config  # type: ignore[attr-defined]
    return cls


@dataclass(frozen=True)
class FieldKind:
    """What a setting's annotation says: its item type (``int``, ``float``, ``bool``,
    ``str``), whether it is a list (``tuple[X, ...]``) and whether None is allowed
    (``X | None``); read from the annotation's text, deferred or not."""

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
    """Check every :func:`setting` field of ``component`` against its bounds, by its
    annotated type (a whole number, a number, a flag, one of ``choices``; ``X | None``
    also None; ``tuple[X, ...]`` each item): one ``ValueError`` naming the argument and
    the value; a number is stored as a float (in a frozen class too)."""
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
