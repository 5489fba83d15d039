"""Programs the gloo tests run on every rank (module-level so spawned ranks can import them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import TensorDataset

from bigbatch import AdaptiveBatch
from bigbatch.batch import BatchWarmup, Constant, Ramp, SimiGrad
from bigbatch.batch.contrib import CriticalBatchRamp
from bigbatch.optim import AGVM, VRGD, create_optimizer
from bigbatch.stats import noise_components, scalar_similarity

D = 12


def regression_data(n: int = 2048, noise: float = 1.0, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=gen)
    x = torch.randn(n, D, generator=gen)
    y = x @ w_star + noise * torch.randn(n, generator=gen)
    return TensorDataset(x.double(), y[:, None].double())


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def param_groups(model: nn.Module) -> list[dict]:
    inner = model.module if isinstance(model, DDP) else model
    return [{"params": list(inner[0].parameters())}, {"params": list(inner[2].parameters())}]


def make_loop(
    controller,
    *,
    ddp: bool = True,
    similarity: str | None = None,
    lr: float = 0.05,
    max_micro_batch: int = 8,
    min_sub_batches: int | None = 2,
    data: TensorDataset | None = None,
    gsnr: bool = False,
    optimizer: str = "sgd",
    fsdp: bool = False,
    noise_from: str = "sub_batches",
    statistics_every: int = 1,
    statistics: bool | None = True,  # measured under a constant batch too
    asynchronous: bool = False,
) -> AdaptiveBatch:
    model = make_model()
    if fsdp:
        model = shard(model)
    elif ddp:
        model = DDP(model)
    groups = param_groups(model)
    if optimizer == "sgd":
        optimizer_ = torch.optim.SGD(groups, lr=lr)
    elif optimizer == "adamw":
        optimizer_ = torch.optim.AdamW(groups, lr=lr)
    elif optimizer == "adamw-fused":
        optimizer_ = torch.optim.AdamW(groups, lr=lr, fused=True)
    elif optimizer in ("lamb", "lars", "merit"):
        optimizer_ = create_optimizer(groups, optimizer, lr=lr)
    elif optimizer == "vr-sgd":
        optimizer_ = VRGD(torch.optim.SGD(groups, lr=lr))
    else:  # agvm
        for group, name in zip(groups, ("first", "last")):
            group["agvm_group"] = name
        optimizer_ = AGVM(torch.optim.SGD(groups, lr=lr), start=0, interval=1)
    return AdaptiveBatch(
        model,
        optimizer_,
        data if data is not None else regression_data(),
        controller=controller,
        max_micro_batch=max_micro_batch,
        min_sub_batches=min_sub_batches,
        lr_scaling="none",
        similarity=similarity,
        gsnr=gsnr,
        noise_from=noise_from,
        statistics_every=statistics_every,
        statistics=statistics,
        asynchronous=asynchronous,
    )


def shard(model: nn.Module) -> nn.Module:
    """``model`` under FSDP2: each linear layer, then the root, ``fully_shard``-ed over the
    ranks."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def train(loop: AdaptiveBatch, steps: int) -> dict[str, list]:
    """Run ``steps`` steps; what every rank saw and decided."""
    record: dict[str, list] = {
        "batch": [], "similarity": [], "loss": [], "indices": [], "noise_scale": [],
        "micro_batches": [],
    }  # fmt: skip
    for step in loop.steps(max_steps=loop.steps_taken + steps):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        step.apply()
        record["batch"].append(step.batch_size)
        record["similarity"].append(step.metrics.get("similarity"))
        record["noise_scale"].append(step.metrics.get("noise_scale"))
        record["loss"].append(step.metrics["loss"])
        record["indices"].append([i for b in step.indices for i in b])
        record["micro_batches"].append(len(step.plan.sizes))
    return record


def flat_params(loop: AdaptiveBatch) -> torch.Tensor:
    """All parameters in one vector (gathered from the ranks' shards under FSDP2)."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in loop.model.parameters()]
    return torch.cat([p.detach().flatten() for p in full])


# ---------------------------------------------------------------- programs


def adaptive_run(
    steps: int,
    similarity: str,
    fsdp: bool = False,
    optimizer: str = "sgd",
    every: int = 1,
    max_micro_batch: int = 8,
) -> dict:
    world = dist.get_world_size()
    controller = SimiGrad(target=0.5, initial=16 * world, min=2 * world, max=512, window=5)
    lr = 0.05 if optimizer == "sgd" else 0.01
    loop = make_loop(
        controller,
        similarity=similarity,
        fsdp=fsdp,
        optimizer=optimizer,
        lr=lr,
        statistics_every=every,
        max_micro_batch=max_micro_batch,
    )
    record = train(loop, steps)
    record["params"] = flat_params(loop)
    return record


def asynchronous_run(steps: int) -> dict:
    """``asynchronous=True`` under DDP: each step's numbers read at the next step."""
    world = dist.get_world_size()
    controller = SimiGrad(target=0.5, initial=16 * world, min=2 * world, max=512, window=5)
    loop = make_loop(controller, optimizer="adamw-fused", lr=0.01, asynchronous=True)
    metrics = []
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        step.apply()
        metrics.append(dict(step.metrics))
    metrics.append(loop.flush())
    return {"metrics": metrics, "params": flat_params(loop)}


def norm_between_measurements(fsdp: bool = False) -> list[tuple[float | None, float]]:
    """Four steps measuring every 2nd, with a controller that learns between measurements:
    each step's logged ``batch_grad_sq_norm`` beside its whole gradient's squared norm
    (gathered from the shards under FSDP2)."""
    world = dist.get_world_size()
    loop = make_loop(CriticalBatchRamp(1.0, initial=16 * world, window=4), fsdp=fsdp,
                     ddp=not fsdp, statistics_every=2)  # fmt: skip
    seen = []
    for step in loop.steps(max_steps=4):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        grads = [p.grad for p in loop.model.parameters()]
        full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        step.apply()
        seen.append((step.metrics.get("batch_grad_sq_norm"),
                     sum(float(g.double().square().sum()) for g in full)))  # fmt: skip
    return seen


def constant_run(batch: int, steps: int, fsdp: bool = False, optimizer: str = "sgd") -> dict:
    loop = make_loop(Constant(batch), fsdp=fsdp, optimizer=optimizer)
    record = train(loop, steps)
    record["params"] = flat_params(loop)
    record["traffic"] = loop.collector.traffic() / steps  # the statistics' bytes per step
    return record


def one_step_statistics(
    similarity: str, batch: int, fsdp: bool = False, per_example: bool = False
) -> dict:
    """One step's statistics, and the same values computed sub-batch by sub-batch (example by
    example for the per-example statistics, each example a sub-batch)."""
    data = regression_data()
    loop = make_loop(
        Constant(batch),
        similarity=similarity,
        data=data,
        fsdp=fsdp,
        noise_from="examples" if per_example else "sub_batches",
        min_sub_batches=1 if per_example else 2,
    )
    reference = make_model() if fsdp else copy.deepcopy(loop.model.module)
    step = next(loop.steps(max_steps=1))
    for x, y in step.micro_batches():
        step.backward(nn.functional.mse_loss(loop.model(x), y))
    step.apply()
    got = {
        "similarity": list(step.stats.group_similarity),
        "overall": float(step.stats.similarity),
        "loss": float(step.stats.loss),
    }
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, step.indices)

    # every sub-batch's gradient by its own backward, on the parameters before the step
    groups = [list(reference[0].parameters()), list(reference[2].parameters())]
    sizes, grads, losses = [], [], []
    if per_example:  # each rank's examples, one sub-batch each
        every_rank = [[[i] for b in rank_batches for i in b] for rank_batches in every_rank]
    for rank_batches in every_rank:
        for indices in rank_batches:
            x, y = data[indices]
            reference.zero_grad()
            loss = nn.functional.mse_loss(reference(x), y)
            loss.backward()
            grads.append([torch.cat([p.grad.flatten() for p in g]) for g in groups])
            sizes.append(len(indices))
            losses.append(float(loss.detach()) * len(indices))
    total = sum(sizes)
    half_ranks = every_rank[: len(every_rank) // 2]
    first = sum(len(b) for rank_batches in half_ranks for b in rank_batches)
    n_first = sum(len(r) for r in half_ranks)
    weights = torch.tensor(sizes, dtype=torch.float64)[:, None]
    expected: dict = {"similarity": [], "signal": [], "trace": [], "loss": sum(losses) / total}
    halves_overall = [0.0, 0.0, 0.0]
    for gi in range(len(groups)):
        sub = torch.stack([g[gi] for g in grads])
        g_a = (weights[:n_first] * sub[:n_first]).sum(0) / first
        g_b = (weights[n_first:] * sub[n_first:]).sum(0) / (total - first)
        full = (weights * sub).sum(0) / total
        signal, trace = noise_components(
            sub.square().sum(1), sizes, full.square().sum(), dataset_size=len(data)
        )
        expected["signal"].append(float(signal))
        expected["trace"].append(float(trace))
        if similarity == "split":
            cosine = g_a @ g_b / (g_a.norm() * g_b.norm())
        else:
            # (the scalar one: of two equal halves, however the ranks split)
            cosine = scalar_similarity(signal, trace, total / 2, total / 2, len(data))
        expected["similarity"].append(float(cosine))
        halves_overall = [
            halves_overall[0] + float(g_a @ g_a),
            halves_overall[1] + float(g_b @ g_b),
            halves_overall[2] + float(g_a @ g_b),
        ]
    if similarity == "split":
        sq_a, sq_b, dot = halves_overall
        expected["overall"] = dot / (sq_a * sq_b) ** 0.5
    else:
        signal, trace = sum(expected["signal"]), sum(expected["trace"])
        expected["overall"] = float(
            scalar_similarity(
                torch.tensor(signal), torch.tensor(trace), total / 2, total / 2, len(data)
            )
        )
    got["signal"], got["trace"] = float(step.stats.grad_sq_norm), float(step.stats.trace)
    expected["signal"], expected["trace"] = sum(expected["signal"]), sum(expected["trace"])
    counts = [len(r) for r in step.rank_sizes]
    return {"expected": expected, "got": got, "sizes": sizes, "micro_counts": counts}


def resume_same_world(steps: int, at: int, fsdp: bool = False, optimizer: str = "sgd") -> dict:
    """A straight run, and one rebuilt from its state after ``at`` steps."""
    world = dist.get_world_size()
    lr = 0.05 if optimizer == "sgd" else 0.01

    def controller():
        return SimiGrad(target=0.5, initial=16 * world, min=2 * world, max=512, window=5)

    loop = make_loop(controller(), fsdp=fsdp, optimizer=optimizer, lr=lr)
    first = train(loop, at)
    state = copy.deepcopy(loop.state_dict())
    rest = train(loop, steps - at)
    straight = flat_params(loop)

    resumed = make_loop(controller(), fsdp=fsdp, optimizer=optimizer, lr=lr)
    resumed.load_state_dict(state)
    again = train(resumed, steps - at)
    return {
        "first": first,
        "rest": rest,
        "again": again,
        "straight": straight,
        "resumed": flat_params(resumed),
        "traffic": [loop.collector.traffic(), resumed.collector.traffic()],
    }


def save_run(steps: int, path: str, fsdp: bool = False, optimizer: str = "sgd") -> dict:
    """Train ``steps`` steps and save the loop's state from rank 0."""
    world = dist.get_world_size()
    controller = SimiGrad(target=0.5, initial=16 * world, min=8, max=512, window=5)
    loop = make_loop(controller, fsdp=fsdp, optimizer=optimizer)
    record = train(loop, steps)
    state = loop.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()
    record["next_batch"] = loop.batch_size
    record["samples"] = loop.samples
    return record


def resume_run(
    steps: int, path: str, fsdp: bool = False, optimizer: str = "sgd", ddp: bool = True
) -> dict:
    """Load a state saved by ``save_run`` (any number of ranks) and train on."""
    controller = SimiGrad(target=0.5, initial=64, min=8, max=512, window=5)
    loop = make_loop(controller, fsdp=fsdp, optimizer=optimizer, ddp=ddp)
    loop.load_state_dict(torch.load(path, weights_only=True))
    start = {"batch": loop.batch_size, "samples": loop.samples, "step": loop.steps_taken}
    record = train(loop, steps)
    record["start"] = start
    return record


def hook_with_inner(steps: int, inner: str) -> dict:
    """The two-group hook around torch's all-reduce or PowerSGD hook, against plain DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from bigbatch.parallel import TwoGroupCosine, two_group_cosine_hook

    plain = make_loop(Constant(24 * dist.get_world_size()), similarity="scalar")
    train(plain, steps)

    model = DDP(make_model())
    optimizer = torch.optim.SGD(param_groups(model), lr=0.05)
    if inner == "allreduce":
        hook = TwoGroupCosine(param_groups(model), inner=(None, default_hooks.allreduce_hook))
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        hook = TwoGroupCosine(param_groups(model), inner=(state, powerSGD_hook.powerSGD_hook))
    model.register_comm_hook(hook, two_group_cosine_hook)
    wrapped = AdaptiveBatch(
        model,
        optimizer,
        regression_data(),
        controller=Constant(24 * dist.get_world_size()),
        max_micro_batch=8,
        min_sub_batches=2,
        lr_scaling="none",
        similarity="scalar",
    )
    sums = []
    for step in wrapped.steps(max_steps=steps):
        hook.reset()
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(wrapped.model(x), y))
        sq_a, sq_b, dot = hook.read()
        sums.append(float((dot / (sq_a * sq_b).sqrt())[0]))
        step.apply()
    return {
        "plain": flat_params(plain),
        "wrapped": flat_params(wrapped),
        "cosines": sums,
        "extra_bytes": hook.extra_bytes,
    }


def similarity_series(steps: int, batch: int) -> dict:
    """Split and scalar similarity at a fixed point (lr 0), step by step."""
    loop = make_loop(Constant(batch), similarity="split", lr=0.0)
    world = dist.get_world_size()
    split, scalar, noise = [], [], []
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        step.apply()
        first = sum(sum(r) for r in step.rank_sizes[: world // 2])
        stats = step.stats
        split.append(float(stats.similarity))
        scalar.append(
            float(
                scalar_similarity(
                    torch.tensor(stats.grad_sq_norm, dtype=torch.float64),
                    torch.tensor(stats.trace, dtype=torch.float64),
                    first,
                    batch - first,
                    len(loop.source.dataset),
                )
            )
        )
        noise.append((float(stats.grad_sq_norm), float(stats.trace)))
    return {"split": split, "scalar": scalar, "noise": noise, "first": first}


def two_step_gsnr(batch: int, fsdp: bool = False) -> dict:
    """The element-wise GSNR of a second step (a non-zero shift) against the slow computation."""
    data = regression_data()
    loop = make_loop(Constant(batch), data=data, gsnr=True, lr=0.0, fsdp=fsdp)  # params stay put
    reference = make_model() if fsdp else copy.deepcopy(loop.model.module)
    for _ in range(2):
        step = next(loop.steps(max_steps=loop.steps_taken + 1))
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        step.apply()
    got = torch.cat([r.flatten() for r in step.stats.gsnr]).double()
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, step.indices)
    grads, sizes = [], []
    for rank_batches in every_rank:
        for indices in rank_batches:
            x, y = data[indices]
            reference.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            grads.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
            sizes.append(len(indices))
    w = torch.tensor(sizes, dtype=torch.float64)[:, None] / sum(sizes)
    g = torch.stack(grads)
    mean = (w * g).sum(0)
    variance = (w * (g - mean) ** 2).sum(0)
    return {"got": got, "expected": mean**2 / (variance + 1e-30), "variance": variance}


def wrapped_run(optimizer: str, steps: int) -> dict:
    """VRGD or AGVM under DDP: what every rank ends with."""
    world = dist.get_world_size()
    loop = make_loop(
        Constant(32 * world), optimizer=optimizer, lr=0.05, min_sub_batches=4, max_micro_batch=8
    )
    record = train(loop, steps)
    record["params"] = flat_params(loop)
    record["agvm"] = [m for m in loop.optimizer.multipliers] if optimizer == "agvm" else None
    return record


def compressed_loop(method: str, compressor: str, ratio: float, **options) -> AdaptiveBatch:
    """The regression problem through AdaptiveBatch with a compression hook (``comm_hook``)."""
    from bigbatch.parallel import CompressionState, compression_hook

    model = DDP(make_model())
    return AdaptiveBatch(
        model,
        torch.optim.SGD(param_groups(model), lr=0.05),
        regression_data(),
        controller=Constant(24 * dist.get_world_size()),
        max_micro_batch=8,
        min_sub_batches=2,
        lr_scaling="none",
        comm_hook=(CompressionState(model, method, compressor, ratio, **options), compression_hook),
    )


def compressed_run(method: str, compressor: str, ratio: float, steps: int, **options) -> dict:
    loop = compressed_loop(method, compressor, ratio, **options)
    record = train(loop, steps)
    record["params"] = flat_params(loop)
    record["bytes"] = loop.comm_hook[0].bytes_per_step()
    return record


def compressed_nan_run(
    method: str, nan_ranks: tuple[int, ...], steps: int = 12, at: int = 6, compressor="topk"
):
    """A compressed run whose loss is NaN at step ``at`` on ``nan_ranks``: the parameters,
    the skips, and (EF21, EControl) how far the shared estimate is from the ranks' sum."""
    loop = compressed_loop(method, compressor, 0.1, warmup=3)
    hook = loop.comm_hook[0]
    poisoned = dist.get_rank() in nan_ranks
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            loss = nn.functional.mse_loss(loop.model(x), y)
            step.backward(loss * float("nan") if poisoned and step.index == at else loss)
        step.apply()
    gap = 0.0
    for key, shared in hook._shared.items():  # EF21's G is the sum of the ranks' estimates
        summed = hook._state[key]["estimate"].clone()
        dist.all_reduce(summed)
        gap = max(gap, (summed - shared).abs().max().item())
    return {
        "params": flat_params(loop),
        "skipped": loop.skipped_steps,
        "gap": gap,
        "iteration": hook.iteration,
    }


def refused_or_warned(case: str) -> str:
    """What a loop says, on 2+ ranks, to an asynchronous compressed run (``compressed``), a
    model not wrapped for the process group (``unwrapped``), ranks built unalike."""
    import warnings

    from bigbatch.parallel import CompressionState, compression_hook

    model = make_model() if case == "unwrapped" else DDP(make_model())
    options = {"asynchronous": True} if case == "compressed" else {}
    if case == "unalike":  # a setting read from a rank's own environment, say
        options["max_micro_batch"] = 8 if dist.get_rank() == 0 else 4
    if case == "compressed":
        options["comm_hook"] = (CompressionState(model, "ef", "topk", 0.1), compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            AdaptiveBatch(model, optimizer, regression_data(), controller=Constant(16), **options)
        except ValueError as err:
            return str(err)
    return " | ".join(str(w.message) for w in caught)


def heterogeneous_quadratic(method: str, steps: int, ratio: float = 0.1) -> float:
    """Distance to the optimum of Σ_i |A_i w - b_i|² / 2n after ``steps`` full-batch steps.

    Each rank holds its own least-squares problem (different scales and
    targets), so local gradients disagree at the optimum: Top-K without
    error control cannot settle there.
    """
    from bigbatch.parallel import CompressionState, compression_hook

    world, rank, d, n = dist.get_world_size(), dist.get_rank(), 40, 200
    problems = []
    for r in range(world):
        gen = torch.Generator().manual_seed(100 + r)
        a = torch.randn(n, d, generator=gen, dtype=torch.float64) * (1 + r)
        b = torch.randn(n, generator=gen, dtype=torch.float64) * 3 + r
        problems.append((a, b))
    a_all = torch.cat([a / n**0.5 for a, _ in problems])
    b_all = torch.cat([b / n**0.5 for _, b in problems])
    optimum = torch.linalg.lstsq(a_all, b_all[:, None]).solution.flatten()
    torch.manual_seed(0)
    model = DDP(nn.Linear(d, 1, bias=False).double())
    if method != "allreduce":
        compressor = "topk"
        state = CompressionState(model, method, compressor, ratio, warmup=2)
        model.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3 / (1 + world) ** 2)
    # a step size decaying to zero: classic EF settles in an O(lr) neighbourhood
    # of the optimum, which then shrinks; without error control the fixed point
    # itself is wrong
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 - t / steps)
    a, b = problems[rank]
    for _ in range(steps):
        optimizer.zero_grad()
        # DDP averages over ranks: scale by W so the step follows Σ_i f_i
        loss = 0.5 * ((model(a).flatten() - b) ** 2).mean() * world
        loss.backward()
        optimizer.step()
        schedule.step()
    return float((model.module.weight.detach().flatten() - optimum).norm() / optimum.norm())


def compressed_resume(method: str, steps: int, at: int, compressor: str = "topk") -> dict:
    def build():
        return compressed_loop(method, compressor, 0.2, warmup=3)

    loop = build()
    train(loop, at)
    state = copy.deepcopy(loop.state_dict())
    rest = train(loop, steps - at)
    resumed = build()
    resumed.load_state_dict(state)
    again = train(resumed, steps - at)
    return {
        "rest": rest["loss"],
        "again": again["loss"],
        "straight": flat_params(loop),
        "resumed": flat_params(resumed),
        "traffic": [loop.comm_hook[0].traffic(), resumed.comm_hook[0].traffic()],
    }


def micro_batch_counts(batch: int, max_micro_batch: int, weighted: bool) -> list[list[int]]:
    """Every rank's micro-batch sizes for one step of an awkward plan."""
    data = regression_data(64)
    model = DDP(make_model())
    loop = AdaptiveBatch(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        data,
        controller=Constant(batch),
        max_micro_batch=max_micro_batch,
        min_sub_batches=1,
        statistics=False,
        weight_fn=(lambda i: 1000) if weighted else None,
    )
    step = next(loop.steps(max_steps=1))
    for x, y in step.micro_batches():
        step.backward(nn.functional.mse_loss(model(x), y))
    step.apply()
    return [list(r) for r in step.rank_sizes]


def within_rank_statistics(batch: int, registered: bool = False) -> dict:
    """With a comm hook the noise comes from each rank's own micro-batches, averaged
    (``registered``: the user registered the hook on the model, not given to the loop)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    data = regression_data()
    model = DDP(make_model())
    reference = copy.deepcopy(model.module)
    # a user's own hook: taken to be lossy, so the noise is estimated within each rank
    hook = (None, lambda _, bucket: default_hooks.allreduce_hook(None, bucket))
    if registered:
        model.register_comm_hook(*hook)
    loop = AdaptiveBatch(
        model,
        torch.optim.SGD(param_groups(model), lr=0.05),
        data,
        controller=Constant(batch),
        max_micro_batch=8,
        min_sub_batches=2,
        lr_scaling="none",
        statistics=True,
        comm_hook=None if registered else hook,
    )
    step = next(loop.steps(max_steps=1))
    for x, y in step.micro_batches():
        step.backward(nn.functional.mse_loss(model(x), y))
    step.apply()
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, step.indices)
    signals, traces = [], []
    for rank_batches in every_rank:
        grads, sizes = [], []
        for indices in rank_batches:
            x, y = data[indices]
            reference.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            grads.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
            sizes.append(len(indices))
        w = torch.tensor(sizes, dtype=torch.float64)[:, None] / sum(sizes)
        local = (w * torch.stack(grads)).sum(0)
        signal, trace = noise_components(
            torch.stack([g.square().sum() for g in grads]), sizes, local.square().sum(), len(data)
        )
        signals.append(float(signal))
        traces.append(float(trace))
    return {
        "got": (float(step.stats.grad_sq_norm), float(step.stats.trace)),
        "expected": (sum(signals) / len(signals), sum(traces) / len(traces)),
    }


def fsdp_refusals() -> list[str]:
    """What AdaptiveBatch says of FSDP2 options it does not support, and of DTensor
    parameters without ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    messages = []
    try:
        make_loop(Constant(16), fsdp=True, similarity="split")
        messages.append("no error")
    except ValueError as err:
        messages.append(str(err))
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
    model[0].weight = weight
    try:
        AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), regression_data())
        messages.append("no error")
    except ValueError as err:
        messages.append(str(err))
    blocks = make_model()  # its layers sharded, its root forgotten
    for layer in blocks:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    try:
        AdaptiveBatch(blocks, torch.optim.SGD(blocks.parameters(), lr=0.1), regression_data())
        messages.append("no error")
    except ValueError as err:
        messages.append(str(err))
    return messages


def users_hook_under_split_similarity() -> int:
    """How often the user's comm hook ran in 2 steps of ``similarity="split"``, which
    reduces the gradient through bigbatch's two-group hook (the user's inside it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = 0

    def hook(state, bucket):
        nonlocal calls
        calls += 1
        return default_hooks.allreduce_hook(None, bucket)

    model = DDP(make_model())
    loop = AdaptiveBatch(
        model, torch.optim.SGD(param_groups(model), lr=0.05), regression_data(),
        controller=Constant(16), statistics=True, similarity="split",
        noise_from="sub_batches", comm_hook=(None, hook),
    )  # fmt: skip
    for step in loop.steps(max_steps=2):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(model(x), y))
        step.apply()
    return calls


def fsdp_gradients_by_micro_batch() -> list[bool]:
    """Whether every sharded ``.grad`` exists after each of a step's two micro-batches."""
    from torch.distributed.fsdp import fully_shard

    from bigbatch.parallel import ddp

    model = make_model()
    fully_shard(model)
    x, y = regression_data()[:8]
    present = []
    for i, last in enumerate((False, True)):
        with ddp.accumulating(model, last):
            nn.functional.mse_loss(model(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]).backward()
        present.append(all(p.grad is not None for p in model.parameters()))
    return present


def sharded_optimizer_collectives(name: str, layers: int) -> int:
    """The all-reduces one step of optimizer ``name`` makes on a ``layers``-deep FSDP2 model
    (two param groups: weights with weight decay, biases without)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(layers)]).double()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    groups = [
        {"params": [m.weight for m in model], "weight_decay": 0.01},
        {"params": [m.bias for m in model], "weight_decay": 0.0},
    ]
    optimizer = create_optimizer(groups, name, lr=0.01)
    x, y = regression_data()[:16]
    nn.functional.mse_loss(model(x).sum(1, keepdim=True), y).backward()
    calls = 0
    real = dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        optimizer.step()
    finally:
        dist.all_reduce = real
    return calls


def cli_build(strategy: str, steps: int) -> dict:
    """The command line's model and loop for ``dist.strategy`` on these ranks, a few steps."""
    from bigbatch.experiments.build import build
    from bigbatch.experiments.plan import plan_run
    from bigbatch.parallel import World

    config = plan_run({"task": "teacher", "device": "cpu", "dist.strategy": strategy})
    world = World(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    problem, loop, _ = build(config, world)
    losses = []
    for step in loop.steps(max_steps=steps):
        for batch in step.micro_batches():
            step.backward(problem.loss(loop.model, batch))
        step.apply()
        losses.append(step.metrics["loss"])
    evaluation = problem.evaluate(problem.model)  # every rank: a collective under FSDP2
    return {
        "model": type(loop.model).__name__,
        "sharded": loop.world.sharded,
        "losses": losses,
        "accuracy": evaluation["eval_accuracy"],
    }


def engines_built_by_the_loop_and_a_plugin() -> dict:
    """The loop registers a lossy comm hook itself; a framework registered the same hook on
    its own DDP model: ``StepEngine.build`` must make the same engine of both (the plugin
    reads the hook from the model), and refuse the measured split under the framework's."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from bigbatch import StepEngine, StepOptions

    hook = (None, default_hooks.fp16_compress_hook)  # lossy: the noise stays within each rank
    options = StepOptions(lr_scaling="none", similarity="scalar")
    loop_model = DDP(make_model())
    loop = AdaptiveBatch(
        loop_model,
        torch.optim.SGD(param_groups(loop_model), lr=0.05),
        regression_data(),
        min_sub_batches=2,
        comm_hook=hook,
        options=options,
    )
    framework_model = DDP(make_model())
    framework_model.register_comm_hook(*hook)

    def build(options: StepOptions) -> StepEngine:
        return StepEngine.build(
            torch.optim.SGD(param_groups(framework_model), lr=0.05),
            options=options,
            model=framework_model,
            sub_batches=2,
            dataset_size=len(regression_data()),
            registers_hooks=False,
        )

    try:
        build(StepOptions(similarity="split"))
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"loop": loop.engine.describe(), "plugin": build(options).describe(), "refused": refused}


def auto_noise_source(fsdp: bool = False) -> dict:
    """Where ``noise_from="auto"`` takes the noise from on this world, and a step's numbers."""
    loop = make_loop(
        BatchWarmup(initial=8 * dist.get_world_size(), min=dist.get_world_size()),
        noise_from="auto",
        min_sub_batches=None,
        max_micro_batch=64,
        fsdp=fsdp,
    )
    step = next(loop.steps(max_steps=1))
    for x, y in step.micro_batches():
        step.backward(nn.functional.mse_loss(loop.model(x), y))
    step.apply()
    return {
        "per_example": loop.collector.per_example is not None,
        "micro_batches": len(step.sizes),
        "why": loop.engine.noise_why,
        "trace": step.metrics["trace"],
    }


def compiled_per_example_run(steps: int, fsdp: bool = False) -> dict:
    """The per-example statistics of a growing batch under DDP (or FSDP2), eager and
    through ``torch.compile`` (the measured layers traced inside the compiled graph)."""
    world = dist.get_world_size()
    out = {}
    for name in ("eager", "compiled"):
        points = [(0, 8 * world), (64 * world, 16 * world), (192 * world, 48 * world)]
        controller = Ramp(points=points)
        loop = make_loop(controller, noise_from="examples", min_sub_batches=None,
                         max_micro_batch=32, fsdp=fsdp)  # fmt: skip
        forward = torch.compile(loop.model) if name == "compiled" else loop.model
        rows = []
        for step in loop.steps(max_steps=steps):
            for x, y in step.micro_batches():
                step.backward(nn.functional.mse_loss(forward(x), y))
            step.apply()
            rows.append([step.batch_size, step.metrics["grad_sq_norm"], step.metrics["trace"]])
        out[name] = rows
    return out


def warm_start(method: str, warmup: int) -> dict:
    """After the warm-up's uncompressed steps: the shared estimate against the last step's
    mean gradient, per parameter."""
    from bigbatch.parallel import CompressionState, compression_hook

    model = DDP(make_model())
    hook = CompressionState(model, method, "topk", 0.05, warmup=warmup)
    loop = AdaptiveBatch(
        model,
        torch.optim.SGD(param_groups(model), lr=0.0),  # the model holds: the grad is the mean
        regression_data(),
        controller=Constant(24 * dist.get_world_size()),
        max_micro_batch=8,
        min_sub_batches=2,
        lr_scaling="none",
        comm_hook=(hook, compression_hook),
    )
    grads = []
    for step in loop.steps(max_steps=warmup):
        for x, y in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(x), y))
        grads = [p.grad.clone() for p in model.parameters()]
        step.apply()
    shared = [hook._shared.get(i) for i in range(len(grads))]
    return {"grads": grads, "shared": shared}


def trained_from_the_first_state(optimizer: str, fsdp: bool, steps: int = 3) -> dict:
    """A loop whose state is taken before its first step (as ``bigbatch train`` saves its
    first checkpoint), trained ``steps`` steps, and another loaded from that state."""
    world = dist.get_world_size()
    runs, state = [], None
    for _ in range(2):
        loop = make_loop(Constant(16 * world), fsdp=fsdp, optimizer=optimizer, lr=0.01)
        if state is None:
            state = copy.deepcopy(loop.state_dict())
        else:
            loop.load_state_dict(state)
        train(loop, steps)
        counts = {float(s["step"]) for s in loop.optimizer.state.values() if "step" in s}
        runs.append({"params": flat_params(loop), "step_counts": counts})
    return {"straight": runs[0], "resumed": runs[1]}
