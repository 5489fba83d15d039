"""The collector against statistics computed the slow way, gradient by gradient."""

import warnings

import pytest
import torch
from torch import nn

import bigbatch as bb
from bigbatch.stats import MicroBatchStatistics, noise_components
from bigbatch.stats.estimators import unbiased

from .common import collect, make_problem, micro_batches, slow_gradients

#: where the ``cuda``-marked test runs (skipped without a GPU)
DEVICE = "cuda"


@pytest.mark.parametrize("sizes", [[6, 6, 6, 5], [5, 5, 4, 5, 4]])
def test_similarity_and_noise_equal_the_slow_computation(sizes):
    model, x, y = make_problem()
    per_batch = slow_gradients(model, x, y, sizes)
    total, half = sum(sizes), len(sizes) // 2
    weights = [b / total for b in sizes]
    g_a = sum(w * g for w, g in zip(weights[:half], per_batch[:half]))
    g_b = sum(w * g for w, g in zip(weights[half:], per_batch[half:]))
    cosine = (g_a @ g_b / (g_a.norm() * g_b.norm())).item()
    full = g_a + g_b
    signal, trace = noise_components(
        torch.stack([g.square().sum() for g in per_batch]), sizes, full.square().sum()
    )

    stats = MicroBatchStatistics(
        [list(model[0].parameters()), list(model[2].parameters())], ema_beta=0.0
    )
    got = collect(model, x, y, sizes, stats)
    assert got.similarity == pytest.approx(cosine, abs=1e-5)
    assert got.grad_sq_norm == pytest.approx(signal.item(), rel=1e-4)
    assert got.trace == pytest.approx(trace.item(), rel=1e-4)
    assert got.noise_scale == pytest.approx((trace / signal).item(), rel=1e-4)
    # per group: the first Linear's parameters come first in the flat vectors
    n0 = sum(p.numel() for p in model[0].parameters())
    group0 = (g_a[:n0] @ g_b[:n0] / (g_a[:n0].norm() * g_b[:n0].norm())).item()
    assert got.group_similarity[0] == pytest.approx(group0, abs=1e-5)
    # .grad is the batch mean gradient, as an ordinary loop would have it
    grad = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-7)


def test_loss_scale_is_divided_out():
    sizes = [6, 6, 6, 5]
    model, x, y = make_problem()
    plain = collect(
        model, x, y, sizes, MicroBatchStatistics([list(model.parameters())], ema_beta=0.0)
    )
    model.zero_grad()
    scaled = collect(
        model,
        x,
        y,
        sizes,
        MicroBatchStatistics([list(model.parameters())], ema_beta=0.0),
        loss_scale=1024.0,
    )
    for name in ("similarity", "grad_sq_norm", "trace", "noise_scale"):
        assert getattr(scaled, name) == pytest.approx(getattr(plain, name), rel=1e-4)


@pytest.mark.parametrize("gsnr", [False, True])
def test_a_backward_outside_a_step_changes_nothing(gsnr):
    sizes = [6, 6, 6, 5]
    model, x, y = make_problem()
    clean = collect(model, x, y, sizes, MicroBatchStatistics([list(model.parameters())], gsnr=gsnr))
    model.zero_grad()
    stats = MicroBatchStatistics([list(model.parameters())], gsnr=gsnr)
    # a user's own backward before the step (its gradient then cleared) ...
    nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad()
    # ... and one between finish() and the next step are not measured
    got = collect(model, x, y, sizes, stats)
    model.zero_grad()
    nn.functional.cross_entropy(model(x[:5]), y[:5]).backward()
    model.zero_grad()
    again = collect(model, x, y, sizes, stats)
    for name in ("similarity", "grad_sq_norm", "trace"):
        assert getattr(got, name) == getattr(clean, name)
        assert getattr(again, name) == getattr(clean, name)
    if gsnr:
        assert all(torch.equal(a, b) for a, b in zip(got.gsnr, clean.gsnr))


def test_misuse_is_reported():
    model, _, _ = make_problem()
    stats = MicroBatchStatistics([list(model.parameters())])
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        stats.begin([23])
    with pytest.raises(ValueError, match="at least 2 sub-batches"):
        MicroBatchStatistics([list(model.parameters())], similarity="scalar").begin([23])
    with pytest.raises(RuntimeError, match="begin"):
        stats.before_backward(0)
    with pytest.raises(RuntimeError, match="begin"):
        stats.finish()
    stats.close()


def test_state_round_trip_keeps_the_moving_averages():
    sizes = [6, 6, 6, 5]
    model, x, y = make_problem()
    stats = MicroBatchStatistics([list(model.parameters())], ema_beta=0.9)
    collect(model, x, y, sizes, stats)
    model.zero_grad()
    other = MicroBatchStatistics([list(model.parameters())], ema_beta=0.9)
    other.load_state_dict(stats.state_dict())
    a = collect(model, x, y, sizes, stats)
    model.zero_grad()
    b = collect(model, x, y, sizes, other)
    assert a.noise_scale == b.noise_scale


def test_equal_loss_weights_as_framework_loops_use():
    """Lightning and the HF Trainer weight each micro-batch's mean loss 1/k, not b_i/B."""
    sizes = [7, 6, 6, 4]
    k = len(sizes)
    model, x, y = make_problem()
    per_batch = torch.stack(slow_gradients(model, x, y, sizes))
    stats = MicroBatchStatistics([list(model.parameters())], ema_beta=0.0, gsnr=True)
    stats.begin(sizes, loss_weights=[1 / k] * k)
    for i, (xb, yb) in enumerate(micro_batches(x, y, sizes)):
        stats.before_backward(i)
        (nn.functional.cross_entropy(model(xb), yb) / k).backward()
    got = stats.finish()
    full = per_batch.mean(0)  # what .grad holds: the mean of the micro-batch means
    # whose variance is Σ (1/k)² trΣ / b_i, not the batch mean's trΣ / B
    h, phi = sum(1 / b for b in sizes) / k, sum(1 / (k * k * b) for b in sizes)
    signal, trace = unbiased(per_batch.square().sum(1).mean(), full.square().sum(), h, phi)
    assert got.grad_sq_norm == pytest.approx(signal.item(), rel=1e-4)
    assert got.trace == pytest.approx(trace.item(), rel=1e-4)
    g_a, g_b = per_batch[:2].mean(0), per_batch[2:].mean(0)
    cosine = (g_a @ g_b / (g_a.norm() * g_b.norm())).item()
    assert got.similarity == pytest.approx(cosine, abs=1e-5)
    variance = ((per_batch - full) ** 2).mean(0)
    flat = torch.cat([r.flatten() for r in got.gsnr]).double()
    informative = variance > 1e-12
    expected = full.square() / (variance + 1e-30)
    torch.testing.assert_close(flat[informative], expected[informative], rtol=2e-3, atol=1e-6)
    with pytest.raises(ValueError, match="loss_weights must be 4 positive numbers"):
        stats.begin(sizes, loss_weights=[1, 1])
    stats.close()


@pytest.mark.cuda
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
    assert got.grad_sq_norm == pytest.approx(expected[0].item(), rel=1e-4, abs=1e-7)
    assert got.trace == pytest.approx(expected[1].item(), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("size, warned", [(2, False), (3, True), (4, False)])
def test_the_split_similarity_on_an_odd_number_of_ranks_is_warned_of(monkeypatch, size, warned):
    """Ranks [0, W/2) against the rest: on 3, 1 against 2, a cosine 5% below one process's
    on the same batch, so SimiGrad held another batch, silently."""
    from bigbatch.parallel.world import World
    from bigbatch.stats import collector
    from bigbatch.stats.layout import ParamLayout

    monkeypatch.setattr(collector, "SplitRanks", lambda layout, world: None)  # (no group here)
    layout = ParamLayout([list(nn.Linear(2, 2).parameters())])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector._halves("split", layout, World(rank=0, size=size), None)
    messages = [str(w.message) for w in caught]
    assert any("compares 1 with 2: halves of unequal size" in m for m in messages) == warned


def test_a_step_finished_before_the_last_was_read_averages_in_order():
    """Two steps finished, the first never read by the caller: the averages take the
    first before the second, as two steps finished and read one after the other do."""

    def run(read_each):
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        statistics = MicroBatchStatistics(optimizer.param_groups)
        pending = []
        for seed in (1, 2):
            gen = torch.Generator().manual_seed(seed)
            x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
            statistics.begin([8, 8])
            for i in range(2):
                statistics.before_backward(i)
                part = slice(8 * i, 8 * i + 8)
                (nn.functional.cross_entropy(model(x[part]), y[part]) * 0.5).backward()
            pending.append(statistics.finish_pending())
            if read_each:
                pending[-1].read()
            optimizer.zero_grad()
        return pending[-1].read().grad_sq_norm_ema

    assert run(read_each=False) == run(read_each=True)
