"""What a loop needs to know about a ``DistributedDataParallel`` (or FSDP2) model."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from .fsdp import accumulate, is_fully_sharded
from .hooks import CommHook, TwoGroupCosine, two_group_cosine_hook
from .world import World

__all__ = [
    "accumulating",
    "hook_state_dict",
    "load_hook_state_dict",
    "register",
    "registered_hook",
    "unwrap",
]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync()`` (FSDP2: gradient sync off) for every micro-batch but the last;
    nothing for a plain module."""
    if is_fully_sharded(model):
        accumulate(model, last)
    elif isinstance(model, nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def register(
    model: nn.Module,
    comm_hook: tuple[Any, CommHook] | None,
    two_groups: TwoGroupCosine | None = None,
) -> None:
    """Register the user's ``(state, hook)`` on a DDP model, inside the two-group hook if any."""
    if two_groups is not None:
        two_groups.inner = comm_hook
        comm_hook = (two_groups, two_group_cosine_hook)
    if comm_hook is None:
        return
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("comm_hook needs a DistributedDataParallel model on 2+ ranks")
    state, hook = comm_hook
    listed = len(getattr(model, "_comm_hooks", []))
    try:
        model.register_comm_hook(state, hook)
    except RuntimeError as err:
        # DDP lists a hook before its C++ side refuses a second one: unlisted, so that
        # registered_hook reads the hook in use, not the refused one
        del getattr(model, "_comm_hooks", [])[listed:]
        raise ValueError(
            "the model has a comm hook already; pass yours as comm_hook=(state, hook) so it "
            f"can be composed with bigbatch's ({err})"
        ) from None


def registered_hook(model: nn.Module) -> tuple[Any, CommHook] | None:
    """The ``(state, hook)`` pair a framework registered on a DDP model, if any (read from
    DDP's ``_comm_hooks``; None where torch has no such list)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    hooks = getattr(model, "_comm_hooks", None) or []
    if not hooks:
        return None
    hook, state = hooks[-1]
    return state, hook


def settle_hook(comm_hook: tuple[Any, CommHook] | None, applied: bool) -> None:
    # tell a stateful hook (one with ``settle``, as CompressionState) whether the step its
    # reduction served was applied: a skipped one must leave its state as it was
    state = comm_hook[0] if comm_hook is not None else None
    if hasattr(state, "settle"):
        state.settle(applied)


def hook_state_dict(comm_hook: tuple[Any, CommHook] | None, world: World) -> list | None:
    """Every rank's comm-hook state (a collective; None when the state keeps none)."""
    state = comm_hook[0] if comm_hook is not None else None
    if not hasattr(state, "state_dict"):
        return None
    return world.all_gather_object(state.state_dict())


def load_hook_state_dict(
    comm_hook: tuple[Any, CommHook] | None, saved: list | None, world: World
) -> None:
    """Give each rank its own saved hook state back (with another number of ranks, none)."""
    state = comm_hook[0] if comm_hook is not None else None
    if saved and hasattr(state, "load_state_dict") and len(saved) == world.size:
        state.load_state_dict(saved[world.rank])
