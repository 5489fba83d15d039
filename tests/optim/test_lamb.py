"""LAMB against timm's Lamb (the apex FusedLAMB semantics), for every impl and switch."""

import pytest
import torch

from bigbatch.optim import LAMB
from bigbatch.optim._base import global_grad_norm

from .common import flat, impl_cases, make_model, rel_err, split_groups, train
from .timm_reference import for_loop, load

SWITCHES = {
    "defaults": {},
    "trust_clip": {"trust_clip": True},
    "always_adapt": {"always_adapt": True},
    "no_grad_clip": {"max_grad_norm": None},
    "decoupled": {"decoupled_weight_decay": True},
    "no_bias_correction": {"bias_correction": False},
}
SWITCHES["all"] = {k: v for switch in SWITCHES.values() for k, v in switch.items()}
TIMM_NAMES = {"decoupled_weight_decay": "decoupled_decay"}


@pytest.mark.parametrize(
    ("impl", "switch"), impl_cases(SWITCHES, compiled=("defaults", "all")), indirect=["impl"]
)
def test_matches_timm_lamb_for_50_steps(impl, switch):
    options = SWITCHES[switch]
    timm_options = {TIMM_NAMES.get(k, k): v for k, v in options.items()}
    timm_lamb = load("lamb").Lamb

    reference_model = make_model()
    start = flat(reference_model)
    # loss_scale 30 puts the global grad norm well above max_grad_norm=1, so the clip acts
    expected = train(
        reference_model,
        for_loop(timm_lamb, split_groups(reference_model, 0.05), lr=0.02, **timm_options),
        loss_scale=30.0,
    )
    model = make_model()
    norms = []
    got = train(
        model,
        LAMB(split_groups(model, 0.05), lr=0.02, impl=impl, **options),
        loss_scale=30.0,
        before_step=lambda i: norms.append(global_grad_norm([p.grad for p in model.parameters()])),
    )

    assert min(norms) > 1.0, "the clip must be exercised"
    assert rel_err(expected, start) > 1e-2, "the run must move the parameters"
    assert rel_err(got, expected) < 1e-5


def test_no_adaptation_without_weight_decay_is_adam():
    """Groups with weight_decay 0 take plain Adam steps unless always_adapt."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(a.detach().clone())
    lamb = LAMB([a], lr=0.1, weight_decay=0.0, max_grad_norm=None)
    adam = torch.optim.Adam([b], lr=0.1, eps=1e-6)
    for _ in range(5):
        g = torch.randn(8, 8)
        a.grad, b.grad = g.clone(), g.clone()
        lamb.step()
        adam.step()
    assert rel_err(a.detach(), b.detach()) < 1e-5


def test_float64_parameters_are_clipped_by_a_float64_norm():
    """The global norm is accumulated in float64 for float64 parameters, as the per-tensor
    norms are: timm's Lamb in float64 to float64's tolerance, the clip acting."""
    timm_lamb = load("lamb").Lamb
    reference_model = make_model().double()
    options = {"lr": 0.02}
    expected = train(
        reference_model,
        for_loop(timm_lamb, split_groups(reference_model, 0.05), **options),
        loss_scale=30.0,
    )
    model = make_model().double()
    norms = []
    got = train(
        model,
        LAMB(split_groups(model, 0.05), impl="foreach", **options),
        loss_scale=30.0,
        before_step=lambda i: norms.append(global_grad_norm([p.grad for p in model.parameters()])),
    )
    assert min(norms) > 1.0
    assert rel_err(got, expected) < 1e-13


@pytest.mark.parametrize("impl", ["reference", "foreach", "compiled"], indirect=True)
def test_a_float32_scalar_beside_float64_parameters_is_clipped_in_its_own_dtype(impl):
    """the global clip is float64 where a parameter is: a 0-dim float32 gradient divided by
    it became float64, and the moments' lerp failed (every impl)."""
    scalar = torch.nn.Parameter(torch.tensor(0.5))
    matrix = torch.nn.Parameter(torch.ones(3, 3, dtype=torch.float64))
    lamb = LAMB([scalar, matrix], lr=0.1, max_grad_norm=0.1, impl=impl)
    alone = torch.nn.Parameter(torch.tensor(0.5))
    reference = LAMB([alone], lr=0.1, max_grad_norm=None, impl=impl)
    scalar.grad, matrix.grad = torch.tensor(0.3), torch.full((3, 3), 0.3, dtype=torch.float64)
    clip = float(global_grad_norm([scalar.grad, matrix.grad])) / 0.1
    alone.grad = torch.tensor(0.3 / clip)
    lamb.step()
    reference.step()
    assert scalar.dtype == lamb.state[scalar]["exp_avg"].dtype == torch.float32
    assert scalar.item() == pytest.approx(alone.item(), rel=1e-6)


def test_a_gradient_below_the_clip_norm_is_not_scaled_up():
    """The global clip divides by max(1, |g| / max_grad_norm): below the norm, nothing."""
    p = torch.nn.Parameter(torch.ones(4))
    lamb = LAMB([p], lr=0.1, weight_decay=0.0, max_grad_norm=1.0)
    reference = torch.nn.Parameter(torch.ones(4))
    plain = LAMB([reference], lr=0.1, weight_decay=0.0, max_grad_norm=None)
    p.grad, reference.grad = torch.full((4,), 1e-7), torch.full((4,), 1e-7)
    lamb.step()
    plain.step()
    torch.testing.assert_close(p.detach(), reference.detach())
