import math

import pytest
import torch

from bigbatch import schedules
from bigbatch.batch import Contract, Ramp, Seesaw, adascale_gain, lr_factor, scaled_lr
from bigbatch.batch.lr import resolve_lr_rule


def test_batch_rules():
    assert lr_factor("none", 1024, 256) == 1.0
    assert lr_factor("linear", 1024, 256) == 4.0
    assert lr_factor("sqrt", 1024, 256) == 2.0
    with pytest.raises(ValueError, match="lr_scaling"):
        lr_factor("cubic", 1024, 256)


class _Holds:
    contract = Contract(lr_follows="none")


def test_auto_is_the_measured_rule_else_the_familys_and_none_under_a_noise_follower():
    assert resolve_lr_rule("auto", object(), "sgd") == "linear"
    assert resolve_lr_rule("auto", object(), "adam") == "sqrt"
    assert resolve_lr_rule("auto", object(), "sgd", measured="sqrt") == "sqrt"
    # a controller that follows the noise holds the rate whatever was measured
    assert resolve_lr_rule("auto", _Holds(), "sgd", measured="sqrt") == "none"
    # a batch that takes over the schedule's decay keeps the family's equivalence rule
    assert resolve_lr_rule("auto", Seesaw(), "sgd", measured="sqrt") == "linear"
    assert resolve_lr_rule("auto", Seesaw(), "lars", measured="none") == "linear"
    assert resolve_lr_rule("auto", Seesaw(), "adam", measured="linear") == "sqrt"
    # a ramp fixed in advance follows the same rule (OLMo-core: x sqrt(ratio) for Adam)
    ramp = Ramp(16, 64, 100)
    assert resolve_lr_rule("auto", ramp, "adam", measured="linear") == "sqrt"
    assert resolve_lr_rule("auto", ramp, "sgd", measured="sqrt") == "linear"
    # a rule the user names is kept
    assert resolve_lr_rule("linear", object(), "sgd", measured="sqrt") == "linear"
    with pytest.raises(ValueError, match="lr_scaling"):
        resolve_lr_rule("auto", object(), "sgd", measured="cubic")


def test_adascale_gain_limits_and_formula():
    # pure noise: linear scaling; no noise: no scaling
    assert adascale_gain(4.0, grad_sq_norm=0.0, trace=100.0, base_batch_size=10) == 4.0
    assert adascale_gain(4.0, grad_sq_norm=1.0, trace=0.0, base_batch_size=10) == 1.0
    var, mu2 = 100.0 / 10, 5.0
    expected = (var + mu2) / (var / 4 + mu2)
    assert adascale_gain(4.0, 5.0, 100.0, 10) == pytest.approx(expected)
    assert lr_factor("adascale-sqrt", 40, 10, grad_sq_norm=5.0, trace=100.0) == pytest.approx(
        math.sqrt(expected)
    )
    assert lr_factor("adascale", 40, 10) == 1.0  # nothing measured yet


def test_scaled_lr_restores_the_user_schedule():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    p.grad = torch.ones(1)
    with scaled_lr(opt, 3.0):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.3)
        opt.step()
    assert p.item() == pytest.approx(-0.3)
    assert opt.param_groups[0]["lr"] == 0.1
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_schedules_in_samples():
    f = schedules.warmup_cosine(total=1000, warmup=100, final=0.1)
    assert f(0) == pytest.approx(0.01)
    assert f(99) == pytest.approx(1.0)
    assert f(100) == pytest.approx(1.0)
    assert f(550) == pytest.approx(0.55)
    assert f(5000) == pytest.approx(0.1)
    g = schedules.warmup_linear(total=1000, warmup=0)
    assert g(500) == pytest.approx(0.5)
    # the LARS paper's polynomial decay, power 2, after the warm-up
    p = schedules.warmup_poly(total=1100, warmup=100)
    assert p(99) == pytest.approx(1.0)
    assert p(600) == pytest.approx(0.25)
    assert p(1100) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="warmup"):
        schedules.warmup_cosine(total=10, warmup=20)


def test_a_warm_up_or_cool_down_that_fills_the_run_ends_at_final_at_the_total():
    """At exactly the total, a decay of no length (warmup = total, or a cool-down of 0)
    returned the peak, where every other schedule is at `final`."""
    for schedule in (
        schedules.warmup_linear(1000, 1000, final=0.1),
        schedules.warmup_cosine(1000, 1000, final=0.1),
        schedules.warmup_stable_decay(1000, 0, cooldown=0.0, final=0.1),
    ):
        assert [schedule(s) for s in (999, 1000, 1001)] == pytest.approx([1.0, 0.1, 0.1])


def test_warmup_stable_decay_holds_the_peak_then_cools_down_linearly():
    f = schedules.warmup_stable_decay(total=1000, warmup=100, cooldown=0.2)
    assert f(0) == pytest.approx(0.01)
    assert f(99) == pytest.approx(1.0)
    assert f(100) == f(500) == f(799) == 1.0  # the stable phase
    assert f(900) == pytest.approx(0.5)
    assert f(1000) == pytest.approx(0.0)
    assert schedules.warmup_stable_decay(1000, 0, cooldown=0.0)(999) == 1.0
    assert schedules.warmup_stable_decay(1000, 0, cooldown=1.0)(500) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cooldown"):
        schedules.warmup_stable_decay(1000, 0, cooldown=1.5)


def test_scaling_twice_without_a_restore_never_compounds():
    from bigbatch.batch.lr import LRScaling

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scaling = LRScaling()
    scaling.apply(optimizer, 2.0)
    scaling.apply(optimizer, 3.0)
    assert optimizer.param_groups[0]["lr"] == 3.0
    scaling.restore(optimizer)
    assert optimizer.param_groups[0]["lr"] == 1.0
