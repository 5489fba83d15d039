"""Adaptive local batches against fixed ones in a Flower federation (issue 38).

    python benchmarks/federated.py --out runs/federated --jobs 2
    python benchmarks/federated.py --splits dirichlet --seeds 3 --rounds 20

For each split (``iid``, ``dirichlet`` with α = 0.5) every arm — fixed local
batches (``--fixed``, bracketing the best), the seed paper's small/large
switch (``switch``: local batch ``--large`` for the first half of the
samples, then ``--switch-small``) and bigbatch's controller on the pooled
statistics (``adaptive N``, from each local batch N of ``--adaptive-start``) — gets the
same ×2 learning-rate grid (``--lrs``, the rate at the arm's own base
batch), widened by ×2 steps up to ``--widen`` times until its best rate is
inside it. The best rate is the one with the highest final test accuracy on
seed 0; it is rerun on ``--seeds`` seeds. All arms train the same samples
per round (``--local-samples`` per client) for ``--rounds`` rounds, under one
warm-up + cosine schedule in samples.

Reported per split and arm (mean over seeds, worst seed): the final
accuracy, and per target (``--targets``: fractions of the way from chance to
the best fixed arm's mean final accuracy) the rounds and the client steps
(sequential local steps, summed over rounds) to reach it, with the ratio of
client steps to the best fixed arm that reaches it in the fewest steps. Writes
``federated.md`` and ``federated.json`` in ``--out``; finished simulations are
reused, so a killed benchmark continues.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from _timing import at_least
from bigbatch.experiments.analysis import mean_std
from bigbatch.experiments.federated import first_reach, simulate
from bigbatch.experiments.options import FederatedSettings
from bigbatch.experiments.pool import in_processes

CHANCE = 0.1  # ten classes


def arms(args: argparse.Namespace) -> dict[str, dict]:
    out = {f"fixed {b}": {"scheme": "fixed", "local_batch": b} for b in args.fixed}
    out["switch"] = {"scheme": "switch", "large": args.large, "local_batch": args.switch_small}
    for start in args.adaptive_start:
        out[f"adaptive {start}"] = {"scheme": "adaptive", "local_batch": start}
    return out


def run_one(item: tuple[str, dict]) -> dict:
    """One simulation (reused from its directory when done)."""
    path, settings = item
    cfg = FederatedSettings(**settings)
    done = Path(path) / "summary.json"
    if done.exists():
        stored = json.loads(done.read_text())
        wanted = json.loads(json.dumps(asdict(cfg)))  # as JSON keeps it: tuples are lists
        if stored["config"] != wanted:  # another --rounds, --clients, ... in this --out
            raise SystemExit(f"{path} holds a run of other settings; use another --out")
        return stored
    result = simulate(cfg, Path(path), threads=1)
    return result["summary"] | {"config": result["config"]}


def run_all(out: Path, items: list[tuple[str, dict]], jobs: int) -> list[dict]:
    return in_processes(run_one, [(str(out / name), s) for name, s in items], jobs)


def base_settings(args: argparse.Namespace, split: str) -> dict:
    return {
        "task": args.task,
        "clients": args.clients,
        "split": split,
        "alpha": args.alpha,
        "rounds": args.rounds,
        "local_samples": args.local_samples,
        "targets": [],
    }


def lr_name(lr: float) -> str:
    return f"lr{lr:g}"


def tune_arm(args, out: Path, split: str, arm: str, settings: dict) -> tuple[float, dict]:
    """The arm's grid on seed 0, widened at an edge best; returns the best rate and results."""
    lrs = sorted(args.lrs)
    results: dict[float, dict] = {}
    for _ in range(args.widen + 1):
        todo = [lr for lr in lrs if lr not in results]
        items = [
            (f"{split}/{arm.replace(' ', '')}/{lr_name(lr)}-s0", {**settings, "lr": lr, "seed": 0})
            for lr in todo
        ]
        for lr, summary in zip(todo, run_all(out, items, args.jobs)):
            results[lr] = summary
        best = max(results, key=lambda lr: _rank(_final(results[lr])))
        if best == min(results):
            lrs = [best / 2, *sorted(results)]
        elif best == max(results):
            lrs = [*sorted(results), best * 2]
        else:
            break
    return best, results


def _final(summary: dict) -> float:
    """The final accuracy; NaN for a run that diverged."""
    value = summary["final_accuracy"]
    return value if value is not None and math.isfinite(value) else math.nan


def _rank(value: float) -> float:
    """For choosing a best: a diverged run ranks last."""
    return value if math.isfinite(value) else -1.0


def _mean(values: list[float]) -> float:
    """The mean of the finite values (a diverged seed is counted apart, not averaged in)."""
    return mean_std(values)[0]


def rows_of(out: Path, name: str) -> list[dict]:
    with open(out / name / "rounds.jsonl") as f:
        return [json.loads(line) for line in f]


def evaluate_split(args, out: Path, split: str) -> dict:
    table = {}
    for arm, extra in arms(args).items():
        settings = {**base_settings(args, split), **extra}
        best, grid = tune_arm(args, out, split, arm, settings)
        names = [f"{split}/{arm.replace(' ', '')}/{lr_name(best)}-s{s}" for s in range(args.seeds)]
        items = [(n, {**settings, "lr": best, "seed": s}) for s, n in enumerate(names)]
        summaries = run_all(out, items, args.jobs)
        table[arm] = {
            "lr": best,
            "grid": {f"{lr:g}": _final(s) for lr, s in sorted(grid.items())},
            "finals": [_final(s) for s in summaries],
            "rows": [rows_of(out, n) for n in names],
            "batches": summaries[0]["local_batches"],
        }
    fixed = [a for a in table if a.startswith("fixed")]
    best_fixed = max(fixed, key=lambda a: _rank(_mean(table[a]["finals"])))
    top = _mean(table[best_fixed]["finals"])
    targets = {f: CHANCE + f * (top - CHANCE) for f in args.targets}
    for entry in table.values():
        entry["reach"] = {}
        for f, target in targets.items():
            hits = [first_reach(rows, target) for rows in entry["rows"]]
            entry["reach"][f] = hits
    for f in targets:
        # the static frontier at this target: the fixed arm with the fewest mean client steps
        reached = [a for a in fixed if all(h is not None for h in table[a]["reach"][f])]
        frontier = min(
            reached,
            key=lambda a: statistics.mean(h[1] for h in table[a]["reach"][f]),
            default=None,
        )
        for entry in table.values():
            hits = entry["reach"][f]
            if frontier is None or any(h is None for h in hits):
                entry.setdefault("ratio", {})[f] = None
                continue
            base = statistics.mean(h[1] for h in table[frontier]["reach"][f])
            entry.setdefault("ratio", {})[f] = {
                "frontier": frontier,
                "mean": statistics.mean(h[1] for h in hits) / base,
                "worst": max(h[1] for h in hits) / base,
                "rounds": statistics.mean(h[0] for h in hits),
                "steps": statistics.mean(h[1] for h in hits),
            }
    return {"best_fixed": best_fixed, "best_fixed_final": top, "targets": targets, "arms": table}


def markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "# Federated: adaptive local batches against fixed ones",
        "",
        f"{args.task}, {args.clients} clients, {args.rounds} rounds of {args.local_samples} "
        f"samples per client, SGD (momentum 0.9), warm-up + cosine in samples; "
        f"{args.seeds} seeds at each arm's best rate (by final accuracy on seed 0).",
        "",
    ]
    for split, res in results.items():
        lines += [
            f"## {split}" + (f" (Dirichlet α = {args.alpha})" if split == "dirichlet" else ""),
            "",
            f"Best fixed: {res['best_fixed']} at {res['best_fixed_final']:.4f}. Targets: "
            + ", ".join(f"{int(f * 100)}% = {t:.3f}" for f, t in res["targets"].items()),
            "",
            "| arm | best lr | grid (final acc., seed 0) | final (mean ± sd) | gap | "
            + " | ".join(f"{int(f * 100)}%: rounds / steps / ratio (worst)" for f in res["targets"])
            + " |",
            "|---|---|---|---|---|" + "---|" * len(res["targets"]),
        ]
        for arm, e in res["arms"].items():
            mean, sd = mean_std(e["finals"])
            diverged = sum(not math.isfinite(v) for v in e["finals"])
            grid = ", ".join(f"{lr}: {v:.3f}" for lr, v in e["grid"].items())
            cells = []
            for f in res["targets"]:
                r = e["ratio"].get(f)
                cells.append(
                    "not reached"
                    if r is None
                    else f"{r['rounds']:.1f} / {r['steps']:.0f} / "
                    f"{r['mean']:.2f} ({r['worst']:.2f})"
                )
            lines.append(
                f"| {arm} | {e['lr']:g} | {grid} | {mean:.4f} ± {sd:.4f}"
                f"{f' ({diverged} diverged)' if diverged else ''} | "
                f"{mean - res['best_fixed_final']:+.4f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
        lines.append(
            "Local batches (seed 0): "
            + "; ".join(
                f"{arm}: {compress(e['batches'])}"
                for arm, e in res["arms"].items()
                if not arm.startswith("fixed")
            )
        )
        lines.append("")
    return "\n".join(lines)


def compress(batches: list[int]) -> str:
    """``16 x3, 32 x17``: the local batch per round, run-length encoded."""
    runs: list[list[int]] = []
    for b in batches:
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return ", ".join(f"{b} x{n}" for b, n in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/federated")
    p.add_argument("--task", default="mnist1d")
    p.add_argument("--splits", nargs="+", default=["iid", "dirichlet"])
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--clients", type=at_least(1), default=4)
    p.add_argument("--rounds", type=at_least(1), default=20)
    p.add_argument("--local-samples", type=at_least(1), default=1024)
    p.add_argument("--fixed", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    p.add_argument("--large", type=int, default=128)
    p.add_argument("--switch-small", type=int, default=32)
    p.add_argument("--adaptive-start", type=int, nargs="+", default=[4, 16])
    p.add_argument("--lrs", type=float, nargs="+", default=[0.0125, 0.025, 0.05, 0.1, 0.2])
    p.add_argument("--widen", type=at_least(0), default=2)
    p.add_argument("--seeds", type=at_least(1), default=3)
    p.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.75, 0.9, 0.95, 0.99])
    p.add_argument("--jobs", type=at_least(1), default=1)
    args = p.parse_args()
    out = Path(args.out)
    results = {split: evaluate_split(args, out, split) for split in args.splits}
    text = markdown(results, args)
    (out / "federated.md").write_text(text)
    for res in results.values():
        for e in res["arms"].values():
            e.pop("rows")
    (out / "federated.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1, default=str)
    )
    print(text)


if __name__ == "__main__":
    main()
