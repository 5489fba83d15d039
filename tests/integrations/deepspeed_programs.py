"""Programs the DeepSpeed tests run on every rank of a gloo cluster (importable by spawned ranks).

Each builds the same small regression run twice, once through a DeepSpeed
engine and :class:`AdaptiveBatchDeepSpeed`, once through the plain
:class:`bigbatch.AdaptiveBatch` (under DDP on 2+ ranks), and returns what
each saw and decided.
"""

from __future__ import annotations

import importlib
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import TensorDataset

from bigbatch import AdaptiveBatch
from bigbatch.batch import Constant, Ramp, SimiGrad
from bigbatch.integrations.deepspeed import AdaptiveBatchDeepSpeed
from bigbatch.optim import create_optimizer

# DeepSpeed's CPU comm backend compiles a shared-memory all-reduce with g++ when it starts
# (about a minute on 2 cores, and start-up fails where no compiler is installed). It only
# speeds up large CPU reductions; these tests are about bigbatch's side: plain gloo.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

D = 12
MICRO = 8  # train_micro_batch_size_per_gpu and the plain loop's max_micro_batch


def regression_data(n: int = 2048, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=gen)
    x = torch.randn(n, D, generator=gen)
    return TensorDataset(x, (x @ w_star + torch.randn(n, generator=gen))[:, None])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return create_optimizer(params, name, lr=lr)


def ds_config(stage: int, dtype: str = "fp32", **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unasked; the plain loop does not
        **extra,
    }


def deepspeed_engine(
    stage: int, dtype: str = "fp32", optimizer: str = "sgd", lr: float = 0.02, **config
):
    """A DeepSpeed engine over :func:`make_model`; ``optimizer="config:adamw"`` lets DeepSpeed
    build the optimizer from its config (torch's AdamW)."""
    # the cluster joined its gloo group without a launcher; DeepSpeed reads these
    for name, value in (
        ("LOCAL_RANK", dist.get_rank()),
        ("RANK", dist.get_rank()),
        ("WORLD_SIZE", dist.get_world_size()),
    ):
        os.environ[name] = str(value)
    model = make_model()
    if optimizer == "config:adamw":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}}
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ds_config(stage, dtype, **config),
        )
        return engine
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=make_optimizer(model.parameters(), optimizer, lr),
        config=ds_config(stage, dtype, **config),
    )
    return engine


def controller(kind: str):
    world = dist.get_world_size()
    if kind == "constant":
        return Constant(32 * world)
    if kind == "ramp":  # fixed in optimizer steps: the change after the 5th
        return Ramp(points=[(0, 16 * world), ("5 steps", 32 * world)])
    return SimiGrad(target=0.5, initial=16 * world, min=4 * world, max=256, window=5)


class Untrusted:
    """A comm-hook state that tells bigbatch not to trust the reduction (``lossless``
    False) while the hook is the exact all-reduce: the plain loop then estimates the
    noise within each rank, as under DeepSpeed, and trains the same parameters."""

    lossless = False


def exact_allreduce(state, bucket):
    return default_hooks.allreduce_hook(None, bucket)


def plain_loop(
    kind: str, optimizer: str = "sgd", lr: float = 0.02, lr_scaling: str = "none"
) -> AdaptiveBatch:
    model = make_model()
    distributed = dist.get_world_size() > 1
    if distributed:
        model = DDP(model)
    return AdaptiveBatch(
        model,
        make_optimizer(model.parameters(), optimizer, lr),
        regression_data(),
        controller=controller(kind),
        max_micro_batch=MICRO,
        min_sub_batches=2,
        lr_scaling=lr_scaling,
        similarity="scalar",  # DeepSpeed's (one process would measure the split halves)
        noise_from="sub_batches",  # DeepSpeed's (its step reduces: no per-example norms)
        comm_hook=(Untrusted(), exact_allreduce) if distributed else None,
    )


def deepspeed_loop(
    kind: str, stage: int, dtype: str = "fp32", optimizer: str = "sgd", lr: float = 0.02, **options
) -> AdaptiveBatchDeepSpeed:
    engine = deepspeed_engine(stage, dtype, optimizer, lr)
    options = {"lr_scaling": "none", **options}
    return AdaptiveBatchDeepSpeed(engine, regression_data(), controller=controller(kind), **options)


def train(loop: AdaptiveBatch, steps: int, nan_at: int | None = None) -> dict:
    """``steps`` steps (step ``nan_at``'s first micro-batch loss made NaN); what was seen."""
    record: dict = {"batch": [], "noise_scale": [], "loss": [], "indices": [], "skipped": []}
    dtype = next(loop.model.parameters()).dtype
    for step in loop.steps(max_steps=loop.steps_taken + steps):
        for i, (x, y) in enumerate(step.micro_batches()):
            loss = nn.functional.mse_loss(loop.model(x.to(dtype)).float(), y)
            if step.index == nan_at and i == 0:
                loss = loss * math.nan
            step.backward(loss)
        step.apply()
        record["batch"].append(step.batch_size)
        record["noise_scale"].append(step.metrics.get("noise_scale"))
        record["loss"].append(step.metrics["loss"])
        record["skipped"].append(step.metrics.get("skipped", 0.0))
        record["indices"].append([i for b in step.indices for i in b])
    record["params"] = params(loop)
    return record


def params(loop: AdaptiveBatch) -> torch.Tensor:
    model = getattr(loop.model, "module", loop.model)
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


# ---------------------------------------------------------------- programs


def compare(
    kind: str,
    stage: int,
    steps: int = 24,
    optimizer: str = "sgd",
    lr: float = 0.02,
    nan_at: int | None = None,
    lr_scaling: str = "none",
) -> dict:
    """The plain loop and the DeepSpeed loop on the same run (``optimizer="config:adamw"``:
    DeepSpeed's config builds the AdamW the plain loop is given)."""
    plain = optimizer.removeprefix("config:")
    ds = deepspeed_loop(kind, stage, "fp32", optimizer, lr, lr_scaling=lr_scaling)
    return {
        "plain": train(plain_loop(kind, plain, lr, lr_scaling), steps, nan_at),
        "deepspeed": train(ds, steps, nan_at),
    }


def abandoned(stage: int, offload: bool = False, steps: int = 6) -> dict:
    """``compare``'s runs (AdamW), each after a first step left unapplied: a break after
    its backward, whose gradient (100 times the loss's) must not reach the next update."""
    config = {}
    if offload:
        config["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW, not DeepSpeed's C++
    engine = deepspeed_engine(stage, "fp32", "adamw", 0.01, **config)
    loops = {
        "plain": plain_loop("constant", "adamw", 0.01),
        "deepspeed": AdaptiveBatchDeepSpeed(
            engine, regression_data(), controller=controller("constant"), lr_scaling="none"
        ),
    }
    for loop in loops.values():
        for step in loop.steps(max_steps=1):
            for x, y in step.micro_batches():
                step.backward(100 * nn.functional.mse_loss(loop.model(x), y))
            break
    return {name: train(loop, steps) for name, loop in loops.items()}


def loaded_into_another_controller(directory: str) -> str:
    """The error loading a checkpoint saved under ``Constant`` into a ``SimiGrad`` loop."""
    saved = deepspeed_loop("constant", 0)
    train(saved, 2)
    saved.save_checkpoint(directory, tag="constant")
    other = deepspeed_loop("adaptive", 0)
    try:
        other.load_checkpoint(directory, tag="constant")
    except ValueError as err:
        return str(err)
    return "loaded"


def misuses(directory: str) -> dict:
    """What a user meets: ``apply(max_grad_norm=)``, a checkpoint DeepSpeed saved without the
    loop's state, and DeepSpeed's own train_batch_size after a ramp's change."""
    loop = deepspeed_loop("ramp", 0)
    answers = {}
    for step in loop.steps(max_steps=1):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        try:
            step.apply(max_grad_norm=1.0)
        except ValueError as err:
            answers["clip"] = str(err)
            step.apply()
    train(loop, 5)
    answers["train_batch_size"] = loop.deepspeed.train_batch_size()
    loop.deepspeed.save_checkpoint(directory, tag="bare")
    try:
        loop.load_checkpoint(directory, tag="bare")
    except ValueError as err:
        answers["bare"] = str(err)
    return answers


def random_state_restored(directory: str) -> bool:
    """Each rank's own random state from a checkpoint: a draw after saving, again after
    loading (the state disturbed between)."""
    loop = deepspeed_loop("constant", 0)
    train(loop, 1)
    torch.manual_seed(100 + dist.get_rank())
    loop.save_checkpoint(directory, tag="rng")
    drawn = torch.rand(4)
    torch.manual_seed(999)
    loop.load_checkpoint(directory, tag="rng")
    return bool(torch.equal(torch.rand(4), drawn))


def bf16_run(stage: int, steps: int = 24) -> dict:
    return train(deepspeed_loop("adaptive", stage, "bf16"), steps)


def refusal(stage: int, dtype: str = "fp32", optimizer: str = "sgd", **config) -> str:
    """The error AdaptiveBatchDeepSpeed raises for this engine, or "accepted"."""
    engine = deepspeed_engine(stage, dtype, optimizer, **config)
    try:
        AdaptiveBatchDeepSpeed(engine, regression_data(), controller=controller("constant"))
    except (ValueError, TypeError) as err:
        return str(err)
    return "accepted"


def resumed(stage: int, directory: str, steps: int = 12) -> dict:
    """``steps`` steps straight, against ``steps // 2``, a checkpoint, a new engine and loop
    loaded from it, and the rest."""
    straight = train(deepspeed_loop("adaptive", stage, optimizer="adamw", lr=0.01), steps)
    first = deepspeed_loop("adaptive", stage, optimizer="adamw", lr=0.01)
    head = train(first, steps // 2)
    first.save_checkpoint(directory, tag="half")
    torch.manual_seed(1234)  # disturb the random state: the checkpoint must restore it
    second = deepspeed_loop("adaptive", stage, optimizer="adamw", lr=0.01)
    second.load_checkpoint(directory, tag="half")
    tail = train(second, steps - steps // 2)
    return {"straight": straight, "head": head, "tail": tail}


def refusal_min_sub_batches() -> str:
    engine = deepspeed_engine(0)
    try:
        AdaptiveBatchDeepSpeed(engine, regression_data(), min_sub_batches=1)
    except ValueError as err:
        return str(err)
    return "accepted"


def refusal_fp16() -> str:
    engine = deepspeed_engine(0)
    engine.fp16_enabled = lambda: True  # DeepSpeed builds no fp16 engine on a CPU
    try:
        AdaptiveBatchDeepSpeed(engine, regression_data())
    except ValueError as err:
        return str(err)
    return "accepted"
