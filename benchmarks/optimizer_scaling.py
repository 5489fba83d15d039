"""Large-batch optimizers against SGD and AdamW as the batch grows (issue 17, claims 1 and 2).

    python benchmarks/optimizer_scaling.py --task mnist1d --out runs/scaling-mnist1d --jobs 2
    python benchmarks/optimizer_scaling.py --task lm --out runs/scaling-lm --jobs 2
    python benchmarks/optimizer_scaling.py --task lm --optimizers adamw lamb merit --multiples 16 64
    python benchmarks/optimizer_scaling.py --task digits --quick      # a first look, minutes

Claim 1 (You et al., LARS 2017 and LAMB 2020): LAMB and LARS keep their
accuracy as the batch grows where SGD and AdamW lose it. Claim 2 (Wang et
al., MERIT 2025): MERIT bounds the largest attention logit and beats LAMB on
language modelling at a large batch (``--task lm --optimizers adamw lamb
merit``).

Every arm is one optimizer at one constant batch, ``multiple ×`` the task's
small batch (``batch.base``, 64), trained for the same sample budget with the
cosine schedule. Its rate is the task's measured rate for the optimizer's
family, carried from batch 64 by the family's rule (sqrt for the Adam type,
linear for the SGD and LARS types), times each point of a 3-point grid
(×0.5, ×1, ×2; ``--multipliers``): every arm gets the same tuning budget. The best rate on seed
0 (best metric: accuracy, lm: eval loss) is rerun on seeds 1 and 2. Writes
``scaling.md`` (final and best metric, mean ± std, per optimizer and batch),
``scaling.json``, ``metric_vs_batch.png`` and, for ``lm``,
``attention_logit.png`` (the largest attention logit over training of each
optimizer's best seed-0 run at every batch). Runs already in ``--out`` are
reused, so a killed benchmark continues.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bigbatch.experiments.analysis import mean_std
from bigbatch.experiments.sweep import Arm, metric, sweep

OPTIMIZERS = ("sgd", "adamw", "lamb", "lars")
MULTIPLES = (1, 16, 64, 256)
GRID = (0.5, 1.0, 2.0)


def arms(task_name: str, optimizers, multiples) -> list[Arm]:
    """Each (optimizer, batch) arm: the family's rate at the small batch, carried by its rule."""
    from bigbatch.experiments.tasks import TASKS

    task = TASKS[task_name]
    out = []
    for name in optimizers:
        rate = task.lr(name, held=False)
        for multiple in multiples:
            batch = task.base_batch * multiple
            overrides = {
                "optimizer": name,
                "batch.initial": batch,
                "batch.max": max(batch, 16384),
                "lr": rate,
            }
            out.append(Arm(f"{name} {batch}", overrides, f"{name}-b{batch}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mnist1d", choices=("mnist1d", "lm", "teacher", "digits"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--multiples", nargs="+", type=int, default=list(MULTIPLES))
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=1.0, help="of the task's sample budget")
    parser.add_argument(
        "--multipliers",
        nargs="+",
        type=float,
        default=list(GRID),
        help="the rate grid, times each arm's carried rate (the same for every arm)",
    )
    parser.add_argument("--quick", action="store_true", help="no grid, one seed")
    args = parser.parse_args()

    from bigbatch.experiments.tasks import TASKS
    from bigbatch.optim import list_optimizers

    unknown = sorted(set(args.optimizers) - set(list_optimizers()))
    if unknown:
        parser.error(f"--optimizers: unknown {', '.join(unknown)}")
    task = TASKS[args.task]
    budget = int(task.max_samples * args.fraction)
    root = Path(args.out or f"runs/scaling-{args.task}{'-quick' if args.quick else ''}")
    root.mkdir(parents=True, exist_ok=True)
    base = {
        "task": args.task,
        "batch.controller": "constant",
        "batch.base": task.base_batch,
        "max_samples": budget,
        "eval_every": 10,
        "threads": 1,
        "device": "cpu",
    }
    results = sweep(
        base,
        arms(args.task, args.optimizers, args.multiples),
        root,
        multipliers=(1.0,) if args.quick else tuple(args.multipliers),
        seeds=1 if args.quick else args.seeds,
        rank="best",
        jobs=args.jobs,
    )
    table = {}
    for result in results:
        table[result.name] = {
            "optimizer": result.overrides["optimizer"],
            "batch": result.overrides["batch.initial"],
            "lr": result.lr,
            "grid_lrs": result.lrs,
            "final": [metric(r, "final") for r in result.runs],
            "best": [metric(r, "best") for r in result.runs],
            "max_attention_logit": [r.get("max_attention_logit") for r in result.runs],
            "run": str(root / result.dirs[0]),
        }
    (root / "scaling.json").write_text(json.dumps(table, indent=2) + "\n")
    write_report(root, args, task, budget, table)


def _cell(values: list[float], digits: int) -> str:
    mean, std = mean_std(values)
    return "—" if math.isnan(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def write_report(root: Path, args, task, budget: int, table: dict[str, dict]) -> None:
    lower = task.lower_is_better
    name = "eval loss" if lower else "test accuracy"
    digits = 4 if lower else 3
    batches = sorted({row["batch"] for row in table.values()})
    optimizers = list(dict.fromkeys(row["optimizer"] for row in table.values()))
    seeds = 1 if args.quick else args.seeds
    lines = [
        f"# Optimizers across batch sizes: {args.task}",
        "",
        f"Budget {budget:,} samples, constant batch, cosine schedule, {seeds} seed(s); "
        f"each cell: final {name} (best in brackets), mean ± std, and the arm's best rate "
        f"at batch {task.base_batch} (carried to the cell's batch by the family's rule).",
        "",
        "| optimizer | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for opt in optimizers:
        cells = []
        for b in batches:
            row = table.get(f"{opt} {b}")
            cells.append(
                "—"
                if row is None
                else f"{_cell(row['final'], digits)} ({_cell(row['best'], digits)}; "
                f"lr {row['lr']:.3g})"
            )
        lines.append(f"| {opt} | " + " | ".join(cells) + " |")
    if any(v is not None for row in table.values() for v in row["max_attention_logit"]):
        lines += ["", "Largest attention logit over training (mean ± std over seeds):", ""]
        lines += ["| optimizer | " + " | ".join(f"batch {b}" for b in batches) + " |"]
        lines += ["|---|" + "---|" * len(batches)]
        for opt in optimizers:
            cells = [
                _cell(table[f"{opt} {b}"]["max_attention_logit"], 2)
                if f"{opt} {b}" in table
                else "—"
                for b in batches
            ]
            lines.append(f"| {opt} | " + " | ".join(cells) + " |")
    lines += ["", f"![{name} against batch size](metric_vs_batch.png)", ""]
    (root / "scaling.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot(root, args, table, name, optimizers)


def plot(root: Path, args, table: dict[str, dict], name: str, optimizers: list[str]) -> None:
    from bigbatch.experiments.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.4))
    for opt in optimizers:
        rows = sorted(
            (r for r in table.values() if r["optimizer"] == opt), key=lambda r: r["batch"]
        )
        stats = [mean_std(r["final"]) for r in rows]
        ax.errorbar(
            [r["batch"] for r in rows],
            [s[0] for s in stats],
            yerr=[s[1] for s in stats],
            marker="o",
            capsize=3,
            label=opt,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (constant)")
    ax.set_ylabel(f"final {name}")
    ax.set_title(f"{args.task}: same samples at every batch", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "metric_vs_batch.png", dpi=110)
    plt.close(fig)

    logits = [r for r in table.values() if r["max_attention_logit"][0] is not None]
    if not logits:
        return
    batches = sorted({r["batch"] for r in logits})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3.4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for row in (r for r in logits if r["batch"] == batch):
            curve = _curve(Path(row["run"]), "max_attention_logit")
            ax.plot([c[0] for c in curve], [c[1] for c in curve], label=row["optimizer"])
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_xlabel("samples")
    axes[0][0].set_ylabel("largest attention logit")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "attention_logit.png", dpi=110)
    plt.close(fig)


def _curve(run: Path, key: str) -> list[tuple[int, float]]:
    """``(samples, value)`` at each logged step of a run that has ``key``."""
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return [(r["samples"], r[key]) for r in rows if r.get(key) is not None]


if __name__ == "__main__":
    main()
