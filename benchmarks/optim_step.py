"""Median optimizer step time on a GPT-2-like parameter set, against anchors run here.

Anchors, measured in the same process: torch.optim.AdamW(foreach),
torch.optim.SGD(momentum, foreach), timm Lamb and Lars (for-loop and foreach),
and the memory-traffic floor of each optimizer: the parameter-sized arrays its
step must move x 4 bytes x N / the bandwidth of an in-place ``mul_`` on a
128 MB tensor (docs/algorithms.md, "The memory floor of an optimizer step").

    python benchmarks/optim_step.py                 # the full table (~5 min on 2 cores)
    python benchmarks/optim_step.py --block-sweep   # choose _blocks.CPU_BLOCK_ELEMENTS
    python benchmarks/optim_step.py --scale 0.1 --no-compiled   # a quick look

timm is optional: its rows are left out when it is not installed
(``pip install --no-deps timm``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from bigbatch.optim import LAMB, LARS, MERIT, _blocks

# Arrays of parameter size a step must read or write at the least.
FLOOR_ARRAYS = {
    # global grad norm: g; moments: p, g, m, v read, m, v written; update: p, m, v read, p written
    "LAMB": 11,
    # norms: p, g; update: p, g, buf read, buf, p written
    "LARS": 7,
    # moments and max-norm ratios: p, g, m, v read, m, v written; update: p, m, v read, p written
    "MERIT": 10,
    "SGD": 5,  # g, buf, p read; buf, p written
    "AdamW": 7,  # g, m, v, p read; m, v, p written
}


def gpt2_like_shapes(
    blocks: int = 4, d: int = 768, vocab: int = 50257, context: int = 1024, scale: float = 1.0
) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-style decoder: embeddings, blocks, final norm."""
    vocab = max(8, int(vocab * scale))
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(blocks):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # ln1, attention
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln2, MLP
    return [*shapes, (d,), (d,)]


def make_params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def median_step_ms(optimizer: torch.optim.Optimizer, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inplace_mul_bandwidth(nbytes: int = 128 * 2**20, repeat: int = 20) -> float:
    """Bytes per second moved by ``x.mul_(c)`` (read + write) on a ``nbytes`` tensor."""
    x = torch.ones(nbytes // 4)
    x.mul_(1.0)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        x.mul_(1.0000001)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def load_timm_optim() -> types.ModuleType | None:
    """timm's ``optim`` package without ``timm/__init__`` (which imports torchvision)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = types.ModuleType("_timm_optim_bench")
    package.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "optim")]
    sys.modules[package.__name__] = package
    lamb = importlib.import_module(f"{package.__name__}.lamb")
    lars = importlib.import_module(f"{package.__name__}.lars")
    return types.SimpleNamespace(Lamb=lamb.Lamb, Lars=lars.Lars)


def candidates(args: argparse.Namespace) -> list[tuple[str, str, str, Callable]]:
    """(family, label, anchor family, factory(params) -> optimizer)."""
    impls = ["foreach", "reference"] + ([] if args.no_compiled else ["compiled"])
    rows: list[tuple[str, str, str, Callable]] = [
        (
            "AdamW",
            "torch AdamW foreach",
            "",
            lambda ps: torch.optim.AdamW(groups(ps, 0.01), lr=1e-3, foreach=True),
        ),
        (
            "SGD",
            "torch SGD momentum foreach",
            "",
            lambda ps: torch.optim.SGD(groups(ps, 0.0), lr=0.1, momentum=0.9, foreach=True),
        ),
    ]
    timm = load_timm_optim()
    if timm is not None:
        for foreach in (False, True):
            kind = "foreach" if foreach else "for-loop"
            rows.append(
                (
                    "LAMB",
                    f"timm Lamb {kind}",
                    "",
                    lambda ps, f=foreach: timm.Lamb(groups(ps, 0.01), lr=1e-3, foreach=f),
                )
            )
            rows.append(
                (
                    "LARS",
                    f"timm Lars {kind}",
                    "",
                    lambda ps, f=foreach: timm.Lars(
                        groups(ps, 1e-4), lr=0.1, momentum=0.9, foreach=f
                    ),
                )
            )
    for impl in impls:
        rows.append(
            (
                "LAMB",
                f"bigbatch LAMB {impl}",
                "timm Lamb foreach",
                lambda ps, i=impl: LAMB(groups(ps, 0.01), lr=1e-3, impl=i),
            )
        )
        rows.append(
            (
                "LARS",
                f"bigbatch LARS {impl}",
                "torch SGD momentum foreach",
                lambda ps, i=impl: LARS(groups(ps, 1e-4), lr=0.1, impl=i),
            )
        )
        rows.append(
            (
                "MERIT",
                f"bigbatch MERIT {impl}",
                "torch AdamW foreach",
                lambda ps, i=impl: MERIT(groups(ps, 0.01), lr=1e-3, impl=i),
            )
        )
    return rows


def run_table(args: argparse.Namespace) -> None:
    shapes = gpt2_like_shapes(scale=args.scale)
    params = make_params(shapes)
    n = sum(p.numel() for p in params)
    bandwidth = inplace_mul_bandwidth()
    print(
        f"# {n / 1e6:.1f}M fp32 params in {len(params)} tensors; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; "
        f"in-place mul_ bandwidth at start {bandwidth / 1e9:.1f} GB/s"
    )
    results: dict[str, float] = {}
    rows = []
    for family, label, anchor, factory in candidates(args):
        if args.only and not any(s.lower() in label.lower() for s in args.only):
            continue
        # The bandwidth drifts on a shared machine: each row's floor is measured beside it.
        floor = FLOOR_ARRAYS[family] * 4 * n / inplace_mul_bandwidth() * 1e3
        optimizer = factory(params)
        start = time.perf_counter()
        optimizer.step()  # state creation and, for impl="compiled", compilation
        first = time.perf_counter() - start
        ms = median_step_ms(optimizer, args.warmup, args.repeat)
        results[label] = ms
        rows.append((family, label, anchor, ms, floor))
        del optimizer
        gc.collect()
        print(f"  measured {label}: {ms:.1f} ms (first step {first:.1f} s)", file=sys.stderr)

    print()
    print("| step | median ms | × anchor (anchor) | × floor (floor ms) |")
    print("|---|---|---|---|")
    for _, label, anchor, ms, floor in rows:
        vs_anchor = f"{ms / results[anchor]:.2f} ({anchor})" if anchor in results else ""
        print(f"| {label} | {ms:.1f} | {vs_anchor} | {ms / floor:.2f} ({floor:.1f}) |")

    def best(family: str) -> tuple[str, float]:
        own = {k: v for k, v in results.items() if k.startswith(f"bigbatch {family}")}
        label = min(own, key=own.get)
        return label, own[label]

    print("\nTargets (issue 2):")
    checks = []
    floors = {label: floor for _, label, _, _, floor in rows}
    if "bigbatch LAMB compiled" in results:
        checks.append(
            (
                "compiled LAMB ≤ 1.5× its floor",
                results["bigbatch LAMB compiled"] / floors["bigbatch LAMB compiled"],
                1.5,
            )
        )
    if "timm Lamb foreach" in results and "bigbatch LAMB foreach" in results:
        checks.append(
            (
                "foreach LAMB ≤ 0.85× timm Lamb foreach",
                results["bigbatch LAMB foreach"] / results["timm Lamb foreach"],
                0.85,
            )
        )
    for family, anchor, bound in (
        ("LARS", "torch SGD momentum foreach", 1.5),
        ("MERIT", "torch AdamW foreach", 2.0),
    ):
        if anchor in results and any(k.startswith(f"bigbatch {family}") for k in results):
            label, ms = best(family)
            checks.append((f"{label} ≤ {bound}× {anchor}", ms / results[anchor], bound))
    for text, ratio, bound in checks:
        print(f"- {text}: {ratio:.2f} {'met' if ratio <= bound else 'NOT met'}")


def run_block_sweep(args: argparse.Namespace) -> None:
    params = make_params(gpt2_like_shapes(scale=args.scale))
    print("| CPU_BLOCK_ELEMENTS | LAMB foreach ms | LARS foreach ms |")
    print("|---|---|---|")
    for power in range(12, 22):
        _blocks.CPU_BLOCK_ELEMENTS = 1 << power
        lamb = median_step_ms(LAMB(groups(params, 0.01), lr=1e-3), args.warmup, args.repeat)
        lars = median_step_ms(LARS(groups(params, 1e-4), lr=0.1), args.warmup, args.repeat)
        print(f"| 2^{power} | {lamb:.1f} | {lars:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the vocabulary size (1.0: the full ~68M-parameter set)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--no-compiled", action="store_true", help="skip impl='compiled'")
    parser.add_argument("--only", nargs="*", help="run only rows whose label contains these")
    parser.add_argument(
        "--block-sweep",
        action="store_true",
        help="time foreach LAMB/LARS for block sizes 2^12..2^21",
    )
    args = parser.parse_args()
    if args.block_sweep:
        run_block_sweep(args)
    else:
        run_table(args)


if __name__ == "__main__":
    main()
