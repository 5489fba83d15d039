"""A length of training in samples, tokens, optimizer steps or a share of the budget,
read from the counts every checkpoint holds::

    Duration.parse("25%")         # a quarter of the run's budget (in samples)
    Duration.parse("2M tokens")   # 2,000,000 tokens: samples × tokens per sample
    Duration.parse("500 steps")   # 500 optimizer steps
    Duration.parse("100k")        # 100,000 samples (a bare number is samples)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["UNITS", "Duration"]

#: the units a duration can be written in; ``budget`` is written as a percentage
UNITS = ("samples", "tokens", "steps", "budget")

_SCALE = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}
_PATTERN = re.compile(
    r"\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<scale>[kKMGB]?)"
    r"\s*(?P<unit>%|samples?|tokens?|steps?)?\s*"
)


@dataclass(frozen=True)
class Duration:
    """``value`` in ``unit`` (one of :data:`UNITS`; ``budget`` as a fraction, 0.25 = 25%)."""

    value: float
    unit: str = "samples"

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"a duration's unit is one of {', '.join(UNITS)}, got {self.unit!r}")
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value)):
            raise ValueError(f"a duration is a finite number, got {self.value!r}")
        if isinstance(self.value, bool) or self.value < 0:
            raise ValueError(f"a duration is a number that is not negative, got {self.value!r}")
        if self.unit in ("samples", "tokens", "steps") and self.value != int(self.value):
            raise ValueError(f"a duration of {self.unit} is whole, got {self.value!r}")
        if self.unit == "budget" and self.value > 1:
            raise ValueError(f"a share of the budget is at most 1 (100%), got {self.value!r}")

    @classmethod
    def parse(cls, text: str | int | float | Duration) -> Duration:
        """A duration from ``"25%"``, ``"2M tokens"``, ``"500 steps"``, ``"100k samples"`` or a
        number (samples); ``ValueError`` otherwise."""
        if isinstance(text, Duration):
            return text
        if isinstance(text, bool):
            raise ValueError(f"not a duration: {text!r}")
        if isinstance(text, (int, float)):
            return cls(text, "samples")
        match = _PATTERN.fullmatch(str(text))
        if match is None:
            raise ValueError(
                f"not a duration: {text!r} (write e.g. '25%', '2M tokens', '500 steps', "
                "'100k samples' or a number of samples)"
            )
        value = float(match["number"]) * _SCALE[match["scale"]]
        if not math.isfinite(value):
            raise ValueError(f"not a duration: {text!r} is too long to count")
        unit = match["unit"] or "samples"
        if unit == "%":
            if value > 100:
                raise ValueError(f"not a duration: {text!r} is more than the whole budget")
            return cls(value / 100, "budget")
        if not unit.endswith("s"):
            unit += "s"
        if unit in ("samples", "tokens", "steps") and value != int(value):
            raise ValueError(f"not a duration: {text!r} is not a whole number of {unit}")
        return cls(int(value) if value == int(value) else value, unit)

    def elapsed(
        self,
        samples: int,
        steps: int,
        *,
        tokens_per_sample: int | None = None,
        budget: int | None = None,
    ) -> float:
        """How far a run of ``samples`` in ``steps`` optimizer steps is, in this unit."""
        self.check(tokens_per_sample=tokens_per_sample, budget=budget)
        if self.unit == "samples":
            return float(samples)
        if self.unit == "steps":
            return float(steps)
        if self.unit == "tokens":
            return float(samples) * tokens_per_sample  # type: ignore[operator]
        return samples / budget  # type: ignore[operator]

    def share(self, *, tokens_per_sample: int | None = None, budget: int | None = None) -> float:
        """This duration as a share of ``budget`` samples; none for optimizer steps."""
        self.check(tokens_per_sample=tokens_per_sample, budget=budget)
        if self.unit == "steps":
            raise ValueError(f"{self} counts optimizer steps: it is no share of samples")
        if self.unit == "budget":
            return self.value
        if not budget:
            raise ValueError(f"{self} as a share of the budget: give budget (in samples)")
        per_sample = tokens_per_sample if self.unit == "tokens" else 1
        return self.value / per_sample / budget  # type: ignore[operator]

    def crossed(
        self,
        before: tuple[int, int],
        after: tuple[int, int],
        *,
        tokens_per_sample: int | None = None,
        budget: int | None = None,
    ) -> bool:
        """Whether a run that went from ``before`` to ``after`` (samples, steps) passed a whole
        multiple of this duration."""
        if self.value <= 0:
            raise ValueError(f"an interval is longer than 0, got {self}")
        facts = {"tokens_per_sample": tokens_per_sample, "budget": budget}
        start, end = self.elapsed(*before, **facts), self.elapsed(*after, **facts)
        # a share of the budget is a float: 0.3 / 0.1 is 2.9999999999999996
        return math.floor(end / self.value + 1e-9) > math.floor(start / self.value + 1e-9)

    @classmethod
    def interval(cls, text: str | int) -> int | Duration:
        """An interval from a config key: a whole number of steps, or a positive duration's text."""
        if isinstance(text, int) and not isinstance(text, bool):
            if text < 1:
                raise ValueError(f"an interval is at least 1 step, got {text!r}")
            return text
        duration = cls.parse(text)
        if duration.value <= 0:
            raise ValueError(f"an interval is longer than 0, got {text!r}")
        return duration

    def check(self, *, tokens_per_sample: int | None = None, budget: int | None = None) -> None:
        """Raise where this duration needs a fact of the run that was not given."""
        if self.unit == "tokens" and not tokens_per_sample:
            raise ValueError(
                f"{self} counts tokens: give tokens_per_sample (a sequence task's context)"
            )
        if self.unit == "budget" and not budget:
            raise ValueError(f"{self} is a share of the budget: give budget (in samples)")

    def __str__(self) -> str:
        if self.unit == "budget":
            return f"{self.value * 100:g}%"
        value = int(self.value) if self.value == int(self.value) else self.value
        return f"{value} {self.unit}"
