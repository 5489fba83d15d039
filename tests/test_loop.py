"""AdaptiveBatch end to end on a small teacher-student problem."""

import copy
import io
import math
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import bigbatch as bb


def make_data(n=3000, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    teacher = torch.randn(d, 4, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(1))


def make_run(seed=0, controller=None, optimizer="lamb", **options):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = bb.optim.create_optimizer(model, optimizer, lr=3e-3)
    controller = controller or bb.batch.SimiGrad(target=0.5, initial=16, min=8, max=512)
    loop = bb.AdaptiveBatch(
        model, opt, make_data(), controller=controller, max_micro_batch=64, **options
    )
    return model, loop


def train(loop, model, **limits):
    history = []
    for step in loop.steps(**limits):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()
        history.append(step.metrics)
    return history


def accuracy(model):
    data = make_data()
    with torch.no_grad():
        return (model(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean().item()


def test_the_batch_adapts_and_training_converges():
    model, loop = make_run()
    history = train(loop, model, max_samples=40_000)
    sizes = [m["batch_size"] for m in history]
    assert len(set(sizes)) > 5, "the batch size must change"
    assert all(8 <= b <= 512 for b in sizes)
    assert sum(sizes) == loop.samples >= 40_000
    assert accuracy(model) > 0.85
    # the LR follows sqrt(B / B0) around the optimizer step and is restored
    last = history[-1]
    assert last["lr_factor"] == pytest.approx((last["batch_size"] / 16) ** 0.5)
    assert loop.optimizer.param_groups[0]["lr"] == 3e-3


def test_micro_batches_follow_the_plan():
    model, loop = make_run(
        controller=bb.batch.Constant(150), noise_from="sub_batches", statistics=True
    )
    step = next(loop.steps(max_steps=1))
    shapes = [x.shape[0] for x, _ in step.micro_batches()]
    assert shapes == [38, 38, 37, 37]
    for x, y in step.micro_batches():
        step.backward(nn.functional.cross_entropy(model(x), y))
    step.apply()


@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")
@pytest.mark.parametrize("optimizer", ["lamb", "vr-lamb"])  # (a wrapper's state: refused)
def test_resume_is_bitwise_identical(optimizer):
    model, loop = make_run(optimizer=optimizer)
    train(loop, model, max_steps=30)
    expected = [p.detach().clone() for p in model.parameters()]
    expected_history = None

    model, loop = make_run(optimizer=optimizer)
    train(loop, model, max_steps=12)
    buffer = io.BytesIO()
    torch.save(loop.state_dict(), buffer)
    buffer.seek(0)
    # a different start: everything comes from the checkpoint
    model, resumed = make_run(seed=99, optimizer=optimizer)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    expected_history = train(resumed, model, max_steps=30)
    assert len(expected_history) == 18
    for p, q in zip(model.parameters(), expected):
        assert torch.equal(p.detach(), q)


def test_a_state_saved_inside_a_step_is_refused_and_one_saved_after_it_resumes():
    """Inside a step the sampler is past its batch and the counters are not: such a state
    would resume never training on that batch."""
    model, loop = make_run(controller=bb.batch.Constant(32))
    step = next(iter(loop.steps(max_steps=2)))
    with pytest.raises(RuntimeError, match=r"step 0 is under way .* after step.apply\(\)"):
        loop.state_dict()  # at the top of the loop's body
    for x, y in step.micro_batches():
        step.backward(nn.functional.cross_entropy(model(x), y))
        with pytest.raises(RuntimeError, match="under way"):
            loop.state_dict()  # between micro-batches
    step.apply()
    state = loop.state_dict()
    assert state["engine"]["samples"] == state["source"]["sampler"]["position"] == 32
    broken_off = next(iter(loop.steps(max_steps=3)))  # a step abandoned by a load
    assert broken_off.index == 1
    loop.load_state_dict(state)
    assert loop.state_dict()["engine"]["samples"] == 32


class _Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.randn(16), torch.tensor(index % 4), torch.tensor(os.getpid())


@pytest.mark.parametrize("given, kept", [({}, True), ({"persistent_workers": False}, False)])
def test_loader_workers_are_kept_across_steps_unless_the_user_says_not(given, kept):
    """The loop iterates its loader once a step: workers not kept start again each step
    (about 60 ms a step forked, a second spawned)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4))
    options = {"num_workers": 1, **given}
    loop = bb.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), _Pids(),
                            controller=bb.batch.Constant(8), loader_options=options)  # fmt: skip
    pids = []
    for step in loop.steps(max_steps=2):
        for x, y, pid in step.micro_batches():
            pids.append(pid[0].item())
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()
    assert (len(set(pids)) == 1) == kept


def test_works_with_torch_optimizers_grad_scaler_and_workers():
    model, loop = make_run(
        optimizer="sgd",
        scaler=torch.amp.GradScaler("cpu", init_scale=256.0),
        loader_options={"num_workers": 2, "persistent_workers": True},
    )
    history = train(loop, model, max_steps=6)
    assert len(history) == 6 and all(torch.isfinite(torch.tensor(m["similarity"])) for m in history)
    # the loss scale is divided out: the statistics are those of the unscaled run
    plain_model, plain = make_run(optimizer="sgd")
    expected = train(plain, plain_model, max_steps=6)
    for got, want in zip(history, expected):
        for name in ("grad_sq_norm", "trace", "similarity", "loss"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-7)


def test_between_measurements_the_batch_gradients_norm_is_unscaled_from_a_grad_scaler():
    """The norm a controller learns from between measurements is the unscaled gradient's:
    what the same run without a scaler logs."""

    def run(**options):
        controller = bb.batch.contrib.CriticalBatchRamp(1.0, initial=16, window=4)
        model, loop = make_run(
            optimizer="sgd", controller=controller, statistics_every=2, **options
        )
        return train(loop, model, max_steps=6)

    history = run(scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    expected = run()
    between = [m for m in history if "batch_grad_sq_norm" in m]
    assert len(between) == 3
    for got, want in zip(history, expected):
        if "batch_grad_sq_norm" in want:
            assert got["batch_grad_sq_norm"] == pytest.approx(want["batch_grad_sq_norm"], rel=1e-4)


def test_a_scaler_unscaled_by_the_user_before_apply_is_refused():
    """The micro-batches' norms are taken scaled in the backward; a gradient unscaled before
    the read made |G|² negative and the noise scale NaN, silently: the batch never grew."""
    model, loop = make_run(optimizer="sgd", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    with pytest.raises(RuntimeError, match=r"scaler.unscale_\(optimizer\) ran before"):
        for step in loop.steps(max_steps=1):
            for x, y in step.micro_batches():
                step.backward(nn.functional.cross_entropy(model(x), y))
            loop.scaler.unscale_(loop.optimizer)  # torch's AMP recipe, to clip or look
            step.apply()
    assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_step_that_raises_leaves_its_own_rate_for_a_checkpoint():
    """An interrupt inside the optimizer's step left the batch's scaled rate in the groups,
    and state_dict() saved it: a resumed run trained at twice the rate for good."""

    class Interrupted(torch.optim.SGD):
        def step(self, closure=None):
            raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(16, 4))
    optimizer = Interrupted(model.parameters(), lr=0.1)
    loop = bb.AdaptiveBatch(
        model, optimizer, make_data(), controller=bb.batch.Constant(32), base_batch_size=16,
        lr_scaling="linear",
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        train(loop, model, max_steps=1)
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert loop.state_dict()["optimizer"]["param_groups"][0]["lr"] == 0.1


@pytest.mark.parametrize("noise_from", ["auto", "sub_batches"])
def test_a_gradient_another_loop_left_unapplied_is_not_the_next_loops(noise_from):
    """A step broken off in one loop, then a new loop on the model: the old gradient was
    added to the new loop's first update and statistics."""

    def first_update(broken_off):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 4))
        options = dict(controller=bb.batch.Constant(16), noise_from=noise_from, seed=1)
        if broken_off:
            old = bb.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   make_data(), **options)  # fmt: skip
            for step in old.steps(max_steps=1):
                x, y = next(iter(step.micro_batches()))
                nn.functional.cross_entropy(model(x), y).backward()  # then a time limit
                break
            old.close()
        loop = bb.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                make_data(), **options)  # fmt: skip
        train(loop, model, max_steps=1)
        return model[0].weight.detach().clone()

    assert torch.equal(first_update(True), first_update(False))


def test_closing_a_loop_another_took_over_leaves_the_new_one_measuring():
    """The docs' way to change what trains is a new loop; closing the old one after took the
    new one's measured layers off the model (its next step refused with a tied-weight error)."""

    def steps_of(close_old):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        options = dict(noise_from="examples", statistics_every=1, seed=1)
        old = bb.AdaptiveBatch(model, optimizer, make_data(), **options)
        train(old, model, max_steps=1)
        new = bb.AdaptiveBatch(model, optimizer, make_data(), **options)
        if close_old:
            old.close()
        return [m["trace"] for m in train(new, model, max_steps=3)]

    assert steps_of(close_old=True) == steps_of(close_old=False)


def test_a_closed_loop_refuses_to_train_on():
    # its statistics' hooks are off the model: it trained on with a negative trace
    model, loop = make_run(controller=bb.batch.Constant(16))
    train(loop, model, max_steps=1)
    loop.close()
    with pytest.raises(RuntimeError, match=r"the loop was closed \(close\(\)\): build a new"):
        train(loop, model, max_steps=2)


def test_noise_scale_controller_and_adascale():
    model, loop = make_run(
        controller=bb.batch.contrib.NoiseScale(initial=16, min=8, max=512),
        lr_scaling="adascale-sqrt",
        schedule=bb.schedules.warmup_cosine(20_000, 2000),
    )
    history = train(loop, model, max_samples=20_000)
    assert history[-1]["noise_scale"] > 0
    assert any(m["batch_size"] != 16 for m in history)


class Stream(IterableDataset):
    def __iter__(self):
        data = make_data()
        yield from zip(*data.tensors)


def test_iterable_dataset_resumes_where_it_stopped():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        controller = bb.batch.Ramp(points=[(0, 32), (64, 48)])
        return model, bb.AdaptiveBatch(model, opt, Stream(), controller=controller)

    def drawn(loop, model, steps):
        seen = []
        for step in loop.steps(max_steps=steps):
            for x, y in step.micro_batches():
                seen.append(x.clone())
                step.backward(nn.functional.cross_entropy(model(x), y))
            step.apply()
        return torch.cat(seen)

    model, straight = make()
    drawn(straight, model, 3)
    state = copy.deepcopy(straight.state_dict())  # its tensors share the live parameters
    expected = drawn(straight, model, 70)  # runs past the end of the stream, which restarts

    fresh_model, resumed = make()
    resumed.load_state_dict(state)
    assert resumed.samples == 32 + 32 + 48
    assert torch.equal(drawn(resumed, fresh_model, 70), expected)
    assert all(torch.equal(p, q) for p, q in zip(fresh_model.parameters(), model.parameters()))


def test_misuse_is_reported():
    _, loop = make_run()
    with pytest.raises(ValueError, match="max_samples or max_steps"):
        next(loop.steps())
    step = next(loop.steps(max_steps=1))
    with pytest.raises(RuntimeError, match="backward ran 0 times"):
        step.apply()
    with pytest.raises(ValueError, match="below min_sub_batches"):
        make_run(controller=bb.batch.SimiGrad(initial=4, min=2, max=64), noise_from="sub_batches")
    with pytest.raises(ValueError, match="needs statistics=True"):
        make_run(statistics=False)
    with pytest.raises(ValueError, match="lr_scaling"):
        make_run(lr_scaling="cubic")


def train_with_nan_at(loop, model, bad_step, steps):
    """Train, with a NaN loss (hence NaN gradients) at step ``bad_step`` (1-based)."""
    history = []
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            loss = nn.functional.cross_entropy(model(x), y)
            if loop.steps_taken + 1 == bad_step:
                loss = loss * float("nan")
            step.backward(loss)
        step.apply()
        history.append(step.metrics)
    return history


@pytest.mark.parametrize("statistics", [True, False])
def test_a_nan_step_is_skipped_and_nothing_absorbs_it(statistics):
    options = {} if statistics else {"statistics": False}
    controller = bb.batch.SimiGrad(target=0.5, initial=16, min=8, max=512)
    if not statistics:
        controller = bb.batch.Constant(32)
    model, loop = make_run(controller=controller, **options)
    history = train_with_nan_at(loop, model, bad_step=6, steps=12)
    assert loop.skipped_steps == 1 and history[5]["skipped"] == 1.0
    assert history[5]["next_batch_size"] == history[5]["batch_size"]  # the controller kept it
    assert all(torch.isfinite(p).all() for p in model.parameters())
    state = loop.optimizer.state_dict()["state"]
    assert all(torch.isfinite(t).all() for s in state.values() for t in s.values() if t.numel())
    if statistics:
        state = loop.collector.state_dict().values()
        assert all(torch.isfinite(v).all() for v in state if torch.is_tensor(v))
    assert history[-1]["loss"] < history[0]["loss"]


def test_a_nan_step_can_stop_the_run_before_any_update():
    model, loop = make_run(nonfinite="raise")
    with pytest.raises(bb.NonFiniteError, match="step 4: the gradient or loss is not finite"):
        train_with_nan_at(loop, model, bad_step=4, steps=10)
    assert loop.steps_taken == 3 and all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        make_run(nonfinite="ignore")


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_loop_rolled_back_to_a_checkpoint_goes_on_as_a_fresh_one_would(asynchronous):
    """After a NonFiniteError (the step's gradient left over, a step read one step late
    pending) or past the checkpoint, load_state_dict abandons the step under way."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        loop = bb.AdaptiveBatch(
            model, optimizer, make_data(), controller=bb.batch.Constant(16), statistics=True,
            nonfinite="raise", lr_scaling="adascale", base_batch_size=4,
            asynchronous=asynchronous,
        )  # fmt: skip
        return model, loop

    def finish(loop, model, steps):
        return [*train(loop, model, max_steps=steps), loop.flush()]

    model, loop = make()
    train(loop, model, max_steps=5)
    checkpoint = roundtrip(loop.state_dict())
    with pytest.raises(bb.NonFiniteError):
        train_with_nan_at(loop, model, bad_step=8, steps=12)
    assert all(p.grad is None for p in model.parameters())  # nothing left to add to
    loop.load_state_dict(roundtrip(checkpoint))
    rolled = finish(loop, model, 10)
    train(loop, model, max_steps=14)  # past the checkpoint, then back to it
    loop.load_state_dict(roundtrip(checkpoint))
    again = finish(loop, model, 10)
    fresh_model, fresh = make()
    fresh.load_state_dict(roundtrip(checkpoint))
    expected = finish(fresh, fresh_model, 10)
    assert rolled == expected and again == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_a_skipped_step_never_reaches_the_noise_averages():
    # an infinite loss with a finite gradient too: the loop skips the step, the averages
    model, loop = make_run(controller=bb.batch.Constant(32), statistics=True)
    train(loop, model, max_steps=2)
    before = loop.collector.state_dict()
    for step in loop.steps(max_steps=3):
        for x, y in step.micro_batches():
            loss = nn.functional.cross_entropy(model(x), y)
            step.backward(loss + (loss.detach() * float("inf")))
        step.apply()
    assert step.metrics["skipped"] == 1.0 and loop.collector.state_dict() == before


def test_a_batch_larger_than_the_dataset_is_measured_without_the_population_correction():
    # sub-batches each as large as the dataset: drawn across epochs, the correction for
    # drawing without replacement no longer applies (with it they carried no noise at all)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4))
    data = TensorDataset(*make_data(10).tensors)
    for noise_from, batch in (("sub_batches", 40), ("examples", 80)):
        loop = bb.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                controller=bb.batch.Constant(batch), statistics=True,
                                noise_from=noise_from)  # fmt: skip
        with pytest.warns(UserWarning, match="holds some samples twice"):
            history = train(loop, model, max_steps=2)
        assert all(math.isfinite(m["trace"]) for m in history)


def test_a_loss_of_more_than_one_number_is_refused_with_its_shape():
    model, loop = make_run()
    step = next(loop.steps(max_steps=1))
    x, y = next(step.micro_batches())
    loss = nn.functional.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(ValueError, match=r"one number .* shape \(\d+,\)"):
        step.backward(loss)


def test_per_example_statistics_need_no_split_of_the_step():
    controller = bb.batch.Constant(48)
    sub_model, sub = make_run(controller=controller, noise_from="sub_batches", statistics=True)
    one_model, one = make_run(
        controller=copy.deepcopy(controller), noise_from="examples", statistics=True
    )
    _, off = make_run(controller=copy.deepcopy(controller), statistics=False)
    assert (sub.min_sub_batches, one.min_sub_batches, off.min_sub_batches) == (4, 1, 1)
    step = next(one.steps(max_steps=1))
    assert len(step.plan.sizes) == 1
    for x, y in step.micro_batches():
        step.backward(nn.functional.cross_entropy(one_model(x), y))
    step.apply()
    assert step.metrics["trace"] > 0 and step.metrics["noise_scale"] > 0
    # the same example norms as the sub-batch run's first step measures, in expectation:
    # over a short run, the noise scales agree within a factor of two
    history = {
        "sub": train(sub, sub_model, max_steps=30),
        "one": train(one, one_model, max_steps=29),
    }
    scale = {
        k: sum(m["trace"] for m in h) / sum(m["grad_sq_norm"] for m in h)
        for k, h in history.items()
    }
    assert 0.5 < scale["one"] / scale["sub"] < 2


def test_auto_takes_the_examples_where_the_model_allows_and_says_why_not(caplog):
    _, covered = make_run(controller=bb.batch.Constant(32), noise_from="auto", statistics=True)
    assert covered.collector.per_example is not None and covered.min_sub_batches == 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("INFO", logger="bigbatch"):
        loop = bb.AdaptiveBatch(
            model,
            opt,
            make_data(),
            controller=bb.batch.Constant(32),
            noise_from="auto",
            statistics=True,
        )
    assert loop.collector.per_example is None and loop.min_sub_batches == 4
    assert "no per-example rule for 1.weight, 1.bias" in caplog.text
    with pytest.raises(ValueError, match="noise_from='examples' is not possible here: no per"):
        bb.AdaptiveBatch(model, opt, make_data(), noise_from="examples")
    # the default; every step split anyway (asked for, or a framework's accumulation): the
    # sub-batch statistics come free, so auto takes them; examples still insists
    caplog.clear()
    with caplog.at_level("INFO", logger="bigbatch"):
        _, split = make_run(controller=bb.batch.Constant(32), min_sub_batches=2, statistics=True)
    assert split.collector.per_example is None and split.min_sub_batches == 2
    assert "every step is split into 2 micro-batches anyway" in caplog.text
    _, insisted = make_run(
        controller=bb.batch.Constant(32), min_sub_batches=4, noise_from="examples", statistics=True
    )
    assert insisted.collector.per_example is not None
    # a constant batch reads no statistics: none are taken unless asked for
    _, constant = make_run(controller=bb.batch.Constant(32))
    assert constant.collector is None and constant.min_sub_batches == 1


def test_simigrad_keeps_its_measured_cosine_under_per_example_statistics():
    _, loop = make_run(noise_from="examples")  # make_run's controller is SimiGrad
    assert loop.collector.per_example is not None
    assert (loop.collector.similarity, loop.min_sub_batches) == ("split", 2)


def test_statistics_every_k_splits_only_the_measured_steps_and_resumes_exactly():
    """SimiGrad decides at steps 1, 4, 7, ...; the steps between are one micro-batch each,
    and a run resumed between two measurements ends where the straight run does."""
    model, loop = make_run(statistics_every=3, noise_from="sub_batches")
    splits, measured = [], []
    for step in loop.steps(max_steps=7):
        splits.append(len(step.plan.sizes))
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()
        measured.append("similarity" in step.metrics)
    assert splits == [4, 1, 1, 4, 1, 1, 4]
    assert measured == [True, False, False, True, False, False, True]
    train(loop, model, max_steps=40)
    expected = [p.detach().clone() for p in model.parameters()]

    model, loop = make_run(statistics_every=3, noise_from="sub_batches")
    train(loop, model, max_steps=11)
    buffer = io.BytesIO()
    torch.save(loop.state_dict(), buffer)
    buffer.seek(0)
    model, resumed = make_run(seed=99, statistics_every=3, noise_from="sub_batches")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    train(resumed, model, max_steps=40)
    for p, q in zip(model.parameters(), expected):
        assert torch.equal(p.detach(), q)


def test_auto_measures_by_the_batch_across_its_changes_and_resumes_exactly():
    """At 16 one step in 4, at 32 one in 2, from 64 every step (a ramp in samples); a run
    resumed between two measurements at 16 measures the same steps and ends the same."""
    ramp = dict(points=[(0, 16), (128, 32), (256, 64)])

    def run(seed=0):
        return make_run(
            seed, bb.batch.Ramp(**ramp), statistics=True, statistics_every="auto",
            noise_from="examples", lr_scaling="none",
        )  # fmt: skip

    model, loop = run()
    history = train(loop, model, max_steps=16)
    assert [r["batch_size"] for r in history][6:14] == [16, 16, 32, 32, 32, 32, 64, 64]
    measured = [i for i, r in enumerate(history) if "trace" in r]
    assert measured == [0, 4, 8, 10, 12, 13, 14, 15]
    train(loop, model, max_steps=24)
    expected = [p.detach().clone() for p in model.parameters()]

    model, loop = run()
    train(loop, model, max_steps=6)
    buffer = io.BytesIO()
    torch.save(loop.state_dict(), buffer)
    buffer.seek(0)
    model, resumed = run(seed=99)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    later = train(resumed, model, max_steps=16)
    assert [6 + i for i, r in enumerate(later) if "trace" in r] == measured[2:]
    train(resumed, model, max_steps=24)
    for p, q in zip(model.parameters(), expected):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("noise_from", ["examples", "sub_batches"])
def test_clipping_in_apply_comes_after_the_statistics_and_before_the_update(noise_from):
    """The statistics read the batch's own gradient; the optimizer steps with the clipped one."""

    def one_step(max_grad_norm):
        model, loop = make_run(
            controller=bb.batch.Constant(32), optimizer="sgd", noise_from=noise_from,
            statistics=True, lr_scaling="none",
        )  # fmt: skip
        step = next(loop.steps(max_steps=1))
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        grads = []

        def keep(optimizer, args, kwargs):
            grads.extend(p.grad.clone() for p in model.parameters())

        loop.optimizer.register_step_pre_hook(keep)
        step.apply(max_grad_norm=max_grad_norm)
        return step.metrics, grads

    plain, grads = one_step(None)
    clipped, clipped_grads = one_step(1e-3)
    for name in ("grad_sq_norm", "trace", "similarity"):
        assert clipped[name] == plain[name], name
    total = torch.cat([g.flatten() for g in grads]).norm()
    assert total > 1e-3
    # the optimizer stepped with the gradient scaled to the norm asked for
    for g, c in zip(grads, clipped_grads, strict=True):
        torch.testing.assert_close(c, g * (1e-3 / total), rtol=1e-4, atol=1e-12)
    with pytest.raises(ValueError, match="max_grad_norm"):
        step = next(make_run()[1].steps(max_steps=1))
        step.apply(max_grad_norm=-1.0)


def test_a_summed_loss_is_measured_as_the_mean_one():
    # the sub-batch statistics take each micro-batch's mean gradient; with a summed loss
    # they took its sum (|G|^2 -3,969 and tr Sigma 191,701 where the truth is 21 and 157)
    runs = {}
    for reduction in ("mean", "sum"):
        model, loop = make_run(
            controller=bb.batch.Constant(48), statistics=True, noise_from="sub_batches",
            loss_reduction=reduction,
        )  # fmt: skip
        history = []
        for step in loop.steps(max_steps=3):
            for x, y in step.micro_batches():
                step.backward(nn.functional.cross_entropy(model(x), y, reduction=reduction))
            step.apply()
            history.append(step.metrics)
        runs[reduction] = [m[key] for m in history for key in ("grad_sq_norm", "trace")]
    assert runs["sum"] == pytest.approx(runs["mean"], rel=1e-5)


# ---------------------------------------------------------------- fp16's GradScaler


def train_with_losses(loop, model, times):
    """One step per factor in ``times``, its loss multiplied by it; the metrics of each."""
    history = []
    steps = loop.steps(max_steps=loop.steps_taken + len(times))
    for step, factor in zip(steps, times, strict=True):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y) * factor)
        step.apply()
        history.append(step.metrics)
    return history


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_grad_scalers_overflow_is_counted_skipped_and_the_scaler_lowers_its_scale(nonfinite):
    """A loss finite but too large once scaled (an fp16 overflow): the scaler's routine, so
    never raised; the engine counts it as skipped and the scaler skips it and halves."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model, loop = make_run(controller=bb.batch.Constant(16), scaler=scaler, nonfinite=nonfinite)
    train_with_losses(loop, model, [1.0])
    before = [p.detach().clone() for p in model.parameters()]
    rows = train_with_losses(loop, model, [1e36])  # x 2^16: infinite in float32
    assert rows[0]["skipped"] == 1.0 and rows[0]["lr"] == 0.0 and math.isfinite(rows[0]["loss"])
    assert loop.skipped_steps == 1 and loop.steps_taken == 2
    assert scaler.get_scale() == 2.0**15, "the scaler saw the overflow and halved its scale"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    rows = train_with_losses(loop, model, [1.0])
    assert "skipped" not in rows[0] and loop.skipped_steps == 1


def test_under_a_grad_scaler_a_non_finite_loss_is_refused_as_without_one():
    scaler = torch.amp.GradScaler("cpu")
    model, loop = make_run(controller=bb.batch.Constant(16), scaler=scaler, nonfinite="raise")
    with pytest.raises(bb.NonFiniteError, match="step 1"):
        train_with_losses(loop, model, [math.nan])
    model, loop = make_run(controller=bb.batch.Constant(16), scaler=scaler)
    rows = train_with_losses(loop, model, [math.nan])
    assert rows[0]["skipped"] == 1.0 and loop.skipped_steps == 1


@pytest.mark.parametrize("controller", ["measured", "between measurements"])
def test_a_scale_fallen_to_zero_is_a_skipped_step_not_a_division_by_zero(controller):
    """Overflow after overflow halves the scale to 0, where no gradient measures anything."""
    if controller == "measured":
        chosen, options = bb.batch.Constant(16), {}
    else:  # BatchWarmup learns |G|^2 from the batch gradient between measurements
        chosen, options = bb.batch.BatchWarmup(initial=16, min=16), {"statistics_every": 4}
    scaler = torch.amp.GradScaler("cpu", init_scale=0.0)
    model, loop = make_run(controller=chosen, scaler=scaler, **options)
    rows = train_with_losses(loop, model, [1.0, 1.0])
    assert [r.get("skipped") for r in rows] == [1.0, 1.0] and loop.skipped_steps == 2
    model, loop = make_run(controller=chosen, scaler=scaler, nonfinite="raise", **options)
    with pytest.raises(bb.NonFiniteError, match="the GradScaler scale fell to 0"):
        train_with_losses(loop, model, [1.0])


def test_a_scaled_gradient_too_large_for_a_float32_norm_is_skipped_and_the_scale_lowered():
    """Finite elements whose norm overflows float32 (a scale grown for long, e.g. under bf16):
    the statistics cannot be taken, so the step is skipped as an overflow, and the scale is
    lowered as the scaler would (it would find no infinite element and step at the base rate)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**80, growth_interval=3)
    model, loop = make_run(controller=bb.batch.Constant(16), scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    rows = train_with_losses(loop, model, [1.0])
    assert rows[0]["skipped"] == 1.0 and loop.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.state_dict()["scale"] == 2.0**79 and scaler.state_dict()["_growth_tracker"] == 0


def test_a_step_left_before_apply_adds_nothing_to_the_next():
    """A ``break`` between backward and apply (a time limit, say): the next ``steps()``
    starts from no gradient, as a plain loop's ``zero_grad`` would."""
    model, loop = make_run(controller=bb.batch.Constant(16))
    for step in loop.steps(max_steps=5):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        break
    reference = copy.deepcopy(model)
    steps = loop.steps(max_steps=1)
    step = next(steps)
    for x, y in step.micro_batches():
        step.backward(nn.functional.cross_entropy(model(x), y))
    grads = [p.grad.clone() for p in model.parameters()]
    x, y = make_data().tensors
    rows = [i for part in step.indices for i in part]
    nn.functional.cross_entropy(reference(x[rows]), y[rows]).backward()
    expected = [p.grad for p in reference.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, expected, strict=True))
    step.apply()
    assert next(steps, None) is None and loop.steps_taken == 1


def test_a_step_used_out_of_order_is_one_error_that_says_what_to_do():
    """Two backwards on one micro-batch (two losses) said only that backward ran too often."""
    model, loop = make_run(controller=bb.batch.Constant(16))
    step = next(loop.steps(max_steps=1))
    with pytest.raises(RuntimeError, match="backward ran 0 times"):
        step.apply()
    (x, y), *rest = list(step.micro_batches())
    assert not rest
    loss = nn.functional.cross_entropy(model(x), y)
    step.backward(loss)
    with pytest.raises(RuntimeError, match=r"once per micro-batch.*loss_a \+ loss_b"):
        step.backward(loss)
    step.apply()
    with pytest.raises(RuntimeError, match="already applied"):
        step.apply()
    with pytest.raises(RuntimeError, match=r"step 0 was applied: backward comes before apply"):
        step.backward(loss)  # (it said the step had fewer micro-batches)


def test_retain_graph_keeps_the_graph_for_another_backward_and_changes_nothing_else():
    """As ``Tensor.backward(retain_graph=True)``: the graph stays for a later use (a
    gradient penalty, a probe), the step and its statistics are those of a plain backward."""
    runs = []
    for retain in (False, True):
        model, loop = make_run(controller=bb.batch.Constant(16))
        for step in loop.steps(max_steps=2):
            for x, y in step.micro_batches():
                loss = nn.functional.cross_entropy(model(x), y)
                step.backward(loss, retain_graph=retain)
                if retain:  # the graph is still there: torch would raise on a freed one
                    torch.autograd.grad(loss, next(model.parameters()))
            step.apply()
        runs.append(([p.detach().clone() for p in model.parameters()], dict(step.metrics)))
    (a, metrics_a), (b, metrics_b) = runs
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)) and metrics_a == metrics_b


def test_a_scaler_on_one_side_of_a_resume_is_said_and_one_on_both_is_restored():
    """A state saved with a scaler loaded into a loop without one dropped its scale, and the
    reverse started the scale again, both silently."""
    model, loop = make_run(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    train_with_losses(loop, model, [1.0, 1e36])  # an overflow halves the scale
    scaled = loop.state_dict()
    model, loop = make_run()
    train_with_losses(loop, model, [1.0])
    plain = loop.state_dict()

    with pytest.warns(UserWarning, match=r"GradScaler \(scale 32768.0\) is dropped"):
        make_run()[1].load_state_dict(scaled)
    with pytest.warns(UserWarning, match="starts again from its initial scale 65536"):
        make_run(scaler=torch.amp.GradScaler("cpu"))[1].load_state_dict(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = torch.amp.GradScaler("cpu")
        make_run(scaler=scaler)[1].load_state_dict(scaled)
        make_run()[1].load_state_dict(plain)
    assert scaler.get_scale() == 2.0**15


def test_a_loop_built_with_another_order_than_the_saved_one_is_told_the_saved_one_wins():
    def loop_of(**order):
        model = nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, bb.AdaptiveBatch(
            model, opt, make_data(), controller=bb.batch.Constant(16), **order
        )

    model, loop = loop_of(seed=3)
    train(loop, model, max_steps=2)
    saved = loop.state_dict()
    other = loop_of(seed=4, shuffle=False)[1]
    with pytest.warns(
        UserWarning, match=r"\(seed=3, shuffle=True\) replaces this one's \(seed=4, shuffle=False\)"
    ):
        other.load_state_dict(saved)
    assert (other.source.sampler.seed, other.source.sampler.shuffle) == (3, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop_of(seed=3)[1].load_state_dict(saved)


def test_the_split_similarity_gets_an_even_micro_batch_count_and_odd_sizes_are_said():
    """Batch 30 at max_micro_batch 12 made 3 micro-batches: halves of 10 and 20 samples, whose
    cosine reads lower (2.7 points at batch 12), unwarned; SimiGrad then held a larger batch."""
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    simigrad = bb.batch.SimiGrad(target=0.5, initial=30, min=8, max=60)
    loop = bb.AdaptiveBatch(model, opt, make_data(), controller=simigrad, max_micro_batch=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in loop.steps(max_steps=2):
            assert len(step.plan.sizes) % 2 == 0
            for x, y in step.micro_batches():
                step.backward(nn.functional.cross_entropy(model(x), y))
            step.apply()
    stats = bb.stats.MicroBatchStatistics([list(model.parameters())], similarity="split")
    with pytest.warns(UserWarning, match=r"compares 10 samples with 20: halves of unequal size"):
        stats.begin([10, 10, 10])


def test_a_loop_dropped_unclosed_takes_its_hooks_with_it_and_a_broken_step_stops_measuring():
    """A dropped loop's sub-batch hooks stayed on the model, holding its collector (about a
    gradient's memory a loop, 97 MB after 41 loops); a loop dropped in a step broken off
    left the layers measuring, and the model's next plain backward was refused."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    data = make_data()

    def loop_of(**options):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        return bb.AdaptiveBatch(model, opt, data, controller=bb.batch.Constant(16), **options)

    for _ in range(3):
        loop = loop_of(noise_from="sub_batches", statistics=True)
        train(loop, model, max_steps=1)
        del loop
    assert all(not p._backward_hooks for p in model.parameters())
    loop = loop_of(statistics=True)  # per-example norms, the default
    for step in loop.steps(max_steps=1):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        break  # before apply()
    del step, loop
    x, y = data[:64]
    nn.functional.cross_entropy(model(x), y).backward()  # the model's own layers again


def test_close_ends_the_loaders_persistent_workers():
    import multiprocessing

    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # (dynamo's import, made first)
    before = set(multiprocessing.active_children())
    model, loop = make_run(loader_options={"num_workers": 1, "persistent_workers": True})
    train(loop, model, max_steps=1)
    assert set(multiprocessing.active_children()) - before
    loop.close()  # the loop still referenced (a notebook's variable): its workers end now
    assert not set(multiprocessing.active_children()) - before


def test_a_sample_budget_of_whole_batches_takes_exactly_those_steps():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    model = nn.Linear(16, 4)
    loop = bb.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            controller=bb.batch.Constant(16), max_micro_batch=8)  # fmt: skip
    for step in loop.steps(max_samples=64):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()
    assert (loop.steps_taken, loop.samples) == (4, 64)
