"""On a CUDA GPU: the optimizers, the statistics, one host sync per step, and the CLI.

Skipped (with the reason) where there is no GPU; the same checks run on the
CPU elsewhere in the suite, this file adds what only a GPU can show.
"""

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch import cli
from bigbatch.testing import host_syncs

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


def gpt_like_params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (128, 32), (32, 128), (32,), (3, 8, 5)]
    return [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]


@pytest.mark.parametrize("name", ["lamb", "lambc", "nvlamb", "lars", "larc", "merit"])
@pytest.mark.parametrize("impl", ["foreach", "compiled", "fused"])
def test_optimizers_match_the_reference_on_cuda(name, impl):
    results = {}
    for which in ("reference", impl):
        params = [nn.Parameter(p.clone()) for p in gpt_like_params()]
        groups = [
            {"params": params[:4], "weight_decay": 0.01},
            {"params": params[4:], "weight_decay": 0.0},
        ]
        opt = bb.optim.create_optimizer(groups, name, lr=1e-2, impl=which)
        gen = torch.Generator().manual_seed(1)
        for _ in range(50):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            opt.step()
        results[which] = [p.detach().cpu() for p in params]
    for a, b in zip(results["reference"], results[impl]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_statistics_match_the_slow_computation_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DEVICE)
    x, y = torch.randn(24, 6, device=DEVICE), torch.randint(0, 3, (24,), device=DEVICE)
    sizes = [6, 6, 6, 6]
    grads = []
    for i in range(4):
        model.zero_grad()
        part = slice(6 * i, 6 * i + 6)
        nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    model.zero_grad()
    expected = bb.stats.noise_components(
        torch.stack([g.square().sum() for g in grads]),
        sizes,
        torch.stack(grads).mean(0).square().sum(),
    )
    stats = bb.stats.MicroBatchStatistics([list(model.parameters())])
    stats.begin(sizes)
    for i in range(4):
        stats.before_backward(i)
        part = slice(6 * i, 6 * i + 6)
        (nn.functional.cross_entropy(model(x[part]), y[part]) / 4).backward()
    got = stats.finish()
    torch.testing.assert_close(got.grad_sq_norm.double(), expected[0], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got.trace.double(), expected[1], rtol=1e-4, atol=1e-7)


def count_syncs(fn):
    """Host synchronisations ``fn`` makes (``bigbatch.testing.host_syncs``)."""
    with host_syncs() as syncs:
        fn()
    return syncs.count


@pytest.mark.parametrize("micro_batches, gsnr", [(2, False), (8, False), (8, True)])
def test_one_host_sync_per_step_on_cuda(micro_batches, gsnr):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(DEVICE)
    data = TensorDataset(torch.randn(8192, 32), torch.randint(0, 4, (8192,)))
    loop = bb.AdaptiveBatch(
        model,
        bb.optim.LAMB(model.parameters(), lr=1e-3),
        data,
        controller=bb.batch.CriticalBatchRamp(8.0, initial=32 * micro_batches, window=2),
        max_micro_batch=32,
        min_sub_batches=micro_batches,
        gsnr=gsnr,
        loader_options={"pin_memory": True},
    )
    steps = loop.steps(max_steps=6)

    def one_step():
        step = next(steps)
        for x, y in step.micro_batches():
            x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()

    one_step()  # the first step creates state
    assert [count_syncs(one_step) for _ in range(4)] == [1, 1, 1, 1]


def run(tmp_path, name, *settings):
    out = tmp_path / name
    args = ["train", "--quiet", "--set", "task=digits", "--set", "max_samples=20000"]
    for setting in settings:
        args += ["--set", setting]
    assert cli.main([*args, "--out", str(out)]) == 0
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_on_cuda_in_each_precision(tmp_path, precision):
    _, summary = run(tmp_path, precision, f"precision={precision}")
    assert summary["device"].startswith("cuda") and summary["precision"] == precision
    assert summary["best_accuracy"] > 0.7


def test_auto_picks_the_gpu_and_a_killed_cuda_run_resumes(tmp_path, monkeypatch):
    straight, summary = run(tmp_path, "straight", "checkpoint_every=5")
    assert summary["device"].startswith("cuda")

    real_step = bb.AdaptiveBatch._optimizer_step

    def crash_after_12(self):
        if self.steps_taken == 12:
            raise KeyboardInterrupt
        return real_step(self)

    killed = tmp_path / "killed"
    monkeypatch.setattr(bb.AdaptiveBatch, "_optimizer_step", crash_after_12)
    args = ["train", "--quiet", "--set", "task=digits", "--set", "max_samples=20000"]
    assert cli.main([*args, "--set", "checkpoint_every=5", "--out", str(killed)]) == 130
    monkeypatch.setattr(bb.AdaptiveBatch, "_optimizer_step", real_step)
    assert cli.main(["train", "--quiet", "--resume", str(killed)]) == 0

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    a, b = rows(straight), rows(killed)
    # GPU reductions may add in another order (atomics): the same path, to float tolerance
    assert [r["batch_size"] for r in a] == [r["batch_size"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4)


@pytest.mark.parametrize("impl", ["reference", "foreach", "compiled", "fused"])
@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_no_host_sync_inside_optimizer_step_on_cuda(name, impl, tensor_lr):
    params = [nn.Parameter(p) for p in gpt_like_params()]
    lr = torch.tensor(1e-2, device=DEVICE) if tensor_lr else 1e-2
    opt = bb.optim.create_optimizer(params, name, lr=lr, impl=impl)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step creates the state (and compiles)
    assert count_syncs(opt.step) == 0


@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_low_precision_parameters_keep_float32_state_on_cuda(name, dtype, impl):
    params = [nn.Parameter(p) for p in gpt_like_params(dtype=dtype)]
    opt = bb.optim.create_optimizer(params, name, lr=1e-3, impl=impl)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        assert p.dtype == dtype
        for value in opt.state[p].values():
            if value.is_floating_point() and value.dim() > 0:
                assert value.dtype == torch.float32


@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_low_precision_matches_foreach_on_cuda(name, dtype):
    """Both compute in float32 and round into the parameter once per step (to nearest)."""
    results = {}
    for impl in ("foreach", "fused"):
        params = [nn.Parameter(p) for p in gpt_like_params(dtype=dtype)]
        opt = bb.optim.create_optimizer(params, name, lr=1e-3, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE, dtype)
            opt.step()
        results[impl] = [p.detach().float().cpu() for p in params]
    for a, b in zip(results["foreach"], results["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-3)
