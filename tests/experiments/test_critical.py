"""The critical batch measured by branching: the choice rule, exact branches, the command."""

import json
import math

import pytest
import torch

from bigbatch import cli
from bigbatch.batch.lr import lr_factor
from bigbatch.experiments import critical
from bigbatch.experiments.build import build
from bigbatch.experiments.config import ConfigError, resolve
from bigbatch.experiments.options import CriticalSettings
from bigbatch.experiments.plan import make_controller, plan_run

from .test_cli import rows

SMALL = {"task": "digits", "max_samples": 4000, "model.width": 16, "eval_every": 5, "threads": 1}
ONE_POINT = CriticalSettings(batches=(16, 32), points=(0.25,), branch_samples=640)


def test_the_critical_batch_is_the_largest_within_the_tolerance():
    losses = {16: 1.00, 32: 1.005, 64: 1.02, 128: 1.009}
    assert critical.critical_batch(losses, 0.01) == 128  # not monotone: the largest passing
    assert critical.critical_batch(losses, 0.005) == 32  # the edge itself passes
    assert critical.critical_batch(losses, 0.0) == 16  # the reference always does
    assert critical.critical_batch({16: 1.0, 32: math.nan}, 1.0) == 16  # a diverged branch fails
    # a diverged reference: none passes, and the answer is the smallest batch, not the largest
    assert critical.critical_batch({16: math.nan, 32: 1.0, 64: 1.0}, 0.01) == 16


@pytest.mark.parametrize(
    "batches, points, message",
    [
        ((64,), (0.5,), "two or more distinct"),
        ((32, 32), (0.5,), "two or more distinct"),
        ((0, 64), (0.5,), "batches must be a whole number >= 1, got 0"),
        ((32, 64), (1.5,), r"points must be in \(0, 1\), got 1.5"),
        ((32, 64), (), "points takes one fraction"),
        ((32, 64), (0.5, 0.5), r"points needs distinct fractions, got \[0.5, 0.5\]"),
    ],
)
def test_bad_options_are_named(batches, points, message):
    with pytest.raises(ConfigError, match=message):
        CriticalSettings(batches=batches, points=points)


@pytest.mark.parametrize(
    "settings, message",
    [
        # the 1,024 branch would run 1,024 samples past 3,808 of 4,000: cut, it passes falsely
        (
            CriticalSettings(batches=(16, 1024), points=(0.95,)),
            r"point 0.95 leaves 192 samples of max_samples \(4,000\) for branches of 1,024",
        ),
        (
            CriticalSettings(batches=(16, 32), points=(0.5,), branch_samples=100),
            "branches of 100 samples are not whole steps at batch 16: give --branch-samples a "
            "multiple of 32",
        ),
        # no batches: the config's (8) and its doublings up to 32 times it, 256
        (
            CriticalSettings(points=(0.5,), branch_samples=100),
            "not whole steps at batch 8: give --branch-samples a multiple of 256",
        ),
        # no branch_samples: 5% of the budget (200) rounded up to a multiple of 32
        (
            CriticalSettings(batches=(16, 32), points=(0.95,)),
            r"point 0.95 leaves 192 samples of max_samples \(4,000\) for branches of 224:",
        ),
    ],
)
def test_branches_of_unequal_samples_are_refused_before_any_training(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        critical.measure(resolve(SMALL), tmp_path / "m", settings, quiet=True)
    assert not (tmp_path / "m").exists()


def test_branches_that_end_at_the_budget_exactly_are_accepted():
    critical._check_branches_fit([16, 32], [0.5], 4096, 2048)  # 2,048 + 2,048 of 4,096: fits


def test_a_branch_batch_larger_than_the_training_set_is_refused_before_any_training(tmp_path):
    # (its branch's own run refused it, after the base run and the smaller branches)
    settings = CriticalSettings(batches=(16, 2048), points=(0.1,), branch_samples=4096)
    config = resolve({**SMALL, "max_samples": 40_000})
    with pytest.raises(ConfigError, match=r"batch.initial = 2048 is larger than the training"):
        critical.measure(config, tmp_path / "m", settings, quiet=True)
    assert not (tmp_path / "m").exists()


def test_a_branch_at_the_base_batch_continues_the_base_run_exactly(tmp_path):
    config = resolve(SMALL)
    threads = torch.get_num_threads()
    try:
        points = critical.measure(config, tmp_path, ONE_POINT, quiet=True)
        assert torch.get_num_threads() == 1  # the config's threads, as `bigbatch train`
    finally:
        torch.set_num_threads(threads)
    (point,) = points
    # the same run trained straight through to the branch's end
    plain = critical._config(config, 16, 16, "auto")
    problem, loop, _ = build(plain)
    for step in loop.steps(max_samples=point.samples + 640):
        for batch in step.micro_batches():
            step.backward(problem.loss(loop.model, batch))
        step.apply()
    assert point.losses[16] == pytest.approx(problem.evaluate(problem.model)["eval_loss"], abs=1e-6)
    assert point.critical_batch in (16, 32) and math.isfinite(point.noise_scale)
    # beside it, what the default controller (BatchWarmup) would decide on, from the same steps
    replay = make_controller(plan_run(config))
    for line in (tmp_path / "base" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        replay.next(row, replay.max, row["samples"])
        if row["samples"] >= point.samples:
            break
    assert point.controller_estimate == pytest.approx(replay.critical_batch())
    assert math.isfinite(point.controller_estimate)
    text = (tmp_path / "critical_batch.json").read_text()
    saved = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in strict JSON"))
    assert saved["points"][0]["losses"]["16"] == point.losses[16]
    assert saved["lr_rule"] == "sqrt"  # auto, resolved: LAMB's family rule on digits
    assert (tmp_path / "critical_batch.png").is_file()
    # each branch is a run of its own, paused where the branch ends
    assert sorted(p.name for p in tmp_path.glob("branch-*")) == ["branch-0-16", "branch-0-32"]
    assert rows(tmp_path / "branch-0-32")[-1]["samples"] == point.samples + 640
    # run again, it continues what is there: nothing is trained twice
    again = critical.measure(config, tmp_path, ONE_POINT, quiet=True)
    assert again == points
    # saved before a config key was added: refused, not continued (no compatibility before 1.0)
    saved = (tmp_path / "plan.json").read_text()
    plan = json.loads(saved)
    del plan["config"]["keep_freed_memory"]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(ConfigError, match="earlier bigbatch, before the key 'keep_freed_memory'"):
        critical.measure(config, tmp_path, ONE_POINT, quiet=True)
    (tmp_path / "plan.json").write_text(saved)
    other_settings = r"other settings \(batches = \[16, 32\] there, \[16, 64\] now\)"
    with pytest.raises(ConfigError, match=other_settings):
        other = CriticalSettings(batches=(16, 64), points=(0.25,))
        critical.measure(config, tmp_path, other, quiet=True)


def test_a_measurement_stopped_by_a_signal_continues_to_the_same_points(tmp_path, monkeypatch):
    from bigbatch.experiments import runner
    from bigbatch.experiments.signals import Stopped

    config = resolve(SMALL)
    options = CriticalSettings(batches=(16, 32), points=(0.25, 0.5), branch_samples=320)
    straight = critical.measure(config, tmp_path / "straight", options, quiet=True)
    train, calls = runner.train, []

    def stopped_at_the_third_run(config, out, **kwargs):
        calls.append(out.name)
        if len(calls) == 3:  # the first branch, after the base run: SIGTERM
            raise Stopped(15, 7, str(out))
        return train(config, out, **kwargs)

    monkeypatch.setattr(runner, "train", stopped_at_the_third_run)
    with pytest.raises(Stopped, match="run the same command again"):
        critical.measure(config, tmp_path / "stopped", options, quiet=True)
    monkeypatch.setattr(runner, "train", train)
    assert critical.measure(config, tmp_path / "stopped", options, quiet=True) == straight
    # stopped after its first point, the report shows that point and says one remains
    data = json.loads((tmp_path / "straight" / "critical_batch.json").read_text())
    data["points"] = data["points"][:1]
    (tmp_path / "straight" / "critical_batch.json").write_text(json.dumps(data))
    assert cli.main(["report", str(tmp_path / "straight")]) == 0
    text = (tmp_path / "straight" / "critical_batch.md").read_text()
    assert "1 of 2 points measured" in text and "| 0.25 |" in text and "| 0.5 |" not in text


def test_a_diverged_branch_fails_the_tolerance_and_the_measurement_goes_on(tmp_path, monkeypatch):
    """A branch past stability is a result (its loss NaN, beyond any tolerance), as in a
    sweep; it stopped the measurement, and run again the reused summary crashed it."""
    from bigbatch.experiments import runner

    train = runner.train

    def diverging_at_32(config, out, **kwargs):
        if out.name != "branch-0-32":
            return train(config, out, **kwargs)
        out.mkdir(parents=True, exist_ok=True)  # what the runner leaves: a summary, no score
        summary = {"ended": "skip_limit", "final_eval_loss": None, "diverged": "too many"}
        (out / "summary.json").write_text(json.dumps(summary))
        raise runner.TooManySkippedError(10, 20, 0.25)

    monkeypatch.setattr(runner, "train", diverging_at_32)
    (point,) = critical.measure(resolve(SMALL), tmp_path, ONE_POINT, quiet=True)
    assert math.isnan(point.losses[32]) and point.critical_batch == 16
    (again,) = critical.measure(resolve(SMALL), tmp_path, ONE_POINT, quiet=True)  # reused
    assert math.isnan(again.losses[32]) and again.critical_batch == 16
    # the file is strict JSON (NaN written as null), and the report shows it as a dash
    text = (tmp_path / "critical_batch.json").read_text()
    saved = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in strict JSON"))
    assert saved["points"][0]["losses"]["32"] is None
    assert "| **≤ 16** |" in (tmp_path / "critical_batch.md").read_text()
    assert "| +0.0000 | — |" in (tmp_path / "critical_batch.md").read_text()


def test_a_branch_whose_steps_were_skipped_is_a_diverged_one(tmp_path, monkeypatch):
    """The run's skip limit counts the base's steps before the snapshot too: a branch of
    NaN steps stayed under it, scored the snapshot's own loss and passed the tolerance."""
    out = tmp_path / "branch"
    out.mkdir()
    steps = [{"step": i, "loss": math.nan, "skipped": 1.0} for i in range(1, 11)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    record = {"paused": True, "eval_loss": 1.52}  # the snapshot's: nothing trained
    monkeypatch.setattr(critical.runner, "train_or_reuse", lambda *a, **k: record)
    assert math.isnan(critical._branch(resolve(SMALL), out, tmp_path / "snapshot", 1280))
    steps[0] = {"step": 1, "loss": 1.5}  # 9 of 10 skipped: still past skip_limit (0.25)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert math.isnan(critical._branch(resolve(SMALL), out, tmp_path / "snapshot", 1280))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.5}) + "\n")
    assert critical._branch(resolve(SMALL), out, tmp_path / "snapshot", 1280) == 1.52
    none_skipped = resolve(SMALL, {"skip_limit": 0.0})  # within a limit of 0: a score
    assert critical._branch(none_skipped, out, tmp_path / "snapshot", 1280) == 1.52


def test_a_branch_below_the_configs_smallest_batch_lowers_it():
    config = resolve({**SMALL, "batch.initial": 64, "batch.min": 64})
    assert critical._config(config, 16, 16, "auto")["batch.min"] == 16
    assert critical._config(config, 128, 16, "auto")["batch.min"] == 64


def test_the_report_shows_each_branch_loss_minus_the_reference(tmp_path):
    from bigbatch.experiments.report.critical_batch import render

    (tmp_path / "plan.json").write_text(json.dumps({"points": [0.5]}))
    point = {"fraction": 0.5, "samples": 2048, "schedule": 1.0, "losses": {"16": 1.0, "32": 1.2},
             "critical_batch": 16, "noise_scale": 10.0, "noise_scale_low": 5.0,
             "noise_scale_high": 20.0}  # fmt: skip
    data = {"config": {"task": "digits"}, "batches": [16, 32], "points": [point],
            "branch_samples": 640, "lr_rule": "sqrt", "tolerance": 0.01}  # fmt: skip
    (tmp_path / "critical_batch.json").write_text(json.dumps(data))
    text = render(tmp_path).read_text()
    assert "| 1.0000 | **≤ 16** |" in text and text.count("| +0.0000 | +0.2000 |") == 1
    assert "points measured" not in text  # every point planned is there: no "1 of 1"


def test_no_run_of_a_measurement_ends_early_at_the_target():
    config = resolve({**SMALL, "stop_at_target": True})
    assert not any(critical._config(config, b, 16, "auto")["stop_at_target"] for b in (16, 32))


@pytest.mark.parametrize(
    "optimizer, rule, at_16, at_256",
    [("lamb", "sqrt", 0.008, 0.032), ("lars", "none", 4.0, 4.0), ("sgd", "sqrt", 0.158, 0.632)],
)
def test_branches_follow_the_rule_the_task_measured_for_the_optimizer(
    optimizer, rule, at_16, at_256
):
    config = resolve({"task": "text", "optimizer": optimizer})
    base, branch = (critical._config(config, b, 16, "auto") for b in (16, 256))
    assert (base["batch.lr_scaling"], branch["batch.lr_scaling"]) == (rule, rule)
    # the config's rate is the one at the base batch; the rule carries it to the branch's
    trained = branch["lr"] * lr_factor(rule, 256, branch["batch.base"])
    assert (base["lr"], trained) == (pytest.approx(at_16), pytest.approx(at_256))


def test_the_command_writes_its_report_and_refuses_bad_options(tmp_path, capsys):
    out = tmp_path / "crit"
    args = ["critical-batch", "--quiet", "--out", out]
    for key, value in SMALL.items():
        args += ["--set", f"{key}={value}"]
    code = cli.main([str(a) for a in [*args, "--batches", "16,32", "--points", "0.5"]])
    assert code == 0
    assert "| 0.5 |" in (out / "critical_batch.md").read_text()
    # bigbatch report re-renders it, as it does a run's or a comparison's
    (out / "critical_batch.md").unlink()
    assert cli.main(["report", str(out)]) == 0
    assert "| 0.5 |" in (out / "critical_batch.md").read_text()
    assert cli.main(["critical-batch", "--batches", "16,x", "--out", str(tmp_path / "x")]) == 2
    assert "--batches takes comma-separated whole numbers, got '16,x'" in capsys.readouterr().err
    assert cli.main(["critical-batch", "--points", "2", "--out", str(tmp_path / "y")]) == 2
    assert "points must be in (0, 1), got 2.0" in capsys.readouterr().err
    # the same options from the file's [critical] table, a flag overriding one of them
    (tmp_path / "study.toml").write_text("[critical]\npoints = [0.5]\nbatches = [8, 16]\n")
    config = ["--config", str(tmp_path / "study.toml"), "--batches", "16,x"]
    assert cli.main(["critical-batch", *config, "--out", str(tmp_path / "z")]) == 2
    assert "--batches takes comma-separated whole numbers" in capsys.readouterr().err
    (tmp_path / "study.toml").write_text("[critical]\npoint = [0.5]\n")
    assert cli.main(["critical-batch", *config[:2], "--out", str(tmp_path / "z")]) == 2
    assert "unknown option 'point' in [critical]" in capsys.readouterr().err
