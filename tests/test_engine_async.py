"""``asynchronous=True``: each step's numbers read at the next step, a non-finite step
skipped by the optimizer on the device, the controller one step late, exactly resumable.

On the CPU the rules run as they do on CUDA (torch's fused AdamW takes ``found_inf`` on
both); what a GPU gains, no host wait, is checked by the ``cuda``-marked test in
test_host_syncs.py."""

import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch.assembly import assemble

from .test_host_syncs import counting_reads


class GrowsAfter(bb.batch.Constant):
    """8 until it has read step ``after``'s numbers, then 16: shows when a decision lands."""

    def __init__(self, after):
        super().__init__(8)
        self.after, self.max = after, 16

    def next(self, measured, batch_size, samples):
        return 16 if measured["step"] >= self.after else 8


def make_loop(asynchronous, controller=None, optimizer="fused", **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1024, 6, generator=gen), torch.randint(0, 3, (1024,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=optimizer == "fused")
    loop = bb.AdaptiveBatch(
        model,
        opt,
        data,
        controller=controller or GrowsAfter(5),
        asynchronous=asynchronous,
        **options,
    )
    return model, loop


def train(model, loop, steps, poison_at=None, on_apply=None):
    """The metrics each apply returned, then what flush returns; ``on_apply(step)`` after each."""
    rows = []
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            loss = nn.functional.cross_entropy(model(x), y)
            step.backward(loss * math.nan if step.index + 1 == poison_at else loss)
        step.apply()
        rows.append(dict(step.metrics))
        if on_apply is not None:
            on_apply(step)
    return rows


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_the_controller_decides_one_step_later_and_the_metrics_come_one_step_late():
    sync_model, sync_loop = make_loop(False)
    sync_rows = train(sync_model, sync_loop, 10)
    async_model, async_loop = make_loop(True)
    async_rows = train(async_model, async_loop, 10)
    last = async_loop.flush()
    assert [r["batch_size"] for r in sync_rows] == [8] * 5 + [16] * 5
    # the batch of step 6 is chosen from step 5's numbers, read at step 6: it lands at step 7
    assert [r["batch_size"] for r in async_rows[1:]] + [last["batch_size"]] == [8] * 6 + [16] * 4
    assert async_rows[0] == {}, "the first step's numbers come with the second"

    # until the batches part, every step computed and measured the same numbers
    def numbers(row):
        return {k: v for k, v in row.items() if k != "next_batch_size"}

    assert [numbers(r) for r in async_rows[1:6]] == [numbers(r) for r in sync_rows[:5]]
    assert last["step"] == 10 and async_loop.flush() == {}
    # each row's next batch is the next step's (one change, after step 6), not the decision
    # for the step after it: the change was logged twice, a step early the first time
    rows = [*async_rows[1:], last]
    assert [r["next_batch_size"] for r in rows[:-1]] == [r["batch_size"] for r in rows[1:]]
    assert [r["step"] for r in rows if r["next_batch_size"] != r["batch_size"]] == [6]


def test_each_steps_numbers_are_read_after_the_next_steps_update_is_queued():
    """On a GPU a read waits for everything queued before it: the read of step k comes
    after step k + 1's forward and backward, not before step k's update."""
    events = []

    def record(step):
        events.append("update")

    for asynchronous in (False, True):
        model, loop = make_loop(asynchronous, controller=bb.batch.Constant(8), statistics=True)
        events.clear()
        with counting_reads() as reads:
            for step in loop.steps(max_steps=4):
                for x, y in step.micro_batches():
                    step.backward(nn.functional.cross_entropy(model(x), y))
                before = len(reads)
                step.apply()
                events.extend(["read"] * (len(reads) - before) + ["update"])
            loop.flush()
        late = ["update"] + ["read", "update"] * 3
        assert events == (late if asynchronous else ["read", "update"] * 4), asynchronous


@pytest.mark.parametrize("statistics", [True, False])
def test_a_non_finite_step_is_skipped_on_the_device_and_counted_a_step_later(statistics):
    controller = GrowsAfter(5) if statistics else bb.batch.Constant(8)
    runs = {}
    for asynchronous in (False, True):
        model, loop = make_loop(asynchronous, controller=controller, statistics=statistics)
        trail = []  # after each step: the parameters and the skipped steps counted
        train(model, loop, 4, poison_at=3, on_apply=lambda s, m=model, lp=loop, t=trail: t.append(
            (params(m), lp.skipped_steps)
        ))  # fmt: skip
        runs[asynchronous] = loop, trail
    (sync_loop, sync_trail), (async_loop, async_trail) = runs[False], runs[True]
    for (sync_params, _), (async_params, _) in zip(sync_trail, async_trail, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(sync_params, async_params, strict=True))
    assert [skipped for _, skipped in sync_trail] == [0, 0, 1, 1]
    assert [skipped for _, skipped in async_trail] == [0, 0, 0, 1]
    sync_state = sync_loop.optimizer.state_dict()["state"]
    async_state = async_loop.optimizer.state_dict()["state"]
    assert all(torch.equal(sync_state[i]["step"], async_state[i]["step"]) for i in sync_state), (
        "the skipped step is not counted in the optimizer's bias correction"
    )


def test_a_non_finite_step_raises_at_the_next_step_with_nothing_updated():
    model, loop = make_loop(True, nonfinite="raise")
    kept = []
    with pytest.raises(bb.NonFiniteError, match="step 3: the gradient or loss is not finite"):
        train(model, loop, 6, poison_at=3, on_apply=lambda s: kept.append(params(model)))
    assert len(kept) == 3, "raised in step 4's apply"
    assert all(torch.equal(a, b) for a, b in zip(kept[1], params(model), strict=True))
    # counted as the synchronous loop counts a refused step: not at all (a run's summary
    # counted a step its metrics never logged)
    assert (loop.steps_taken, loop.samples, loop.flush()) == (2, 16, {})


def test_a_checkpoint_between_two_steps_resumes_to_the_same_run():
    model, loop = make_loop(True, controller=GrowsAfter(5), statistics=True)
    whole = [*train(model, loop, 12), loop.flush()]
    final = params(model)

    model, loop = make_loop(True, controller=GrowsAfter(5), statistics=True)
    first = train(model, loop, 5)  # step 5's numbers are pending: they decide step 7's batch
    buffer = io.BytesIO()
    torch.save(loop.state_dict(), buffer)
    buffer.seek(0)
    model, loop = make_loop(True, controller=GrowsAfter(5), statistics=True)
    loop.load_state_dict(torch.load(buffer, weights_only=True))
    rest = [*train(model, loop, 12), loop.flush()]
    assert first + rest == whole
    assert all(torch.equal(a, b) for a, b in zip(final, params(model), strict=True))


def test_a_checkpoint_taken_as_the_batch_changed_logs_that_change_when_resumed():
    """A step read after its batch changed logs the change's estimate (the controller's,
    kept for it): resumed from a checkpoint between them, it logged 0 for it."""

    def run(stop=None):
        controller = bb.batch.BatchWarmup(multiple=1, initial=8, window=3, max=256)
        model, loop = make_loop(True, controller=controller, statistics_every=2)
        if stop is not None:
            loop.load_state_dict(stop)
        return model, loop

    model, loop = run()
    whole = [*train(model, loop, 25), loop.flush()]
    model, loop = run()
    first = train(model, loop, 10)  # step 10's reading pending, read after the change
    buffer = io.BytesIO()
    torch.save(loop.state_dict(), buffer)
    buffer.seek(0)
    model, loop = run(torch.load(buffer, weights_only=True))
    rest = [*train(model, loop, 25), loop.flush()]
    assert len({r["batch_size"] for r in whole if r}) > 1  # the batch changes
    assert [_nan_as_none(r) for r in first + rest] == [_nan_as_none(r) for r in whole]


def _nan_as_none(row):
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def test_a_checkpoint_of_an_asynchronous_run_resumes_synchronously():
    model, loop = make_loop(True, controller=GrowsAfter(5), statistics=True)
    train(model, loop, 5)
    state = loop.state_dict()
    model, loop = make_loop(False, controller=GrowsAfter(5), statistics=True)
    loop.load_state_dict(state)
    rows = train(model, loop, 7)
    # step 6 was drawn at 8; step 5's pending decision is taken before step 6's own
    assert [r["batch_size"] for r in rows] == [8, 16]
    assert loop.engine.flush() is None


def test_steps_between_measurements_learn_as_they_do_synchronously():
    def ramp():  # a small noise multiple: the batch stays at 8, so the two runs agree
        return bb.batch.contrib.CriticalBatchRamp(1e-6, initial=8, min=8, window=2)

    model, loop = make_loop(False, controller=ramp(), statistics_every=2)
    sync_rows = train(model, loop, 6)
    model, loop = make_loop(True, controller=ramp(), statistics_every=2)
    rows = [*train(model, loop, 6), loop.flush()]
    assert rows[1:] == sync_rows
    assert "trace" in rows[1] and "trace" not in rows[2] and "batch_grad_sq_norm" in rows[2]


def test_refused_where_a_step_cannot_be_skipped_on_the_device():
    with pytest.raises(ValueError, match="AdamW cannot skip a non-finite step on the device"):
        make_loop(True, optimizer="foreach")
    model = nn.Linear(4, 2)
    vrgd = bb.optim.VRGD(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    with pytest.raises(ValueError, match="VRGD reads each step's statistics"):
        bb.AdaptiveBatch(
            model, vrgd, TensorDataset(torch.randn(64, 4)), min_sub_batches=8, asynchronous=True
        )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    options = bb.StepOptions(asynchronous=True)
    with pytest.raises(ValueError, match="a framework's own step cannot"):
        assemble(opt, options=options, model=model, registers_hooks=False)


def test_under_a_grad_scaler_the_scaler_skips_and_the_optimizer_must_take_found_inf():
    """fp16's GradScaler hands a fused optimizer its own ``found_inf`` (no host read); for
    one that cannot take it, it would read its overflow flag on the host: refused."""
    model, loop = make_loop(
        True, controller=bb.batch.Constant(8), scaler=torch.amp.GradScaler("cpu")
    )
    rows = [*train(model, loop, 3, poison_at=2), loop.flush()]
    assert [r["step"] for r in rows[1:]] == [1, 2, 3]
    assert loop.scaler.get_scale() < 2.0**16, "the overflowed step lowered the scale"
    with pytest.raises(ValueError, match="AdamW cannot skip a non-finite step"):
        make_loop(True, optimizer="foreach", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("optimizer", ["fused-adamw", "fused-sgd"])
def test_under_a_grad_scaler_a_nan_loss_with_a_finite_gradient_updates_nothing(optimizer, clip):
    """The scaler checks the gradients; a NaN term that carries no gradient leaves them
    finite: the step is counted skipped, so nothing may change (the first step, where fused
    SGD's momentum would start uninitialised, among them). Clipped in apply, the scaler's
    unscale_ had read the gradient before it was marked: the step was applied, NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 6, generator=gen), torch.randint(0, 3, (256,)))
    if optimizer == "fused-sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    loop = bb.AdaptiveBatch(
        model, opt, data, controller=bb.batch.Constant(8), asynchronous=True,
        scaler=torch.amp.GradScaler("cpu"),
    )  # fmt: skip
    seen = [params(model)]
    for step in loop.steps(max_steps=4):
        for x, y in step.micro_batches():
            loss = nn.functional.cross_entropy(model(x), y)
            step.backward(loss + math.nan if step.index in (0, 2) else loss)  # steps 1 and 3
        step.apply(max_grad_norm=clip)
        seen.append(params(model))
    loop.flush()
    assert loop.skipped_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(seen[2], seen[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[1], seen[2], strict=True))
    assert all(torch.isfinite(p).all() for p in seen[-1])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_disabled_grad_scaler_still_skips_a_non_finite_step(asynchronous):
    """``GradScaler(enabled=use_amp)`` with amp off steps as the optimizer would: the
    engine, not the scaler, must skip a non-finite step."""
    model, loop = make_loop(
        asynchronous, controller=bb.batch.Constant(8),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
    )  # fmt: skip
    train(model, loop, 4, poison_at=2)
    loop.flush()
    assert loop.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_skipped_first_step_leaves_fused_sgds_momentum_as_a_step_never_taken():
    """torch's fused SGD makes its momentum buffers with ``empty_like`` at its first step and
    keeps them so where that step is skipped; the loop starts them at zeros, the same first
    step without dampening: the run goes on exactly as the synchronous loop's."""
    runs = {}
    for asynchronous in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256, 6, generator=gen), torch.randint(0, 3, (256,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        loop = bb.AdaptiveBatch(
            model, opt, data, controller=bb.batch.Constant(8), asynchronous=asynchronous
        )
        train(model, loop, 4, poison_at=1)
        runs[asynchronous] = params(model), loop
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0], strict=True))
    model = nn.Linear(4, 2)
    dampened = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1, fused=True)
    with pytest.raises(ValueError, match="with dampening they do not"):
        bb.AdaptiveBatch(model, dampened, TensorDataset(torch.randn(64, 4)), asynchronous=True)


@pytest.mark.parametrize(
    "controller",
    [
        bb.batch.BatchWarmup(multiple=1, initial=8, window=5),
        bb.batch.Seesaw(initial=8, min=8, window=5, growth=8),
    ],
    ids=["batch_warmup", "seesaw"],
)
def test_a_rule_that_reads_the_statistics_never_decides_on_a_step_of_an_older_batch(controller):
    """The step read after a change measured the batch before it: told that older batch,
    BatchWarmup's "no change yet" undid its growth and the batch see-sawed (8, 16, 8, 16)."""
    decay = lambda samples: max(0.05, 1 - samples / 1500)  # noqa: E731 - Seesaw grows by it
    controller.max = 512  # the data's 1,024 samples, at most once in a batch
    model, loop = make_loop(True, controller=controller, schedule=decay)
    rows = [r for r in train(model, loop, 120) if r]
    sizes = [r["batch_size"] for r in rows]
    assert sizes == sorted(sizes) and len(set(sizes)) >= 3  # it grew, and never shrank
