"""What a federated server decides each round (FedAvg, McMahan et al. 2017): the
clients' local batch and rate. :func:`pool_steps` pools the clients' statistics, a
scheme picks the next local batch, :class:`RoundPlanner` makes the
:class:`RoundPlan`. docs/federated.md; docs/algorithms.md, "Local batches in
federated training"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ._checks import check_number, choice, positive_int, whole_number
from .batch.controllers import Controller
from .batch.lr import Schedule, constant, lr_factor

__all__ = [
    "ClientReport",
    "ControllerScheme",
    "Fixed",
    "RoundPlan",
    "RoundPlanner",
    "Scheme",
    "SmallLargeSwitch",
    "finite_mean",
    "pool_steps",
]


@dataclass(frozen=True)
class RoundPlan:
    """What every client trains in one round: ``local_steps`` steps of ``local_batch``
    samples (at least ``local_samples``) at rate ``lr``, the ``global_batch`` being
    ``clients × local_batch``."""

    round: int
    local_batch: int
    local_steps: int
    lr: float
    clients: int
    #: the schedule's rate multiplier the round trains at (a controller weighs its
    #: statistics by it)
    schedule: float = 1.0

    @property
    def global_batch(self) -> int:
        return self.clients * self.local_batch

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "global_batch": self.global_batch}


@dataclass(frozen=True)
class ClientReport:
    """One client's round: its samples, and per local step its unbiased ``grad_sq_norm``
    (``|G|²``), ``trace`` (``tr Σ``, per sample) and half-batch ``similarity``."""

    samples: int
    batches: Sequence[int]
    grad_sq_norm: Sequence[float]
    trace: Sequence[float]
    similarity: Sequence[float]
    loss: float = math.nan


def finite_mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """The (weighted) mean of the finite values; NaN if there are none."""
    pairs = [(v, w) for v, w in zip(values, weights or [1.0] * len(values)) if math.isfinite(v)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else math.nan


def pool_steps(reports: Sequence[ClientReport]) -> list[dict[str, float]]:
    """Per local step, the clients' sample-weighted mean ``|G|²``, ``tr Σ`` and similarity,
    and the global batch. On non-IID data the pooled ``B_simple`` errs low."""
    if not reports:
        return []
    steps = min(len(r.grad_sq_norm) for r in reports)
    weights = [float(r.samples) for r in reports]
    pooled = []
    for i in range(steps):
        pooled.append(
            {
                "grad_sq_norm": finite_mean([r.grad_sq_norm[i] for r in reports], weights),
                "trace": finite_mean([r.trace[i] for r in reports], weights),
                "similarity": finite_mean([r.similarity[i] for r in reports], weights),
                "batch": float(sum(r.batches[i] for r in reports)),
            }
        )
    return pooled


class Scheme(Protocol):
    """``next_local_batch(pooled, local_batch, clients, samples, total) -> local batch``
    (``pooled``: :func:`pool_steps`; ``samples``: trained after the round; ``total``: the
    budget)."""

    initial: int

    def next_local_batch(
        self,
        pooled: Sequence[dict[str, float]],
        local_batch: int,
        clients: int,
        samples: int,
        total: int,
    ) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Stateless:
    """A scheme that decides from the round alone: nothing to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Fixed(_Stateless):
    """The same local batch every round (the baseline)."""

    def __init__(self, local_batch: int) -> None:
        self.initial = positive_int("local_batch", local_batch)

    def next_local_batch(self, pooled, local_batch, clients, samples, total) -> int:
        return self.initial

    def __repr__(self) -> str:
        return f"Fixed(local_batch={self.initial})"


class SmallLargeSwitch(_Stateless):
    """Large local batches first, small ones after ``switch`` of the samples.

    The seed paper's trade-off (Tyagi 2025, arXiv:2509.10537) in the concrete form of
    SWAP (Gupta, Serrano, DeCoste 2020, ICLR), switching at a share of the budget.
    """

    def __init__(self, large: int, small: int, switch: float = 0.5) -> None:
        self.large = positive_int("large", large)
        self.small = positive_int("small", small)
        if self.small > self.large:
            raise ValueError(f"small ({small}) must not exceed large ({large})")
        self.switch = check_number("switch", switch, low=0.0, high=1.0)
        self.initial = self.large if self.switch > 0 else self.small

    def next_local_batch(self, pooled, local_batch, clients, samples, total) -> int:
        return self.large if samples < self.switch * total else self.small

    def __repr__(self) -> str:
        return f"SmallLargeSwitch(large={self.large}, small={self.small}, switch={self.switch})"


class ControllerScheme:
    """A bigbatch controller choosing the *global* batch from the pooled statistics.

    It sees one pooled measurement per local step; a decision within a round applies
    from the next round, and the steps after it are not shown to it. The local batch
    is the global one divided by the clients, rounded up.
    """

    def __init__(self, controller: Controller, clients: int) -> None:
        self.controller = controller
        self.clients = positive_int("clients", clients)
        self.initial = max(1, math.ceil(controller.initial / self.clients))

    def next_local_batch(self, pooled, local_batch, clients, samples, total) -> int:
        batch = local_batch * clients
        seen = samples - batch * len(pooled)
        for step in pooled:
            seen += batch
            chosen = self.controller.next(step, batch, seen)
            if chosen != batch:
                return max(1, math.ceil(chosen / clients))
        return local_batch

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state["controller"])

    def __repr__(self) -> str:
        return f"ControllerScheme({self.controller!r}, clients={self.clients})"


#: the least local batch: a client's statistics need two sub-batches a local step
MIN_LOCAL_BATCH = 2


class RoundPlanner:
    """Each round's :class:`RoundPlan`, from a scheme, the rate rule and the schedule.

    Every client trains ``local_samples`` per round (whole steps), at the rate
    ``lr × lr_factor(lr_scaling, local_batch, base_batch) × schedule(samples)``, the
    schedule (in planned samples, all clients) read at the round's middle.
    """

    def __init__(
        self,
        scheme: Scheme,
        *,
        clients: int,
        local_samples: int,
        lr: float,
        lr_scaling: str = "linear",
        base_batch: int | None = None,
        total_samples: int,
        schedule: Schedule = constant,
    ) -> None:
        self.scheme = scheme
        self.clients = positive_int("clients", clients)
        own = getattr(scheme, "clients", self.clients)  # a scheme that divides a global batch
        if own != self.clients:
            raise ValueError(f"the scheme divides its batch among {own} clients, not {clients}")
        self.local_samples = positive_int("local_samples", local_samples)
        self.lr = check_number("lr", lr, low=0.0, low_open=True)
        # the AdaScale rules need smoothed statistics at the step, which a round's held rate
        # does not have
        self.lr_scaling = choice("lr_scaling", lr_scaling, ("none", "linear", "sqrt"))
        self.base_batch = positive_int("base_batch", base_batch or scheme.initial)
        self.schedule = schedule
        self.total_samples = positive_int("total_samples", total_samples)
        # a client measures its statistics from two sub-batches a local step at least
        self.local_batch = whole_number("the scheme's local batch", scheme.initial, MIN_LOCAL_BATCH)
        self.samples = 0
        self.round = 0

    def plan(self) -> RoundPlan:
        """The next round's plan (call :meth:`update` with its reports before the next)."""
        steps = math.ceil(self.local_samples / self.local_batch)
        factor = lr_factor(self.lr_scaling, self.local_batch, self.base_batch)
        multiplier = self.schedule(self.midpoint())
        return RoundPlan(
            round=self.round + 1,
            local_batch=self.local_batch,
            local_steps=steps,
            lr=self.lr * factor * multiplier,
            clients=self.clients,
            schedule=multiplier,
        )

    def midpoint(self) -> int:
        """The samples at the middle of the next round, where its held rate is read."""
        # in planned samples (local_samples a client a round), as total_samples counts them:
        # the whole steps trained, counted, ran past the total, and the last round at rate 0
        return (2 * self.round + 1) * self.clients * self.local_samples // 2

    def update(self, plan: RoundPlan, reports: Sequence[ClientReport]) -> list[dict[str, float]]:
        """Count the round's samples and let the scheme choose the next local batch (at most
        ``local_samples``); returns the pooled statistics. Missing clients thin the
        statistics; the batch is the planned one."""
        self.samples += sum(r.samples for r in reports)
        self.round = plan.round
        pooled = pool_steps(reports)
        for step in pooled:
            step["schedule"] = plan.schedule  # the multiplier the round trained at
        chosen = self.scheme.next_local_batch(
            pooled, plan.local_batch, self.clients, self.samples, self.total_samples
        )
        chosen = min(positive_int("local batch", chosen), self.local_samples)
        self.local_batch = max(chosen, MIN_LOCAL_BATCH)
        return pooled

    def state_dict(self) -> dict[str, Any]:
        return {
            "local_batch": self.local_batch,
            "samples": self.samples,
            "round": self.round,
            "scheme": self.scheme.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_batch = int(state["local_batch"])
        self.samples = int(state["samples"])
        self.round = int(state["round"])
        self.scheme.load_state_dict(state["scheme"])
