"""Every optimizer at its default recipe against the best of its own rate grid (issue 40).

    python benchmarks/recipes.py --out runs/recipes --jobs 2
    python benchmarks/recipes.py --tasks digits --settings b256 --optimizers lars sgd
    python benchmarks/recipes.py --tasks mnist1d --settings x16 x64 --optimizers sgd lars larc lamb

For each task, optimizer and setting — ``b256`` (constant batch 256),
``x16`` / ``x64`` (constant batch 16 and 64 times that: 4096, 16384),
``default`` (the default controller, batch_warmup from 16) and ``held``
(critical_ramp from 64, a controller that holds the rate: its recipe rate is
the task's held rate, which noise_scale and damped_simigrad get too, though
only critical_ramp is trained here) — one arm trains
at the task's default budget with everything at the optimizer's recipe
(``bigbatch.optim.RECIPES``): its rate is the task's measured rate carried
by the optimizer's batch rule, the same ×1 point a user gets with
``--set optimizer=NAME``. The arm's grid is that rate times ×0.5, ×1, ×2
(``x16``/``x64``: ×1/16 to ×1, since the linear rule's 16× and 64× are
where the SGD-type rates stop being stable), widened by ×2 steps up to
``--widen`` times until its best rate is inside it; the best is chosen by
the final score (accuracy; ``lm``/``text``: eval loss) and rerun on
``--seeds`` seeds. Runs already in ``--out`` are reused, so a killed
benchmark continues where it stopped. With ``--gammas``, each VRGD form
also trains at each of those γ (``vrgd.gamma``, the lower clip of its GSNR
ratio; the recipe's is 0.1), every γ an arm with its own bracketed rate
grid, so that γ and the rate are chosen together (rows ``NAME γ=G``).
``--set KEY=VALUE`` (repeatable) changes a config key for every arm, e.g.
the LARS paper's schedule (``--set schedule.kind=poly --set
schedule.warmup=0.17``); the keys the arms set themselves are refused.

Prints, and writes as ``recipes.md`` and ``recipes.json``: per cell the
default's final score (seed 0), the best rate's final score (mean ± std over
the seeds), the gap, and whether the default is within the goal (1 point;
0.02 nats on ``lm``/``text``). Cells already in ``--out``'s tables from an
earlier invocation stay, unless measured again.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from bigbatch.experiments.analysis import mean_std
from bigbatch.experiments.build import with_task_defaults
from bigbatch.experiments.config import ConfigError, parse_assignment, resolve
from bigbatch.experiments.sweep import Arm, ArmResult, metric, sweep

SETTINGS = {
    "b256": {"batch.controller": "constant", "batch.initial": 256},
    "x16": {"batch.controller": "constant", "batch.initial": 4096, "batch.max": 4096},
    "x64": {"batch.controller": "constant", "batch.initial": 16384, "batch.max": 16384},
    "default": {},
    "held": {"batch.controller": "critical_ramp"},
}
#: the rate grid around each arm's default rate, per setting
GRIDS = {
    "b256": (0.5, 1.0, 2.0),
    "default": (0.5, 1.0, 2.0),
    "held": (0.5, 1.0, 2.0),
    "x16": (0.0625, 0.25, 1.0),
    "x64": (0.0625, 0.25, 1.0),
}
#: how far below the best a default may end: 1 point of accuracy, 0.02 nats of loss
TOLERANCE = {"accuracy": 0.01, "loss": 0.02}


def cell_arms(optimizers: list[str], setting: str, gammas: Sequence[float] = ()) -> list[Arm]:
    """Each optimizer at its recipe, and each VRGD form at every other γ of ``gammas`` too."""
    from bigbatch.optim import RECIPES

    arms = []
    for name in optimizers:
        overrides = {"optimizer": name, **SETTINGS[setting]}
        arms.append(Arm(f"{name} {setting}", overrides, f"{name}-{setting}"))
        recipe = RECIPES.get(name)  # an unknown name is refused by the sweep's config check
        if recipe is None or "gamma" not in recipe.options:
            continue
        # one arm per γ named by its printed form, the recipe's own γ being the arm above
        others = {f"{g:g}": g for g in gammas if f"{g:g}" != f"{recipe.options['gamma']:g}"}
        arms += [
            Arm(f"{name} γ={g} {setting}", {**overrides, "vrgd.gamma": v}, f"{name}-g{g}-{setting}")
            for g, v in others.items()
        ]
    return arms


#: keys every arm sets itself, which ``--set`` may not change under it
ARM_KEYS = frozenset(
    # batch.lr_scaling: the recipe's rule (held or scaled) is part of what is measured
    {
        "task",
        "optimizer",
        "vrgd.gamma",
        "batch.lr_scaling",
        *(k for s in SETTINGS.values() for k in s),
    }
)


def merged(path: Path, rows: list[dict]) -> list[dict]:
    """``rows`` over the rows an earlier run wrote to ``path``: a cell measured again replaces
    its old row, the others stay (so two invocations into one ``--out`` keep both tables)."""
    key = lambda r: (r["task"], r["optimizer"], r["setting"])  # noqa: E731
    old = json.loads(path.read_text()) if path.is_file() else []
    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def row(task: str, setting: str, result: ArmResult, default_lr: float, lr_max: float = 0.0) -> dict:
    """One cell: the default rate's final score (seed 0) beside the best rate's seeds."""
    at_default = min(
        range(len(result.lrs)), key=lambda i: abs(math.log(result.lrs[i] / default_lr))
    )
    default = metric(result.grid[at_default], "final")
    finals = [metric(s, "final") for s in result.runs]
    mean, std = mean_std(finals)
    loss = result.runs[0].get("target_metric", "").endswith("loss")
    best_seed0 = finals[0]
    gap = (default - best_seed0) if loss else (best_seed0 - default)
    return {
        "task": task,
        "optimizer": result.overrides["optimizer"]
        + (f" γ={result.overrides['vrgd.gamma']:g}" if "vrgd.gamma" in result.overrides else ""),
        "setting": setting,
        "default_lr": default_lr,
        "default_lr_max": lr_max,
        "default_final": default,
        "best_lr": result.lr,
        "best_final_mean": mean,
        "best_final_std": std,
        "seeds": len(finals),
        # a seed that diverged has no score: counted here, left out of the mean
        "diverged": sum(1 for v in finals if v is None or not math.isfinite(v)),
        "gap": gap,
        "within": gap <= TOLERANCE["loss" if loss else "accuracy"] + 1e-12,
        "at_edge": result.at_edge,
        "grid": {f"{lr:.4g}": metric(s, "final") for lr, s in zip(result.lrs, result.grid)},
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| task | optimizer | setting | default lr | default final | best lr | best final "
        "(seeds) | gap | within |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        edge = " (edge)" if r["at_edge"] else ""
        ceiling = f" (≤ {r['default_lr_max']:.4g})" if r.get("default_lr_max") else ""
        lines.append(
            f"| {r['task']} | {r['optimizer']} | {r['setting']} | {r['default_lr']:.4g}"
            f"{ceiling} | "
            f"{r['default_final']:.4f} | {r['best_lr']:.4g}{edge} | "
            f"{r['best_final_mean']:.4f} ± {r['best_final_std']:.4f} ({r['seeds']}"
            f"{', ' + str(r['diverged']) + ' diverged' if r.get('diverged') else ''}) | "
            f"{r['gap']:+.4f} | {'yes' if r['within'] else '**no**'} |"
        )
    return "\n".join(lines)


def main() -> None:
    from bigbatch.optim import list_optimizers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/recipes")
    parser.add_argument("--tasks", nargs="+", default=["mnist1d", "digits"])
    parser.add_argument("--optimizers", nargs="+", default=list_optimizers())
    parser.add_argument("--settings", nargs="+", default=["b256", "default"], choices=SETTINGS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--widen", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    parser.add_argument(
        "--gammas", nargs="+", type=float, default=[], help="VRGD forms: also train at these γ"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key for every arm (repeatable)",
    )
    args = parser.parse_args()
    try:
        sets = dict(parse_assignment(a) for a in args.sets)
    except ConfigError as err:
        parser.error(str(err))
    if taken := sorted(set(sets) & ARM_KEYS):
        parser.error(f"--set {taken[0]}: every arm sets it (use --tasks, --optimizers, ...)")

    root = Path(args.out)
    rows = []
    for task in args.tasks:
        for setting in args.settings:
            multipliers = GRIDS[setting]
            arms = cell_arms(args.optimizers, setting, args.gammas)
            base = {"task": task, **sets}
            results = sweep(
                base,
                arms,
                root / task,
                multipliers=multipliers,
                seeds=args.seeds,
                rank="final",
                jobs=args.jobs,
                widen=args.widen,
            )
            # each arm's recipe: its rate and the ceiling it trains under (0: none), which
            # its grid scales with the rate (build.at_rate), so the ×1 point is the recipe
            recipes = [with_task_defaults(resolve({**base, **arm.overrides})) for arm in arms]
            rows += [
                row(task, setting, r, own["lr"], own["lr_max"]) for r, own in zip(results, recipes)
            ]
            root.mkdir(parents=True, exist_ok=True)
            everything = merged(root / "recipes.json", rows)
            (root / "recipes.json").write_text(json.dumps(everything, indent=1))
            (root / "recipes.md").write_text(table(everything) + "\n")
            print(table(rows[-len(results) :]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
