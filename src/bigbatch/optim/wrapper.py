"""The common shape of optimizers that modulate another one from gradient statistics."""

from __future__ import annotations

from typing import Any

import torch

from ..stats.result import GradientStats
from ._base import own_state

__all__ = ["StatisticsWrapper"]


class StatisticsWrapper(torch.optim.Optimizer):
    """Wraps ``base`` and shares its param groups and state (timm's Lookahead pattern).

    Schedulers, ``GradScaler`` and bigbatch's rate rules work on it. Subclasses read each
    step's :class:`~bigbatch.stats.GradientStats` in :meth:`observe` and name what they
    need in ``needs`` (``"gsnr"``).
    """

    needs: frozenset[str] = frozenset()

    def __init__(self, base: torch.optim.Optimizer) -> None:
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")
        self.base = base
        super().__init__(base.param_groups, base.defaults)
        # one list of groups with the base, so a group added to either is in both
        self.param_groups = base.param_groups
        self.state = base.state
        self._stats: GradientStats | None = None

    def __getstate__(self) -> dict[str, Any]:  # base and settings too: a copy that steps
        return own_state(self)

    def observe(self, stats: GradientStats) -> None:
        """The statistics of the step about to be taken (passed on to a wrapped wrapper)."""
        self._stats = stats
        if isinstance(self.base, StatisticsWrapper):
            self.base.observe(stats)

    def requirements(self) -> frozenset[str]:
        """What this wrapper and any wrapper inside it need collected."""
        inner = (
            self.base.requirements() if isinstance(self.base, StatisticsWrapper) else frozenset()
        )
        return self.needs | inner

    def check_sub_batches(self, count: int) -> None:
        """Refuse (or warn about) ``count`` sub-batches per step if too few for this wrapper."""
        if isinstance(self.base, StatisticsWrapper):
            self.base.check_sub_batches(count)

    def metrics(self) -> dict[str, float]:
        """Values worth logging after a step (none by default)."""
        return self.base.metrics() if isinstance(self.base, StatisticsWrapper) else {}

    @torch._disable_dynamo  # (run eagerly, as its base's step)
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Run ``closure``, then the modulated step (nothing where no parameter has a grad)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not any(p.grad is not None for g in self.param_groups for p in g["params"]):
            self._stats = None
            return loss
        self.modulated_step(self._take_stats())
        return loss

    def modulated_step(self, stats: GradientStats) -> None:
        """The base optimizer's step, modulated by this step's statistics (subclasses)."""
        raise NotImplementedError

    def _take_stats(self) -> GradientStats:
        stats, self._stats = self._stats, None
        if stats is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the step's gradient statistics: train with "
                "bigbatch.AdaptiveBatch, or call observe(stats) before step()"
            )
        return stats

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if any(param_group is g for g in self.base.param_groups):
            super().add_param_group(param_group)  # during __init__: the base's own groups
            return
        self.base.add_param_group(param_group)  # checked there; the list is this one's too
        self._groups_changed()

    def _groups_changed(self) -> None:
        # a group was added: what a subclass keeps per parameter or group follows (none here)
        pass

    # --- state: the base's, plus the wrapper's own under its name

    def _wrapper_state(self) -> dict[str, Any]:
        return {}

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        pass

    def _check_wrapper_state(self, state: dict[str, Any]) -> None:
        pass  # a ValueError where _load_wrapper_state cannot load state

    # torch's hooks on the wrapper run around its own state, as torch's methods run them
    def state_dict(self) -> dict[str, Any]:
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = {"base": self.base.state_dict(), "wrapper": self._wrapper_state()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        if not {"base", "wrapper"} <= state_dict.keys():
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state lacks 'base' and 'wrapper' "
                "(a plain optimizer's state? load that into its .base)"
            )
        self._check_wrapper_state(state_dict["wrapper"])  # before anything is loaded
        self.base.load_state_dict(state_dict["base"])
        # torch's load_state_dict builds new group dicts: share the base's again, or the
        # rates set on the wrapper (schedulers, bigbatch's LR rules, AGVM) would miss it
        self.param_groups = self.base.param_groups
        self.state = self.base.state
        self._load_wrapper_state(state_dict["wrapper"])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
