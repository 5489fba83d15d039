"""A run's report: ``report.md`` and its three figures, from the run's folder alone
(``metrics.jsonl``, ``summary.json``, ``config.toml``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...sinks import batch_change
from ..rundir import read_json, read_metrics
from .figures import plt, save, series

PLOTS = {
    "batch_similarity.png": "batch size, noise scale and similarity vs step",
    "loss_accuracy.png": "loss and accuracy vs samples and vs steps",
    "lr.png": "learning rate vs step",
}


def plot_run(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    similarity = series(rows, "step", "similarity")
    if similarity[0]:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        bottom.plot(*similarity, color="tab:orange", lw=0.7)
        bottom.set_ylabel("half-batch similarity")
    else:  # nothing measured it (statistics off, or a rule that reads none): no empty panel
        fig, top = plt.subplots(figsize=(7, 3.5))
        bottom = top
    top.plot(*series(rows, "step", "batch_size"), color="tab:blue", label="batch size")
    if any("noise_scale" in r for r in rows):
        _plot_noise_scale(top, rows)
    top.legend(fontsize=8)
    top.set_yscale("log")
    top.set_ylabel("samples")
    top.set_title(title)
    bottom.set_xlabel("optimizer step")
    save(fig, out / "batch_similarity.png")

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for column, x in enumerate(("samples", "step")):
        axes[0, column].plot(*series(rows, x, "loss"), lw=0.7, label="train (batch)")
        axes[0, column].plot(*series(rows, x, "eval_loss"), marker=".", label="test")
        axes[0, column].set_ylabel("loss")
        axes[0, column].set_yscale("log")
        axes[0, column].legend()
        axes[1, column].plot(*series(rows, x, "eval_accuracy"), marker=".", color="tab:green")
        axes[1, column].set_ylabel("test accuracy")
        axes[1, column].set_xlabel("samples" if x == "samples" else "optimizer step")
    fig.suptitle(title)
    save(fig, out / "loss_accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(*series(rows, "step", "lr"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title)
    save(fig, out / "lr.png")


def _plot_noise_scale(ax: Any, rows: list[dict[str, Any]]) -> None:
    """The logged noise scale (the estimate the controller decides on) and its bounds,
    and the critical batch a controller compares with the next size, where it logs one."""
    known = [
        r for r in rows if math.isfinite(r.get("noise_scale", math.nan)) and r["noise_scale"] > 0
    ]
    steps = [r["step"] for r in known]
    ax.plot(steps, [r["noise_scale"] for r in known], color="tab:gray", lw=0.7, label="B_simple")
    if known and "noise_scale_low" in known[0]:
        # an unknown bound (0 or inf) is drawn at the plot's edge, not stretching the axis
        floor = min(r["noise_scale"] for r in known) / 10
        top = max(r["noise_scale"] for r in known) * 10
        low = [max(r["noise_scale_low"], floor) for r in known]
        high = [min(r["noise_scale_high"], top) for r in known]
        ax.fill_between(steps, low, high, color="tab:gray", alpha=0.2, lw=0, label="its bounds")
    critical = [(r["step"], r["critical_batch"]) for r in rows if r.get("critical_batch", 0) > 0]
    if critical:
        ax.plot(*zip(*critical), color="tab:red", lw=0.7, label="critical batch (decides)")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def render(out: Path) -> Path:
    """Write the run's plots and ``report.md`` from its ``metrics.jsonl``, summary and config."""
    out = Path(out)
    rows = read_metrics(out)
    summary = read_json(out / "summary.json")
    config_text = (out / "config.toml").read_text()
    plot_run(rows, out, f"{summary['task']}: {out.name}")
    lines = [f"# Run {out.name}", ""]
    if summary.get("ended") in ("signal", "error"):  # the numbers are of a run not done
        lines += [f"**Not ended: {summary.get('why', summary['ended'])}.**", ""]
    if "target_note" in summary:
        lines += [f"**{summary['target_note'][0].upper()}{summary['target_note'][1:]}.**", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in summary.items()]
    lines += [""] + [f"![{text}]({name})\n" for name, text in PLOTS.items()]
    lines += _batch_changes(rows)
    lines += ["## Config", "", "```toml", config_text.rstrip(), "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


#: a report lists this many batch changes at most (a similarity controller makes thousands)
LISTED_CHANGES = 40


def _batch_changes(rows: list[dict[str, Any]]) -> list[str]:
    """The section listing each batch change with the estimates that caused it."""
    changes = [text for row in rows if (text := batch_change(row)) is not None]
    if not changes:
        return []
    lines = ["## Batch changes", "", f"{len(changes)} changes of the batch size:", ""]
    lines += [f"- {text}" for text in changes[:LISTED_CHANGES]]
    if len(changes) > LISTED_CHANGES:
        lines.append(f"- ... and {len(changes) - LISTED_CHANGES} more (metrics.jsonl)")
    return [*lines, ""]
