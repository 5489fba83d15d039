"""``bigbatch tune`` against the full ×2 rate grid, and the short-horizon bias.

    python benchmarks/tune_vs_grid.py --task mnist1d --out runs/tune-mnist1d --jobs 2
    python benchmarks/tune_vs_grid.py --task lm --out runs/tune-lm --jobs 2 --top 3

For one task and its default ``bigbatch train`` config (one thread per run):

- **Grid**: the rates of ``bigbatch tune``'s default space (the task's rate
  × 1/8 ... 8, seven points by ×2), trained to the end on ``--seeds`` seeds
  (with ``--top K``, the further seeds only at the K best rates of seed 0).
  The grid's best rate is the one with the best seed-mean final metric.
- **Tune**: one study per seed ``s`` (training seed and sampler seed ``s``),
  stopped at ``--budget`` of the grid's samples (the grid on one seed). The
  tuned rate is then trained on the other seeds, so that its seed-mean final
  metric is compared with the grid's best on the same seeds.
- **Short-horizon bias**: the best rate of the grid runs judged at a prefix of
  their run (what the pruner sees at a low fidelity: the schedule laid over
  the whole budget), and the best rate of runs whose whole schedule is
  compressed into that many samples (``--horizons``; what a tuner that
  shortens runs would choose).

Writes ``tune_vs_grid.md`` and ``tune_vs_grid.json`` into ``--out``;
finished runs and studies there are reused.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Any

from bigbatch.experiments.arms import metric
from bigbatch.experiments.build import at_rate, with_task_defaults
from bigbatch.experiments.config import resolve
from bigbatch.experiments.rundir import read_metrics
from bigbatch.experiments.sweep import run_all
from bigbatch.experiments.tasks import TASKS
from bigbatch.experiments.tune import TuneSettings, default_space, tune

PREFIXES = (Fraction(1, 27), Fraction(1, 9), Fraction(1, 3))


def main() -> None:
    args = _arguments()
    out = Path(args.out)
    base: dict[str, Any] = {"task": args.task, "threads": 1}
    if args.max_samples:
        base["max_samples"] = args.max_samples
    budget = with_task_defaults(resolve(base))["max_samples"]
    loss = TASKS[args.task].target_metric.endswith("loss")
    space = default_space(base)[0]
    rates = [space.low * 2**k for k in range(space.grid_points())]
    seeds = list(range(args.seeds))

    grid = _grid(base, rates, seeds, out / "grid", args, loss)
    horizons = {
        str(f): _grid(
            {**base, "max_samples": round(float(Fraction(f)) * budget)},
            rates,
            seeds if not args.top else seeds[:1],
            out / f"horizon-{Fraction(f).denominator}",
            argparse.Namespace(**{**vars(args), "top": 0}),
            loss,
        )
        for f in args.horizons
    }
    studies = _studies(base, seeds, out, args)
    verified = _verify(base, studies, seeds, out / "verify", args.jobs)
    result = _summarise(grid, horizons, studies, verified, rates, seeds, budget, loss, args)
    (out / "tune_vs_grid.json").write_text(json.dumps(result, indent=1))
    (out / "tune_vs_grid.md").write_text(_render(result))
    print(_render(result))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="mnist1d", choices=sorted(TASKS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--top", type=int, default=0, help="further seeds at the K best rates")
    parser.add_argument("--budget", type=float, default=0.25, help="0: no budget")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--horizons", nargs="*", default=["1/9"], help="compressed schedules")
    parser.add_argument("--max-samples", type=int, default=0, help="the task's budget if 0")
    parser.add_argument("--jobs", type=int, default=1)
    return parser.parse_args()


def _grid(
    base: dict[str, Any],
    rates: list[float],
    seeds: list[int],
    root: Path,
    args: argparse.Namespace,
    loss: bool,
) -> dict[tuple[int, int], dict[str, Any]]:
    """Summaries of the grid runs by (rate index, seed)."""

    def jobs(pairs: list[tuple[int, int]]) -> list[tuple[dict[str, Any], str]]:
        return [
            (at_rate({**base, "seed": s}, rates[i]), str(root / f"lr{i}-seed{s}")) for i, s in pairs
        ]

    first = [(i, seeds[0]) for i in range(len(rates))]
    done = dict(zip(first, run_all(jobs(first), args.jobs)))
    if args.top:
        ranked = sorted(range(len(rates)), key=lambda i: _sign(loss) * _final(done[i, seeds[0]]))
        chosen = sorted(ranked[: args.top])
    else:
        chosen = list(range(len(rates)))
    more = [(i, s) for s in seeds[1:] for i in chosen]
    done.update(zip(more, run_all(jobs(more), args.jobs)))
    for (i, s), summary in done.items():
        summary["dir"] = str(root / f"lr{i}-seed{s}")
    return done


def _final(summary: dict[str, Any]) -> float:
    value = metric(summary, "final")
    return value if math.isfinite(value) else math.nan


def _sign(loss: bool) -> int:
    """Multiply a metric by this to make lower better."""
    return 1 if loss else -1


def _tune_one(job: tuple[dict[str, Any], str, int, float, int]) -> dict[str, Any]:
    config, out, seed, budget, trials = job
    settings = TuneSettings(trials=trials, budget=budget or None, seed=seed)
    result = tune(config, Path(out), settings=settings)
    return {
        "seed": seed,
        "lr": result.best["lr"],
        "value": result.best_value,
        "cost": result.cost,
        "samples": result.samples,
        "grid_samples": result.grid_samples,
        "best_dir": str(result.best_dir),
        "trials": len(result.trials),
        "complete": sum(t["state"] == "complete" for t in result.trials),
    }


def _studies(
    base: dict[str, Any], seeds: list[int], out: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    jobs = [
        ({**base, "seed": s}, str(out / f"tune-seed{s}"), s, args.budget, args.trials)
        for s in seeds
    ]
    if args.jobs <= 1:
        return [_tune_one(j) for j in jobs]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        return list(pool.map(_tune_one, jobs))


def _verify(
    base: dict[str, Any], studies: list[dict[str, Any]], seeds: list[int], root: Path, jobs: int
) -> dict[int, list[dict[str, Any]]]:
    """Each study's rate on every seed (its own seed's run is the study's best trial)."""
    pairs = [(study, t) for study in studies for t in seeds if t != study["seed"]]
    configs = [
        (at_rate({**base, "seed": t}, study["lr"]), str(root / f"tuned{study['seed']}-seed{t}"))
        for study, t in pairs
    ]
    runs = dict(zip(((p[0]["seed"], p[1]) for p in pairs), run_all(configs, jobs)))
    for study in studies:
        own = json.loads((Path(study["best_dir"]) / "summary.json").read_text())
        runs[study["seed"], study["seed"]] = own
    return {st["seed"]: [runs[st["seed"], t] for t in seeds] for st in studies}


def _at(run_dir: str, samples: float, key: str) -> float:
    """The last evaluation of a run at or before ``samples``."""
    rows = [r for r in read_metrics(Path(run_dir)) if key in r and r["samples"] <= samples]
    return rows[-1][key] if rows else math.nan


def _best_rate(scores: dict[int, float], loss: bool) -> int:
    finite = {i: v for i, v in scores.items() if math.isfinite(v)}
    return min(finite, key=lambda i: _sign(loss) * finite[i])


def _summarise(
    grid: dict[tuple[int, int], dict[str, Any]],
    horizons: dict[str, dict[tuple[int, int], dict[str, Any]]],
    studies: list[dict[str, Any]],
    verified: dict[int, list[dict[str, Any]]],
    rates: list[float],
    seeds: list[int],
    budget: int,
    loss: bool,
    args: argparse.Namespace,
) -> dict[str, Any]:
    key = "eval_loss" if loss else "eval_accuracy"
    full_seeds = {i: [s for s in seeds if (i, s) in grid] for i in range(len(rates))}
    grid_mean = {
        i: statistics.fmean(_final(grid[i, s]) for s in full_seeds[i]) for i in range(len(rates))
    }
    # the grid's best among the rates trained on every seed
    complete = {i: v for i, v in grid_mean.items() if len(full_seeds[i]) == len(seeds)}
    best = _best_rate(complete, loss)
    prefix = {}
    for f in PREFIXES:
        scores = {i: _at(grid[i, seeds[0]]["dir"], f * budget, key) for i in range(len(rates))}
        prefix[str(f)] = {"rate": rates[_best_rate(scores, loss)], "scores": scores}
    compressed = {}
    for f, runs in horizons.items():
        on = sorted({s for _, s in runs})
        scores = {i: statistics.fmean(_final(runs[i, s]) for s in on) for i in range(len(rates))}
        compressed[f] = {"rate": rates[_best_rate(scores, loss)], "scores": scores, "seeds": on}
    tuned = []
    for study in studies:
        finals = [_final(r) for r in verified[study["seed"]]]
        mean = statistics.fmean(finals)
        gap = _sign(loss) * (mean - grid_mean[best])
        tuned.append({**study, "finals": finals, "mean": mean, "gap": gap})
    return {
        "task": args.task,
        "budget": budget,
        "seeds": seeds,
        "top": args.top,
        "rates": rates,
        "grid_mean": grid_mean,
        "grid_seeds": full_seeds,
        "grid_best": rates[best],
        "grid_best_mean": grid_mean[best],
        "prefix": prefix,
        "compressed": compressed,
        "tuned": tuned,
        "loss": loss,
        "tune_budget": args.budget,
        "trials": args.trials,
    }


def _render(r: dict[str, Any]) -> str:
    unit = "nats" if r["loss"] else "pt"
    scale = 1 if r["loss"] else 100
    lines = [
        f"# bigbatch tune against the ×2 grid: {r['task']}",
        "",
        f"Budget {r['budget']:,} samples per run; grid seeds {r['seeds']}"
        + (f" (further seeds at the {r['top']} best rates of seed 0)" if r["top"] else ""),
        "",
        "| rate | grid final (seed mean) | seeds | best at 1/27 | 1/9 | 1/3 of the run |",
        "|---|---|---|---|---|---|",
    ]
    for i, lr in enumerate(r["rates"]):
        marks = [
            "←" if r["prefix"][str(f)]["rate"] == lr else "" for f in PREFIXES
        ]  # the prefix's best rate
        lines.append(
            f"| {lr:.4g}{' **best**' if lr == r['grid_best'] else ''} | "
            f"{r['grid_mean'][i]:.4f} | {len(r['grid_seeds'][i])} | " + " | ".join(marks) + " |"
        )
    lines += ["", "Short horizon: the best rate when judged early, and when trained short:", ""]
    for f in PREFIXES:
        rate = r["prefix"][str(f)]["rate"]
        lines.append(
            f"- prefix {f} of the full schedule (seed {r['seeds'][0]}): {rate:.4g} "
            f"(×{rate / r['grid_best']:g} the full run's best)"
        )
    for f, c in r["compressed"].items():
        lines.append(
            f"- the whole schedule in {f} of the samples (seeds {c['seeds']}): {c['rate']:.4g} "
            f"(×{c['rate'] / r['grid_best']:g} the full run's best)"
        )
    lines += [
        "",
        f"Tuned (`bigbatch tune`, default space, {r['trials']} trials, budget "
        f"{r['tune_budget'] or 'none'}):",
        "",
        "| study seed | trials (complete) | cost / grid | tuned rate | its final, seed mean "
        f"| gap to the grid's best ({unit}) |",
        "|---|---|---|---|---|---|",
    ]
    for t in r["tuned"]:
        lines.append(
            f"| {t['seed']} | {t['trials']} ({t['complete']}) | {t['cost']:.2f} | "
            f"{t['lr']:.4g} | {t['mean']:.4f} | {scale * t['gap']:+.3f} |"
        )
    lines.append("")
    lines.append(
        f"Grid best {r['grid_best']:.4g}: {r['grid_best_mean']:.4f} (positive gap: the tuned "
        "rate is worse)."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
