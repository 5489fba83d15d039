"""Median optimizer step time on a GPT-2-like parameter set, against anchors run here.

Anchors, measured in the same process: torch.optim.AdamW(foreach),
torch.optim.SGD(momentum, foreach), timm Lamb and Lars (for-loop and foreach),
and the memory-traffic floor of each optimizer: the parameter-sized arrays its
step must move x 4 bytes x N / the bandwidth of an in-place ``mul_`` on a
128 MB tensor (docs/algorithms.md, "The memory floor of an optimizer step").

    python benchmarks/optim_step.py                 # the full table (~5 min on 2 cores)
    python benchmarks/optim_step.py --block-sweep   # choose _blocks.CPU_BLOCK_ELEMENTS
    python benchmarks/optim_step.py --scale 0.1 --no-compiled   # a quick look
    python benchmarks/optim_step.py --device cuda --model 124M  # on a GPU (and --model 774M)
    python benchmarks/optim_step.py --device cuda --model 774M --fused-sweep  # fused chunk sizes

On a GPU the step is timed with CUDA events (median of 15 after 3 warm-up
steps), the floor's bandwidth is that of ``mul_`` on a 256 MB tensor on the
device, the anchors add torch's fused AdamW and SGD, and the table adds the
host synchronisations inside one ``step()`` (``torch.cuda.set_sync_debug_mode``)
and the first step's time (state creation and, for ``compiled``, compiling).

timm is optional: its rows are left out when it is not installed
(``pip install --no-deps timm``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

from _timing import seconds
from bigbatch.optim import LAMB, LARS, MERIT, _blocks
from bigbatch.testing import host_syncs

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


#: GPT-2 sizes as (blocks, d): 124M has 148 tensors, 774M 436
MODELS = {"small": (4, 768), "124M": (12, 768), "774M": (36, 1280)}


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


def make_params(shapes: list[tuple[int, ...]], device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device)
        params.append(p)
    return params


def groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def median_step_ms(
    optimizer: torch.optim.Optimizer, warmup: int, repeat: int, device: str = "cpu"
) -> float:
    for _ in range(warmup):
        optimizer.step()
    return statistics.median(seconds(optimizer.step, device) for _ in range(repeat)) * 1e3


def count_host_syncs(fn: Callable[[], object], device: str) -> int | None:
    """Host synchronisations ``fn`` makes on a GPU (sync debug mode); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    with host_syncs(device) as syncs:
        fn()
    return syncs.count


def inplace_mul_bandwidth(
    nbytes: int = 128 * 2**20, repeat: int = 20, device: str = "cpu"
) -> float:
    """Bytes per second moved by ``x.mul_(c)`` (read + write) on a ``nbytes`` tensor."""
    x = torch.ones(nbytes // 4, device=device)
    x.mul_(1.0)
    return (
        2
        * nbytes
        / statistics.median(seconds(lambda: x.mul_(1.0000001), device) for _ in range(repeat))
    )


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
    cuda = args.device.startswith("cuda")
    impls = ["foreach", "reference"] + ([] if args.no_compiled else ["compiled"])
    impls += ["fused"] if cuda else []  # Triton kernels: CUDA only
    fused: list[tuple[str, str, str, Callable]] = []
    if cuda:  # torch's fused kernels: the GPU anchors
        fused = [
            (
                "AdamW",
                "torch AdamW fused",
                "",
                lambda ps: torch.optim.AdamW(groups(ps, 0.01), lr=1e-3, fused=True),
            ),
            (
                "SGD",
                "torch SGD momentum fused",
                "",
                lambda ps: torch.optim.SGD(groups(ps, 0.0), lr=0.1, momentum=0.9, fused=True),
            ),
        ]
    rows: list[tuple[str, str, str, Callable]] = [
        *fused,
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
        # timm's Lamb and Lars take ``foreach`` only in some versions
        takes_foreach = "foreach" in inspect.signature(timm.Lamb).parameters
        for foreach in (False, True) if takes_foreach else (False,):
            kind = "foreach" if foreach else "for-loop"
            extra = {"foreach": foreach} if takes_foreach else {}
            rows.append(
                (
                    "LAMB",
                    f"timm Lamb {kind}",
                    "",
                    lambda ps, kw=extra: timm.Lamb(groups(ps, 0.01), lr=1e-3, **kw),
                )
            )
            rows.append(
                (
                    "LARS",
                    f"timm Lars {kind}",
                    "",
                    lambda ps, kw=extra: timm.Lars(groups(ps, 1e-4), lr=0.1, momentum=0.9, **kw),
                )
            )
    for impl in impls:
        rows.append(
            (
                "LAMB",
                f"bigbatch LAMB {impl}",
                "torch AdamW fused" if cuda else "timm Lamb foreach",
                lambda ps, i=impl: LAMB(groups(ps, 0.01), lr=1e-3, impl=i),
            )
        )
        rows.append(
            (
                "LARS",
                f"bigbatch LARS {impl}",
                "torch SGD momentum fused" if cuda else "torch SGD momentum foreach",
                lambda ps, i=impl: LARS(groups(ps, 1e-4), lr=0.1, impl=i),
            )
        )
        rows.append(
            (
                "MERIT",
                f"bigbatch MERIT {impl}",
                "torch AdamW fused" if cuda else "torch AdamW foreach",
                lambda ps, i=impl: MERIT(groups(ps, 0.01), lr=1e-3, impl=i),
            )
        )
    return rows


def run_table(args: argparse.Namespace) -> None:
    blocks, d = MODELS[args.model]
    shapes = gpt2_like_shapes(blocks=blocks, d=d, scale=args.scale)
    params = make_params(shapes, args.device)
    n = sum(p.numel() for p in params)
    probe = 256 * 2**20 if args.device.startswith("cuda") else 128 * 2**20
    bandwidth = inplace_mul_bandwidth(probe, device=args.device)
    where = (
        torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else f"{torch.get_num_threads()} CPU threads"
    )
    print(
        f"# {n / 1e6:.1f}M fp32 params in {len(params)} tensors; torch {torch.__version__}, "
        f"{where}; in-place mul_ bandwidth at start {bandwidth / 1e9:.1f} GB/s"
    )
    results: dict[str, float] = {}
    rows = []
    for family, label, anchor, factory in candidates(args):
        if args.only and not any(s.lower() in label.lower() for s in args.only):
            continue
        # The bandwidth drifts on a shared machine: each row's floor is measured beside it.
        floor = FLOOR_ARRAYS[family] * 4 * n / inplace_mul_bandwidth(probe, device=args.device)
        floor *= 1e3
        optimizer = factory(params)
        # state creation and, for impl="compiled", compilation
        first = seconds(optimizer.step, args.device)
        ms = median_step_ms(optimizer, args.warmup, args.repeat, args.device)
        syncs = count_host_syncs(optimizer.step, args.device)
        results[label] = ms
        rows.append((family, label, anchor, ms, floor, first, syncs))
        del optimizer
        gc.collect()
        print(f"  measured {label}: {ms:.1f} ms (first step {first:.1f} s)", file=sys.stderr)

    print()
    print("| step | median ms | × anchor (anchor) | × floor (floor ms) | first step s | syncs |")
    print("|---|---|---|---|---|---|")
    for _, label, anchor, ms, floor, first, syncs in rows:
        vs_anchor = f"{ms / results[anchor]:.2f} ({anchor})" if anchor in results else ""
        print(
            f"| {label} | {ms:.2f} | {vs_anchor} | {ms / floor:.2f} ({floor:.2f}) "
            f"| {first:.1f} | {'—' if syncs is None else syncs} |"
        )


def run_fused_sweep(args: argparse.Namespace) -> None:
    """impl="fused" at other chunk sizes (LAMB, LARS) and tile sizes (MERIT), on a GPU."""
    from bigbatch.optim import _fused

    blocks, d = MODELS[args.model]
    params = make_params(gpt2_like_shapes(blocks=blocks, d=d, scale=args.scale), args.device)
    adamw = torch.optim.AdamW(groups(params, 0.01), lr=1e-3, fused=True)
    base = median_step_ms(adamw, args.warmup, args.repeat, args.device)
    print(f"# {args.model}: torch AdamW fused {base:.2f} ms")
    defaults = (_fused.CHUNK, _fused.NUM_WARPS, _fused.TILE_ROWS, _fused.TILE_COLS, _fused.SUB_COLS)

    def timed_fused(make: Callable) -> float:
        _fused._layouts.clear()  # the tables depend on the sizes
        return median_step_ms(make(), args.warmup, args.repeat, args.device)

    for chunk, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        _fused.CHUNK, _fused.NUM_WARPS = chunk, warps
        lamb = timed_fused(lambda: LAMB(groups(params, 0.01), lr=1e-3, impl="fused"))
        lars = timed_fused(lambda: LARS(groups(params, 1e-4), lr=0.1, impl="fused"))
        print(f"chunk {chunk}, {warps} warps: LAMB {lamb:.2f} ms, LARS {lars:.2f} ms")
    _fused.CHUNK, _fused.NUM_WARPS = defaults[:2]
    for rows, cols, sub, warps in (
        (32, 512, 128, 8),
        (16, 512, 128, 4),
        (32, 256, 256, 8),
        (64, 512, 128, 8),
        (32, 1024, 256, 8),
        (8, 1024, 512, 4),
    ):
        _fused.TILE_ROWS, _fused.TILE_COLS, _fused.SUB_COLS, _fused.NUM_WARPS = (
            rows,
            cols,
            sub,
            warps,
        )
        merit = timed_fused(lambda: MERIT(groups(params, 0.01), lr=1e-3, impl="fused"))
        print(f"tile {rows}x{cols}/{sub}, {warps} warps: MERIT {merit:.2f} ms")
    _fused.CHUNK, _fused.NUM_WARPS, _fused.TILE_ROWS, _fused.TILE_COLS, _fused.SUB_COLS = defaults


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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default="small", choices=tuple(MODELS), help="GPT-2 size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=None, help="10 on the CPU, 15 on a GPU")
    parser.add_argument("--no-compiled", action="store_true", help="skip impl='compiled'")
    parser.add_argument("--only", nargs="*", help="run only rows whose label contains these")
    parser.add_argument(
        "--block-sweep",
        action="store_true",
        help="time foreach LAMB/LARS for block sizes 2^12..2^21",
    )
    parser.add_argument(
        "--fused-sweep",
        action="store_true",
        help="on a GPU: time impl='fused' at other chunk and tile sizes",
    )
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 15 if args.device.startswith("cuda") else 10
    if args.block_sweep:
        run_block_sweep(args)
    elif args.fused_sweep:
        run_fused_sweep(args)
    else:
        run_table(args)


if __name__ == "__main__":
    main()
