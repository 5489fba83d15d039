"""A federated run's report: what its summary says, in its words."""

from bigbatch.experiments.report.rounds import _markdown

CONFIG = {"scheme": "fedavg", "task": "digits", "clients": 4, "split": "iid", "rounds": 2,
          "local_samples": 64, "lr": 0.1, "local_batch": 16}  # fmt: skip


def test_the_report_names_the_round_each_target_was_reached_in_and_the_best_accuracy():
    summary = {"client_sizes": [10] * 4, "final_accuracy": 0.8, "best_accuracy": 0.9,
               "client_steps": 40, "wall_seconds": 1.0,
               "targets": {"0.85": {"round": 2, "client_steps": 40}, "0.95": None}}  # fmt: skip
    lines = _markdown(CONFIG, summary, []).splitlines()
    assert "Final accuracy 0.8000 (best 0.9000) after 40 client steps, 1 s." in lines
    assert "| 0.85 | 2 | 40 |" in lines and "| 0.95 | not reached | - |" in lines
