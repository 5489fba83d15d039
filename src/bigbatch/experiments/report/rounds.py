"""A federated run's report: ``report.md`` and ``federated.png``, from its
``rounds.jsonl`` and ``summary.json`` alone."""

from __future__ import annotations

import math
from pathlib import Path

from ..rundir import read_json, read_metrics
from .figures import plt, save


def render(out: Path) -> Path:
    """Write ``report.md`` and ``federated.png`` from the run's files; the report's path."""
    rounds = read_metrics(out, "rounds.jsonl")
    summary = read_json(out / "summary.json")
    config = summary.pop("config")
    _plot(out / "federated.png", rounds)
    path = out / "report.md"
    path.write_text(_markdown(config, summary, rounds))
    return path


def _markdown(cfg: dict, summary: dict, rounds: list[dict]) -> str:
    lines = [
        f"# Federated run: {cfg['scheme']} on {cfg['task']}, {cfg['clients']} clients, "
        f"{cfg['split']} split",
        "",
        f"{cfg['rounds']} rounds of {cfg['local_samples']} samples per client; "
        f"lr {cfg['lr']} at local batch {cfg['local_batch']}; client data sizes "
        f"{summary['client_sizes']}.",
        f"Final accuracy {summary['final_accuracy']:.4f} (best {summary['best_accuracy']:.4f}) "
        f"after {summary['client_steps']} client steps, {summary['wall_seconds']:.0f} s.",
        "",
        "| target | round | client steps |",
        "|---|---|---|",
    ]
    for target, hit in summary["targets"].items():
        lines.append(
            f"| {target} | {hit['round'] if hit else 'not reached'} | "
            f"{hit['client_steps'] if hit else '-'} |"
        )
    lines += [
        "",
        "| round | local batch | steps | lr | noise scale | loss | accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['round']} | {r['local_batch']} | {r['local_steps']} | {r['lr']:.4g} | "
            f"{r['noise_scale']:.1f} | {r['loss']:.4f} | {r.get('eval_accuracy', math.nan):.4f} |"
        )
    return "\n".join([*lines, "", "![rounds](federated.png)", ""])


def _plot(path: Path, rows: list[dict]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [r["client_steps"] for r in rows]
    left.plot(steps, [r.get("eval_accuracy", math.nan) for r in rows], marker=".")
    left.set_xlabel("client steps")
    left.set_ylabel("test accuracy")
    right.step([r["round"] for r in rows], [r["local_batch"] for r in rows], where="post")
    right.set_xlabel("round")
    right.set_ylabel("local batch")
    right.set_yscale("log", base=2)
    save(fig, path, dpi=110)
