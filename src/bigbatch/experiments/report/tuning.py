"""The report and plot of a ``bigbatch tune`` study (``tune.md``, ``tune.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..tasks import TASKS
from .figures import plt, save


def markdown(config: dict[str, Any], result: Any, space: list[Any]) -> str:
    task = TASKS[config["task"]]
    name = task.target_metric.removeprefix("eval_")
    budget = result.budget
    states = [t["state"] for t in result.trials]
    best = ", ".join(f"{k} = {v:.4g}" for k, v in result.best.items())
    ranges = ", ".join(
        f"{d.key} {d.low:.4g} to {d.high:.4g}{' (log)' if d.log else ''}" for d in space
    )
    lines = [
        f"# Tuning {task.name}: {len(states)} trials",
        "",
        f"Searched {ranges} by successive halving: every trial is a run of the whole "
        f"schedule ({budget:,} samples), paused at each fidelity; the best of a bracket go on "
        "from their checkpoints, the others are stopped (pruned).",
        "",
        f"**Best: {best}**, final {name} {result.best_value:.4f} "
        f"(`{result.best_dir.name}`; `best.toml` is its config).",
        "",
        f"{states.count('complete')} trained to the end, {states.count('pruned')} stopped early, "
        f"{sum(bool(t['diverged']) for t in result.trials)} diverged. Cost: "
        f"{result.samples:,} samples, "
        f"{result.samples / budget:.2f} full runs; the ×2 grid over the same range trains "
        f"{result.grid_samples // budget} full runs: **{result.cost:.0%} of the grid**.",
        "",
        f"| trial | bracket | {' | '.join(d.key for d in space)} | state | samples "
        f"| final {name} | last reported {name} |",
        "|---|---|" + "---|" * (len(space) + 4),
    ]
    for t in sorted(result.trials, key=lambda t: t["number"]):
        values = " | ".join(f"{t['params'].get(d.key, float('nan')):.4g}" for d in space)
        final = f"{t['value']:.4f}" if t["state"] == "complete" else "-"
        last = f"{t['last']:.4f}" if t["last"] is not None else "-"
        lines.append(
            f"| {t['number']} | {t['bracket']} | {values} | {t['state']} | {t['samples']:,} "
            f"| {final} | {last} |"
        )
    return "\n".join(lines) + "\n"


def plot(path: Path, config: dict[str, Any], result: Any, space: list[Any]) -> None:
    """The searched value against the final (or last reported) metric, and every trial's
    validation curve against samples."""
    name = TASKS[config["task"]].target_metric.removeprefix("eval_")
    first = space[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for state, marker in (("complete", "o"), ("pruned", "x")):
        rows = [t for t in result.trials if t["state"] == state and first.key in t["params"]]
        left.scatter(
            [t["params"][first.key] for t in rows],
            [t["value"] if state == "complete" else t["last"] for t in rows],
            marker=marker,
            label="trained to the end (final)" if state == "complete" else "stopped (last)",
        )
    left.axvline(result.best[first.key], color="grey", linestyle=":", label="best")
    if first.log:
        left.set_xscale("log")
    left.set(xlabel=first.key, ylabel=name, title=f"{first.key} against {name}")
    left.legend()
    for t in result.trials:
        if t["curve"]:
            samples, values = zip(*t["curve"])
            right.plot(samples, values, alpha=0.6, linewidth=1)
    right.set(xlabel="samples", ylabel=name, title="every trial's validation curve")
    save(fig, path, dpi=110)
