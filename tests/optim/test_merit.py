"""MERIT against a plain transcription of docs/algorithms.md, "MERIT" (the authors' rule)."""

import itertools

import torch

from bigbatch.optim import MERIT
from bigbatch.optim.merit import merit_ratio

from .common import batches, flat, make_model, rel_err


def transcribed_ratio(W: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """τ element by element, in plain Python, straight from the text of §5."""
    A, Bu = W.abs(), u.abs()
    if W.ndim < 2:
        a, b = A.max().item(), Bu.max().item()
        return torch.full_like(W, 1.0 if a == 0 or b == 0 else a / b)
    rho_num, rho_den = A.max().item(), Bu.max().item()
    row_A, row_B = A.amax(1).tolist(), Bu.amax(1).tolist()  # over dim 1, other axes kept
    col_A, col_B = A.amax(0).tolist(), Bu.amax(0).tolist()  # over dim 0
    tau = torch.empty_like(W)
    for index in itertools.product(*(range(n) for n in W.shape)):
        i, j, rest = index[0], index[1], index[2:]
        r_num, r_den = _at(row_A, (i, *rest)), _at(row_B, (i, *rest))
        c_num, c_den = _at(col_A, (j, *rest)), _at(col_B, (j, *rest))
        if 0.0 in (r_num, r_den, c_num, c_den, rho_num, rho_den):
            tau[index] = 1.0
        else:
            tau[index] = max(max(r_num / r_den, c_num / c_den), rho_num / rho_den)
    return tau


def _at(nested, index):
    for k in index:
        nested = nested[k]
    return nested


def transcribed_merit_step(params, state, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    for p in params:
        m, v = state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
        g = p.grad
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = m / (v.sqrt() + eps) + weight_decay * p.detach()
        update = (u * transcribed_ratio(p.detach(), u)).clamp(-1.0, 1.0)
        p.data.sub_(lr * update)


def test_trajectory_matches_the_transcription(impl):
    settings = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.01}
    expected_model, model = make_model(), make_model()
    start = flat(model)
    optimizer = MERIT(model.parameters(), impl=impl, **settings)
    state: dict = {}
    for x, y in batches(20):
        for net in (expected_model, model):
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
        transcribed_merit_step(list(expected_model.parameters()), state, **settings)
        optimizer.step()
    assert rel_err(flat(expected_model), start) > 1e-2
    assert rel_err(flat(model), flat(expected_model)) < 1e-5


def test_ratio_on_degenerate_rows_columns_and_kernels():
    torch.manual_seed(0)
    for shape in [(5, 7), (4, 3, 3), (6,), ()]:
        W, u = torch.randn(shape), torch.randn(shape)
        if W.ndim >= 2:
            W[1] = 0.0  # a zero weight row
            u[:, 2] = 0.0  # a zero update column
        torch.testing.assert_close(merit_ratio(W, u).expand(shape), transcribed_ratio(W, u))
    zeros = torch.zeros(3, 4)
    torch.testing.assert_close(merit_ratio(zeros, torch.randn(3, 4)), torch.ones(3, 4))
    torch.testing.assert_close(merit_ratio(torch.randn(3, 4), zeros), torch.ones(3, 4))


def test_every_element_moves_at_most_lr(eager_impl):
    """The clip of the scaled update bounds each step element-wise by lr."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 16) * 10)
    optimizer = MERIT([p], lr=0.5, impl=eager_impl)
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.randn(16, 16) * 100
        optimizer.step()
        assert (p.detach() - before).abs().max() <= 0.5 + 1e-6


def test_a_weight_column_without_an_update_stays_finite_and_matches_the_reference():
    """An input feature always 0 gives its weight column no gradient, no update: its
    ratio's 0/0 is masked (unmasked, the column went NaN)."""
    results = []
    for impl in ("reference", "foreach"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 3)
        optimizer = MERIT(layer.parameters(), lr=0.01, impl=impl)
        x = torch.randn(32, 4)
        x[:, 2] = 0.0
        for _ in range(2):
            optimizer.zero_grad()
            layer(x).square().mean().backward()
            optimizer.step()
        assert torch.isfinite(layer.weight).all()
        results.append(layer.weight.detach().clone())
    torch.testing.assert_close(results[1], results[0])
