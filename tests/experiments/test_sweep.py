"""The tuned-sweep protocol: the same rate grid for every arm, the best rate on more seeds."""

import dataclasses
import json
from unittest import mock

import pytest

from bigbatch.experiments.config import ConfigError, resolve
from bigbatch.experiments.options import Protocol, TuneSettings
from bigbatch.experiments.plan import plan_run
from bigbatch.experiments.sweep import RANKS, Arm, metric, sweep
from bigbatch.experiments.tasks import TASKS

BASE = {"task": "digits", "batch.controller": "constant", "lr": 0.004}


def test_each_arm_gets_the_grid_and_its_best_rate_gets_the_seeds(trained, tmp_path):
    arms = [
        Arm("low", {"batch.initial": 64, "lr": 0.002}, "low"),  # best at x2
        Arm("high", {"batch.initial": 256, "lr": 0.008}, "high"),  # best at x0.5
    ]
    results = sweep(BASE, arms, tmp_path, Protocol(lr_grid=(0.5, 1.0, 2.0), seeds=3))
    assert [r.lr for r in results] == pytest.approx([0.004, 0.004])
    assert [r.chosen for r in results] == [2, 0]
    assert results[0].lrs == pytest.approx([0.001, 0.002, 0.004])
    assert results[1].lrs == pytest.approx([0.004, 0.008, 0.016])
    # 3 grid runs per arm on seed 0, then seeds 1 and 2 at the chosen rate only
    assert len(trained) == 2 * 3 + 2 * 2
    assert [r["seed"] for r in trained[6:]] == [1, 2, 1, 2]
    assert results[0].dirs == ["low-lr2-seed0", "low-lr2-seed1", "low-lr2-seed2"]
    assert [metric(s) for s in results[0].runs] == pytest.approx([0.98, 0.979, 0.978])


def test_an_arm_that_sets_its_seed_trains_from_that_seed(trained, tmp_path):
    """``--vary seed=0,5``: each arm's grid and further seeds start at its own seed (they
    were all trained at the base's seed, the same runs under different names)."""
    arms = [Arm("s0", {"seed": 0}, "s0"), Arm("s5", {"seed": 5}, "s5")]
    results = sweep({**BASE, "seed": 3}, arms, tmp_path, Protocol(lr_grid=(1.0, 2.0), seeds=2))
    assert [r["seed"] for r in trained] == [0, 0, 5, 5, 1, 6]
    assert results[1].dirs == ["s5-lr0-seed5", "s5-lr0-seed6"]
    assert results[1].grid_dirs == ["s5-lr0-seed5", "s5-lr1-seed5"]
    assert [metric(s) for s in results[1].runs] == pytest.approx([0.975, 0.974])
    pytest.importorskip("optuna")
    trained.clear()
    # the task's rate (no lr given): the chosen point's config is resolved again
    base = {k: v for k, v in BASE.items() if k != "lr"}
    base["stop_at_target"] = True  # off in the study's trials, so in the further seeds too
    protocol = Protocol(lr_grid=(0.5, 2.0), seeds=2, tune=True)
    tuned = sweep(
        base, arms[1:], tmp_path / "tuned", protocol, tune=TuneSettings(trials=3, reduction=3)
    )
    assert {r["seed"] for r in trained} == {5, 6}  # the study's trials, then seed 6
    assert not any(resolve(r)["stop_at_target"] for r in trained)  # one kind of run an arm
    assert tuned[0].dirs[1] == "s5-tuned-seed1"
    assert [r["final_accuracy"] for r in tuned[0].runs][1] < tuned[0].runs[0]["final_accuracy"]


def test_a_grid_at_the_tasks_rate_scales_the_tasks_ceiling_with_it(trained, tmp_path):
    """×1 is the recipe ``bigbatch train`` runs; a ceiling the user gives stays fixed."""
    digits = dataclasses.replace(TASKS["digits"], lr_max={"adam": 0.01})
    base = {"task": "digits", "batch.controller": "constant", "batch.initial": 64}
    with mock.patch.dict(TASKS, {"digits": digits}):
        (a,) = sweep(base, [Arm("a", {}, "a")], tmp_path / "a", Protocol(lr_grid=(0.5, 1.0, 2.0)))
        user = {**base, "lr_max": 0.03}
        (b,) = sweep(user, [Arm("b", {}, "b")], tmp_path / "b", Protocol(lr_grid=(0.5, 2)))
        # the ceiling the chosen point trained under, for a run at the chosen rate
        assert (a.lr_max, b.lr_max) == (0.01 * a.lr / trained[1]["lr"], 0.03)
        assert (a.own, b.own) == (1, None)  # a grid without x1 has no own rate (x2 was taken)
        assert plan_run(trained[1]) == {**plan_run(base), "seed": 0}
    rate = trained[1]["lr"]
    assert [(c["lr"], c["lr_max"]) for c in trained] == [
        (rate / 2, 0.005),
        (rate, 0.01),
        (rate * 2, 0.02),
        (rate / 2, 0.03),
        (rate * 2, 0.03),
    ]


def test_a_repeated_sweep_reuses_its_finished_runs(trained, tmp_path):
    arms = [Arm("a", {"batch.initial": 64}, "a")]
    first = sweep(BASE, arms, tmp_path, Protocol(lr_grid=(0.5, 1.0), seeds=2))
    count = len(trained)
    (tmp_path / "a-lr1-seed1" / "summary.json").unlink()  # as if killed midway
    stopped = {"ended": "signal", "why": "stopped by SIGTERM at step 3", "final_accuracy": 0.1}
    (tmp_path / "a-lr0-seed0" / "summary.json").write_text(json.dumps(stopped))
    again = sweep(BASE, arms, tmp_path, Protocol(lr_grid=(0.5, 1.0), seeds=2))
    assert len(trained) == count + 2  # only the killed and the stopped run trained again
    assert [r.runs for r in again] == [r.runs for r in first]


def test_a_finished_run_of_another_config_is_refused_not_reused(trained, tmp_path):
    # the same run name ("a-lr0-seed0") after the arm's rate changed: another run
    sweep(BASE, [Arm("a", {"lr": 0.004}, "a")], tmp_path)
    with pytest.raises(ConfigError, match=r"a-lr0-seed0.*lr = 0\.004 there, 0\.002 now"):
        sweep(BASE, [Arm("a", {"lr": 0.002}, "a")], tmp_path)
    # the thread count changes float sums, not the question: the run is reused
    count = len(trained)
    sweep({**BASE, "threads": 2}, [Arm("a", {"lr": 0.004}, "a")], tmp_path)
    assert len(trained) == count


def test_a_best_rate_at_the_grid_edge_widens_the_grid_until_it_is_inside(trained, tmp_path):
    # the fake's best rate is 0.004: from a grid 0.00025-0.0005, three more points above
    arms = [Arm("a", {"lr": 0.00025}, "a"), Arm("b", {"lr": 0.004}, "b")]
    results = sweep(BASE, arms, tmp_path, Protocol(lr_grid=(1.0, 2.0), rank="final", widen=4))
    a, b = results
    assert a.lrs == pytest.approx([0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008])
    assert a.lr == pytest.approx(0.004) and not a.at_edge
    # the other arm's best (x1) was at the low end: one point below it, then inside
    assert b.lrs == pytest.approx([0.002, 0.004, 0.008]) and b.lr == pytest.approx(0.004)
    assert len(trained) == 6 + 3


def test_widening_stops_at_its_cap_and_says_the_rate_is_at_the_edge(trained, tmp_path):
    arms = [Arm("a", {"lr": 0.00025}, "a")]
    (result,) = sweep(BASE, arms, tmp_path, Protocol(lr_grid=(1.0, 2.0), rank="final", widen=1))
    assert result.lrs == pytest.approx([0.00025, 0.0005, 0.001])
    assert result.at_edge and result.dirs == ["a-lr2-seed0"]
    # by the grid's own step (x4 here), not by doubling
    protocol = Protocol(lr_grid=(1.0, 4.0), rank="final", widen=1)
    (result,) = sweep(BASE, [Arm("b", {"lr": 0.00025}, "b")], tmp_path, protocol)
    assert result.lrs == pytest.approx([0.00025, 0.001, 0.004])
    (result,) = sweep(BASE, [Arm("c", {}, "c")], tmp_path, Protocol(lr_grid=(1.0,)))
    assert not result.at_edge  # one rate is no grid to be at the end of


def test_a_best_score_tied_at_an_end_of_the_grid_widens_it(tmp_path, monkeypatch):
    """A plateau reaching the grid's top (digits' accuracy comes in steps of 1/360) chose the
    lower rate inside it: not widened, not flagged, though the optimum may lie beyond."""
    from bigbatch.experiments import runner

    from .fake_runs import fake_train

    def train(config, out, **options):
        summary = fake_train(config, out, **options)
        if config["lr"] >= 0.004:  # flat from 0.004 up to `top`, then lower
            score = 0.98 if config["lr"] <= top else 0.9
            summary.update(final_accuracy=score, best_accuracy=score)
            (out / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(runner, "train", train)
    protocol = Protocol(lr_grid=(0.5, 1.0, 2.0), rank="final", widen=1)
    top = 0.016  # past the grid (0.002-0.008): widened once, still flat there, so at the end
    (result,) = sweep(BASE, [Arm("a", {"lr": 0.004}, "a")], tmp_path / "flat", protocol)
    assert result.lrs == pytest.approx([0.002, 0.004, 0.008, 0.016])
    assert result.lr == pytest.approx(0.016) and result.at_edge
    top = 0.008  # widened once, lower there: the plateau is inside, its lowest rate chosen
    (result,) = sweep(BASE, [Arm("a", {"lr": 0.004}, "a")], tmp_path / "inside", protocol)
    assert result.lrs == pytest.approx([0.002, 0.004, 0.008, 0.016])
    assert result.lr == pytest.approx(0.004) and not result.at_edge
    top = 0.016  # flat over the whole grid (0.008-0.016): the low end is chosen, widened below
    protocol = Protocol(lr_grid=(2.0, 4.0), rank="final", widen=1)
    (result,) = sweep(BASE, [Arm("a", {"lr": 0.004}, "a")], tmp_path / "all", protocol)
    assert result.lrs == pytest.approx([0.004, 0.008, 0.016])
    assert result.lr == pytest.approx(0.004) and result.at_edge


def test_runs_in_parallel_share_the_cores(trained, tmp_path, monkeypatch):
    # two runs at a time each took every core (no threads given)
    from bigbatch.experiments.device import share_of_cores

    serial = lambda train, jobs, workers: [train(job) for job in jobs]  # noqa: E731
    monkeypatch.setattr("bigbatch.experiments.sweep.in_processes", serial)
    sweep(BASE, [Arm("a", {}, "a")], tmp_path, Protocol(lr_grid=(1.0,), jobs=2))
    assert trained[0]["threads"] == share_of_cores(2)


def test_the_steps_rank_prefers_reaching_the_target_sooner():
    late = {"steps_to_target": 300, "best_accuracy": 0.99, "target_metric": "eval_accuracy"}
    soon = {"steps_to_target": 200, "best_accuracy": 0.95, "target_metric": "eval_accuracy"}
    never = {"steps_to_target": None, "best_accuracy": 0.99, "target_metric": "eval_accuracy"}
    assert sorted([late, never, soon], key=RANKS["steps"]) == [soon, late, never]
    assert sorted([late, never, soon], key=RANKS["best"])[-1] is soon
    lm = {"best_eval_loss": float("nan"), "target_metric": "eval_loss"}
    assert RANKS["best"](lm) == float("inf")  # a diverged run ranks last


def test_the_protocol_offers_every_rank_the_sweep_has():
    from bigbatch.experiments.options import RANK_NAMES

    assert tuple(RANKS) == RANK_NAMES


def test_a_bad_arm_config_stops_the_sweep_before_any_run(trained, tmp_path):
    # (bad protocol options are refused when the Protocol is made: test_compare.py)
    with pytest.raises(ConfigError, match=r"batch\.intial"):
        sweep(BASE, [Arm("a", {"batch.intial": 3}, "a")], tmp_path)
    with pytest.raises(ValueError, match="the protocol does not tune"):
        sweep(BASE, [Arm("a", {}, "a")], tmp_path, tune=TuneSettings())
    assert trained == []


def test_a_rate_that_diverges_ranks_last_and_leaves_a_summary(trained, tmp_path, monkeypatch):
    from bigbatch.experiments import runner

    from .fake_runs import fake_train

    def train(config, out, **options):
        if config["lr"] > 0.005:  # past stability: the runner stops on skipped steps
            err = runner.TooManySkippedError(30, 40, 0.25)
            out.mkdir(parents=True)  # and leaves the summary of a diverged run, as it does
            diverged = {"ended": "skip_limit", "diverged": str(err), **dict.fromkeys(runner.SCORES)}
            (out / "summary.json").write_text(json.dumps(diverged))
            raise err
        return fake_train(config, out, **options)

    monkeypatch.setattr(runner, "train", train)
    (result,) = sweep(BASE, [Arm("a", {"lr": 0.004}, "a")], tmp_path, Protocol(lr_grid=(1.0, 2.0)))
    assert result.lr == pytest.approx(0.004)
    diverged = json.loads((tmp_path / result.grid_dirs[1] / "summary.json").read_text())
    assert "30 of 40 optimizer steps were skipped" in diverged["diverged"]
    assert metric(diverged) != metric(diverged)  # NaN: no score
    assert (tmp_path / "a-lr1-seed0" / "summary.json").is_file()  # reused, not retrained


def test_the_errors_that_end_a_run_cross_a_process_boundary():
    """A sweep's or a study's workers send them back pickled; they must come back whole (a
    stop on a signal came back as a broken process pool)."""
    import pickle

    from bigbatch.experiments.runner import TooManySkippedError
    from bigbatch.experiments.signals import Stopped

    err = pickle.loads(pickle.dumps(TooManySkippedError(30, 40, 0.25)))
    assert (err.skipped, err.steps, err.limit) == (30, 40, 0.25)
    assert "30 of 40" in str(err)
    for again in (None, "run the same command again"):
        stop = Stopped(15, 7, "runs/a", again)
        back = pickle.loads(pickle.dumps(stop))
        assert (back.signum, back.step, back.out, back.code) == (15, 7, "runs/a", 143)
        assert str(back) == str(stop)
