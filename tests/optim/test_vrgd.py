"""VRGD against transcriptions of its formulas (docs/algorithms.md, "VRGD")."""

import inspect
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch.optim import VRGD, FewSubBatchesWarning, create_optimizer, gsnr_ratio
from bigbatch.stats import MicroBatchStatistics


def test_ratio_is_normalised_per_tensor_then_clipped():
    r = torch.tensor([0.0, 0.5, 1.0, 2.5, 8.0])  # mean 2.4
    expected = torch.clamp(r / 2.4, 0.1, 1.0)
    torch.testing.assert_close(gsnr_ratio(r, 0.1), expected)
    torch.testing.assert_close(gsnr_ratio(r, 0.1, "median"), torch.clamp(r / 1.0, 0.1, 1.0))
    assert gsnr_ratio(torch.zeros(3), 0.2).tolist() == pytest.approx([0.2] * 3)
    # of an even count, the two middle values' mean (torch's median takes the lower: a
    # bias of two elements was never damped)
    even = torch.tensor([1.0, 2.0, 4.0, 8.0])
    torch.testing.assert_close(gsnr_ratio(even, 0.1, "median"), torch.clamp(even / 3, 0.1, 1.0))
    assert gsnr_ratio(torch.tensor([1.0, 3.0]), 0.1, "median").tolist() == [0.5, 1.0]
    assert gsnr_ratio(torch.zeros(0), 0.1, "median").numel() == 0  # an empty parameter
    assert gsnr_ratio(torch.tensor([1.0, math.nan, 3.0]), 0.1, "median").isnan().all()


def sub_batch_problem(sizes, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(sum(sizes), 5), torch.randn(sum(sizes), 2)
    return model, x, y


def run_step(model, optimizer, x, y, sizes):
    """One accumulated step with statistics; returns the sub-batch mean gradients."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    per_batch, start = [], 0
    for b in sizes:  # the slow way, one backward per sub-batch
        model.zero_grad()
        nn.functional.mse_loss(model(x[start : start + b]), y[start : start + b]).backward()
        per_batch.append([p.grad.clone() for p in params])
        start += b
    model.zero_grad()
    stats = MicroBatchStatistics(optimizer.param_groups, gsnr=True)
    stats.begin(sizes)
    start, total = 0, sum(sizes)
    for i, b in enumerate(sizes):
        stats.before_backward(i)
        loss = nn.functional.mse_loss(model(x[start : start + b]), y[start : start + b])
        (loss * b / total).backward()
        start += b
    finished = stats.finish()
    if isinstance(optimizer, bb.optim.StatisticsWrapper):
        optimizer.observe(finished)
    grads = [p.grad.clone() for p in params]
    optimizer.step()
    stats.close()
    return per_batch, grads


def expected_ratios(per_batch, sizes, gamma, eps=1e-30):
    w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    out = []
    for j in range(len(per_batch[0])):
        g = torch.stack([b[j].double() for b in per_batch])
        mean = (w.view(-1, *[1] * (g.ndim - 1)) * g).sum(0)
        var = (w.view(-1, *[1] * (g.ndim - 1)) * (g - mean) ** 2).sum(0)
        r = mean**2 / (var + eps)
        out.append(torch.clamp(r / r.mean(), gamma, 1.0).float())
    return out


def test_vr_sgd_step_is_the_gsnr_scaled_gradient():
    sizes = [5, 6, 5, 6, 5, 6, 5, 6]
    model, x, y = sub_batch_problem(sizes)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = VRGD(torch.optim.SGD(model.parameters(), lr=0.1), gamma=0.1)
    per_batch, grads = run_step(model, optimizer, x, y, sizes)
    ratios = expected_ratios(per_batch, sizes, 0.1)
    assert any((r < 1).any() for r in ratios) and any((r == 0.1).any() for r in ratios)
    for p, p0, g, r in zip(model.parameters(), before, grads, ratios):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * r * g, rtol=1e-4, atol=1e-6)


def test_ratio_momentum_is_a_bias_corrected_average():
    sizes = [4] * 8
    model, x, y = sub_batch_problem(sizes)
    optimizer = VRGD(torch.optim.SGD(model.parameters(), lr=0.0), gsnr_momentum=0.9)
    first, _ = run_step(model, optimizer, x, y, sizes)
    r1 = expected_ratios(first, sizes, 0.1)
    torch.testing.assert_close(
        [a / (1 - 0.9) for a in optimizer._ratio_avg], r1, rtol=1e-4, atol=1e-6
    )
    x2 = torch.randn_like(x)
    second, _ = run_step(model, optimizer, x2, y, sizes)
    r2 = expected_ratios(second, sizes, 0.1)
    expected = [(0.9 * 0.1 * a + 0.1 * b) / (1 - 0.81) for a, b in zip(r1, r2)]
    got = [a / (1 - 0.81) for a in optimizer._ratio_avg]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_few_sub_batches_are_refused_or_warned_about():
    model = nn.Linear(3, 1)
    optimizer = create_optimizer(model, "vr-sgd", lr=0.1)
    data = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
    controller = bb.batch.Constant(16)
    with pytest.raises(ValueError, match=r"at least 4 sub-batches.*min_sub_batches"):
        bb.AdaptiveBatch(model, optimizer, data, controller=controller, min_sub_batches=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loop = bb.AdaptiveBatch(model, optimizer, data, controller=controller, min_sub_batches=4)
        line = inspect.currentframe().f_lineno - 1
        for step in loop.steps(max_samples=32):  # each step checks its count again
            for x, y in step.micro_batches():
                step.backward(nn.functional.mse_loss(model(x), y))
            step.apply()
    # once, at the user's line (not inside bigbatch or torch's no_grad wrapper)
    (warning,) = [w for w in record if w.category is FewSubBatchesWarning]
    assert "heavy-tailed" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop = bb.AdaptiveBatch(model, optimizer, data, controller=controller, min_sub_batches=8)
    assert loop.collector.gsnr  # the loop collects what VRGD needs


def test_step_without_statistics_is_a_clear_error():
    model = nn.Linear(3, 1)
    optimizer = create_optimizer(model, "vr-lamb", lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="observe"):
        optimizer.step()


def test_state_round_trip_keeps_the_ratio_average(tmp_path):
    sizes = [4] * 8
    model, x, y = sub_batch_problem(sizes)
    optimizer = create_optimizer(model, "vr-lamb", lr=1e-2)
    run_step(model, optimizer, x, y, sizes)
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    twin_model = sub_batch_problem(sizes)[0]
    twin_model.load_state_dict(model.state_dict())
    twin = create_optimizer(twin_model, "vr-lamb", lr=1e-2)
    twin.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    run_step(model, optimizer, x, y, sizes)
    run_step(twin_model, twin, x, y, sizes)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["vr-sgd", "vr-momentum", "vr-adam", "vr-lars", "vr-lamb"])
def test_every_variant_trains_in_adaptive_batch(name):
    torch.manual_seed(0)
    x = torch.randn(2048, 8)
    y = (x @ torch.randn(8, 3)).argmax(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    lr = {"vr-sgd": 0.5, "vr-momentum": 0.1, "vr-adam": 1e-2, "vr-lars": 10.0, "vr-lamb": 1e-2}
    optimizer = create_optimizer(model, name, lr=lr[name])
    loop = bb.AdaptiveBatch(
        model,
        optimizer,
        TensorDataset(x, y),
        controller=bb.batch.Constant(128),
        min_sub_batches=8,
        max_micro_batch=16,
    )
    # a torch LR scheduler drives the wrapper like any optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=60, gamma=0.5)
    losses = []
    for step in loop.steps(max_steps=60):
        for xb, yb in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(xb), yb))
        step.apply()
        losses.append(step.metrics["loss"])
        scheduler.step()
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10]), name
    assert optimizer.base.param_groups[0]["lr"] == pytest.approx(lr[name] * 0.5)


@pytest.mark.parametrize("scheduled", [False, True], ids=["", "scheduled"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", ["lamb", "lars", "merit", "vrgd", "agvm"])
def test_a_copied_optimizer_steps_as_the_original(kind, how, scheduled):
    """torch's pickling keeps defaults, state and groups alone: a copy (``copy.deepcopy``, a
    pickle) lost ``impl``, LAMB's ``max_grad_norm``, a wrapper's ``base``, and its step
    raised ``AttributeError``. With an LR scheduler attached (it wraps ``step`` on the
    instance), a deep copy's step moved the original's parameters and a pickle failed."""
    import copy
    import pickle

    sizes = [3, 3, 3, 3]
    model, x, y = sub_batch_problem(sizes)
    if kind in ("lamb", "lars", "merit"):
        optimizer = create_optimizer(model, kind, lr=0.01)
    elif kind == "vrgd":
        optimizer = VRGD(create_optimizer(model, "lamb", lr=0.01), gsnr_momentum=0.9)
    else:
        groups = bb.optim.module_param_groups(model, 0.01, "ends")
        optimizer = bb.optim.AGVM(create_optimizer(groups, "lamb", lr=0.01), start=0, interval=1)
    if scheduled:
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    run_step(model, optimizer, x, y, sizes)
    pair = (model, optimizer)
    other = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    before = [p.detach().clone() for p in model.parameters()]
    run_step(*other, x, y, sizes)  # the copy's step moves the copy alone
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    run_step(*pair, x, y, sizes)
    for p, q in zip(model.parameters(), other[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_an_added_groups_average_is_bias_corrected_by_its_own_steps():
    """A group added after 20 steps was corrected by the optimizer's 20 steps, not its one:
    a ratio that should be 1 came out 0.11, below the clip floor gamma."""
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    optimizer = VRGD(create_optimizer([a], "lamb", lr=1e-3), gamma=0.1, gsnr_momentum=0.9)
    for _ in range(20):
        optimizer.ratios([torch.ones(4, 4)])  # a consistent gradient: ratio 1
    optimizer.add_param_group({"params": [b]})
    ratios = optimizer.ratios([torch.ones(4, 4), torch.ones(4, 4)])
    assert [float(r.mean()) for r in ratios] == pytest.approx([1.0, 1.0])
    again = VRGD(create_optimizer([a], "lamb", lr=1e-3), gamma=0.1, gsnr_momentum=0.9)
    again.add_param_group({"params": [b]})
    again.load_state_dict(optimizer.state_dict())  # each average's count is saved
    assert again.state_dict()["wrapper"]["steps"] == [21, 1]


def test_a_parameter_without_a_gradient_holds_its_ratio_average():
    """A step in which no micro-batch reached a parameter gives it no GSNR to average: its
    zero was clipped to γ and averaged in, pulling the ratio down (and counted a step)."""
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    optimizer = VRGD(create_optimizer([a, b], "lamb", lr=1e-3), gamma=0.1, gsnr_momentum=0.9)
    optimizer.ratios([torch.ones(4), torch.ones(4)])
    held = [r.clone() for r in optimizer._ratio_avg]
    ratios = optimizer.ratios([torch.ones(4), torch.zeros(4)], measured=[True, False])
    assert optimizer._counts == [2, 1]
    torch.testing.assert_close(optimizer._ratio_avg[1], held[1])
    assert ratios[1].tolist() == pytest.approx([1.0] * 4)  # its average, bias-corrected


def test_a_layer_frozen_in_a_loop_is_told_to_build_a_new_loop():
    sizes = [4] * 8
    model, x, y = sub_batch_problem(sizes)
    optimizer = VRGD(torch.optim.SGD(model.parameters(), lr=0.1), gamma=0.1)
    loop = bb.AdaptiveBatch(model, optimizer, TensorDataset(x, y), controller=bb.batch.Constant(32),
                            min_sub_batches=8)  # fmt: skip
    steps = loop.steps(max_samples=64)
    for i, step in enumerate(steps):
        if i == 1:
            model[0].requires_grad_(False)
        for xb, yb in step.micro_batches():
            step.backward(nn.functional.mse_loss(model(xb), yb))
        if i == 1:
            with pytest.raises(ValueError, match="a parameter frozen since it was built; build a"):
                step.apply()
            break
        step.apply()
    loop.close()


def test_the_ratios_follow_the_parameters_trainable_now():
    """A layer unfrozen after VRGD was built: every step failed ("GSNR for 4 tensors, but the
    optimizer has 2"), or, at an equal count, its ratios went to the wrong tensors."""
    sizes = [4] * 8
    model, x, y = sub_batch_problem(sizes)
    model[0].requires_grad_(False)
    optimizer = VRGD(torch.optim.SGD(model.parameters(), lr=0.1), gamma=0.1)
    run_step(model, optimizer, x, y, sizes)
    model[0].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    per_batch, grads = run_step(model, optimizer, x, y, sizes)
    ratios = expected_ratios(per_batch, sizes, 0.1)
    for p, p0, g, r in zip(model.parameters(), before, grads, ratios, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * r * g, rtol=1e-4, atol=1e-6)


def test_the_ratio_averages_stay_with_their_parameters_and_load_only_where_they_fit():
    sizes = [4] * 8
    model, x, y = sub_batch_problem(sizes)
    model[2].requires_grad_(False)
    optimizer = VRGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gsnr_momentum=0.9)
    run_step(model, optimizer, x, y, sizes)
    model[2].requires_grad_(True)
    run_step(model, optimizer, x, y, sizes)
    assert optimizer.state_dict()["wrapper"]["steps"] == [2, 2, 1, 1]  # by parameter
    saved = optimizer.state_dict()
    model[2].requires_grad_(False)
    other = VRGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gsnr_momentum=0.9)
    with pytest.raises(ValueError, match=r"ratios of 4 trainable parameters, but this .* has 2"):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match="lacks 'base' and 'wrapper'"):
        other.load_state_dict(saved["base"])  # a plain SGD's state
    assert not other.base.state  # nothing was loaded
