"""Every per-step option of a run, in one frozen, validated record (documented and
checked once, here); every entry point takes it or its fields as keywords."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._checks import check_flag, check_number, choice, positive_int
from .batch.lr import LR_RULES, Schedule
from .batch.plan import LOSS_REDUCTIONS
from .stats.halves import SIMILARITY_MODES
from .stats.per_example import UNITS

__all__ = ["NOISE_SOURCES", "NONFINITE_POLICIES", "StepOptions"]

#: ``statistics_every="auto"``: a step of batch ``B`` below this measures once in
#: ``AUTO_EXAMPLES // B`` steps, where a measurement's fixed cost (its launches and Python,
#: not its arithmetic) is the largest share of the step (docs/results.md, "Measuring every
#: k-th step"). ``B`` is the whole step's over every rank, in the batch's unit (a batch
#: counted in tokens is past it: every step)
AUTO_EXAMPLES = 64
#: ... and at most once in this many: the noise scale's trace, smoothed over 20 steps,
#: still holds ``MIN_TRACE`` measurements' weight (bigbatch.batch.smoothing)
AUTO_MOST = 4

NONFINITE_POLICIES = ("skip", "raise")
#: where the noise statistics' small-batch norms come from (``StepOptions.noise_from``)
NOISE_SOURCES = ("sub_batches", "examples", "auto")


@dataclass(frozen=True)
class StepOptions:
    """The per-step rules of a run: how the rate follows the batch, which statistics to
    collect, what a non-finite step does."""

    #: how the rate follows the batch relative to ``base_batch_size``: ``none``,
    #: ``linear``, ``sqrt``, ``adascale``, ``adascale-sqrt`` or ``auto`` (held under a
    #: controller that follows the noise, else by optimizer family; ``bigbatch.batch.lr``).
    #: A step's rate is ``lr × rule(B / base) × schedule(samples)``, set just before the
    #: optimizer step and restored after it.
    lr_scaling: str = "auto"
    #: the batch the optimizer's rate is tuned for (None: the controller's first batch)
    base_batch_size: int | None = None
    #: the rate multiplier as a function of samples seen (``bigbatch.schedules``)
    schedule: Schedule | None = None
    #: the most the batch rule and the schedule together may multiply the rate by (None:
    #: no ceiling). The best rate of SGD-type optimizers stops rising with the batch
    #: where steps become unstable (McCandlish et al. 2018's ``ε_max``; Cohen et al.
    #: 2021), so a rule that scales the rate stops at ``lr × max_lr_factor``
    max_lr_factor: float | None = None
    #: collect the gradient statistics: None (the default) where something reads them (a
    #: controller that follows them, the AdaScale rules, VRGD, AGVM, ``gsnr``), so that a
    #: constant batch or a fixed ramp pays for none; True to measure and log them anyway;
    #: False for none
    statistics: bool | None = None
    #: also collect the element-wise gradient SNR (a VRGD optimizer asks by itself)
    gsnr: bool = False
    #: ``"split"`` (the cosine of two halves, measured) or ``"scalar"`` (from the noise
    #: scalars); None: split on one process where the step is split anyway (sub-batch
    #: statistics) or a controller reads it (SimiGrad's rules), else scalar; scalar under
    #: DDP and FSDP2
    similarity: str | None = None
    #: where the noise scale's small-batch gradient norms come from: ``"sub_batches"``
    #: (each step split into micro-batches, ``min_sub_batches`` of them), ``"examples"``
    #: (each example's gradient norm, from the one backward pass: a step needs no split;
    #: every trainable parameter must sit in a layer bigbatch.stats.per_example covers) or
    #: ``"auto"`` (examples where the model and the run allow and the step is not split
    #: anyway by ``min_sub_batches`` >= 2 or a framework's accumulation, else sub-batches,
    #: said once in the log; docs/adaptive_batching.md, "The statistics (`bigbatch.stats`)")
    noise_from: str = "auto"
    #: with per-example statistics, how finely each micro-batch is cut: a micro-batch of
    #: ``n`` examples into units of ``⌊n / noise_units⌋`` examples (from ``noise_units`` to
    #: twice as many units; each example alone below twice ``noise_units``), and each
    #: unit's gradient norm is taken in the backward (bigbatch.stats.per_example; None:
    #: every example alone). At least 2
    noise_units: int | None = UNITS
    #: measure the statistics at every ``statistics_every``-th optimizer step (1: every
    #: step). The steps between run as a plain step would: no statistics, no split into
    #: micro-batches beyond what memory asks. A noise-scale controller
    #: (``Contract.learns_between_measurements``) still learns ``|G|²`` from their batch gradient's
    #: norm; one that reads the similarity holds the batch, its window counting measured
    #: steps. Not with VRGD, AGVM or ``gsnr``, which read every step's statistics.
    #: ``"auto"`` (``bigbatch train``'s default): by the batch (:meth:`every_at`), every
    #: step where something reads every step's statistics
    statistics_every: int | str = 1
    #: smoothing of the statistics' noise-scale averages (gpt-neox: 0.99)
    ema_beta: float = 0.99
    #: correct the noise for batches that are a large fraction of a finite dataset
    #: (sampling without replacement)
    finite_correction: bool = True
    #: ``"mean"`` if the micro-batch losses are means, ``"sum"`` if sums (the plain loop's)
    loss_reduction: str = "mean"
    #: a step with a NaN/Inf gradient or loss is dropped and counted (``"skip"``) or
    #: raises :class:`bigbatch.NonFiniteError` (``"raise"``) before anything learns from
    #: it; with a ``GradScaler`` an overflow (the loss finite) is counted but never raised:
    #: the scaler skips it and lowers its scale
    nonfinite: str = "skip"
    #: read each step's numbers (statistics, loss, finiteness) one step late, so that the
    #: host never waits for the device: a non-finite step is skipped by the optimizer on
    #: the device (``found_inf``, which torch's optimizers take with ``fused=True``, as
    #: under a ``GradScaler``), the controller decides from the step before the last (its batch
    #: follows the noise one step later) and a step's metrics come with the next step's
    #: (``Step.metrics["step"]`` says whose; ``AdaptiveBatch.flush`` reads the last).
    #: Not with an optimizer that reads this step's statistics (VRGD, AGVM).
    #: docs/adaptive_batching.md, "An asynchronous step"
    asynchronous: bool = False

    def __post_init__(self) -> None:
        choice("lr_scaling", self.lr_scaling, (*LR_RULES, "auto"))
        if self.base_batch_size is not None:
            positive_int("base_batch_size", self.base_batch_size)
        if self.max_lr_factor is not None:
            check_number("max_lr_factor", self.max_lr_factor, low_open=True)
        if self.schedule is not None and not callable(self.schedule):
            raise ValueError(f"schedule must be a function of samples, got {self.schedule!r}")
        if self.statistics is not None:
            check_flag("statistics", self.statistics)
        check_flag("gsnr", self.gsnr)
        if self.similarity is not None:
            choice("similarity", self.similarity, SIMILARITY_MODES)
        choice("noise_from", self.noise_from, NOISE_SOURCES)
        if self.noise_units is not None:
            positive_int("noise_units", self.noise_units)
            if self.noise_units < 2:
                raise ValueError(
                    f"noise_units must be at least 2 (one unit has no noise to measure), "
                    f"got {self.noise_units}"
                )
        if isinstance(self.statistics_every, str) and self.statistics_every != "auto":
            raise ValueError(
                f"statistics_every must be a whole number of steps or 'auto', got "
                f"{self.statistics_every!r}"
            )
        if self.statistics_every != "auto":
            positive_int("statistics_every", self.statistics_every)
        check_number("ema_beta", self.ema_beta, high=1.0, high_open=True)
        check_flag("finite_correction", self.finite_correction)
        choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_flag("asynchronous", self.asynchronous)

    def every_at(self, batch_size: int) -> int:
        """Steps from one measured step to the next at ``batch_size``."""
        if self.statistics_every != "auto":
            return self.statistics_every
        return min(AUTO_MOST, max(1, AUTO_EXAMPLES // batch_size))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' keyword names."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: StepOptions | None = None, **keywords: Any) -> StepOptions:
        """``options`` (default: all defaults) with ``keywords`` replacing fields; an unknown
        keyword is one ``TypeError`` naming it."""
        unknown = sorted(set(keywords) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"unknown option {', '.join(map(repr, unknown))}; the step options are "
                f"{', '.join(cls.names())}"
            )
        base = options if options is not None else cls()
        if not isinstance(base, StepOptions):
            raise TypeError(f"options must be a StepOptions, got {type(base).__name__}")
        return dataclasses.replace(base, **keywords) if keywords else base

    @classmethod
    def pop_from(cls, keywords: dict[str, Any]) -> dict[str, Any]:
        """Remove the step options from ``keywords`` and return them."""
        return {name: keywords.pop(name) for name in cls.names() if name in keywords}

    def as_dict(self) -> Mapping[str, Any]:
        return {name: getattr(self, name) for name in self.names()}
