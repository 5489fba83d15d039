"""``bigbatch tune``: the search, its pruning and budget, its outputs, resume and bad input.

Most tests train with a stand-in whose validation curve is a known function of
the rate (best at 0.004), so the search's choices are checked in seconds; the
resume test kills a real ``bigbatch tune`` process and compares it with one
never killed.
"""

import dataclasses
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

pytest.importorskip("optuna")

from bigbatch import cli
from bigbatch.experiments import runner
from bigbatch.experiments.config import ConfigError, load_toml, resolve, to_toml
from bigbatch.experiments.plan import plan_run
from bigbatch.experiments.tasks import TASKS
from bigbatch.experiments.tune import (
    Dimension,
    TuneSettings,
    default_space,
    latin_hypercube,
    parse_space,
    render_report,
    trial_config,
    tune,
)

from .test_cli import rows

BASE = {"task": "digits", "batch.controller": "constant", "max_samples": 27_000}
BEST_LR = 0.004
SPACE = [Dimension("lr", 0.0005, 0.032, log=True)]  # 7 points of a ×2 grid


def curve(lr: float, fraction: float) -> float:
    """Accuracy after ``fraction`` of the run: rises with training, falls with the squared
    log-distance of the rate from the best (a larger rate learns faster early on)."""
    distance = math.log(lr / BEST_LR)
    return 0.98 - 0.02 * distance**2 - 0.02 * (1 - fraction) * math.exp(-distance)


class FakeRuns:
    """runner.train replaced by :func:`curve`: pauses at ``until`` and resumes from where it
    paused (a ``checkpoint.pt`` holding its samples), diverges above ``diverge_above``."""

    def __init__(self, loss: bool = False, diverge_above: float = math.inf) -> None:
        self.calls: list[tuple[float, int, int | None]] = []  # (lr, from samples, until)
        self.trained = 0
        self.loss, self.diverge_above = loss, diverge_above

    def __call__(self, config, out, *, resume=False, quiet=False, until=None):
        total = config["max_samples"]
        start = int((out / "checkpoint.pt").read_text()) if resume else 0
        assert resume == (out / "checkpoint.pt").exists()
        out.mkdir(parents=True, exist_ok=True)
        end = total if until is None or until >= total else until
        self.calls.append((config["lr"], start, until))
        self.trained += end - start
        if config["lr"] > self.diverge_above:
            raise runner.TooManySkippedError(10, 20, 0.25)
        (out / "checkpoint.pt").write_text(str(end))
        accuracy = curve(config["lr"], end / total)
        scores = {"eval_accuracy": accuracy, "eval_loss": 1 - accuracy}
        if end < total:
            return {"paused": True, "samples": end, **scores}
        summary = {
            "target_metric": "eval_loss" if self.loss else "eval_accuracy",
            "final_accuracy": accuracy,
            "best_accuracy": accuracy,
            "final_eval_loss": 1 - accuracy,
            "best_eval_loss": 1 - accuracy,
            "samples": total,
        }
        (out / "summary.json").write_text(json.dumps(summary))
        return summary


@pytest.fixture
def fake(monkeypatch):
    runs = FakeRuns()
    monkeypatch.setattr(runner, "train", runs)
    return runs


def test_successive_halving_keeps_the_best_and_continues_them_from_their_pause(fake, tmp_path):
    result = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=9))
    # the warm-up is 5%: 9 trials to 1/9 of the run (not 1/27: inside two warm-ups), 3 to
    # 1/3, one to the end
    assert [t["state"] for t in result.trials].count("complete") == 1
    assert [t["state"] for t in result.trials].count("pruned") == 8
    assert abs(math.log2(result.best["lr"] / BEST_LR)) < 0.5  # the closest of the 9 points
    # every survivor went on from where it paused: no sample trained twice
    starts = sorted((lr, start) for lr, start, _ in fake.calls)
    assert len(starts) == len(set(starts)) == 9 + 3 + 1
    assert min(until for _, _, until in fake.calls if until) == 3000  # 1/9 of 27,000
    assert result.samples == fake.trained
    bracket = TuneSettings(trials=9).bracket_runs(warmup=0.05)
    assert result.samples == pytest.approx(bracket * 27_000, abs=2)
    assert result.grid_samples == 7 * 27_000 and result.cost == pytest.approx(7 / 21, abs=1e-3)


def test_a_stop_inside_a_trial_asks_for_the_command_again_and_a_trial_finished_by_hand_counts(
    fake, monkeypatch, tmp_path
):
    """A signal in one trial's run stops the study, whose advice is the command again (the
    trial's own resume trains it past its pause); a trial's run that a user resumed to its
    end anyway then reports its end, not a KeyError."""
    from bigbatch.experiments.signals import Stopped

    straight = tune(BASE, tmp_path / "straight", SPACE, TuneSettings(trials=3))
    trained = []

    def stopped_at_the_second_run(config, out, **options):
        if len(trained) == 1:
            raise Stopped(15, 7, str(out))
        trained.append((config, out))
        return fake(config, out, **options)

    monkeypatch.setattr(runner, "train", stopped_at_the_second_run)
    out = tmp_path / "stopped"
    with pytest.raises(Stopped, match=rf"run the same command again \(--out {out}\)"):
        tune(BASE, out, SPACE, TuneSettings(trials=3))
    fake(*trained[0], resume=True)  # the paused trial resumed by hand, to its end
    monkeypatch.setattr(runner, "train", fake)
    result = tune(BASE, out, SPACE, TuneSettings(trials=3))
    assert [t["state"] for t in result.trials] == [t["state"] for t in straight.trials]
    assert result.best["lr"] == straight.best["lr"]


def test_a_tie_at_a_pause_goes_to_the_earlier_trial(fake, monkeypatch, tmp_path):
    def flat(config, out, **options):  # every rate scores alike at the pauses
        lr = BEST_LR if options.get("until") else config["lr"]
        return fake({**config, "lr": lr}, out, **options)

    monkeypatch.setattr(runner, "train", flat)
    result = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=3))
    states = [t["state"] for t in sorted(result.trials, key=lambda t: t["number"])]
    assert states == ["complete", "pruned", "pruned"]  # (ranked the other way: the last)


def test_a_trial_finished_by_hand_reports_its_final_score_at_a_pause(fake, monkeypatch, tmp_path):
    def finished_first(config, out, **options):  # trial 0 trained to its end, best above final
        if out.name == "0000" and options.get("until"):
            summary = {**fake(config, out, **{**options, "until": None}), "best_accuracy": 0.999}
            (out / "summary.json").write_text(json.dumps(summary))
            return summary
        return fake(config, out, **options)

    monkeypatch.setattr(runner, "train", finished_first)
    result = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=3))
    (first,) = [t for t in result.trials if t["number"] == 0]
    assert first["curve"] and {value for _, value in first["curve"]} == {first["value"]}


def test_the_report_counts_the_trials_and_the_cost_in_full_runs():
    from pathlib import Path

    from bigbatch.experiments.report.tuning import markdown
    from bigbatch.experiments.tune import TuneResult

    def trial(number, state, samples):
        return {
            "number": number, "bracket": 0, "state": state, "params": {"lr": 0.004},
            "samples": samples, "value": 0.97 if state == "complete" else None, "last": 0.97,
            "curve": [], "diverged": None,
        }  # fmt: skip

    result = TuneResult(
        best={"lr": 0.004}, best_value=0.97, best_dir=Path("trials/0000"), samples=27_000,
        budget=9_000, grid_samples=63_000,
        trials=[trial(0, "complete", 9_000), trial(1, "pruned", 3_000), trial(2, "pruned", 3_000)],
    )  # fmt: skip
    text = markdown({"task": "digits"}, result, SPACE)
    assert "1 trained to the end, 2 stopped early, 0 diverged." in text
    assert "27,000 samples, 3.00 full runs; the ×2 grid over the same range trains 7 full " in text
    assert "**43% of the grid**" in text


def test_the_best_config_report_and_plot_are_written(fake, tmp_path):
    result = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=9, brackets=2))
    best = resolve(load_toml(tmp_path / "t" / "best.toml"))
    assert best["lr"] == pytest.approx(result.best["lr"]) and best["task"] == "digits"
    report = (tmp_path / "t" / "tune.md").read_text()
    assert "of the grid" in report and f"{result.best['lr']:.4g}" in report
    assert (tmp_path / "t" / "tune.png").stat().st_size > 0
    # bigbatch report re-renders it from the folder alone
    (tmp_path / "t" / "tune.md").unlink()
    assert cli.main(["report", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "tune.md").read_text() == report
    # the second bracket is proposed by TPE from the first: near the best rate
    second = [t["params"]["lr"] for t in result.trials if t["bracket"] == 1]
    assert len(second) == 9
    assert sorted(abs(math.log2(lr / BEST_LR)) for lr in second)[4] < 1.5


def test_no_trial_pauses_inside_the_longest_warm_up_searched(fake, tmp_path):
    space = [*SPACE, Dimension("schedule.warmup", 0.0, 0.15)]
    tune(BASE, tmp_path / "t", space, TuneSettings(trials=9))
    assert min(until for _, _, until in fake.calls if until) == 9000  # 1/3: past 2 x 0.15
    # where no pause fits (2 x 0.2 past 1/3), every trial trains to the end: only the first
    # trained (by number, with no score yet), the others "pruned" at 0 samples
    fake.calls.clear()
    space = [*SPACE, Dimension("schedule.warmup", 0.0, 0.2)]
    result = tune(BASE, tmp_path / "long", space, TuneSettings(trials=5))
    assert [t["state"] for t in result.trials] == ["complete"] * 5
    assert [until for _, _, until in fake.calls] == [None] * 5


def test_a_loss_is_minimised(monkeypatch, tmp_path):
    runs = FakeRuns(loss=True)
    monkeypatch.setattr(runner, "train", runs)
    result = tune({**BASE, "task": "lm"}, tmp_path / "t", SPACE, TuneSettings(trials=9))
    assert abs(math.log2(result.best["lr"] / BEST_LR)) < 0.7


def test_a_diverging_rate_leaves_its_bracket(monkeypatch, tmp_path):
    runs = FakeRuns(diverge_above=0.01)
    monkeypatch.setattr(runner, "train", runs)
    result = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=9))
    failed = [t for t in result.trials if t["state"] == "fail"]
    assert failed and all(t["params"]["lr"] > 0.01 and t["diverged"] for t in failed)
    assert result.best["lr"] <= 0.01
    assert "diverged" in (tmp_path / "t" / "tune.md").read_text()


def test_a_study_without_a_finished_trial_or_a_database_is_one_line(monkeypatch, fake, tmp_path):
    """Every trial diverged, none finished yet, a damaged or a missing study.db: tracebacks
    (exit 1), one of them saying "every one diverged" of a study stopped before any trial
    ended; a missing study.db was made again, empty."""
    monkeypatch.setattr(runner, "train", FakeRuns(diverge_above=0.0))
    with pytest.raises(ConfigError, match="every one diverged; lower the range"):
        tune(BASE, tmp_path / "diverged", SPACE, TuneSettings(trials=3))
    monkeypatch.setattr(runner, "train", fake)
    out = tmp_path / "t"
    tune(BASE, out, SPACE, TuneSettings(trials=3))
    with sqlite3.connect(out / "study.db") as db:  # as if stopped before any trial ended
        db.execute("UPDATE trials SET state = 'RUNNING'")
    with pytest.raises(ConfigError, match=r"has trained to the end yet: run the same tune"):
        render_report(out)
    (out / "study.db").write_text("not a database")
    with pytest.raises(ConfigError, match=r"study.db: not a study's database \(DatabaseError"):
        render_report(out)
    (out / "study.db").unlink()
    with pytest.raises(ConfigError, match=r"study.db: missing"):
        render_report(out)
    assert not (out / "study.db").exists()


def test_the_budget_limits_the_brackets_and_one_too_small_is_refused(fake, tmp_path):
    settings = TuneSettings(trials=9, brackets=5, budget=0.7)  # 2.33 runs a bracket, of 7
    result = tune(BASE, tmp_path / "t", SPACE, settings)
    assert {t["bracket"] for t in result.trials} == {0, 1}
    assert result.cost <= 0.7
    with pytest.raises(
        ConfigError,
        match=r"budget 0.1 of the grid is 0.70 runs.*2.33 runs with pauses at 0.111, 0.333, 1",
    ):
        tune(BASE, tmp_path / "u", SPACE, TuneSettings(trials=9, budget=0.1))
    assert not (tmp_path / "u").exists()


def test_a_finished_study_run_again_trains_nothing_and_other_settings_are_refused(fake, tmp_path):
    first = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=6))
    count = len(fake.calls)
    again = tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=6))
    assert len(fake.calls) == count and again.best == first.best
    # also where it was saved before a config key (at its default) was added
    saved = json.loads((tmp_path / "t" / "tune.json").read_text())
    del saved["config"]["keep_freed_memory"]
    (tmp_path / "t" / "tune.json").write_text(json.dumps(saved))
    assert tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=6)).best == first.best
    assert len(fake.calls) == count
    # or with other trials at a time, which set the threads of each (they were refused)
    saved["jobs"], saved["config"]["threads"] = 2, 1
    (tmp_path / "t" / "tune.json").write_text(json.dumps(saved))
    assert tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=6)).best == first.best
    assert len(fake.calls) == count
    with pytest.raises(ConfigError, match=r"holds a study of other settings.*trials"):
        tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=7))
    (tmp_path / "plain").mkdir()  # an empty folder is taken; one holding other files is not
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no study"):
        tune(BASE, tmp_path / "plain", SPACE, TuneSettings(trials=6))


def test_no_trial_ends_early_at_the_target(monkeypatch, tmp_path):
    """A trial that stopped at the target would have no score at its pause (the study
    failed on it); the study ranks by quality at each pause, so the key is off in it."""
    runs, seen = FakeRuns(), []

    def recording(config, out, **kwargs):
        seen.append(config["stop_at_target"])
        return runs(config, out, **kwargs)

    monkeypatch.setattr(runner, "train", recording)
    tune({**BASE, "stop_at_target": True}, tmp_path / "t", SPACE, TuneSettings(trials=3))
    assert seen and not any(seen)


def test_the_pauses_divide_the_run_by_powers_of_the_reduction_after_two_warmups():
    settings = TuneSettings()
    assert settings.rungs() == pytest.approx([1 / 27, 1 / 9, 1 / 3, 1])
    assert settings.survivors() == [9, 3, 2, 1]  # two kept to the last pause
    assert settings.bracket_runs() == pytest.approx((9 + 3 * 2 + 2 * 6 + 18) / 27)
    assert settings.rungs(warmup=0.05) == pytest.approx([1 / 9, 1 / 3, 1])
    assert settings.survivors(warmup=0.05) == [9, 3, 1]
    assert TuneSettings(after_warmup=0).rungs(warmup=0.05) == pytest.approx(settings.rungs())
    assert TuneSettings(trials=1).survivors() == [1, 1, 1, 1]
    assert len(TuneSettings(min_fidelity=1 / 243).rungs()) == 6  # 3^-5 in floats: 5 pauses


def test_a_trial_killed_before_it_joined_a_bracket_is_failed_and_its_point_asked_again(
    fake, tmp_path, monkeypatch
):
    import optuna

    from bigbatch.experiments import tune as tune_module

    straight = tune(BASE, tmp_path / "straight", SPACE, TuneSettings(trials=9))
    out = tmp_path / "t"
    with monkeypatch.context() as patched:  # a study folder whose bracket never ran
        patched.setattr(tune_module._Bracket, "run", lambda self, processes: None)
        with pytest.raises(ConfigError, match=r"no trial of .* has trained to the end yet"):
            tune(BASE, out, SPACE, TuneSettings(trials=9))
    study = optuna.load_study(study_name="bigbatch", storage=f"sqlite:///{out / 'study.db'}")
    points = latin_hypercube(SPACE, 9, seed=0)
    for params in points:  # queued, then killed after asking two: one joined, one did not
        study.enqueue_trial(params)
    joined = study.ask()
    SPACE[0].suggest(joined)
    joined.set_user_attr("bracket", 0)
    study.ask()
    result = tune(BASE, out, SPACE, TuneSettings(trials=9))
    assert len(study.get_trials()) == 17  # one asked, seven queued: failed in the study
    states = [t["state"] for t in result.trials]  # and out of its result, as never asked
    assert sorted(states) == sorted(t["state"] for t in straight.trials) and len(states) == 9
    asked = sorted(t["params"]["lr"] for t in result.trials if t["bracket"] == 0)
    assert asked == pytest.approx(sorted(p["lr"] for p in points))  # each point once
    assert result.best == straight.best


def test_the_first_bracket_covers_every_stratum_of_each_range():
    space = [Dimension("lr", 0.001, 0.064, log=True), Dimension("schedule.warmup", 0.0, 0.3)]
    points = latin_hypercube(space, 6, seed=3)
    lr_strata = sorted(int(6 * math.log(p["lr"] / 0.001) / math.log(64)) for p in points)
    warmup_strata = sorted(int(6 * p["schedule.warmup"] / 0.3) for p in points)
    assert lr_strata == warmup_strata == list(range(6))
    assert latin_hypercube(space, 6, seed=3) == points != latin_hypercube(space, 6, seed=4)


def test_a_trials_rate_takes_the_tasks_ceiling_along_and_its_other_values_stay():
    config = resolve({"task": "text", "optimizer": "vr-sgd", "batch.controller": "constant"})
    config = resolve(config, {"batch.initial": 256})
    trial = trial_config(config, {"lr": 1.264, "weight_decay": 0.001})
    assert (trial["lr"], trial["lr_max"], trial["weight_decay"]) == (1.264, 0.316, 0.001)
    assert trial_config(config, {"weight_decay": 0.001})["lr_max"] == 0.0  # the task's, later


def test_every_trial_and_best_toml_take_the_tasks_ceiling_along_with_the_rate(
    monkeypatch, tmp_path
):
    runs, seen = FakeRuns(), []

    def recording(config, out, **options):
        seen.append((config["lr"], config["lr_max"]))
        return runs(config, out, **options)

    monkeypatch.setattr(runner, "train", recording)
    ceiled = dataclasses.replace(TASKS["digits"], lr_max={"adam": 0.01})
    monkeypatch.setitem(TASKS, "digits", ceiled)
    rate = plan_run(BASE)["lr"]
    tune(BASE, tmp_path / "t", SPACE, TuneSettings(trials=6))
    assert len({lr for lr, _ in seen}) == 6
    assert all(ceiling == pytest.approx(0.01 * lr / rate) for lr, ceiling in seen)
    best = resolve(load_toml(tmp_path / "t" / "best.toml"))
    assert best["lr_max"] == pytest.approx(0.01 * best["lr"] / rate)


def test_a_trial_folder_of_another_config_is_refused_not_continued(tmp_path):
    from bigbatch.experiments.tune import _train_trial

    old = resolve(BASE, {"lr": 0.004})
    (tmp_path / "0000").mkdir()
    (tmp_path / "0000" / "config.toml").write_text(to_toml(plan_run(old)))
    with pytest.raises(ConfigError, match=r"holds a finished run of another config \(lr_max"):
        _train_trial(({**old, "lr_max": 0.002}, str(tmp_path / "0000"), 9000, True))


def test_the_default_space_spans_the_tasks_rate_by_eight_each_way():
    (dimension,) = default_space(BASE)
    assert dimension.key == "lr" and dimension.log
    assert dimension.high / dimension.low == pytest.approx(64)
    assert dimension.grid_points() == 7


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr=0.1:0.01", "LOW must be below HIGH"),
        ("lr=0.01:0.01", "LOW must be below HIGH"),
        ("lrr=0.1:1", "unknown config key 'lrr'; did you mean 'lr'?"),
        ("lr=0:1:log", "a log range needs LOW > 0"),
        ("lr=-1:1", "lr must be >= 0, got -1.0"),
        ("optimizer=1:2", "only number keys can be searched"),
        ("max_samples=1000:3000", "a study pauses and ranks its trials at fractions of one"),
        ("lr=a:b", "the range must be two numbers"),
        ("lr", "KEY=LOW:HIGH or KEY=LOW:HIGH:log"),
        # digits trains on 1,437 samples: an end the data cannot give, before any trial
        ("batch.initial=64:3000", r"batch.initial = 3000 is larger than the training set"),
        # BASE's constant batch reads no target: every trial would train one run
        ("batch.target=0.1:0.5", "the constant controller does not read it"),
        ("dist.eta=0.1:0.5", r"dist.compression = 'none' does not read it \(econtrol does\)"),
        ("lr=0.001:0.01, lr=0.002:0.004", "lr: a key is searched twice"),
    ],
)
def test_a_bad_range_or_key_gets_one_error_naming_it(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_space(text.split(", "), BASE)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trials": 0}, "trials must be a whole number >= 1, got 0"),
        ({"jobs": -1}, "jobs must be"),
        ({"reduction": 1}, "reduction must be a whole number >= 2, got 1"),
        ({"brackets": 1.5}, "brackets must be"),
        ({"min_fidelity": 1.5}, r"min_fidelity must be in \(0, 1\], got 1.5"),
        ({"budget": 0}, r"budget must be > 0"),
        ({"after_warmup": -1}, "after_warmup must be >= 0"),
    ],
)
def test_bad_settings_are_refused_when_made(settings, message):
    with pytest.raises(ConfigError, match=message):
        TuneSettings(**settings)


def _states(db):
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT number, state FROM trials ORDER BY number").fetchall()
    return dict(rows)


def _states_while_written(db):
    """``_states`` of a study another process is writing: none yet while it creates the file's
    tables (the file exists first) or holds the lock."""
    try:
        return _states(db) if db.exists() else {}
    except sqlite3.OperationalError:
        return {}


def _reports(db):
    with sqlite3.connect(db) as connection:
        return connection.execute(
            "SELECT trial_id, step, intermediate_value FROM trial_intermediate_values "
            "ORDER BY trial_id, step"
        ).fetchall()


TUNE = [
    sys.executable, "-m", "bigbatch.cli", "tune", "--task", "digits", "--quiet",
    "--set", "max_samples=8000", "--set", "eval_every=4", "--set", "threads=1",
    "--set", "batch.controller=constant", "--trials", "6", "--min-fidelity", "0.1",
]  # fmt: skip


@pytest.mark.faults
def test_a_killed_tune_resumes_and_ends_as_one_never_killed(tmp_path):
    """SIGKILL once a trial has been stopped and another trains on, then the same command:
    every stored measurement kept, and the study, its runs and its choice equal those of
    a study never killed."""
    straight = subprocess.run([*TUNE, "--out", str(tmp_path / "straight")], timeout=300)
    assert straight.returncode == 0
    out = tmp_path / "study"
    process = subprocess.Popen([*TUNE, "--out", str(out)], start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if "PRUNED" in _states_while_written(out / "study.db").values():
            break
        assert process.poll() is None, "tune ended before it could be killed"
        time.sleep(0.1)
    else:
        pytest.fail("no trial was stopped in time")
    time.sleep(1.0)  # into the next fidelity's training
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = _reports(out / "study.db")
    done = subprocess.run([*TUNE, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    after = _reports(out / "study.db")
    assert set(before) <= set(after)  # nothing stored was lost or measured again
    assert after == _reports(tmp_path / "straight" / "study.db")
    assert _states(out / "study.db") == _states(tmp_path / "straight" / "study.db")
    for trial in (out / "trials").iterdir():  # each run continued from its checkpoint
        assert rows(trial) == rows(tmp_path / "straight" / "trials" / trial.name)
    assert (out / "best.toml").read_text() == (tmp_path / "straight" / "best.toml").read_text()
    assert "best config" in done.stdout


@pytest.mark.processes
def test_trials_run_in_parallel_processes(tmp_path):
    out = tmp_path / "study"
    command = [
        sys.executable, "-m", "bigbatch.cli", "tune", "--task", "digits", "--quiet",
        "--set", "max_samples=4000", "--set", "batch.controller=constant",
        "--trials", "4", "--reduction", "2", "--min-fidelity", "0.25", "--jobs", "2",
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    states = _states(out / "study.db")
    assert sorted(states.values()) == ["COMPLETE", "PRUNED", "PRUNED", "PRUNED"]
    assert len(list((out / "trials").iterdir())) == 4
