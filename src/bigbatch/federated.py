"""What a federated server decides each round: the clients' local batch and rate.

Federated training (FedAvg, McMahan et al. 2017) runs in rounds: the server
sends the model to ``K`` clients, each trains on its own data, and the server
averages what comes back. With every client training at local batch ``b``,
one local step of all clients together processes a global batch of ``K·b``
samples; a larger ``b`` covers a round's samples in fewer sequential steps
(the parallel speed of large batches) at the risk of the large-batch
generalisation gap. This module holds the framework-free half of bigbatch's
answer (docs/federated.md); :mod:`bigbatch.integrations.flower` carries it
into Flower.

- :func:`pool_steps` pools the clients' per-step noise statistics into one
  measurement per local step: the means of their unbiased ``|G|²`` and
  ``tr Σ`` estimates (weighted by samples), so ``B_simple = tr Σ / |G|²`` is
  estimated from every client's data.
- A *scheme* chooses the next round's local batch from the round just done:
  :class:`Fixed`, :class:`SmallLargeSwitch` (the seed paper's trade-off
  between large and small batches, Tyagi 2025, arXiv:2509.10537, in the
  concrete form of SWAP, Gupta et al. 2020) and :class:`ControllerScheme`
  (any bigbatch controller, e.g. :class:`~bigbatch.batch.BatchWarmup`,
  deciding the global batch from the pooled statistics).
- :class:`RoundPlanner` turns the scheme's batch into a :class:`RoundPlan`:
  the local batch, the local steps that cover the round's samples, and the
  rate (the base rate × the batch rule × the schedule in samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ._checks import check_number, choice, positive_int
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
    """What every client trains in one round.

    ``local_batch`` samples per local step, ``local_steps`` steps (together
    at least the round's ``local_samples``), at learning rate ``lr`` held for
    the round; ``global_batch`` is ``clients × local_batch``.
    """

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
    """One client's round: its samples, and per local step the statistics it measured.

    ``grad_sq_norm`` and ``trace`` are the step's unbiased estimates of
    ``|G|²`` and ``tr Σ`` (per sample) from the client's micro-batches;
    ``similarity`` the cosine of its two half-batch gradients.
    """

    samples: int
    batches: Sequence[int]
    grad_sq_norm: Sequence[float]
    trace: Sequence[float]
    similarity: Sequence[float]
    loss: float = math.nan


def finite_mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """The (weighted) mean of the finite values, NaN if there are none: a client's missing
    or diverged value is left out rather than spreading to the pooled one."""
    pairs = [(v, w) for v, w in zip(values, weights or [1.0] * len(values)) if math.isfinite(v)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else math.nan


def pool_steps(reports: Sequence[ClientReport]) -> list[dict[str, float]]:
    """Per local step, the clients' statistics pooled: sample-weighted means of ``|G|²``,
    ``tr Σ`` and the similarity, and the global batch (the sum of the local batches).

    Each client's ``|G|²`` estimates the squared norm of *its* mean gradient.
    On non-IID data those differ, and the mean of their squares exceeds the
    square of their mean (the global ``|G|²``) by the spread between clients;
    so the pooled ``B_simple`` errs low there (docs/federated.md).
    """
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
    """``next_local_batch(pooled, local_batch, clients, samples, total) -> local batch``.

    ``pooled`` is the round's :func:`pool_steps`, ``samples`` the samples all
    clients have trained on after the round, ``total`` the run's budget.
    """

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

    The seed paper (Tyagi 2025, "On Using Large-Batches in Federated
    Learning", arXiv:2509.10537) proposes to combine "the parallel scaling of
    large-batches and good generalizability of small-batch training"; the
    body of the paper was not available to us, so the concrete rule is that
    of SWAP (Gupta, Serrano and DeCoste 2020, "Stochastic Weight Averaging in
    Parallel: Large-Batch Training That Generalizes Well"), which does
    exactly that: a first phase of synchronous large-batch training, then
    small-batch training on every worker whose models are averaged — in a
    federation, FedAvg rounds at a small local batch. The switch is at a
    fraction of the sample budget (SWAP switches at a fixed training
    accuracy; a fraction of the budget needs no labels at the server).
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

    The controller sees one measurement per local step (the clients' pooled
    ``|G|²``, ``tr Σ`` and similarity, with the schedule's multiplier), as it
    would on one machine whose batch is the sum of the local batches. A
    decision it takes within a round applies from the next round (all
    clients of a round train at one batch); the steps after the decision
    were measured at the old batch and are not shown to it. The local batch
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


class RoundPlanner:
    """Each round's :class:`RoundPlan`, from a scheme, the rate rule and the schedule.

    Every client trains ``local_samples`` samples per round (rounded up to
    whole steps), so rounds cost the same samples whatever the batch and a
    larger batch means fewer sequential steps. The round's rate is
    ``lr × lr_factor(lr_scaling, local_batch, base_batch) × schedule(samples)``
    with the schedule (in samples, all clients) read at the round's middle.
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
        self.local_batch = scheme.initial
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
        """The samples at the middle of the next round, where its held rate is read off the
        schedule (read at the round's start, a warm-up one round long would train the
        first round at rate ~0)."""
        return self.samples + self.clients * self.local_samples // 2

    def update(self, plan: RoundPlan, reports: Sequence[ClientReport]) -> list[dict[str, float]]:
        """Count the round's samples and let the scheme choose the next local batch;
        returns the pooled statistics it saw.

        The scheme sees the planned global batch (``clients`` × the local batch)
        even when some clients did not reply: their absence thins the statistics,
        it is not a smaller batch to correct. The next local batch is at most
        ``local_samples`` (a round is at least one step).
        """
        self.samples += sum(r.samples for r in reports)
        self.round = plan.round
        pooled = pool_steps(reports)
        for step in pooled:
            step["schedule"] = plan.schedule  # the multiplier the round trained at
        chosen = self.scheme.next_local_batch(
            pooled, plan.local_batch, self.clients, self.samples, self.total_samples
        )
        self.local_batch = min(positive_int("local batch", chosen), self.local_samples)
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
