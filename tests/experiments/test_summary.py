"""Summary numbers computed from a run's metrics."""

import json
import math

import pytest

from bigbatch.experiments.summary import (
    ENDS,
    FINISHED,
    batch_path_ratio,
    finished_summary,
    target_summary,
)
from bigbatch.experiments.tasks import TASKS


def test_batch_path_ratio():
    assert batch_path_ratio([64, 64, 128, 256, 256]) == pytest.approx(1.0)  # monotone
    assert batch_path_ratio([64, 64, 64]) == 1.0  # constant
    saw = batch_path_ratio([64, 256, 64, 256])  # up, down, up: 3 moves for a net 1
    assert saw == pytest.approx(3.0)
    assert batch_path_ratio([64, 128, 64]) is None  # back where it began


def test_target_summary_in_numbers_and_words():
    task = TASKS["mnist1d"]
    evals = [
        {"step": 10, "samples": 640, "eval_accuracy": 0.5},
        {"step": 20, "samples": 1280, "eval_accuracy": 0.975},
    ]
    reached = target_summary(task, evals)
    assert reached["target_reached"] and reached["steps_to_target"] == 20
    assert reached["samples_to_target"] == 1280
    assert "reached at step 20 (1,280 samples)" in reached["target_note"]
    missed = target_summary(task, evals[:1])
    assert not missed["target_reached"] and missed["steps_to_target"] is None
    assert missed["target_note"] == "target accuracy 0.97 not reached; best 0.5"
    # the best of several evals is the highest accuracy, not the lowest
    missed = target_summary(task, [*evals[:1], {"step": 20, "samples": 1280, "eval_accuracy": 0.9}])
    assert missed["target_note"] == "target accuracy 0.97 not reached; best 0.9"


def test_a_loss_target_is_reached_from_above():
    task = TASKS["lm"]
    assert task.lower_is_better
    evals = [
        {"step": 1, "samples": 64, "eval_loss": 3.0, "eval_accuracy": 0.1},
        {"step": 2, "samples": 128, "eval_loss": task.target - 1e-3, "eval_accuracy": 0.2},
    ]
    summary = target_summary(task, evals)
    assert summary["steps_to_target"] == 2 and summary["target_metric"] == "eval_loss"
    assert not math.isnan(task.target)
    missed = target_summary(task, [{**evals[0], "eval_loss": 3.5}, evals[0]])
    assert missed["target_note"].endswith("not reached; best 3")  # the lowest loss


@pytest.mark.parametrize("ended", sorted(ENDS))
def test_only_a_run_that_ended_with_a_result_is_finished(tmp_path, ended):
    assert finished_summary(tmp_path) is None  # no summary: not finished
    summary = {"ended": ended, "final_accuracy": 0.9}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert (finished_summary(tmp_path) == summary) == (ended in FINISHED)


def test_a_run_stopped_at_its_skip_limit_is_a_result_but_not_one_stopped_early():
    # a diverged rate ranks last in a sweep; it is not rerun
    assert sorted(FINISHED) == ["budget", "skip_limit", "target"]


def test_a_summary_that_does_not_say_how_the_run_ended_is_no_result(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"final_accuracy": 0.9}))
    assert finished_summary(tmp_path) is None
