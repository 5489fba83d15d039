"""The trainable parameters a collector watches, their groups, and one step's sub-batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..parallel.fsdp import local
from ..parallel.world import World


class ParamLayout:
    """The trainable parameters of some param groups, and which group each belongs to.

    Group indices live on the device, so per-group sums never copy from the host.
    ``sources`` maps a sharded parameter (by ``id``) to the unsharded tensor its
    gradients flow through (FSDP2); hooks go on ``hooked``.
    """

    def __init__(
        self,
        param_groups: Sequence[Sequence[Tensor] | dict],
        sources: dict[int, Tensor] | None = None,
    ) -> None:
        given = param_groups  # an optimizer's own list grows with ``add_param_group``
        param_groups = [param_groups] if isinstance(param_groups, Tensor) else list(param_groups)
        if any(isinstance(g, Tensor) for g in param_groups):
            # a flat list of parameters: each would be read as a group of its rows, views
            # that never get a gradient (a similarity of 0 and a NaN noise scale, unsaid)
            raise TypeError(
                "param_groups must be groups of parameters (optimizer.param_groups, or "
                "[list(model.parameters())]), not parameters"
            )
        groups = [list(g["params"]) if isinstance(g, dict) else list(g) for g in param_groups]
        self.params = [p for g in groups for p in g if p.requires_grad]
        # what may start to train later, unwatched: a frozen parameter, a group added to the
        # optimizer's live list (``add_param_group``)
        self._frozen = [p for g in groups for p in g if not p.requires_grad]
        self._live = given if isinstance(given, list) else None
        #: the tensors whose gradients are each backward's increments (hooks go here)
        self.hooked = [sources.get(id(p), p) for p in self.params] if sources else self.params
        if not self.params:
            raise ValueError("gradient statistics need at least one trainable parameter")
        self.groups = groups
        self.num_groups = len(groups)
        self.device = self.params[0].device
        self._owner_list = [i for i, g in enumerate(groups) for p in g if p.requires_grad]
        self.owner = torch.tensor(self._owner_list, device=self.device)
        self._subsets: dict[tuple[int, ...], Tensor] = {}

    def check_unchanged(self) -> None:
        """``RuntimeError`` where a parameter not watched now trains (the statistics and a
        measured step's finiteness check would leave it out)."""
        thawed = [p for p in self._frozen if p.requires_grad]
        if thawed or (self._live is not None and len(self._live) != self.num_groups):
            what = (
                f"{len(thawed)} frozen parameter(s) now require grad"
                if thawed
                else "a param group was added to the optimizer"
            )
            raise RuntimeError(
                f"the trainable parameters changed after the statistics were built ({what}): "
                "they would leave the new ones out; build a new loop after changing what "
                "trains (or statistics=False)"
            )

    @property
    def owner_list(self) -> list[int]:
        """The group of each parameter, as a list."""
        return self._owner_list

    def group_of(self, param_index: int) -> int:
        """The group of parameter ``param_index`` (an index into ``params``)."""
        return self._owner_list[param_index]

    def owners(self, present: Sequence[int]) -> Tensor:
        """The group of each parameter in ``present`` (indices into ``params``), cached."""
        if len(present) == len(self.params):
            return self.owner
        key = tuple(present)
        if key not in self._subsets:
            self._subsets[key] = torch.tensor(
                [self._owner_list[i] for i in key], device=self.device
            )
        return self._subsets[key]

    def per_group(self, values: Sequence[Tensor] | Tensor, square: bool = False) -> Tensor:
        """Per-parameter scalars summed per group in float64 (squared first with ``square``)."""
        if isinstance(values, Tensor):
            v = values.double()
        else:
            v = torch.stack([x.double() for x in values])
        if square:
            v = v.square()
        if self.num_groups == 1:
            return v.sum().reshape(1)
        out = torch.zeros(self.num_groups, dtype=torch.float64, device=v.device)
        return out.index_add_(0, self.owner, v)

    def grads(self) -> list[Tensor]:
        """Every parameter's ``.grad`` (zeros where it has none; this rank's shard if sharded)."""
        return [
            local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in self.params
        ]


@dataclass
class SubBatches:
    """One step's sub-batches: this rank's ``sizes``, every rank's ``rank_sizes``, this
    rank's ``loss_weights`` and the ``current`` micro-batch."""

    sizes: list[int]
    rank_sizes: list[list[int]]
    loss_weights: list[float]
    world: World
    current: int | None = None

    @property
    def total(self) -> int:
        """The global batch (every rank's samples or weight)."""
        return sum(sum(r) for r in self.rank_sizes)

    @property
    def all_sizes(self) -> list[int]:
        return [b for r in self.rank_sizes for b in r]

    @property
    def half(self) -> int:
        """On one process, micro-batches ``[0, half)`` form half A, the rest half B."""
        return len(self.sizes) // 2

    @property
    def last(self) -> bool:
        """The current micro-batch is this rank's last of the step."""
        return self.current == len(self.sizes) - 1
