"""Estimators of gradient noise from sub-batch gradients, pure functions of scalars
(notation of docs/algorithms.md, "Gradient statistics")."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor


def inverse_size(b: float, dataset_size: float | None = None) -> float:
    """The variance factor of a mean over ``b`` samples: ``1/b``, or ``(N - b) / (b (N - 1))``
    without replacement from ``N`` (the finite-population correction)."""
    if dataset_size is None or math.isinf(dataset_size):
        return 1.0 / b
    n = float(dataset_size)
    if n <= 1:
        return 0.0
    return max(0.0, (n - b) / (b * (n - 1)))


def population(dataset_size: float | None, batch: float) -> float | None:
    """``dataset_size``, or None (no correction) where ``batch`` exceeds it (across epochs)."""
    return dataset_size if dataset_size is not None and batch <= dataset_size else None


def noise_components(
    sub_sq_norms: Tensor,
    sizes: Sequence[float],
    full_sq_norm: Tensor,
    dataset_size: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Unbiased ``(|G|², tr Σ)`` from the sub-batch and batch squared gradient norms
    (McCandlish et al. 2018, App. A, generalised to unequal sizes).

    Args:
        sub_sq_norms: ``|g_i|²``, shape ``(k,)`` or ``(k, groups)``.
        sizes: the ``k`` sub-batch sizes (samples, or tokens).
        full_sq_norm: ``|g|²``, shape ``()`` or ``(groups,)``.
        dataset_size: ``N`` for the finite-population correction, or None.
    """
    return noise_from_mean(sub_sq_norms.mean(0), sizes, full_sq_norm, dataset_size)


def noise_from_mean(
    mean_sub_sq_norm: Tensor,
    sizes: Sequence[float],
    full_sq_norm: Tensor,
    dataset_size: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`noise_components` from ``L = mean_i |g_i|²`` alone (what DDP all-reduces)."""
    if len(sizes) < 2:
        raise ValueError(f"noise estimates need at least 2 sub-batches, got {len(sizes)}")
    total = float(sum(sizes))
    dataset_size = population(dataset_size, total)
    h = sum(inverse_size(b, dataset_size) for b in sizes) / len(sizes)
    phi = inverse_size(total, dataset_size)
    if h - phi <= 0:
        raise ValueError(
            f"sub-batches of sizes {list(sizes)} carry no noise information "
            f"(dataset_size={dataset_size})"
        )
    return unbiased(mean_sub_sq_norm, full_sq_norm, h, phi)


def noise_from_examples(
    mean_example_sq_norm: Tensor,
    examples: int,
    full_sq_norm: Tensor,
    dataset_size: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`noise_from_mean` with every sub-batch one example, of ``examples`` in all."""
    if examples < 2:
        raise ValueError(f"noise estimates need at least 2 examples, got {examples}")
    dataset_size = population(dataset_size, examples)
    h, phi = inverse_size(1, dataset_size), inverse_size(examples, dataset_size)
    if h - phi <= 0:
        raise ValueError(
            f"a batch of {examples} examples carries no noise information "
            f"(dataset_size={dataset_size})"
        )
    return unbiased(mean_example_sq_norm, full_sq_norm, h, phi)


def unbiased(mean_sub_sq: Tensor, full_sq: Tensor, h: float, phi: float) -> tuple[Tensor, Tensor]:
    """Solve ``E L = |G|² + h trΣ``, ``E T = |G|² + φ trΣ`` for ``(|G|², trΣ)`` (tensors or
    floats)."""
    denominator = h - phi
    trace = (mean_sub_sq - full_sq) / denominator
    signal = (h * full_sq - phi * mean_sub_sq) / denominator
    return signal, trace


def half_split_cosine(sq_a: Tensor, sq_b: Tensor, dot_ab: Tensor, eps: float = 1e-30) -> Tensor:
    """``<g_A, g_B> / (|g_A| |g_B|)`` from the squared norms and the dot product, in [-1, 1]
    (tensors, or floats; a NaN stays NaN)."""
    if isinstance(sq_a, Tensor):
        return (dot_ab / (sq_a.clamp(min=eps) * sq_b.clamp(min=eps)).sqrt()).clamp(-1.0, 1.0)
    cosine = dot_ab / math.sqrt(max(sq_a, eps) * max(sq_b, eps))
    return cosine if math.isnan(cosine) else min(1.0, max(-1.0, cosine))


def scalar_halves(
    signal: Tensor,
    trace: Tensor,
    size_a: float,
    size_b: float,
    dataset_size: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Expected ``(|g_A|², |g_B|², <g_A, g_B>)`` of two halves, from ``|G|²`` and ``tr Σ``."""
    cross = signal
    dataset_size = population(dataset_size, size_a + size_b)
    if dataset_size is not None and not math.isinf(dataset_size) and dataset_size > 1:
        cross = signal - trace / (float(dataset_size) - 1)
    sq_a = signal + trace * inverse_size(size_a, dataset_size)
    sq_b = signal + trace * inverse_size(size_b, dataset_size)
    return sq_a, sq_b, cross


def scalar_similarity(
    signal: Tensor,
    trace: Tensor,
    size_a: float,
    size_b: float,
    dataset_size: float | None = None,
) -> Tensor:
    """The half-split cosine estimated from ``|G|²`` and ``tr Σ`` (:func:`scalar_halves`),
    clamped to [-1, 1]; docs/algorithms.md, "Gradient statistics"."""
    return half_split_cosine(*scalar_halves(signal, trace, size_a, size_b, dataset_size))


def expected_similarity(b_simple: float, size_a: float, size_b: float | None = None) -> float:
    """The half-batch cosine a noise scale implies,
    ``1 / sqrt((1 + B_simple/B_A)(1 + B_simple/B_B))``."""
    size_b = size_a if size_b is None else size_b
    return 1.0 / math.sqrt((1 + b_simple / size_a) * (1 + b_simple / size_b))


def equilibrium_batch(b_simple: float, target: float) -> float:
    """The batch at which equal halves have similarity ``target``: ``2 B_simple s / (1 - s)``."""
    if not 0 < target < 1:
        raise ValueError(f"target similarity must be in (0, 1), got {target!r}")
    return 2 * b_simple * target / (1 - target)
