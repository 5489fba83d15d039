"""``runner.train``'s pause point: a run paused at ``until`` and resumed is the run never paused."""

import json
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from bigbatch.experiments import runner
from bigbatch.experiments.config import ConfigError, resolve

from .test_cli import rows

CONFIG = {
    "task": "digits",
    "device": "cpu",
    "threads": 1,
    "max_samples": 6000,
    "eval_every": 5,
    "batch.controller": "constant",
}


def _summary(run):
    """A run's summary without what differs between two runs of one config."""
    summary = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in ("wall_seconds", "run_dir")}


def test_a_run_paused_twice_and_resumed_ends_like_one_never_paused(tmp_path):
    straight = runner.train(resolve(CONFIG), tmp_path / "straight", quiet=True)
    run = tmp_path / "paused"
    first = runner.train(resolve(CONFIG), run, quiet=True, until=1000)
    assert first["paused"] and 1000 <= first["samples"] < 1200
    assert "eval_accuracy" in first and not (run / "summary.json").exists()
    again = runner.train(resolve(CONFIG), run, resume=True, quiet=True, until=1000)
    assert again["samples"] == first["samples"]  # paused there already: no step taken
    assert again["eval_accuracy"] == first["eval_accuracy"]
    second = runner.train(resolve(CONFIG), run, resume=True, quiet=True, until=3000)
    assert second["paused"] and second["samples"] >= 3000
    done = runner.train(resolve(CONFIG), run, resume=True, quiet=True, until=None)
    assert done["final_accuracy"] == straight["final_accuracy"]
    assert done["steps"] == straight["steps"]
    # a pause evaluates for its own return, not into the rows: they and the summary are
    # the run's never paused
    assert rows(run) == rows(tmp_path / "straight")
    assert _summary(run) == _summary(tmp_path / "straight")
    a = torch.load(run / "checkpoint.pt", weights_only=True)["loop"]["model"]
    b = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["loop"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((run / "summary.json").read_text())["samples"] == straight["samples"]


def test_a_run_checkpointed_on_a_gpu_resumes_on_a_cpu(tmp_path):
    """A checkpoint whose tensors torch.save tagged cuda:0 (here re-saved so, as a GPU run
    writes them) was refused on a machine without one, as 'truncated or corrupted'."""
    straight = runner.train(resolve(CONFIG), tmp_path / "straight", quiet=True)
    run = tmp_path / "gpu"
    runner.train(resolve(CONFIG), run, quiet=True, until=3000)
    registry = torch.serialization._package_registry
    before = list(registry)
    torch.serialization.register_package(
        0, lambda obj: "cuda:0" if getattr(obj, "device", None) is not None else None,
        lambda obj, location: None,
    )  # fmt: skip
    try:
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            torch.save(torch.load(run / name, weights_only=True), run / name)
    finally:
        registry[:] = before
    if not torch.cuda.is_available():  # (as written on a GPU: a CPU cannot load it as it is)
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(run / "checkpoint.pt", weights_only=True)
    done = runner.train(resolve(CONFIG), run, resume=True, quiet=True)
    assert done["final_accuracy"] == straight["final_accuracy"]
    assert rows(run) == rows(tmp_path / "straight")


def test_a_resume_whose_log_lost_rows_says_so_and_counts_what_it_holds(tmp_path):
    """metrics.jsonl cut short after its checkpoint (an edit, a machine's crash before the
    OS wrote it): resumed in silence, the log missed rows its summary counted."""
    run = tmp_path / "run"
    runner.train(resolve(CONFIG), run, quiet=True, until=3000)
    metrics = run / "metrics.jsonl"
    counted = len(metrics.read_text().splitlines())
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:5]))
    message = f"holds 5 rows where the checkpoint counts {counted}: the resumed run's log"
    with pytest.warns(RuntimeWarning, match=message):
        runner.train(resolve(CONFIG), run, resume=True, quiet=True, until=4000)
    held = rows(run)
    with warnings.catch_warnings():  # its count now the file's: a second resume is silent
        warnings.simplefilter("error")
        done = runner.train(resolve(CONFIG), run, resume=True, quiet=True)
    assert rows(run)[: len(held)] == held
    assert len(rows(run)) == done["steps"] - (counted - 5)


def test_a_pause_never_ends_a_run_at_its_target(tmp_path):
    """``stop_at_target`` checks the evaluations the run schedules, not a pause's own."""
    config = {
        **CONFIG, "stop_at_target": True, "eval_every": 50, "max_samples": 60000,
        "batch.initial": 32,
    }  # fmt: skip
    straight = runner.train(resolve(config), tmp_path / "straight", quiet=True)
    paused = runner.train(resolve(config), tmp_path / "paused", quiet=True, until=19584)
    assert paused["paused"] and paused["samples"] < straight["samples"]
    done = runner.train(resolve(config), tmp_path / "paused", resume=True, quiet=True)
    assert (done["steps"], done["steps_to_target"]) == (
        straight["steps"],
        straight["steps_to_target"],
    )


def test_a_resume_under_another_config_is_refused_in_one_line(tmp_path):
    runner.train(resolve(CONFIG), tmp_path / "r", quiet=True, until=1000)
    with pytest.raises(ConfigError, match=r"trained lr = .*, the config to resume it with"):
        runner.train(resolve({**CONFIG, "lr": 0.5}), tmp_path / "r", resume=True, quiet=True)
    # a key a run may change (threads) resumes it (a few steps more are enough to show it)
    resumed = {**CONFIG, "threads": 2}
    summary = runner.train(resolve(resumed), tmp_path / "r", resume=True, quiet=True, until=1500)
    assert summary["samples"] >= 1500


def test_until_at_or_past_the_budget_trains_the_whole_run(tmp_path):
    summary = runner.train(resolve(CONFIG), tmp_path / "r", quiet=True, until=6000)
    assert "paused" not in summary and summary["samples"] >= 6000


def test_a_run_is_planned_once_then_checked_and_trained_with_that_plan(
    trained, tmp_path, monkeypatch
):
    from bigbatch.experiments.plan import RunPlan

    planned = []

    def plan_run(config):
        planned.append(config)
        return real(config)

    real = runner.plan_run
    monkeypatch.setattr(runner, "plan_run", plan_run)
    runner.train_or_reuse(resolve(CONFIG), tmp_path / "run")
    # the runner planned the config once; the check and the trainer took that plan
    assert len([c for c in planned if not isinstance(c, RunPlan)]) == 1
    assert isinstance(trained[0], RunPlan) and trained[0]["lr"] > 0
    runner.train_or_reuse(resolve(CONFIG), tmp_path / "run")  # finished: checked, reused
    assert len(trained) == 1


#: ``asynchronous``: each step's row written at the next step, its evaluation held till then
ASYNC = {**CONFIG, "optimizer": "adamw", "asynchronous": True}


def test_an_asynchronous_run_logs_every_step_once_with_its_own_evaluation(tmp_path):
    """Each row is its own step's: against the same run read at once (torch's fused AdamW
    in both), a constant batch trains alike, so the rows are the same."""
    late = runner.train(resolve(ASYNC), tmp_path / "async", quiet=True)
    sync = {**ASYNC, "asynchronous": False, "optimizer_impl": "fused"}
    once = runner.train(resolve(sync), tmp_path / "sync", quiet=True)
    assert [r["step"] for r in rows(tmp_path / "async")] == list(range(1, late["steps"] + 1))
    assert rows(tmp_path / "async") == rows(tmp_path / "sync")
    assert late["final_accuracy"] == once["final_accuracy"]


def test_an_asynchronous_run_paused_and_resumed_ends_like_one_never_paused(tmp_path):
    config = {**ASYNC, "batch.controller": "batch_warmup"}
    straight = runner.train(resolve(config), tmp_path / "straight", quiet=True)
    run = tmp_path / "paused"
    first = runner.train(resolve(config), run, quiet=True, until=2000)
    assert first["paused"]
    done = runner.train(resolve(config), run, resume=True, quiet=True)
    assert (
        done["steps"] == straight["steps"] and done["final_accuracy"] == straight["final_accuracy"]
    )
    assert rows(run) == rows(tmp_path / "straight")
    batches = {r["batch_size"] for r in rows(run)}
    assert len(batches) > 1, "the batch must have grown"


def test_a_branch_of_an_asynchronous_run_starts_at_its_own_first_step(tmp_path):
    """The base run's last step, read but not decided on, is the base run's: a branch
    (``critical-batch``'s) drops it and logs its own steps only."""
    config = {**ASYNC, "batch.controller": "batch_warmup"}
    base = runner.train(resolve(config), tmp_path / "base", quiet=True, until=1000)
    branch = {**ASYNC, "batch.initial": 64}
    runner.train(
        resolve(branch), tmp_path / "branch", quiet=True, until=2000,
        start_from=tmp_path / "base" / "checkpoint.pt",
    )  # fmt: skip
    logged = rows(tmp_path / "branch")
    assert [r["step"] for r in logged] == list(
        range(base["steps"] + 1, base["steps"] + 1 + len(logged))
    )
    assert {r["batch_size"] for r in logged} == {64}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_run_the_skip_limit_stops_logs_every_step_it_took(tmp_path, asynchronous):
    config = {**ASYNC, "asynchronous": asynchronous, "optimizer_impl": "fused", "lr": 1e30}
    with pytest.raises(runner.TooManySkippedError):
        runner.train(resolve(config), tmp_path / "r", quiet=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["ended"] == "skip_limit"
    assert [r["step"] for r in rows(tmp_path / "r")] == list(range(1, summary["steps"] + 1))
    assert summary["skipped_steps"] == summary["steps"] - 1  # all but the first
    assert summary["steps"] == runner.SKIP_GRACE_STEPS  # judged from then on, not before
    # judged on every step taken: asynchronous, the last one's late reading first
    assert summary["why"].startswith(f"{summary['skipped_steps']} of {summary['steps']} ")


def test_an_fp16_run_whose_scaled_gradients_overflow_step_after_step_meets_the_skip_limit(
    tmp_path,
):
    """Each overflow the GradScaler skips is a skipped step: a diverging fp16 run stops at the
    skip limit (uncounted, its scale halved to 0 and a division by it raised)."""
    config = {**CONFIG, "precision": "fp16", "lr": 1e6, "batch.controller": "batch_warmup"}
    with pytest.raises(runner.TooManySkippedError):
        runner.train(resolve(config), tmp_path / "r", quiet=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["ended"] == "skip_limit" and summary["skipped_steps"] > 5
    assert sum(r.get("skipped", 0) for r in rows(tmp_path / "r")) == summary["skipped_steps"]


@pytest.mark.compile
def test_a_compiled_run_trains_as_the_eager_one_in_a_few_graphs(tmp_path):
    """``compile``: the training steps through torch.compile, the measured layers traced
    with the model; the batch grows through several sizes, each without a graph of its own."""
    torch._dynamo.reset()
    counters.clear()
    config = {
        **CONFIG,
        "batch.controller": "batch_warmup",
        "statistics_every": 1,
        "max_samples": 20000,
    }
    eager = runner.train(resolve(config), tmp_path / "eager", quiet=True)
    compiled = runner.train(resolve({**config, "compile": "default"}), tmp_path / "c", quiet=True)
    assert {r["batch_size"] for r in rows(tmp_path / "c")} == {
        r["batch_size"] for r in rows(tmp_path / "eager")
    }
    assert len({r["batch_size"] for r in rows(tmp_path / "c")}) >= 3
    assert compiled["steps"] == eager["steps"]
    assert compiled["final_accuracy"] == pytest.approx(eager["final_accuracy"], abs=0.02)
    assert counters["stats"]["unique_graphs"] <= 4


def test_a_run_that_met_its_target_trains_no_further_when_resumed(tmp_path):
    # its end was not in the checkpoint: a resume trained on toward the budget (250 -> 300
    # steps), after a stop at the target's step as after a finished run
    config = resolve(
        {"task": "digits", "max_samples": 8000, "optimizer": "adamw", "lr": 0.01,
         "stop_at_target": True, "threads": 1, "device": "cpu"}
    )  # fmt: skip
    ended = runner.train(config, tmp_path / "run", quiet=True)
    assert ended["ended"] == "target" and ended["samples"] < 8000
    again = runner.train(config, tmp_path / "run", quiet=True, resume=True)
    assert (again["steps"], again["samples"], again["ended"]) == (
        ended["steps"], ended["samples"], "target"
    )  # fmt: skip
    assert len(rows(tmp_path / "run")) == ended["steps"]


@pytest.mark.compile
def test_each_compiled_run_traces_its_own_graphs_as_in_a_process_of_its_own():
    """Runs in one process (compare's arms, a notebook) each added graphs to dynamo's cache:
    from the fifth `bigbatch train --set compile=default`, torch's recompile limit ran the
    model eagerly. Each run now starts the cache afresh."""
    from bigbatch.experiments.build import training_model

    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    counters.clear()
    for _ in range(2):
        training_model(model, "default")(x)
    assert counters["stats"]["unique_graphs"] == 2  # traced again: the cache was reset


def test_the_progress_bar_says_while_the_run_evaluates(tmp_path, capsys):
    """An evaluation left the bar as it was: `lm` at a context of 2,000 evaluated for minutes
    with no sign of what the run was doing."""
    runner.train(resolve({**CONFIG, "max_samples": 600}), tmp_path / "run")
    shown = capsys.readouterr().err
    assert "evaluating:" in shown  # the held-out evaluations
    assert "evaluating on the training set:" in shown  # digits' after the last step


def test_a_budget_of_whole_batches_evaluates_its_first_and_last_steps_and_checkpoints_the_last(
    tmp_path,
):
    batch = 64  # digits' first batch under the constant controller: 7 whole steps
    config = resolve({**CONFIG, "batch.initial": batch, "max_samples": 7 * batch})
    summary = runner.train(config, tmp_path / "run", quiet=True)
    logged = rows(tmp_path / "run")
    assert summary["steps"] == len(logged) == 7
    assert "eval_accuracy" in logged[0] and "eval_accuracy" in logged[-1]
    assert [i + 1 for i, r in enumerate(logged) if "eval_accuracy" in r] == [1, 5, 7]
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["run"]["metrics_lines"] == 7  # the last step's checkpoint, not step 5's
    assert summary["final_accuracy"] == logged[-1]["eval_accuracy"]


def test_a_checkpoint_without_its_config_is_refused_in_one_line(tmp_path):
    runner.train(resolve(CONFIG), tmp_path / "run", quiet=True, until=1000)
    path = tmp_path / "run" / "checkpoint.pt"
    saved = torch.load(path, weights_only=True)
    del saved["config"]
    torch.save(saved, path)
    with pytest.raises(ConfigError, match="was written by an earlier bigbatch: train it anew"):
        runner.train(resolve(CONFIG), tmp_path / "run", resume=True, quiet=True)


def test_a_resumed_runs_clock_goes_on_from_its_checkpoint(tmp_path):
    """The rows' wall_seconds count the training's time across sessions: after a resume
    they go on from the checkpoint's, not from 0."""
    run = tmp_path / "r"
    runner.train(resolve(CONFIG), run, quiet=True, until=5000)
    runner.train(resolve(CONFIG), run, resume=True, quiet=True)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    clock = [json.loads(line)["wall_seconds"] for line in lines]
    assert clock == sorted(clock) and clock[0] > 0
    assert json.loads((run / "summary.json").read_text())["wall_seconds"] >= clock[-1]


def test_a_run_resumed_from_its_predecessor_keeps_rolling_its_checkpoints_on(tmp_path):
    """Resumed from checkpoint.prev.pt (checkpoint.pt damaged): its first checkpoint keeps
    the good predecessor (not the damaged file); each one after keeps the one before it."""
    config = {**CONFIG, "checkpoint_every": 10}
    run = tmp_path / "r"
    runner.train(resolve(config), run, quiet=True, until=2000)
    good = (run / "checkpoint.prev.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(b"damaged")
    with pytest.warns(RuntimeWarning, match="resuming from the previous checkpoint"):
        runner.train(resolve(config), run, resume=True, quiet=True, until=3000)
    kept = torch.load(run / "checkpoint.prev.pt", weights_only=True)
    last = torch.load(run / "checkpoint.pt", weights_only=True)
    assert (run / "checkpoint.prev.pt").read_bytes() != good  # rolled on past the first
    assert 0 < kept["run"]["metrics_lines"] < last["run"]["metrics_lines"]


def test_every_row_a_checkpoint_counts_is_on_disk_before_it(tmp_path, monkeypatch):
    """A kill right after a checkpoint must find its rows in the log: else the resumed run
    warns of lost rows and its log misses them."""
    run, seen, save = tmp_path / "r", [], runner.save_atomically

    def counting_save(obj, path, keep_previous=False):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        seen.append((obj["run"]["metrics_lines"], len(lines)))
        save(obj, path, keep_previous)

    monkeypatch.setattr(runner, "save_atomically", counting_save)
    runner.train(resolve({**CONFIG, "checkpoint_every": 7}), run, quiet=True, until=3000)
    assert len(seen) > 3 and all(counted == on_disk for counted, on_disk in seen)


def test_a_run_evaluates_at_its_first_step_every_eval_every_and_its_last(tmp_path):
    summary = runner.train(resolve({**CONFIG, "max_samples": 1992}), tmp_path / "r", quiet=True)
    evaluated = [r["step"] for r in rows(tmp_path / "r") if "eval_loss" in r]
    last = summary["steps"]
    assert last % 5 and evaluated == [1, *range(5, last, 5), last]
