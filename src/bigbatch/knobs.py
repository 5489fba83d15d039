"""How a component exposes its constructor's arguments as configuration keys.

A component (a batch controller, an optimizer wrapper, a compression state)
lists the arguments a run's configuration may set in a ``CONFIG`` mapping
from key to :class:`Knob`. The key's default is the argument's default in
the constructor's signature, so every knob has one default, in one place;
the key's help and bounds sit beside it. The command line's schema is
generated from these declarations (``bigbatch.experiments.config``), the way
timm's registry keeps models as data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Knob", "signature_defaults"]

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
    #: the config's value for "not set" where the signature has none to give (e.g. 0 for a
    #: length the run derives from its budget)
    unset: Any = None
    #: a run's default where it must differ from the library's (the help says why)
    run_default: Any = None
    #: for a text value with a grammar (a duration, a table of points): the parser whose
    #: ``ValueError`` names what it could not read; the config keeps the text
    parse: Callable[[str], Any] | None = None


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
