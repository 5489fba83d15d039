"""What a loop needs to know about a model sharded with FSDP2's ``fully_shard``
(docs/algorithms.md, "Gradient statistics", "Under FSDP2")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .._checks import check_param_groups

__all__ = [
    "accumulate",
    "full_state",
    "is_dtensor",
    "is_fully_sharded",
    "load_full_state",
    "local",
    "mesh_group",
    "shard_like",
    "unsharded_parameters",
]


def _fsdp_module_type() -> type | None:
    fsdp = getattr(torch.distributed, "fsdp", None)
    return getattr(fsdp, "FSDPModule", None) if fsdp is not None else None


def is_fully_sharded(model: nn.Module) -> bool:
    """``model`` is the root of an FSDP2 ``fully_shard``."""
    kind = _fsdp_module_type()
    return kind is not None and isinstance(model, kind)


def mesh_group(model: nn.Module) -> Any:
    """The process group ``model``'s parameters are sharded over (a one-dimensional mesh)."""
    meshes: list = []
    for p in model.parameters():  # each fully_shard call may build its own, equal, mesh
        if is_dtensor(p) and not any(p.device_mesh == m for m in meshes):
            meshes.append(p.device_mesh)
    if len(meshes) != 1:
        raise ValueError(
            f"the model's parameters are sharded over {len(meshes)} device meshes; bigbatch "
            "supports fully_shard over one mesh of the data-parallel ranks"
        )
    mesh = meshes[0]
    if mesh.ndim != 1:
        raise ValueError(
            f"the model is sharded over a {mesh.ndim}-D device mesh (HSDP or tensor "
            "parallel); bigbatch supports fully_shard over a 1-D mesh of the data-parallel ranks"
        )
    return mesh.get_group()


def unsharded_parameters(model: nn.Module) -> dict[int, Tensor]:
    """For each sharded parameter (by ``id``), the unsharded tensor its gradient comes
    from; a collective (one all-gather and reshard)."""
    sharded = [m for m in model.modules() if is_fully_sharded(m)]
    for module in sharded:
        module.unshard()
    for module in sharded:
        module.reshard()
    found: dict[int, Tensor] = {}
    for module in sharded:
        group = module._get_fsdp_state()._fsdp_param_group  # torch has no public accessor
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            found[id(fsdp_param.sharded_param)] = fsdp_param.unsharded_param
    return found


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model and optimizer states as plain CPU tensors on rank 0 (empty on the
    others), keyed like the unsharded module; a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if getattr(optimizer, "base", None) is not None:  # torch reads torch's layout only
        raise NotImplementedError(
            f"the state of a {type(optimizer).__name__} (a statistics wrapper: its own state "
            "beside its base optimizer's) is not gathered under FSDP2; checkpoint it under DDP"
        )
    with _no_initial_step(optimizer):
        return get_state_dict(model, optimizer, options=options)


# torch's state-dict helpers fill an empty optimizer state by stepping the optimizer once on
# zero gradients at a rate of 0: an Adam's step count (and so every bias correction after)
# would be one ahead of the steps trained. Where a parameter holds a gradient they do not.


@contextlib.contextmanager
def _no_initial_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    # torch's helpers inside leave an empty ``optimizer`` state empty
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        yield
        return
    params[0].grad = torch.zeros_like(params[0])
    try:
        yield
    finally:
        params[0].grad = None


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """Load :func:`full_state`'s dictionaries into a sharded model and its optimizer; a
    collective (rank 0's are broadcast)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    if not model_state:
        # torch skips the model on a rank whose dictionary is empty, broadcast or not:
        # name the keys (rank 0 sends the values)
        model_state = dict.fromkeys(model.state_dict())
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    optimizer_state = _keyed_by_name(optimizer_state, model, optimizer)
    trained = [bool(optimizer_state and optimizer_state.get("state"))]
    torch.distributed.broadcast_object_list(trained, src=0)  # rank 0's state is the one loaded
    if not trained[0]:  # saved before the first step: the optimizer stays as it is built
        set_model_state_dict(model, model_state, options=options)
        return
    set_state_dict(  # (torch fills the state by a step at rate 0, then replaces it)
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=options,
    )


def _keyed_by_name(saved: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    # a state saved without FSDP2 (under DDP, on one process) keys its parameters by their
    # place in the groups, as torch.optim does; torch's full-state load wants their names,
    # and took the other without a word, every parameter's state left empty
    groups = saved.get("param_groups") if saved else None
    places = [p for g in groups or () for p in g.get("params", ())]
    if not places or not all(isinstance(p, int) for p in places):
        return saved
    names = {id(p): n for n, p in model.named_parameters()}
    own = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    check_param_groups([len(g["params"]) for g in groups],
                       [len(g["params"]) for g in optimizer.param_groups])  # fmt: skip
    name = dict(zip(places, own))
    return {
        "state": {name[k]: v for k, v in saved.get("state", {}).items()},
        "param_groups": [{**g, "params": [name[p] for p in g["params"]]} for g in groups],
    }


def accumulate(model: nn.Module, last: bool) -> None:
    """Reduce-scatter the gradients only at the step's last micro-batch."""
    model.set_requires_gradient_sync(last)


def shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's rows of ``whole`` as ``like`` (a DTensor) is sharded, with no
    communication; ``whole`` otherwise."""
    if not is_dtensor(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    part = distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
    return part.to_local()


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def is_dtensor(t: Any) -> bool:
    """``t`` is a DTensor (by name: ``torch.distributed.tensor`` need not be importable)."""
    return type(t).__name__ == "DTensor"
