"""Plots and Markdown reports of runs and comparisons, rendered from their files alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..batch.smoothing import SmoothedNoise
from .rundir import read_metrics

PLOTS = {
    "batch_similarity.png": "batch size, noise scale and similarity vs step",
    "loss_accuracy.png": "loss and accuracy vs samples and vs steps",
    "lr.png": "learning rate vs step",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(r[x], r[y]) for r in rows if y in r and r[y] is not None and math.isfinite(r[y])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def smoothed_noise_scale(rows: list[dict[str, Any]], window: int = 20) -> list[float]:
    """Per step, ``B_simple`` from the steps' ``|G|²`` and ``tr Σ`` averaged apart over
    ``window`` steps (what the noise-following controllers act on); NaN where unknown."""
    noise, out = SmoothedNoise(window), []
    for r in rows:
        noise.update(r.get("grad_sq_norm", math.nan), r.get("trace", math.nan))
        out.append(noise.noise_scale())
    return out


def plot_run(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(*_series(rows, "step", "batch_size"), color="tab:blue", label="batch size")
    if any("trace" in r for r in rows):
        scale = smoothed_noise_scale(rows)
        steps = [r["step"] for r, v in zip(rows, scale) if math.isfinite(v) and v > 0]
        top.plot(
            steps,
            [v for v in scale if math.isfinite(v) and v > 0],
            color="tab:gray",
            lw=0.7,
            label="noise scale B_simple (20-step average)",
        )
        top.legend(fontsize=8)
    top.set_yscale("log")
    top.set_ylabel("samples")
    top.set_title(title)
    bottom.plot(*_series(rows, "step", "similarity"), color="tab:orange", lw=0.7)
    bottom.set_ylabel("half-batch similarity")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(out / "batch_similarity.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for column, x in enumerate(("samples", "step")):
        axes[0, column].plot(*_series(rows, x, "loss"), lw=0.7, label="train (batch)")
        axes[0, column].plot(*_series(rows, x, "eval_loss"), marker=".", label="test")
        axes[0, column].set_ylabel("loss")
        axes[0, column].set_yscale("log")
        axes[0, column].legend()
        axes[1, column].plot(*_series(rows, x, "eval_accuracy"), marker=".", color="tab:green")
        axes[1, column].set_ylabel("test accuracy")
        axes[1, column].set_xlabel("samples" if x == "samples" else "optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "loss_accuracy.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(*_series(rows, "step", "lr"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out / "lr.png", dpi=100)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def render_run(out: Path) -> Path:
    """Write the run's plots and ``report.md`` from its ``metrics.jsonl``, summary and config."""
    out = Path(out)
    rows = read_metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    config_text = (out / "config.toml").read_text()
    plot_run(rows, out, f"{summary['task']}: {out.name}")
    lines = [f"# Run {out.name}", ""]
    if "target_note" in summary:
        lines += [f"**{summary['target_note'][0].upper()}{summary['target_note'][1:]}.**", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in summary.items()]
    lines += [""] + [f"![{text}]({name})\n" for name, text in PLOTS.items()]
    lines += ["## Config", "", "```toml", config_text.rstrip(), "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten in both larger batch and higher accuracy, by batch size."""
    front = []
    for batch, accuracy in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or accuracy > front[-1][1]:
            front.append((batch, accuracy))
    return sorted(front)


def render_comparison(root: Path) -> Path:
    """Overlaid curves, a table and the (average batch, best accuracy) Pareto front."""
    root = Path(root)
    index = json.loads((root / "compare.json").read_text())
    runs = []
    for entry in index["runs"]:
        run_dir = root / entry["dir"]
        if not (run_dir / "summary.json").is_file():
            continue
        runs.append(
            (
                entry["label"],
                read_metrics(run_dir),
                json.loads((run_dir / "summary.json").read_text()),
            )
        )
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows, _ in runs:
        for ax, x in zip(axes, ("samples", "step")):
            ax.plot(*_series(rows, x, "eval_accuracy"), marker=".", label=label)
    for ax, x in zip(axes, ("samples", "optimizer steps")):
        ax.set_xlabel(x)
        ax.set_xscale("log")
        ax.set_ylabel("test accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "accuracy.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    points = [(s["avg_batch_size"], s["best_accuracy"]) for _, _, s in runs]
    for (label, _, _), (b, a) in zip(runs, points):
        ax.scatter([b], [a])
        ax.annotate(label, (b, a), fontsize=7)
    front = pareto_front(points)
    ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("average batch size (samples / steps)")
    ax.set_ylabel("best test accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(root / "pareto.png", dpi=100)
    plt.close(fig)

    columns = [
        "best_accuracy",
        "final_accuracy",
        "avg_batch_size",
        "steps",
        "samples",
        "steps_to_target",
        "samples_to_target",
        "wall_seconds",
    ]
    lines = [
        "# Comparison",
        "",
        "| run | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for label, _, s in runs:
        lines.append(f"| {label} | " + " | ".join(_fmt(s.get(c)) for c in columns) + " |")
    lines += [
        "",
        "![test accuracy vs samples and steps](accuracy.png)",
        "",
        "![average batch vs best accuracy](pareto.png)",
        "",
    ]
    path = root / "report.md"
    path.write_text("\n".join(lines))
    return path


def render(path: Path) -> Path:
    path = Path(path)
    if (path / "compare.json").is_file():
        return render_comparison(path)
    if (path / "summary.json").is_file():
        return render_run(path)
    raise FileNotFoundError(f"{str(path)!r} is neither a run nor a comparison directory")
