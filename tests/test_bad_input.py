"""Bad inputs: one clear error naming the bad value, no traceback, no file changed."""

import hashlib
import re

import pytest
import torch
from torch import nn

import bigbatch as bb
from bigbatch import cli
from bigbatch.batch import GlobalBatchSampler, SimiGrad, micro_batch_sizes, shard_batch
from bigbatch.optim import AGVM, LAMB, LARS, MERIT, VRGD, create_optimizer
from bigbatch.stats import MicroBatchStatistics

SMALL = ["--quiet", "--set", "task=digits", "--set", "max_samples=2000", "--set", "eval_every=5"]


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    assert cli.main(["train", *SMALL, "--out", str(out)]) == 0
    return out


def snapshot(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


DIGITS_CONSTANT = ["--set", "task=digits", "--set", "batch.controller=constant"]
CLI_CASES = [
    (["train", "--set", "lr=-1"], "lr must be >= 0, got -1"),
    (["train", "--set", "lr=fast"], "fast"),
    (["train", "--set", "batch.target=2"], "batch.target must be in [-1, 1], got 2"),
    (["train", "--set", "agvm.momentum=1"], "agvm.momentum must be in [0, 1), got 1"),
    (["train", "--set", "statistics_every=auto"], "'auto': give a whole number of steps (0: by"),
    # rules the controller holds beyond the key's bounds: the key, then the argument's error
    (
        ["train", "--set", "batch.controller=seesaw", "--set", "batch.max_growth=0.5"],
        "batch.max_growth = 0.5: growth must be 0 (no cap) or at least 1, got 0.5",
    ),
    (
        ["train", "--set", "batch.controller=damped_simigrad", "--set", "batch.target=1"],
        "batch.target = 1.0: target must be in (0, 1), got 1.0",
    ),
    (  # a ramp's own rules: the key and the value as typed (the controller's words alone before)
        ["train", "--set", "batch.controller=ramp", "--set", "batch.ramp_points='5%:16'"],
        "batch.ramp_points = '5%:16': Ramp's points must start at 0",
    ),
    (["train", "--set", "batch.initial=-1"], "batch.initial must be a whole number >= 0, got -1"),
    (  # the smallest batch moved down to it: the key set named, not batch.min alone
        ["train", "--explain", "--set", "batch.initial=1"],
        "batch.min (1; from batch.initial (1), set past its default 8) is below 2",
    ),
    (["train", "--set", "batch.min=64", "--set", "batch.max=32"], "batch.min (64) is larger"),
    (  # the cool-down started where the warm-up ended: shorter than --explain said
        [
            "train",
            "--set",
            "schedule.kind=wsd",
            "--set",
            "schedule.warmup=0.5",
            "--set",
            "schedule.cooldown=0.6",
        ],
        "and a cool-down of 0.6 of 1,200,000 are longer than the run together",
    ),
    (
        ["train", "--set", "batch.initial=1", "--set", "batch.min=1"],
        "batch.min (1) is below 2: the noise statistics need two examples a step",
    ),
    (
        ["train", "--set", "batch.initial=8", "--set", "batch.min=32"],
        "batch.initial (8) is outside",
    ),
    (["train", "--set", "task=imagenet"], "'imagenet'"),
    (["train", "--set", "optimizer=adamax"], "'adamax'"),
    (["train", "--set", "batch.controller=pid"], "'pid'"),
    (["train", "--set", "batch.lr_scaling=cube"], "'cube'"),
    (["train", "--set", "batch.tagret=0.4"], "'batch.tagret'; did you mean 'batch.target'"),
    (["train", "--set", "oops"], "--set takes key=value"),
    (["train", "--set", "threads=-2"], "threads must be a whole number >= 0, got -2"),
    (["train", "--set", "seed=1.5"], "seed must be a whole number, got 1.5"),
    (["train", "--set", "agvm.enabled=maybe"], "maybe"),
    (["train", "--set", "asynchronous=true"], "which lamb cannot: use optimizer = 'adamw'"),
    (["train", "--set", "dist.ratio=0"], "dist.ratio must be in (0, 1], got 0"),
    (["train", "--set", "dist.compression=zip"], "'zip'"),
    (  # built as foreach, unsaid
        ["train", "--explain", "--set", "optimizer=sgd", "--set", "optimizer_impl=compiled"],
        "optimizer_impl = 'compiled': sgd is torch's, which takes 'foreach' or 'fused'",
    ),
    (  # torch's PowerSGD would silently have taken 2
        ["train", "--explain", "--set", "dist.compression=powersgd", "--set", "dist.warmup=1"],
        "dist.warmup = 1: torch's PowerSGD needs 2 or more uncompressed steps",
    ),
    (["train", "--set", "nonfinite=ignore"], "'ignore'"),
    (["train", "--set", "task=digits", "--set", "dist.compression=ef"], "--nproc 2 or more"),
    # refused inside each rank before: exit 4 or 2 by which rank the agent heard first
    (
        ["train", "--nproc", "2", "--set", "dist.strategy=fsdp", "--set", "dist.compression=ef"],
        "dist.compression compresses DDP's all-reduce; dist.strategy = 'fsdp' reduce-scatters",
    ),
    (
        ["train", "--explain", "--set", "dist.strategy=fsdp", "--set", "batch.similarity=split"],
        "batch.similarity = 'split' needs each half's gradient",
    ),
    # (checkpointed before the first step: a traceback on every rank, exit 4)
    (
        ["train", "--explain", "--set", "dist.strategy=fsdp", "--set", "optimizer=vr-lamb"],
        "optimizer = 'vr-lamb' keeps state that a checkpoint under dist.strategy = 'fsdp'",
    ),
    (
        ["train", "--explain", "--set", "dist.strategy=fsdp", "--set", "agvm.enabled=true"],
        "agvm.enabled keeps state that a checkpoint under dist.strategy = 'fsdp' cannot hold",
    ),
    (["train", "--config", "missing.toml"], "missing.toml' does not exist"),
    (["train", "--resume", "nowhere"], "'nowhere' is not a run directory"),
    (["train", "--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["report", "nowhere"], "'nowhere' does not exist"),
    (["compare", "--vary", "batch.target"], "--vary takes KEY=V1,V2"),
    (["compare", "--set", "task=digits"], "at least one --vary"),
    (
        [
            "train",
            "--set",
            "task=digits",
            "--set",
            "optimizer=vr-sgd",
            *["--set", "min_sub_batches=2"],
        ],
        "at least 4 sub-batches per step",
    ),
    (
        ["train", "--set", "agvm.rule=yolo"],
        "agvm.rule must be one of 'top', 'ends', 'detection', 'transformer', got 'yolo'",
    ),
    (  # a rule that fits no parameter of the model: the key was not named
        [
            "train",
            "--set",
            "task=digits",
            "--set",
            "agvm.enabled=true",
            *["--set", "agvm.rule=detection"],
        ],
        "agvm.rule = 'detection': parameter '0.weight' matches no module group",
    ),
    (["train", "--set", "vrgd.gamma=0"], "vrgd.gamma must be in (0, 1], got 0"),
    (["train", "--set", "batch.ramp_over=soon"], "batch.ramp_over = 'soon': not a duration"),
    (  # MNIST-1D's samples are not sequences: an interval in tokens cannot be measured
        ["train", "--set", "eval_every=1M tokens"],
        "eval_every = '1M tokens': 1000000 tokens counts tokens",
    ),
    # found by a fuzzing review (2026-11-28): each was a traceback or taken silently
    (["train", "--set", "seed=100000000000000"], "seed must be a whole number in [0, 4294967295]"),
    (["train", "--set", "agvm_start=3", "--set", "agvm.start=9"], "'agvm_start' is now"),
    (["train", "--out", ""], "--out is empty"),
    (["train", "--resume", " "], "--resume is empty"),
    (["train", "--config", ""], "--config is empty"),
    (["train", "--task", ""], "--task is empty"),
    (["report", ""], "DIR is empty"),
    (["federated", "--threads", "-1"], "--threads must be a whole number >= 0, got -1"),
    (["federated", "--clients", "50000"], "clients = 50000 is more than the 40000 training"),
    (["federated", "--min-sub-batches", "8"], "--min-sub-batches (8) exceeds local_batch (4)"),
    (["compare", "--vary", "seed=0,0"], "--vary seed: '0' is given twice"),
    # seeds 0-1 and 1-2: seed 1 trained twice, counted in two arms
    (["compare", "--vary", "seed=0,1", "--seeds", "2"], "seeds = 2 beside arms that set the seed"),
    (["compare", "--vary", "seed=0,1", "--trials", "3"], "--trials sets the rate study of --tune"),
    # on the data, before any run trains (compare trained its first arms, and left a folder)
    (
        ["compare", *DIGITS_CONSTANT, "--vary", "batch.initial=8,1500", "--out", "c"],
        "batch.initial = 1500 is larger than the training set (1,437 samples)",
    ),
    (
        ["tune", *DIGITS_CONSTANT, "--set", "batch.initial=1500", "--out", "t"],
        "batch.initial = 1500 is larger than the training set (1,437 samples)",
    ),
    (["compare", "--vary", "seed=0", "--search-seed", "3"], "--search-seed sets the rate study"),
    (
        ["compare", "--vary", "seed=0,1", "--lr-grid", "0.5,2", "--tune", "--widen", "2"],
        "--widen judges a grid of",
    ),
    (
        ["compare", "--vary", "seed=0,1", "--lr-grid", "0.5,2", "--tune", "--prefixes", "0.5"],
        "--prefixes judges a grid of trained rates, which --tune has not",
    ),
    (
        ["compare", "--arm", "r:batch.controller=ramp,batch.ramp_points=0:16, 25%:32"],
        "--arm r: '25%:32' is not KEY=V (--arm splits at commas",
    ),
    # the bounds are checked when a run is planned: every command plans before it writes
    (
        ["compare", "--set", "batch.min=32", "--vary", "batch.initial=8,64", "--out", "c"],
        "batch.initial (8) is outside",
    ),
    (
        ["tune", "--set", "batch.min=32", "--search", "batch.initial=8:64", "--out", "t"],
        "batch.initial (8) is outside",
    ),
    (["critical-batch", "--set", "batch.max=32", "--out", "k"], "batch.initial (64) is outside"),
    (["train", "--nproc", "2", "--set", "batch.min=64", "--set", "batch.max=32"], "is larger"),
    (["compare", "--vary", "seed=0", "--lr-grid", "1,,2"], "--lr-grid takes comma-separated"),
    (
        [
            "train",
            "--set",
            "batch.controller=ramp",
            "--set",
            "batch.ramp_points=0:16,50%:32,25%:64",
        ],
        "Ramp's points must be in order, each later than the one before",
    ),
]


@pytest.mark.parametrize("args, message", CLI_CASES)
def test_cli(args, message, capsys, tmp_path, monkeypatch, existing_run):
    monkeypatch.chdir(tmp_path)
    before = snapshot(existing_run)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("bigbatch: error:") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert snapshot(existing_run) == before
    assert not list(tmp_path.iterdir())  # nothing written: no run, study or launcher folder


def test_running_out_of_memory_is_one_line_and_exit_2(capsys):
    # what torch raises when the CPU allocator is refused (a model far too wide)
    refused = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1999999999980 bytes. Error code 12"
    )
    assert cli._reported(refused) == 2
    err = capsys.readouterr().err
    assert err.startswith("bigbatch: error: out of memory") and "model.width" in err, err
    assert err.count("\n") == 1
    assert cli._reported(RuntimeError("something else")) is None  # a bug keeps its traceback


def test_cli_existing_run_and_resume_options(existing_run, capsys):
    before = snapshot(existing_run)
    assert cli.main(["train", *SMALL, "--out", str(existing_run)]) == 2
    assert "already exists" in capsys.readouterr().err
    # (a federated run has no --resume to point to)
    assert cli.main(["federated", "--out", str(existing_run)]) == 2
    assert capsys.readouterr().err.rstrip().endswith("runs are never overwritten")
    assert cli.main(["train", "--resume", str(existing_run), "--set", "lr=1"]) == 2
    assert "drop --config/--task/--set/--out" in capsys.readouterr().err
    assert snapshot(existing_run) == before


def test_cli_corrupted_checkpoint_changes_nothing(existing_run, capsys, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in existing_run.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / "checkpoint.pt").write_bytes(b"\x80\x02garbage")
    (copy / "checkpoint.prev.pt").write_bytes(b"\x80\x02garbage too")  # no fallback
    before = snapshot(copy)
    assert cli.main(["train", "--quiet", "--resume", str(copy)]) == 2
    assert "truncated or corrupted" in capsys.readouterr().err
    assert snapshot(copy) == before


def model():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def data():
    return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


API_CASES = [
    (lambda: LAMB(model().parameters(), lr=-1.0), ValueError, "-1.0"),
    (lambda: LAMB(model().parameters(), betas=(0.9, 1.0)), ValueError, "1.0"),
    (lambda: LARS(model().parameters(), lr=0.1, momentum=-0.5), ValueError, "-0.5"),
    (lambda: MERIT(model().parameters(), impl="fast"), ValueError, "'fast'"),
    (lambda: create_optimizer(model(), "lamb", lr=1e-3, beta=0.9), ValueError, "'beta'"),
    (lambda: create_optimizer(model(), "lamd", lr=1e-3), ValueError, "'lamd'"),
    (lambda: VRGD(torch.optim.SGD(model().parameters(), lr=0.1), gamma=0), ValueError, "0"),
    (lambda: AGVM(torch.optim.SGD(model().parameters(), lr=0.1), interval=0), ValueError, "0"),
    (lambda: SimiGrad(target=1.5), ValueError, "1.5"),
    (lambda: bb.StepOptions(statistics_every="often"), ValueError, "or 'auto', got 'often'"),
    (lambda: micro_batch_sizes(3, max_micro_batch=8, min_sub_batches=4), ValueError, "3"),
    (lambda: shard_batch([1, 2, 3], 5, 2), ValueError, "5"),
    (lambda: GlobalBatchSampler(100, 0, micro_batches=2), ValueError, "0"),
    (lambda: MicroBatchStatistics([list(model().parameters())], ema_beta=1.0), ValueError, "1.0"),
    (
        lambda: loop(noise_from="sub_batches", min_sub_batches=1),
        ValueError,
        "at least 2 to measure statistics on one process (noise_from = 'sub_batches'), got 1",
    ),
    (
        lambda: loop(lr_scaling="cube"),
        ValueError,
        "'cube'",
    ),
    (
        lambda: loop(
            lambda net: create_optimizer(net, "vr-sgd", lr=0.1),
            controller=bb.batch.Constant(16),
            min_sub_batches=2,
        ),
        ValueError,
        "at least 4 sub-batches",
    ),
    # found by a fuzzing review of the API (2026-11-28): each was taken silently or failed late
    (
        lambda: bb.AdaptiveBatch(model(), torch.optim.SGD(model().parameters(), lr=0.1), data()),
        ValueError,
        "the optimizer holds none of the model's parameters",
    ),
    (lambda: loop(controller=bb.batch.BatchWarmup), TypeError, "controller must be a controller"),
    (lambda: loop(controller="simigrad"), TypeError, "got 'simigrad'"),
    (
        lambda: (lambda net: bb.AdaptiveBatch(net, torch.optim.SGD(net.parameters()), None))(
            model()
        ),
        TypeError,
        "dataset must be a map-style dataset (with __getitem__ and __len__) or an Iterable",
    ),
    (lambda: loop(weight_fn=3), TypeError, "weight_fn must be a function"),
    (lambda: loop(scaler="x"), TypeError, "scaler must be a torch.amp.GradScaler or None, got"),
    (  # a torch error from deep in a norm at the first step (review, 2026-11-30)
        lambda: (lambda net: bb.AdaptiveBatch(net, torch.optim.SGD(net.parameters()), data()))(
            nn.Sequential(nn.Embedding(4, 3, sparse=True))
        ),
        ValueError,
        "module '0' (Embedding) makes sparse gradients",
    ),
    # a torch error from a norm at the first step; LBFGS's missing closure inside apply()
    (
        lambda: (lambda net: bb.AdaptiveBatch(net, torch.optim.SGD(net.parameters()), data()))(
            nn.Linear(4, 2, dtype=torch.complex64)
        ),
        ValueError,
        "parameter 'weight' is complex (torch.complex64)",
    ),
    (
        lambda: loop(lambda net: torch.optim.LBFGS(net.parameters())),
        TypeError,
        "LBFGS.step needs a closure",
    ),
    (lambda: loop(seed="0"), ValueError, "seed must be a whole number, got '0'"),
    (lambda: loop(loader_options={"in_order": False}), TypeError, "['in_order']: the loop sets"),
    (lambda: loop(seed=2**40), ValueError, "seed must be a whole number in [0, 4294967295]"),
    (lambda: loop(shuffle="no"), ValueError, "shuffle must be true or false, got 'no'"),
    # ignored without workers (the loop reads a micro-batch itself), where torch refuses it
    (
        lambda: loop(loader_options={"prefetch_factor": 2}),
        ValueError,
        "loader_options: prefetch_factor option could only be specified in multiprocessing",
    ),
    (lambda: loop(loader_options={"timeout": -1}), ValueError, "loader_options: timeout option"),
    (lambda: next(loop().steps(max_steps=1.5)), ValueError, "max_steps must be a whole number"),
    (lambda: next(loop().steps(max_samples=-5)), ValueError, "max_samples must be a whole"),
    (lambda: bb.batch.lr.warmup_poly(32, power=-1.0), ValueError, "power must be > 0, got -1.0"),
    (lambda: bb.batch.lr.warmup_linear(32, final=-1), ValueError, "final must be >= 0, got -1"),
    (lambda: bb.duration.Duration.parse("1e400"), ValueError, "'1e400' is too long to count"),
    (lambda: next(loop().steps(max_steps=1)).backward(1.0), TypeError, "the micro-batch's loss"),
    (lambda: bb.batch.lr.lr_factor("linear", 16, 0), ValueError, "base_batch_size must be a"),
    (lambda: stats(gsnr="yes"), ValueError, "gsnr must be true or false, got 'yes'"),
    (lambda: stats(dataset_size=0), ValueError, "dataset_size must be a whole number >= 1"),
    (lambda: stats(per_example=3), TypeError, "per_example must be the trained nn.Module"),
    (
        lambda: bb.AdaptiveBatch(model(), "sgd", data()),
        TypeError,
        "optimizer must be a torch optimizer built from the model's parameters",
    ),
    (lambda: bb.batch.LossSlope(bins=2.7), ValueError, "bins must be a whole number, got 2.7"),
    (lambda: bb.batch.lr.warmup_stable_decay(100, final=-1), ValueError, "final must be >= 0"),
    (
        lambda: bb.batch.lr.scaled_lr(
            torch.optim.SGD(model().parameters(), lr=0.1), -1.0
        ).__enter__(),
        ValueError,
        "factors must be >= 0, got -1.0",
    ),
    (lambda: bb.optim.Recipe(0.01, schedule="cosin"), ValueError, "did you mean 'cosine'"),
    (lambda: bb.optim.Recipe(-1.0), ValueError, "weight_decay must be >= 0, got -1.0"),
    # torch's own optimizers took these, or failed with an IndexError
    (lambda: create_optimizer(model(), "sgd", lr=float("nan")), ValueError, "lr must be finite"),
    (
        lambda: create_optimizer(model(), "sgd", lr=0.1, momentum=1.5),
        ValueError,
        "momentum must be in [0, 1), got 1.5",
    ),
    (
        lambda: create_optimizer(model(), "adamw", lr=0.1, betas=(0.9,)),
        ValueError,
        "betas must be a pair (beta1, beta2), got (0.9,)",
    ),
    # a position past the end made take() wait forever; another sampler's state: a KeyError
    (
        lambda: bb.batch.VariableBatchSampler(10).load_state_dict(
            {**bb.batch.VariableBatchSampler(10).state_dict(), "position": 50}
        ),
        ValueError,
        "position must be a whole number in [0, 10], got 50",
    ),
    (
        lambda: bb.batch.VariableBatchSampler(10).load_state_dict(
            GlobalBatchSampler(10, 4, micro_batches=2).state_dict()
        ),
        ValueError,
        "not a VariableBatchSampler state: it lacks seed",
    ),
    # a rank past the world drew nothing, forever; a budget of 0 or 2.5 was taken
    (lambda: bb.parallel.World(rank=3, size=2), ValueError, "rank must be in [0, 2), got 3"),
    (lambda: bb.parallel.World(size=0), ValueError, "size must be a whole number >= 1, got 0"),
    (  # an AttributeError (process_group) before
        lambda: bb.parallel.CompressionState(model(), "ef"),
        ValueError,
        "CompressionState needs the DistributedDataParallel model, got Sequential",
    ),
    (
        lambda: GlobalBatchSampler(10, 4, micro_batches=2, world_size=2, rank=2),
        ValueError,
        "rank must be in [0, 2), got 2",
    ),
    (
        lambda: GlobalBatchSampler(10, 4, micro_batches=2, max_samples=2.5),
        ValueError,
        "max_samples must be a whole number, got 2.5",
    ),
    (lambda: bb.batch.plan_step(list(range(8)), count=0), ValueError, "count must be a whole"),
    (lambda: bb.batch.Ramp(points=[(0, 16, 3)]), ValueError, "a ramp point must be a pair"),
    (lambda: bb.batch.Ramp(points=[16]), ValueError, "a ramp point must be a pair (WHEN, BATCH)"),
    (lambda: bb.batch.Ramp(points=16), ValueError, "points must be a list of (WHEN, BATCH)"),
    (
        lambda: AGVM(torch.optim.SGD(model().parameters(), lr=0.1), bounds=(1.0,)),
        ValueError,
        "bounds must be a pair (low, high), got (1.0,)",
    ),
]


def stats(**options):
    return MicroBatchStatistics([list(model().parameters())], **options)


def loop(make_optimizer=None, **options):
    """A loop of a fresh model and an optimizer of its parameters (SGD by default)."""
    net = model()
    optimizer = (make_optimizer or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))(net)
    return bb.AdaptiveBatch(net, optimizer, data(), **options)


@pytest.mark.parametrize("build, error, message", API_CASES)
def test_api(build, error, message):
    with pytest.raises(error, match=re.escape(message)):
        build()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"schedule": lambda samples: float("nan")}, "the schedule gave nan at 0 samples"),
        ({"schedule": lambda samples: -1.0}, "the schedule gave -1.0 at 0 samples"),
        ({"schedule": lambda samples: None}, "the schedule gave None"),
        # a weight of 0 never filled the batch: the first step hung
        ({"weight_fn": lambda index: 0}, "must be a whole number >= 1, got 0"),
        ({"weight_fn": lambda index: 1.5}, "must be a whole number >= 1, got 1.5"),
    ],
)
def test_a_bad_value_of_a_users_function_stops_the_first_step(options, message):
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    run = bb.AdaptiveBatch(net, torch.optim.SGD(net.parameters(), lr=0.1), data(), **options)
    with pytest.raises(ValueError, match=re.escape(message)):
        for step in run.steps(max_steps=1):
            for x, y in step.micro_batches():
                step.backward(nn.functional.cross_entropy(net(x), y))
            step.apply()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


@pytest.mark.parametrize(
    "controller", [SimiGrad(), bb.batch.Constant(16), bb.batch.Ramp(16, 32, over=1000)]
)
def test_a_state_of_another_controller_is_refused_before_anything_is_loaded(controller):
    # Constant and Ramp keep no state: they took any controller's silently
    saved = loop(controller=bb.batch.BatchWarmup()).state_dict()
    other = loop(controller=controller)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"saved controller state .*does not fit"):
        other.load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())
    with pytest.raises(ValueError, match="it lacks model, optimizer, optimizer_class, source"):
        other.load_state_dict({})


def test_the_catalogue_is_long_enough():
    assert len(CLI_CASES) + 3 + len(API_CASES) >= 30


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(64):
            yield torch.full((4,), float(i)), i % 2


@pytest.mark.parametrize(
    "saved_on, loaded_on, message",
    [
        # the model and optimizer were loaded before the source refused: a half-loaded loop
        (data, lambda: torch.utils.data.TensorDataset(torch.randn(60, 4), torch.zeros(60).long()),
         "the checkpoint's sampler covered 64 samples, this dataset has 60"),
        # a bare KeyError, the model loaded
        (data, _Stream, "the saved source is not an iterable dataset's (it lacks consumed)"),
        (_Stream, data, "the saved source is not a map-style dataset's (it lacks sampler"),
    ],
)  # fmt: skip
def test_a_source_state_that_does_not_fit_is_refused_before_anything_is_loaded(
    saved_on, loaded_on, message
):
    first, net = model(), model()
    saved = bb.AdaptiveBatch(first, torch.optim.SGD(first.parameters(), lr=0.1), saved_on())
    other = bb.AdaptiveBatch(net, torch.optim.SGD(net.parameters(), lr=0.1), loaded_on())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        other.load_state_dict(saved.state_dict())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_an_optimizer_state_that_does_not_fit_is_refused_before_anything_is_loaded():
    """torch's own check came after the model was loaded: a half-loaded loop."""
    saved = loop().state_dict()
    net = model()
    groups = [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.01}]
    other = bb.AdaptiveBatch(net, torch.optim.SGD(groups, lr=0.1), data())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("groups of [4] parameters where the loop's")):
        other.load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def _three_classes():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    return bb.AdaptiveBatch(net, LARS(net.parameters(), lr=0.1), data())


@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")
@pytest.mark.parametrize(
    "saving, message",
    [
        # torch's load takes any optimizer's state by position: LAMB's moments ran into
        # LARS's step as a KeyError; a VRGD state into an AGVM loop, after the model loaded
        (lambda: loop(lambda m: LAMB(m.parameters())),
         "the saved optimizer state is LAMB's where the loop's optimizer is LARS"),
        (lambda: loop(lambda m: create_optimizer(m, "vr-lars", lr=0.1)), "is VRGD(LARS)'s"),
        # another head: torch copied the layers that fit, then raised
        (_three_classes, "the saved model state does not fit the loop's model (2 entries "
         "missing, extra or of another shape: 2.weight, 2.bias)"),
    ],
)  # fmt: skip
def test_a_state_of_another_optimizer_or_model_is_refused_before_anything_is_loaded(
    saving, message
):
    other = loop(lambda m: LARS(m.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        other.load_state_dict(saving().state_dict())
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())
