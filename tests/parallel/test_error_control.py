"""The error-control rules on flat tensors, with the ranks simulated in one process."""

import functools

import pytest
import torch

from bigbatch.parallel import compression
from bigbatch.parallel.error_control import METHODS, SHARED_ESTIMATE, local_step, start


def top_k(ratio):
    return functools.partial(compression.top_k, ratio=ratio)


def compressed_step(method, eta, xs, states, shared, ratio):
    """One compressed reduction of the ranks' shares ``xs``: the step (``states`` move on)."""
    total = torch.zeros_like(shared)
    for rank, x in enumerate(xs):
        values, indices, new = local_step(method, x, states[rank], eta, top_k(ratio))
        states[rank] = {**states[rank], **new}
        total.index_add_(0, indices, values)
    return shared + total if method in SHARED_ESTIMATE else total


def simulate(method, eta, shares, ratio):
    """Steps of ``len(shares[0])`` ranks: the first share uncompressed, then compressed."""
    states = [start(method, x) for x in shares[0]]
    steps = [sum(shares[0])]
    for xs in shares[1:]:
        steps.append(compressed_step(method, eta, xs, states, steps[-1], ratio))
    return steps


def random_shares(steps=12, ranks=3, d=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(d, generator=gen, dtype=torch.float64) for _ in range(ranks)]
        for _ in range(steps)
    ]


def test_ef21_sgdm_without_averaging_is_ef21():
    shares = random_shares()
    for a, b in zip(simulate("ef21-sgdm", 1.0, shares, 0.1), simulate("ef21", 0.0, shares, 0.1)):
        assert torch.equal(a, b)


def test_econtrol_without_feedback_is_ef21():
    shares = random_shares()
    for a, b in zip(simulate("econtrol", 0.0, shares, 0.1), simulate("ef21", 0.0, shares, 0.1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ef21-sgdm"])
def test_sending_everything_steps_with_the_mean(method):
    shares = random_shares(seed=1)
    for xs, step in zip(shares, simulate(method, 0.1, shares, 1)):
        torch.testing.assert_close(step, sum(xs), rtol=1e-12, atol=1e-12)


def test_ef21_sgdm_sending_everything_steps_with_the_moving_average():
    shares = random_shares(seed=2)
    average = sum(shares[0])
    for xs, step in zip(shares[1:], simulate("ef21-sgdm", 0.3, shares, 1)[1:]):
        average = 0.7 * average + 0.3 * sum(xs)
        torch.testing.assert_close(step, average, rtol=1e-12, atol=1e-12)


def test_local_step_leaves_its_input_state_alone():
    x = torch.randn(20, dtype=torch.float64)
    for method in METHODS:
        state = start(method, x)
        before = {k: v.clone() for k, v in state.items()}
        local_step(method, 2 * x, state, 0.5, top_k(0.1))
        for name, tensor in state.items():
            assert torch.equal(tensor, before[name]), (method, name)
    with pytest.raises(ValueError, match="method must be one of"):
        local_step("ef22", x, {}, 0.1, top_k(0.1))


def least_squares_distance(method, eta, steps=2000, lr=0.003, ranks=4, d=40, batch=10):
    """Mean distance to the optimum over the last 500 of ``steps`` constant-step SGD steps.

    Each rank holds its own least-squares problem (different scales and
    targets, so the local gradients disagree at the optimum) and samples
    ``batch`` of its 100 rows per step: stochastic gradients with a
    constant step, where EF21's estimators hold single noisy samples and
    stall, and EF21-SGDM's moving average brings the noise down to plain
    SGD's (Fatkhullin, Tyurin, Richtárik 2023, section 3).
    """
    problems = []
    for r in range(ranks):
        gen = torch.Generator().manual_seed(100 + r)
        a = torch.randn(100, d, generator=gen, dtype=torch.float64) * (1 + r)
        b = torch.randn(100, generator=gen, dtype=torch.float64) * 3 + r
        problems.append((a, b))
    a_all = torch.cat([a for a, _ in problems]) / (100 * ranks) ** 0.5
    b_all = torch.cat([b for _, b in problems]) / (100 * ranks) ** 0.5
    optimum = torch.linalg.lstsq(a_all, b_all[:, None]).solution.flatten()
    gen = torch.Generator().manual_seed(0)
    w = torch.zeros(d, dtype=torch.float64)

    def shares():
        out = []
        for a, b in problems:
            rows = torch.randint(0, 100, (batch,), generator=gen)
            out.append(a[rows].T @ (a[rows] @ w - b[rows]) / batch / ranks)
        return out

    kind = "none" if method == "allreduce" else method
    first = shares()
    states = [start(kind, x) for x in first]
    shared = sum(first)
    w = w - lr * shared
    distances = []
    for _ in range(steps):
        xs = shares()
        if method == "allreduce":
            shared = sum(xs)
        else:
            shared = compressed_step(kind, eta, xs, states, shared, 0.1)
        w = w - lr * shared
        distances.append(float((w - optimum).norm()))
    return sum(distances[-500:]) / 500, float(optimum.norm())


def test_ef21_sgdm_converges_with_a_constant_step_where_stochastic_ef21_stalls():
    plain, start_distance = least_squares_distance("allreduce", 0.0)
    ef21, _ = least_squares_distance("ef21", 0.0)
    sgdm, _ = least_squares_distance("ef21-sgdm", 0.1)
    assert plain < start_distance / 2  # SGD itself gets close (to its noise floor)
    assert ef21 > 2 * plain, (ef21, plain)  # EF21 stays about where it started
    assert sgdm < 1.2 * plain, (sgdm, plain)
