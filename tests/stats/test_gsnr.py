"""The element-wise GSNR, ``mean² / variance`` of the sub-batch gradients, against a direct
computation: Welford's update (one process) and the shifted sums (DDP, FSDP2)."""

import pytest
import torch

from bigbatch.parallel.world import World
from bigbatch.stats import MicroBatchStatistics
from bigbatch.stats.gsnr import ShiftedGSNR, WelfordGSNR
from bigbatch.stats.layout import ParamLayout

from .common import backward_micro_batches, collect, make_problem, slow_gradients, sub_batches

SIZES = [3, 5, 2, 6]


def make_params():
    return [torch.zeros(4, 3, requires_grad=True), torch.zeros(5, requires_grad=True)]


def random_means(params, offset=0.5, seed=0):
    """Per micro-batch, a mean gradient for each parameter: ``offset`` plus unit noise."""
    gen = torch.Generator().manual_seed(seed)
    return [[offset + torch.randn(p.shape, generator=gen) for p in params] for _ in SIZES]


def direct_gsnr(means, weights):
    """Per parameter, ``mean² / variance`` over the micro-batches, in float64 (weights
    normalised to sum to 1)."""
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    out = []
    for j in range(len(means[0])):
        x = torch.stack([m[j].double() for m in means])
        w_j = w.view(-1, *[1] * (x.dim() - 1))
        mean = (w_j * x).sum(0)
        out.append(mean.square() / (w_j * (x - mean).square()).sum(0))
    return out


def run_step(part, params, means, batches):
    """One step of ``part``: micro-batch ``i``'s backward adds ``l_i × means[i]`` to ``.grad``."""
    for p in params:
        p.grad = None
    part.begin(batches)
    weights = batches.loss_weights
    increments = [[weights[i] * m for m in step] for i, step in enumerate(means)]
    backward_micro_batches(params, increments, batches)
    return part.finish([p.grad for p in params], batches)


def assert_gsnr(got, expected, rtol=1e-4):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("weighting", ["samples", "equal"])
def test_welford_weights_each_micro_batch_by_its_loss_weight(weighting):
    params = make_params()
    loss_weights = None if weighting == "samples" else [1 / len(SIZES)] * len(SIZES)
    batches = sub_batches(SIZES, loss_weights)
    means = random_means(params)
    gsnr = WelfordGSNR(ParamLayout([params]), lambda: batches)
    assert_gsnr(run_step(gsnr, params, means, batches), direct_gsnr(means, batches.loss_weights))
    assert gsnr.memory() == 4 * sum(p.numel() for p in params)  # one float32 buffer
    assert gsnr.traffic() == 0


@pytest.mark.parametrize("weighting", ["samples", "equal"])
def test_shifted_sums_weight_each_sub_batch_by_its_samples(weighting):
    params = make_params()
    loss_weights = None if weighting == "samples" else [1 / len(SIZES)] * len(SIZES)
    batches = sub_batches(SIZES, loss_weights)
    means = random_means(params)
    gsnr = ShiftedGSNR(ParamLayout([params]), lambda: batches, World())
    assert_gsnr(run_step(gsnr, params, means, batches), direct_gsnr(means, SIZES))
    assert gsnr.memory() == 3 * 4 * sum(p.numel() for p in params)  # Σ w(x-c), Σ w(x-c)², c


def test_far_from_zero_the_shift_keeps_the_variance_exact():
    """Gradients near 1000 with unit spread: about zero (the first step) the float32 sums
    cancel; about the previous step's mean (every later one), and in Welford's update, not."""
    params = make_params()
    batches = sub_batches(SIZES)
    shifted = ShiftedGSNR(ParamLayout([params]), lambda: batches, World())
    welford = WelfordGSNR(ParamLayout([params]), lambda: batches)
    first, second = random_means(params, 1000.0, seed=1), random_means(params, 1000.0, seed=2)
    unshifted = run_step(shifted, params, first, batches)
    errors = [
        (g.double() / e - 1).abs().max() for g, e in zip(unshifted, direct_gsnr(first, SIZES))
    ]
    assert max(errors) > 1e-2, "the first step has no shift: its sums cancel"
    expected = direct_gsnr(second, SIZES)
    assert_gsnr(run_step(shifted, params, second, batches), expected, rtol=1e-3)
    assert_gsnr(run_step(welford, params, second, batches), expected, rtol=1e-3)


def test_gsnr_is_mean_squared_over_variance_of_micro_batch_gradients():
    sizes = [6, 6, 6, 5]
    model, x, y = make_problem()
    per_batch = torch.stack(slow_gradients(model, x, y, sizes))
    weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    mean = (weights[:, None] * per_batch).sum(0)
    variance = (weights[:, None] * (per_batch - mean) ** 2).sum(0)
    got = collect(model, x, y, sizes, MicroBatchStatistics([list(model.parameters())], gsnr=True))
    flat = torch.cat([r.flatten() for r in got.gsnr]).double()
    expected = mean.square() / (variance + 1e-30)
    finite = variance > 1e-12
    torch.testing.assert_close(flat[finite], expected[finite], rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("world", [None, World(sharded=True)], ids=["welford", "shifted"])
def test_a_parameter_some_micro_batches_skip_counts_a_zero_gradient_there(world):
    """A branch unused in micro-batches 0, 2, 5 and 7 of 8 (a conditional layer): its
    gradient there is 0, and the variance must hold (0 - mean)²; the hooks that never fired
    left it out (the GSNR 0.9x to 3x the truth). Two steps: the shifted path's shift moves."""
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    params = [trunk.weight, trunk.bias, branch.weight, branch.bias]
    sizes = [3, 5, 4, 6, 2, 7, 5, 4]
    start = [sum(sizes[:i]) for i in range(9)]
    options = {"world": world, "similarity": "scalar"} if world else {}
    statistics = MicroBatchStatistics([params], gsnr=True, **options)
    for uses in ([True] * 8, [False, True, False, True, True, False, True, False]):
        x, y = torch.randn(36, 3), torch.randn(36, 2)

        def loss(i, x=x, y=y, uses=uses):
            part = slice(start[i], start[i + 1])
            out = trunk(x[part]) + (branch(x[part]) if uses[i] else 0)
            return torch.nn.functional.mse_loss(out, y[part])

        each = []
        for i in range(8):
            grads = torch.autograd.grad(loss(i), params, allow_unused=True)
            each.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
        statistics.begin(sizes)
        for i in range(8):
            statistics.before_backward(i)
            (loss(i) * sizes[i] / 36).backward()
        got = statistics.finish().gsnr
        for p in params:
            p.grad = None
        w = torch.tensor(sizes, dtype=torch.float64) / 36
        for j in range(len(params)):
            g = torch.stack([e[j].double() for e in each])
            weights = w.view(-1, *[1] * (g.ndim - 1))
            mean = (weights * g).sum(0)
            variance = (weights * (g - mean) ** 2).sum(0)
            torch.testing.assert_close(got[j].double(), mean**2 / variance, rtol=1e-5, atol=0)
    statistics.close()
