"""A stand-in for ``runner.train`` whose outcome is a known function of the config.

Sweeps and comparisons are about choosing and aggregating runs; with this
trainer their tests check the choices against known answers in milliseconds.
The model: the best rate is 0.004 at any batch (accuracy falls with the
squared log-distance from it), and the steps to the target follow
``S_min · (1 + B_crit / B)`` with ``S_min = 100`` and ``B_crit = 4 · width``; a run
trains its budget (``max_samples``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bigbatch.experiments.config import to_toml
from bigbatch.experiments.plan import plan_run
from bigbatch.experiments.runner import SCORES

S_MIN = 100


def critical_batch(width: int) -> float:
    return 4.0 * width


def fake_train(
    config: dict[str, Any],
    out: Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    until: int | None = None,
):
    """The run's summary; with ``until`` below the budget, a paused run's record (its
    accuracy already the final one) and a checkpoint to resume from."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    filled = plan_run(config)
    (out / "config.toml").write_text(to_toml(filled))  # as the runner does
    batch = filled["batch.initial"]
    width = filled["model.width"]
    accuracy = 0.98 - 0.01 * math.log(config["lr"] / 0.004) ** 2 - 0.001 * config["seed"]
    steps = round(S_MIN * (1 + critical_batch(width) / batch))
    if until is not None and until < filled["max_samples"]:
        (out / "checkpoint.pt").write_text(str(until))
        return {"paused": True, "samples": until, "eval_accuracy": accuracy}
    summary = {
        "task": config["task"],
        "target_metric": "eval_accuracy",
        "target": 0.9,
        "best_accuracy": accuracy,
        "final_accuracy": accuracy - 0.001,
        "best_eval_loss": 1 - accuracy,
        "final_eval_loss": 1 - accuracy,
        "steps_to_target": steps if accuracy >= 0.9 else None,
        "samples_to_target": steps * batch if accuracy >= 0.9 else None,
        "steps": 2 * steps,
        "samples": filled["max_samples"],
        "avg_batch_size": float(batch),
        "wall_seconds": 1.0,
        "ended": "budget",
    }
    if config["lr"] > 1:  # a rate this far off diverges: no score, as the runner records it
        summary.update(dict.fromkeys(SCORES), steps_to_target=None, ended="skip_limit")
    if config["task"] == "lm":  # a transformer: the runner logs its largest attention logit
        summary["max_attention_logit"] = 10.0 * config["lr"] / 0.004
    if config.get("train_samples"):  # a cut training set: the runner measures the gap
        summary.update(final_train_accuracy=1.0, generalization_gap=1.0 - summary["final_accuracy"])
    rows = [{"step": s, "samples": s * batch, "eval_accuracy": accuracy} for s in (1, steps)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps(summary))
    return summary
