"""``(|G|², tr Σ)`` per group from the step's sub-batch norms, and their moving averages."""

import math

import pytest
import torch

from bigbatch.parallel.world import World
from bigbatch.stats.estimators import noise_from_mean
from bigbatch.stats.layout import ParamLayout
from bigbatch.stats.noise import NoiseAverages, PerRankNoise, ReducedNoise, SmallNorms
from bigbatch.stats.result import Gather

from .common import backward_micro_batches, sub_batches


def f64(values):
    """A float64 tensor: a scalar, or one value per group."""
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    "dataset_size, signal, trace",
    [
        # b = 4, B = 12: h = 1/4, φ(B) = 1/12; trΣ = (L - T) / (1/6), |G|² = (h T - φ L) / (1/6)
        (None, f64([0.3, 0.4]), f64([10.8, 2.4])),
        # from 24 samples without replacement: h = 5/23, φ(B) = 1/23
        (24, f64([0.75, 0.5]), f64([10.35, 2.3])),
    ],
)
def test_reduced_noise_on_one_process_is_the_closed_form(dataset_size, signal, trace):
    batches = sub_batches([4, 4, 4])
    params = [torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)]
    noise = ReducedNoise(ParamLayout([params[:1], params[1:]]), World(), dataset_size)
    loss = torch.tensor(0.7, dtype=torch.float64)
    h = 1 / 4 if dataset_size is None else 5 / 23
    # L = mean_i |g_i|² = (3, 1) per group; T = |g|² = (1.2, 0.6), under a loss scale of 2
    small = SmallNorms(count=3, h=h, sums=f64([9.0, 3.0]) * 4)
    grad_norms = list((f64([1.2, 0.6]) * 4).sqrt())
    into = Gather()
    noise.gather(into, grad_norms, small, loss)
    got = noise.estimate(into.split(into.tensor().tolist()), small, batches, 4.0)
    assert got[0] == pytest.approx(signal.tolist()) and got[1] == pytest.approx(trace.tolist())
    assert got[2] == 0.7 and noise.traffic() == 0


@pytest.mark.parametrize("grad_kept", [True, False], ids=["grad-accumulates", "grad-freed"])
def test_per_rank_noise_takes_the_local_total_at_the_last_micro_batch(grad_kept):
    """Where .grad is freed after each micro-batch (DeepSpeed ZeRO-2 reduces it into its
    partitions), the estimate keeps the sum itself and gets the same total."""
    params = [torch.zeros(4, 3, requires_grad=True), torch.zeros(5, requires_grad=True)]
    layout = ParamLayout([params[:1], params[1:]])
    batches = sub_batches([2, 3, 5])
    noise = PerRankNoise(layout, lambda: batches, World(), None, grad_accumulates=grad_kept)
    scale = 8.0  # a loss scale: on the increments, divided out by reduce
    gen = torch.Generator().manual_seed(0)
    means = [[torch.randn(p.shape, generator=gen) for p in params] for _ in batches.sizes]
    weights = batches.loss_weights
    increments = [[scale * w * g for g in step] for w, step in zip(weights, means)]
    noise.begin(batches)

    def free_grads(i):
        for p in params:
            p.grad = None

    backward_micro_batches(params, increments, batches, None if grad_kept else free_grads)
    assert not noise._sums  # the sum lives only during the step's backward passes
    sub_sq = torch.stack([sum(step[j].double().square().sum() for step in means) for j in (0, 1)])
    full = [sum(w * step[j].double() for w, step in zip(weights, means)) for j in (0, 1)]
    loss = torch.tensor(0.5, dtype=torch.float64)
    lossy = list(f64([1e9, 1e9]))  # |g| of the lossy reduction: not trusted, not used
    small = SmallNorms(count=3, h=0.0, sums=sub_sq * scale**2)
    into = Gather()
    noise.gather(into, lossy, small, loss, scale**2, batches)
    signal, trace, got_loss, _ = noise.estimate(
        into.split(into.tensor().tolist()), small, batches, scale**2
    )
    expected = noise_from_mean(sub_sq / 3, [2, 3, 5], torch.stack([g.square().sum() for g in full]))
    assert signal == pytest.approx(expected[0].tolist(), rel=1e-5, abs=1e-8)
    assert trace == pytest.approx(expected[1].tolist(), rel=1e-5, abs=1e-8)
    assert got_loss == 0.5


def test_per_rank_noise_needs_two_micro_batches_on_every_rank():
    layout = ParamLayout([[torch.zeros(3, requires_grad=True)]])
    noise = PerRankNoise(layout, lambda: None, World(), None)
    with pytest.raises(ValueError, match="every rank needs 2\\+ micro-batches"):
        noise.begin(sub_batches([8]))


def test_averages_are_bias_corrected():
    beta = 0.9
    averages = NoiseAverages(beta)
    # a constant is its own corrected average from the first step on
    for _ in range(3):
        signal, trace = averages.update(2.0, 5.0)
        assert signal == pytest.approx(2.0) and trace == pytest.approx(5.0)
    fresh = NoiseAverages(beta)
    fresh.update(1.0, 4.0)
    signal, trace = fresh.update(3.0, 0.0)
    # ((1 - β) β x1 + (1 - β) x2) / (1 - β²) = (β x1 + x2) / (1 + β)
    assert signal == pytest.approx((beta * 1 + 3) / (1 + beta))
    assert trace == pytest.approx(beta * 4 / (1 + beta))


def test_averages_skip_a_non_finite_step_and_round_trip_their_state():
    averages = NoiseAverages(0.5)
    averages.update(2.0, 6.0)
    signal, trace = averages.update(float("nan"), float("inf"))
    assert math.isfinite(signal) and math.isfinite(trace)
    other = NoiseAverages(0.5)
    other.load_state_dict(averages.state_dict())
    assert averages.update(1.0, 1.0) == other.update(1.0, 1.0)
    # a state saved while the averages were device tensors loads too
    tensors = {k: torch.tensor(v) for k, v in averages.state_dict().items()}
    other.load_state_dict(tensors)
    assert other.state_dict() == averages.state_dict()


@pytest.mark.parametrize("beta", [-0.1, 1.0, 1.5])
def test_ema_beta_must_be_in_zero_one(beta):
    with pytest.raises(ValueError, match=r"ema_beta must be in \[0, 1\)"):
        NoiseAverages(beta)


def test_ema_beta_zero_is_the_last_step():
    averages = NoiseAverages(0.0)
    averages.update(1.0, 1.0)
    assert averages.update(3.0, 7.0) == (3.0, 7.0)


@pytest.mark.parametrize("dataset_size", [6, None])
@pytest.mark.parametrize("weights", [[0.5, 0.5], [1.0, 1.0], None], ids=["1/k", "ones", "default"])
def test_the_estimates_are_unbiased_under_any_loss_weights(dataset_size, weights):
    """The exact expectation over every draw of 3 of 6 examples (sub-batches of 2 and 1):
    with weights other than ``W b_i / B`` (a framework's 1/k, or none) the reduced gradient
    is ``Σ w_i g_i``, whose norm the estimator took as the batch mean's (23.4 and 122 for 21
    and 153 in a review's oracle)."""
    import itertools

    from bigbatch.stats import MicroBatchStatistics

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen)
    model = torch.nn.Linear(3, 1, bias=False).double()
    per_example = []
    for j in range(6):
        model.zero_grad()
        (0.5 * (model(x[j]) - y[j]) ** 2).sum().backward()
        per_example.append(model.weight.grad.clone())
    model.zero_grad()
    mean = sum(per_example) / 6
    signal = float(mean.square().sum())
    # the population's covariance, which φ(b) = (N − b) / (b (N − 1)) pairs with
    trace = float(sum((g - mean).square().sum() for g in per_example) / 6)
    draws = itertools.permutations(range(6), 3) if dataset_size else itertools.product(
        range(6), repeat=3
    )  # fmt: skip
    got = []
    for draw in draws:
        stats = MicroBatchStatistics([[model.weight]], dataset_size=dataset_size)
        stats.begin([2, 1], loss_weights=weights)
        for i, part in enumerate((list(draw[:2]), list(draw[2:]))):
            stats.before_backward(i)
            w = weights[i] if weights else len(part) / 3
            loss = (0.5 * (model(x[part]).squeeze(1) - y.double()[part]) ** 2).mean()
            (loss * w).backward()
        result = stats.finish()
        model.zero_grad()
        stats.close()
        got.append((result.grad_sq_norm, result.trace))
    assert sum(g for g, _ in got) / len(got) == pytest.approx(signal, rel=1e-9)
    assert sum(t for _, t in got) / len(got) == pytest.approx(trace, rel=1e-9)
