"""Noise estimators against closed-form oracles (docs/algorithms.md, "Gradient statistics")."""

import pytest
import torch

from bigbatch.stats import (
    MicroBatchStatistics,
    equilibrium_batch,
    expected_similarity,
    inverse_size,
    noise_components,
)


def linear_regression_run(sizes, steps, d=20, noise=1.0, seed=0):
    """Statistics at a fixed point of least squares with Gaussian inputs.

    Per-sample gradient at w = w* + δ: x (xᵀδ - ε), x ~ N(0, I), ε ~ N(0, σ²). Then
    G = δ and Σ = δδᵀ + (|δ|² + σ²) I, so with |δ| = 1:
    |G|² = 1, tr Σ = 1 + d (1 + σ²), B_simple = tr Σ.
    """
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=gen)
    delta = torch.randn(d, generator=gen)
    delta /= delta.norm()
    w = torch.nn.Parameter(w_star + delta)
    stats = MicroBatchStatistics([[w]], ema_beta=0.0)
    total = sum(sizes)
    results = []
    for _ in range(steps):
        stats.begin(sizes)
        w.grad = None
        for i, b in enumerate(sizes):
            x = torch.randn(b, d, generator=gen)
            y = x @ w_star + noise * torch.randn(b, generator=gen)
            stats.before_backward(i)
            (0.5 * ((x @ w - y) ** 2).mean() * b / total).backward()
        results.append(stats.finish())
    return results, 1 + d * (1 + noise**2)


@pytest.mark.parametrize("sizes", [[16, 16, 16, 16], [13, 16, 17, 18, 9]])
def test_noise_scale_and_similarity_match_the_analytic_values(sizes):
    results, b_simple = linear_regression_run(sizes, steps=1500)
    signal = sum(r.grad_sq_norm for r in results) / len(results)
    trace = sum(r.trace for r in results) / len(results)
    assert signal == pytest.approx(1.0, rel=0.1)
    assert trace / signal == pytest.approx(b_simple, rel=0.1)
    half = len(sizes) // 2
    expected = expected_similarity(b_simple, sum(sizes[:half]), sum(sizes[half:]))
    similarity = sum(r.similarity for r in results) / len(results)
    assert abs(similarity - expected) < 0.03


def test_similarity_relation_for_equal_halves():
    assert expected_similarity(41.0, 32) == pytest.approx(1 / (1 + 2 * 41 / 64))
    assert equilibrium_batch(1000, 0.8) == pytest.approx(8000)
    assert equilibrium_batch(1000, 1 / 3) == pytest.approx(1000)


def test_noise_components_are_exact_on_their_own_expectations():
    """Feed E L and E T (with a finite dataset) and get |G|² and tr Σ back exactly."""
    signal, trace, n = 2.0, 300.0, 1000
    sizes = [100, 120, 80, 150]
    expected_sub = torch.tensor([signal + trace * inverse_size(b, n) for b in sizes])
    expected_full = torch.tensor(signal + trace * inverse_size(sum(sizes), n))
    got_signal, got_trace = noise_components(expected_sub, sizes, expected_full, n)
    assert got_signal.item() == pytest.approx(signal)
    assert got_trace.item() == pytest.approx(trace)


def test_finite_population_correction():
    assert inverse_size(64) == 1 / 64
    assert inverse_size(16_000, 40_000) == pytest.approx((1 / 16_000) * 24_000 / 39_999)
    assert inverse_size(40_000, 40_000) == 0.0
    with pytest.raises(ValueError, match="at least 2 sub-batches"):
        noise_components(torch.ones(1), [4], torch.ones(()))
    # a batch larger than the dataset is drawn across epochs, with repeats: no correction
    # (with it, sub-batches each as large as the dataset would carry no noise at all)
    norms, full = torch.tensor([3.0, 2.0]), torch.tensor(1.5)
    free = torch.stack(noise_components(norms, [5, 5], full))
    torch.testing.assert_close(torch.stack(noise_components(norms, [5, 5], full, 5)), free)
    assert not torch.allclose(torch.stack(noise_components(norms, [5, 5], full, 10)), free)
