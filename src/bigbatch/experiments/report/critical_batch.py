"""A critical-batch measurement's report: ``critical_batch.md`` and ``critical_batch.png``,
from ``critical_batch.json`` alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..rundir import read_json
from .figures import plt, save

#: what a measurement was asked to do, kept so that running it again continues it
PLAN = "plan.json"


def render(out: Path) -> Path:
    """Write ``critical_batch.md`` and ``critical_batch.png`` from ``critical_batch.json``;
    the report's path."""
    data = read_json(out / "critical_batch.json")
    batches, points = data["batches"], data["points"]
    planned = len(read_json(out / PLAN)["points"])
    lines = [f"# Critical batch of {data['config']['task']}, measured by branching", ""]
    if len(points) < planned:  # a measurement stopped part-way: its points so far
        lines += [
            f"**{len(points)} of {planned} points measured: run the same bigbatch "
            f"critical-batch command (--out {out}) to measure the rest.**",
            "",
        ]
    lines += [
        f"Base run at batch {batches[0]}; branches of {data['branch_samples']:,} samples with "
        f"the {data['lr_rule']} rate rule; tolerance {data['tolerance']:g} in eval loss. "
        "Each batch's column is its branch loss minus the reference (the base batch's); "
        "B_simple is the base run's 20-step noise scale, the controller's estimate what "
        f"{data.get('controller', 'the controller')} would compare with the next size there.",
        "",
        "| fraction | samples | schedule | reference loss | critical batch "
        + "| B_simple [low, high] | controller's estimate | "
        + " | ".join(str(b) for b in batches)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(batches),
    ]
    for p in points:
        losses = {int(b): _number(v) for b, v in p["losses"].items()}
        reference = losses[batches[0]]
        deltas = " | ".join(_shown(losses[b] - reference, "+.4f") for b in batches)
        # at the edge of the batches tried the measurement bounds the critical batch only
        edge = {batches[-1]: "≥ ", batches[0]: "≤ "}.get(p["critical_batch"], "")
        lines.append(
            f"| {p['fraction']:g} | {p['samples']:,} | {p['schedule']:.2f} | {reference:.4f} "
            f"| **{edge}{p['critical_batch']}** | {_shown(p['noise_scale'], '.1f')} "
            f"[{_shown(p['noise_scale_low'], '.1f')}, {_shown(p['noise_scale_high'], '.1f')}] "
            f"| {_shown(p.get('controller_estimate'), '.1f')} | {deltas} |"
        )
    lines += ["", "![critical batch](critical_batch.png)", ""]
    path = out / "critical_batch.md"
    path.write_text("\n".join(lines))
    _plot(out, batches, points)
    return path


def _number(value: float | None, missing: float = math.nan) -> float:
    # the JSON's null: not measured (NaN), or an unbounded interval's end (missing=inf)
    return missing if value is None else value


def _shown(value: float | None, spec: str) -> str:
    value = _number(value)
    return format(value, spec) if math.isfinite(value) else "—"


def _plot(out: Path, batches: list[int], points: list[dict[str, Any]]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in batches:
        ax.axhline(b, color="0.85", lw=0.6, zorder=0)
    samples = [p["samples"] for p in points]
    ax.plot(
        samples, [p["critical_batch"] for p in points], "o-", label="critical batch (branching)"
    )
    scale = [_number(p["noise_scale"]) for p in points]
    ax.plot(samples, scale, "s--", color="tab:gray", label="B_simple")
    estimates = [_number(p.get("controller_estimate")) for p in points]
    if any(math.isfinite(e) for e in estimates):
        ax.plot(samples, estimates, "^:", color="tab:orange", label="the controller's estimate")
    ax.fill_between(
        samples,
        [max(_number(p["noise_scale_low"]), 1e-3) for p in points],
        [min(_number(p["noise_scale_high"], math.inf), 10 * batches[-1]) for p in points],
        color="tab:gray",
        alpha=0.2,
        lw=0,
    )
    ax.set(xlabel="samples", ylabel="batch (samples)", yscale="log")
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=8)
    save(fig, out / "critical_batch.png", dpi=110)
