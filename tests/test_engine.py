"""The step engine: one place for the per-step rules, tested without a framework."""

import math
import warnings

import pytest
import torch
from torch import nn

import bigbatch as bb
from bigbatch.batch import StepPlan
from bigbatch.engine import StepEngine


def setup(controller=None, optimizer="sgd", statistics=True, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif optimizer == "lamb":
        opt = bb.optim.LAMB(model.parameters(), lr=0.01)
    else:
        opt = optimizer(model)
    collector = bb.stats.MicroBatchStatistics(opt.param_groups) if statistics else None
    controller = controller or bb.batch.Constant(16)
    engine = StepEngine(opt, controller, collector=collector, **options)
    return model, opt, engine


FOUR = StepPlan(((4, 4, 4, 4),))


def run_step(model, engine, plan=FOUR, poison=False, seed=0, give_loss=True):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    engine.begin(plan)
    start = 0
    for i, size in enumerate(plan.sizes):
        engine.before_backward(i)
        loss = nn.functional.cross_entropy(model(x[start : start + size]), y[start : start + size])
        if poison:
            loss = loss * math.nan
        loss = loss * engine.loss_weight(i)
        if give_loss:
            engine.add_loss(loss)
        loss.backward()
        start += size
    return engine.before_optimizer_step()


def test_the_rate_is_set_for_the_step_and_restored_after():
    seen = []
    model, opt, engine = setup(
        bb.batch.Constant(16), lr_scaling="linear", base_batch_size=8, schedule=lambda s: 0.5
    )
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    result = run_step(model, engine)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 2 * 0.5)  # applied now
    opt.step()
    engine.after_optimizer_step(result)
    assert opt.param_groups[0]["lr"] == 0.1  # restored exactly
    assert seen == [pytest.approx(0.1)]
    assert result.metrics["lr_factor"] == pytest.approx(1.0)
    assert result.metrics["lr"] == pytest.approx(0.1) and result.metrics["schedule"] == 0.5


@pytest.mark.parametrize(("schedule", "factor"), [(1.0, 1.5), (0.5, 1.0), (0.25, 0.5)])
def test_the_rate_stops_at_its_ceiling_whatever_the_rule_and_schedule_give(schedule, factor):
    """linear ×2 at batch 16 from 8: the ceiling 1.5 binds only where rule × schedule pass it."""
    model, opt, engine = setup(
        bb.batch.Constant(16),
        lr_scaling="linear",
        base_batch_size=8,
        schedule=lambda s: schedule,
        max_lr_factor=1.5,
    )
    result = run_step(model, engine)
    assert result.metrics["lr_factor"] == pytest.approx(factor)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * factor)
    opt.step()
    engine.after_optimizer_step(result)
    assert opt.param_groups[0]["lr"] == 0.1


def test_a_restore_the_framework_never_called_does_not_compound():
    model, opt, engine = setup(bb.batch.Constant(16), lr_scaling="linear", base_batch_size=8)
    run_step(model, engine)  # applied x2, never restored (a GradScaler skipped the step)
    opt.zero_grad()
    run_step(model, engine)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_counters_and_the_controller_decision():
    ramp = bb.batch.Ramp(points=[(0, 16), (32, 32)])
    model, opt, engine = setup(ramp, lr_scaling="none")
    first = run_step(model, engine)
    engine.after_optimizer_step(first)
    assert (engine.steps_taken, engine.samples, engine.batch_size) == (1, 16, 16)
    opt.zero_grad()
    second = run_step(model, engine)
    assert second.metrics["step"] == 2 and second.metrics["samples"] == 32
    assert second.metrics["next_batch_size"] == engine.batch_size == 32


@pytest.mark.parametrize("statistics", [True, False])
def test_a_loop_that_never_gives_its_loss_has_none_not_zero(statistics):
    """BatchWarmup's loss_lag reads the loss: a missing one must not look like a flat one."""
    seen = []

    class Watching(bb.batch.Constant):
        def next(self, measured, batch_size, samples):
            seen.append(dict(measured))
            return batch_size

    model, opt, engine = setup(Watching(16), statistics=statistics)
    result = run_step(model, engine, give_loss=False)
    assert "loss" not in result.metrics and "loss" not in seen[-1] and not result.skip
    opt.zero_grad()
    given = run_step(model, engine)
    assert given.metrics["loss"] > 0 and seen[-1]["loss"] == given.metrics["loss"]


@pytest.mark.parametrize("statistics", [True, False])
def test_a_non_finite_step_is_skipped_before_anything_learns_from_it(statistics):
    ramp = bb.batch.contrib.CriticalBatchRamp
    controller = ramp(0.01, initial=16, window=2) if statistics else None
    model, opt, engine = setup(controller or bb.batch.Constant(16), statistics=statistics)
    averages = engine.collector.state_dict() if statistics else None
    result = run_step(model, engine, poison=True)
    assert result.skip and result.metrics["skipped"] == 1.0 and result.metrics["lr"] == 0.0
    assert engine.skipped_steps == 1 and engine.steps_taken == 1 and engine.batch_size == 16
    assert opt.param_groups[0]["lr"] == 0.1  # nothing applied
    if statistics:  # the moving averages never saw the step (not even its count)
        assert engine.collector.state_dict() == averages


def test_a_non_finite_step_raises_when_asked():
    model, _, engine = setup(nonfinite="raise")
    with pytest.raises(bb.NonFiniteError, match="step 1"):
        run_step(model, engine, poison=True)
    assert engine.steps_taken == 0


@pytest.mark.parametrize(
    "controller, optimizer, rule",
    [
        (bb.batch.contrib.CriticalBatchRamp(initial=16), "sgd", "none"),  # follows the noise: held
        (bb.batch.Constant(16), "sgd", "linear"),
        (bb.batch.Constant(16), "lamb", "sqrt"),
        (bb.batch.SimiGrad(initial=16), "lamb", "sqrt"),
    ],
)
def test_auto_rule_by_controller_and_optimizer_family(controller, optimizer, rule):
    _, _, engine = setup(controller, optimizer=optimizer)
    assert engine.lr_scaling == rule
    assert engine.base_batch_size == 16  # the controller's first batch


def test_what_the_rules_need_is_checked_up_front():
    with pytest.raises(ValueError, match="needs statistics"):
        setup(bb.batch.contrib.CriticalBatchRamp(initial=16), statistics=False)
    with pytest.raises(ValueError, match="needs statistics"):
        setup(bb.batch.Constant(16), statistics=False, lr_scaling="adascale")

    def vrgd(model):
        return bb.optim.VRGD(torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(ValueError, match="gsnr"):
        setup(optimizer=vrgd)  # a collector without the GSNR VRGD reads
    with pytest.raises(ValueError, match="nonfinite"):
        setup(nonfinite="ignore")


def test_state_round_trip():
    model, opt, engine = setup(bb.batch.contrib.CriticalBatchRamp(0.5, initial=16, window=2))
    for seed in range(6):
        engine.after_optimizer_step(run_step(model, engine, seed=seed))
        opt.zero_grad()
    state = engine.state_dict()
    _, _, other = setup(bb.batch.contrib.CriticalBatchRamp(0.5, initial=16, window=2))
    other.load_state_dict(state)
    again = other.state_dict()
    assert again["controller"] == state["controller"]
    assert all(
        torch.equal(again["statistics"][k], v)
        for k, v in state["statistics"].items()
        if torch.is_tensor(v)
    )
    assert (other.steps_taken, other.samples, other.batch_size) == (6, 96, engine.batch_size)


@pytest.mark.parametrize(("optimizer", "power"), [("sgd", 1.0), ("lamb", 0.5)])
def test_under_seesaw_the_rate_over_the_familys_invariant_is_the_schedule(optimizer, power):
    """The batch takes over the decay: ``η / (B/B0)^p`` (p = 1 for SGD, ½ for Adam-type: Smith
    et al. 2018; Meterez et al. 2025) is the schedule's multiplier at every step, the batch
    stops at its cap and the rest of the decay goes back to the rate."""
    total = 16 * 60
    schedule = bb.schedules.warmup_cosine(total, warmup=16 * 5)
    controller = bb.batch.Seesaw(initial=4, min=4, growth=4, critical_multiple=0)
    model, opt, engine = setup(controller, optimizer=optimizer, statistics=False, schedule=schedule)
    batches = []
    while engine.samples < total:
        batch = engine.batch_size
        result = run_step(model, engine, plan=StepPlan(((batch,),)))
        invariant = result.metrics["lr_factor"] / (batch / 4) ** power
        assert invariant == pytest.approx(result.metrics["schedule"])
        batches.append(batch)
        opt.step()
        engine.after_optimizer_step(result)
        opt.zero_grad()
    assert batches[0] == 4 and max(batches) == 16 and batches == sorted(batches)
    assert result.metrics["lr_factor"] < 0.05  # capped at 16: the run still ends annealed


class Recording(bb.batch.contrib.CriticalBatchRamp):
    """A statistics-reading controller that records the steps it was asked at, and what."""

    def __init__(self, between: bool = False) -> None:
        super().__init__(0.5, initial=16, window=2)
        self.contract = bb.batch.Contract(learns_between_measurements=between, lr_follows="none")
        self.asked: list[int] = []
        self.seen: list[dict] = []

    def next(self, measured, batch_size, samples):
        self.asked.append(samples // 16)
        self.seen.append(dict(measured))
        return super().next(measured, batch_size, samples)


def test_statistics_every_k_measures_steps_1_k_plus_1_and_the_controller_decides_only_there():
    model, opt, engine = setup(Recording(), statistics_every=3)
    measured = []
    for seed in range(7):
        assert engine.next_sub_batches == (4 if seed % 3 == 0 else 1)
        plan = FOUR if seed % 3 == 0 else StepPlan(((16,),))
        result = run_step(model, engine, plan=plan, seed=seed)
        engine.after_optimizer_step(result)
        opt.zero_grad()
        measured.append(result.stats is not None)
        assert ("trace" in result.metrics) == measured[-1]
        assert "batch_grad_sq_norm" not in result.metrics  # this controller cannot use it
        assert result.metrics["loss"] > 0 and result.metrics["step"] == seed + 1
    assert measured == [True, False, False, True, False, False, True]
    assert engine.controller.asked == [1, 4, 7]  # its windows count measured steps
    assert engine.collector.state_dict()["ema_steps"] == 3


def test_a_controller_that_learns_between_measurements_gets_the_batch_gradients_norm():
    """Between measurements such a controller is asked too, with ``|g_B|²`` of the step's
    whole gradient (what ``.grad`` holds) and ``φ(B) = 1/B``; a measured step is as before."""
    model, opt, engine = setup(Recording(between=True), statistics_every=3)
    for seed in range(4):
        plan = FOUR if seed % 3 == 0 else StepPlan(((16,),))
        result = run_step(model, engine, plan=plan, seed=seed)
        grad_sq = sum(float(p.grad.double().square().sum()) for p in model.parameters())
        engine.after_optimizer_step(result)
        opt.zero_grad()
        seen = engine.controller.seen[-1]
        if seed % 3:
            assert "trace" not in seen
            assert seen["batch_grad_sq_norm"] == pytest.approx(grad_sq, rel=1e-6)
            assert seen["batch_inverse_size"] == 1 / 16
        else:
            assert "batch_grad_sq_norm" not in seen and math.isfinite(seen["trace"])
    assert engine.controller.asked == [1, 2, 3, 4]


def test_a_controller_that_reads_no_statistics_decides_at_every_step_between_measurements():
    ramp = bb.batch.Ramp(points=[(0, 16), (32, 32)])
    model, opt, engine = setup(ramp, lr_scaling="none", statistics_every=4)
    first = run_step(model, engine)
    engine.after_optimizer_step(first)
    opt.zero_grad()
    second = run_step(model, engine, plan=StepPlan(((16,),)))
    assert second.stats is None and engine.batch_size == 32


def test_adascale_between_measurements_uses_the_last_averages_and_they_resume():
    model, opt, engine = setup(lr_scaling="adascale", base_batch_size=4, statistics_every=2)
    first = run_step(model, engine)
    engine.after_optimizer_step(first)
    opt.zero_grad()
    second = run_step(model, engine, plan=StepPlan(((16,),)), seed=1)
    assert second.stats is None
    assert second.metrics["lr_factor"] == pytest.approx(first.metrics["lr_factor"])
    assert 1.0 < first.metrics["lr_factor"] <= 4.0  # AdaScale's gain at 4x its base batch
    _, _, other = setup(lr_scaling="adascale", base_batch_size=4, statistics_every=2)
    other.load_state_dict(engine.state_dict())
    other.steps_taken = 3  # the step after a measured one again: between measurements
    model.zero_grad()
    again = run_step(model, other, plan=StepPlan(((16,),)), seed=1)
    assert again.metrics["lr_factor"] == pytest.approx(first.metrics["lr_factor"])


def test_statistics_every_is_refused_where_every_steps_statistics_are_read():
    model = nn.Linear(4, 2)
    vrgd = bb.optim.VRGD(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="statistics_every=2 measures only some steps, but VR"):
        StepEngine.build(
            vrgd, bb.batch.Constant(16), bb.StepOptions(statistics_every=2), model=model
        )
    with pytest.raises(ValueError, match="statistics_every"):
        bb.StepOptions(statistics_every=0)


@pytest.mark.parametrize(
    ("batch", "every"), [(2, 4), (8, 4), (16, 4), (32, 2), (48, 1), (64, 1), (1024, 1)]
)
def test_auto_measures_once_in_64_over_b_steps_at_most_once_in_four(batch, every):
    assert bb.StepOptions(statistics_every="auto").every_at(batch) == every
    assert bb.StepOptions(statistics_every=3).every_at(batch) == 3


@pytest.mark.parametrize(
    ("batch", "measured"), [(16, [0, 4, 8]), (32, [0, 2, 4, 6, 8]), (64, list(range(9)))]
)
def test_auto_measures_by_the_batch_the_next_step_takes(batch, measured):
    _, _, engine = setup(bb.batch.Constant(batch), statistics_every="auto")
    found = []
    for step in range(9):
        engine.steps_taken = step
        if engine.measures():
            found.append(step)
    assert found == measured


def test_an_engine_built_directly_resolves_auto_as_the_assembled_one_does():
    _, _, similarity = setup(bb.batch.SimiGrad(), statistics_every="auto")
    _, _, noise = setup(bb.batch.BatchWarmup(initial=16, min=16), statistics_every="auto")
    assert (similarity.options.statistics_every, noise.options.statistics_every) == (1, "auto")


@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")  # no data here
def test_auto_measures_every_step_where_every_steps_statistics_are_read():
    model = nn.Linear(4, 2)
    vrgd = bb.optim.VRGD(torch.optim.SGD(model.parameters(), lr=0.1))
    engine = StepEngine.build(
        vrgd, bb.batch.Constant(16), bb.StepOptions(statistics_every="auto"), model=model
    )
    assert engine.options.statistics_every == 1


def test_a_saved_batch_outside_the_new_bounds_resumes_at_the_nearest_bound():
    model, _, engine = setup(bb.batch.Constant(64))
    engine.after_optimizer_step(run_step(model, engine))
    _, _, smaller = setup(bb.batch.Constant(16))  # resumed with less memory
    with pytest.warns(
        UserWarning, match=r"batch 64 is outside the controller's bounds \[16, 16\]"
    ) as record:
        smaller.load_state_dict(engine.state_dict())
    assert record[0].filename == __file__
    assert smaller.batch_size == 16
    _, _, same = setup(bb.batch.Constant(64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within its bounds: no warning
        same.load_state_dict(engine.state_dict())
    assert same.batch_size == 64


def test_a_large_finite_float64_gradient_is_finite_between_measurements():
    """Each tensor's norm is read; their squares (1.4e308 here) may overflow when added up,
    which makes ``|g_B|²`` infinite but the step no less finite."""
    from bigbatch.engine import _mean_loss_and_finiteness
    from bigbatch.parallel.world import World

    params = [nn.Parameter(torch.zeros(1, dtype=torch.float64)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((1,), 1.2e154, dtype=torch.float64)
    optimizer = torch.optim.SGD(params, lr=0.1)
    loss = torch.ones((), dtype=torch.float64)
    assert _mean_loss_and_finiteness(optimizer, World(), loss).read()[1]
    metrics, finite = _mean_loss_and_finiteness(optimizer, World(), loss, 0.0).read()
    assert finite and metrics["batch_grad_sq_norm"] == math.inf
    params[0].grad[0] = math.nan
    assert not _mean_loss_and_finiteness(optimizer, World(), loss, 0.0).read()[1]


def test_the_skipped_steps_count_survives_a_checkpoint():
    def engine():
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        statistics = bb.stats.MicroBatchStatistics(optimizer.param_groups)
        return model, StepEngine(optimizer, bb.batch.Constant(16), collector=statistics)

    model, first = engine()
    first.begin(StepPlan(((8, 8),)))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for i in range(2):
        first.before_backward(i)
        part = slice(8 * i, 8 * i + 8)
        loss = nn.functional.cross_entropy(model(x[part]), y[part]) * math.nan
        first.add_loss(loss * first.loss_weight(i))
        (loss * first.loss_weight(i)).backward()
    first.before_optimizer_step()
    assert first.skipped_steps == 1
    _, resumed = engine()
    resumed.load_state_dict(first.state_dict())
    assert resumed.skipped_steps == 1
