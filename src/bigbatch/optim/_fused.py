"""``impl="fused"``: LAMB, LARS and MERIT as a few multi-tensor Triton kernels on CUDA,
each parameter-sized array moved the minimum number of times (docs/algorithms.md,
"The memory floor of an optimizer step"; docs/optimizers.md, "The four
implementations"). No host sync; float32 state and arithmetic for low-precision
parameters; float64, non-contiguous and MERIT's >2-d tensors run through ``foreach``.
With ``TRITON_INTERPRET=1`` set before import the kernels run on CPU tensors."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._tensors import norms
from ._trust import lars_ratio

#: dtypes the kernels read and write; others take the foreach update
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: elements per program of the element-wise kernels
CHUNK = 4096
#: MERIT's tile: rows per program, columns per program, columns per inner step
TILE_ROWS, TILE_COLS, SUB_COLS = 32, 512, 128
#: width of the virtual rows a one-dimensional tensor is cut into for MERIT
#: (its ratio is a single scalar, so only the maxima over all elements matter)
FLAT_WIDTH = 2048
#: partial sums one program of a reduction kernel reads per iteration
REDUCE_BLOCK = 1024
#: warps per program of the element-wise and tile kernels
NUM_WARPS = 8


def interpreted() -> bool:
    """The kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_lamb_moments_kernel).__name__ == "InterpretedFunction"


def check_device(device: torch.device) -> None:
    if device.type != "cuda" and not interpreted():
        raise ValueError(
            f"impl='fused' runs on CUDA, but parameters are on {device}; use impl='foreach'"
        )


# ---------------------------------------------------------------- kernels


@triton.jit
def _chunk(chunk_tensor, first_chunk, numels, BLOCK: tl.constexpr):
    """This program's chunk: its id, its tensor, the element indices and their mask."""
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    start = (c - tl.load(first_chunk + t)).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    return c, t, idx, idx < tl.load(numels + t)


@triton.jit
def _offset(offsets, list_index, n, t, ALIGN: tl.constexpr):
    """Element offset of tensor ``t`` of list ``list_index`` from that list's first tensor."""
    return tl.multiple_of(tl.load(offsets + list_index * n + t), ALIGN)


@triton.jit
def _rounded(x, P):
    """``x`` (float32) in the dtype of ``P``'s elements, rounded to nearest as torch's copy does."""
    return x.to(P.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit
def _learning_rate(lr, lr_ptr, LR_PTR: tl.constexpr):
    if LR_PTR:
        return tl.load(lr_ptr).to(tl.float32)
    return lr


@triton.jit
def _lamb_moments_kernel(
    P, G, M, V, offsets, n, chunk_tensor, first_chunk, numels,
    clip_ptr, lr, lr_ptr, w_part, u_part, step_scale,
    one_minus_beta1, beta2, one_minus_beta2, eps_hat, coupled, weight_decay,
    HAS_CLIP: tl.constexpr, COUPLED: tl.constexpr, DECOUPLED: tl.constexpr,
    ADAPT: tl.constexpr, LR_PTR: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    c, t, idx, mask = _chunk(chunk_tensor, first_chunk, numels, BLOCK)
    p_at = P + _offset(offsets, 0, n, t, ALIGN) + idx
    m_at = M + _offset(offsets, 2, n, t, ALIGN) + idx
    v_at = V + _offset(offsets, 3, n, t, ALIGN) + idx
    p = tl.load(p_at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + _offset(offsets, 1, n, t, ALIGN) + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_at, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_at, mask=mask, other=0.0).to(tl.float32)
    if HAS_CLIP:
        g = g / tl.load(clip_ptr)
    m = m + one_minus_beta1 * (g - m)  # torch.lerp's formula for a weight below 0.5
    v = v * beta2 + one_minus_beta2 * (g * g)
    tl.store(m_at, m, mask=mask)
    tl.store(v_at, v, mask=mask)
    u = m / (tl.sqrt(v) + eps_hat)
    if COUPLED:
        u = u + coupled * p
    lr_value = _learning_rate(lr, lr_ptr, LR_PTR)
    if ADAPT:
        if DECOUPLED:  # the ratio sees the decayed weight; the update writes it
            p = p * (1.0 - lr_value * weight_decay)
        tl.store(w_part + c, tl.sum(p * p, axis=0))
        tl.store(u_part + c, tl.sum(u * u, axis=0))
    else:  # no trust ratio: the update is final, written in this one pass
        tl.store(p_at, _rounded(p - (lr_value * step_scale) * u, P), mask=mask)


@triton.jit
def _lamb_ratio_kernel(
    w_part, u_part, first_chunk, step_sizes, lr, lr_ptr, step_scale,
    TRUST_CLIP: tl.constexpr, LR_PTR: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per tensor: its norms from its chunks' partial sums, in chunk order;
    ``ROUNDS`` is a constant bound because Triton's interpreter needs one."""
    t = tl.program_id(0)
    lo, hi = tl.load(first_chunk + t), tl.load(first_chunk + t + 1)
    w_sq = tl.zeros([BLOCK], tl.float32)
    u_sq = tl.zeros([BLOCK], tl.float32)
    for k in range(0, ROUNDS):
        i = lo + k * BLOCK + tl.arange(0, BLOCK)
        w_sq += tl.load(w_part + i, mask=i < hi, other=0.0)
        u_sq += tl.load(u_part + i, mask=i < hi, other=0.0)
    w_norm = tl.sqrt(tl.sum(w_sq, axis=0))
    u_norm = tl.sqrt(tl.sum(u_sq, axis=0)) * step_scale
    ratio = tl.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
    if TRUST_CLIP:
        ratio = tl.minimum(ratio, 1.0)
    lr_value = _learning_rate(lr, lr_ptr, LR_PTR)
    tl.store(step_sizes + t, ratio * (-lr_value * step_scale))


@triton.jit
def _lamb_apply_kernel(
    P, M, V, offsets, n, chunk_tensor, first_chunk, numels,
    step_sizes, lr, lr_ptr, eps_hat, coupled, weight_decay,
    COUPLED: tl.constexpr, DECOUPLED: tl.constexpr, LR_PTR: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _, t, idx, mask = _chunk(chunk_tensor, first_chunk, numels, BLOCK)
    p_at = P + _offset(offsets, 0, n, t, ALIGN) + idx
    p = tl.load(p_at, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + _offset(offsets, 2, n, t, ALIGN) + idx, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + _offset(offsets, 3, n, t, ALIGN) + idx, mask=mask, other=0.0).to(tl.float32)
    u = m / (tl.sqrt(v) + eps_hat)
    if COUPLED:
        u = u + coupled * p
    if DECOUPLED:
        p = p * (1.0 - _learning_rate(lr, lr_ptr, LR_PTR) * weight_decay)
    tl.store(p_at, _rounded(p + tl.load(step_sizes + t) * u, P), mask=mask)


@triton.jit
def _lars_apply_kernel(
    P, G, B, offsets, n, chunk_tensor, first_chunk, numels,
    ratios, lr, lr_ptr, weight_decay, momentum, one_minus_dampening,
    ADAPT: tl.constexpr, HAS_DECAY: tl.constexpr, MOMENTUM: tl.constexpr,
    FIRST: tl.constexpr, NESTEROV: tl.constexpr, LR_PTR: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _, t, idx, mask = _chunk(chunk_tensor, first_chunk, numels, BLOCK)
    p_at = P + _offset(offsets, 0, n, t, ALIGN) + idx
    p = tl.load(p_at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + _offset(offsets, 1, n, t, ALIGN) + idx, mask=mask, other=0.0).to(tl.float32)
    if ADAPT:
        if HAS_DECAY:
            g = g + weight_decay * p
        g = g * tl.load(ratios + t)
    if MOMENTUM:
        b_at = B + _offset(offsets, 2, n, t, ALIGN) + idx
        if FIRST:  # a new buffer starts as the adapted gradient (torch SGD, timm)
            b = g
        else:
            b = tl.load(b_at, mask=mask, other=0.0).to(tl.float32) * momentum
            b = b + one_minus_dampening * g
        tl.store(b_at, b, mask=mask)
        g = g + momentum * b if NESTEROV else b
    tl.store(p_at, _rounded(p - g * _learning_rate(lr, lr_ptr, LR_PTR), P), mask=mask)


@triton.jit
def _tile(tiles, shapes, maxima_at, ROWS: tl.constexpr):
    """This program's tile of a MERIT tensor seen as a matrix, with its tensor's facts."""
    k = tl.program_id(0)
    t = tl.load(tiles + 3 * k)
    row0 = tl.load(tiles + 3 * k + 1).to(tl.int64)
    col0 = tl.load(tiles + 3 * k + 2).to(tl.int64)
    n_rows = tl.load(shapes + 3 * t)
    n_cols = tl.load(shapes + 3 * t + 1)
    numel = tl.load(shapes + 3 * t + 2)
    rows = row0 + tl.arange(0, ROWS)
    row_at = tl.load(maxima_at + 2 * t)  # where this tensor's row maxima start
    col_at = tl.load(maxima_at + 2 * t + 1)
    return t, rows, col0, n_rows, n_cols, numel, row_at, col_at


@triton.jit
def _merit_moments_kernel(
    P, G, M, V, offsets, n, tiles, shapes, maxima_at,
    row_w, row_u, col_w, col_u, layer_w, layer_u,
    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
    ALIGN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    t, rows, col0, n_rows, n_cols, numel, row_at, col_at = _tile(tiles, shapes, maxima_at, ROWS)
    p_base = P + _offset(offsets, 0, n, t, ALIGN)
    g_base = G + _offset(offsets, 1, n, t, ALIGN)
    m_base = M + _offset(offsets, 2, n, t, ALIGN)
    v_base = V + _offset(offsets, 3, n, t, ALIGN)
    best_w = tl.zeros([ROWS], tl.float32)
    best_u = tl.zeros([ROWS], tl.float32)
    for j in tl.static_range(0, COLS, SUB):
        cols = col0 + j + tl.arange(0, SUB)
        flat = rows[:, None] * n_cols + cols[None, :]
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols) & (flat < numel)
        p = tl.load(p_base + flat, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_base + flat, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_base + flat, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_base + flat, mask=mask, other=0.0).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        tl.store(m_base + flat, m, mask=mask)
        tl.store(v_base + flat, v, mask=mask)
        u = m / (tl.sqrt(v) + eps) + weight_decay * p
        abs_p = tl.where(mask, tl.abs(p), 0.0)
        abs_u = tl.where(mask, tl.abs(u), 0.0)
        best_w = tl.maximum(best_w, tl.max(abs_p, axis=1))
        best_u = tl.maximum(best_u, tl.max(abs_u, axis=1))
        col_mask = cols < n_cols
        tl.atomic_max(col_w + col_at + cols, tl.max(abs_p, axis=0), mask=col_mask)
        tl.atomic_max(col_u + col_at + cols, tl.max(abs_u, axis=0), mask=col_mask)
    row_mask = rows < n_rows
    tl.atomic_max(row_w + row_at + rows, best_w, mask=row_mask)
    tl.atomic_max(row_u + row_at + rows, best_u, mask=row_mask)
    tl.atomic_max(layer_w + t, tl.max(best_w, axis=0))
    tl.atomic_max(layer_u + t, tl.max(best_u, axis=0))


@triton.jit
def _merit_apply_kernel(
    P, M, V, offsets, n, tiles, shapes, maxima_at, matrix,
    row_w, row_u, col_w, col_u, layer_w, layer_u, lr, lr_ptr, eps, weight_decay,
    LR_PTR: tl.constexpr, ALIGN: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    t, rows, col0, n_rows, n_cols, numel, row_at, col_at = _tile(tiles, shapes, maxima_at, ROWS)
    p_base = P + _offset(offsets, 0, n, t, ALIGN)
    m_base = M + _offset(offsets, 2, n, t, ALIGN)
    v_base = V + _offset(offsets, 3, n, t, ALIGN)
    row_mask = rows < n_rows
    rw = tl.load(row_w + row_at + rows, mask=row_mask, other=1.0)[:, None]
    ru = tl.load(row_u + row_at + rows, mask=row_mask, other=1.0)[:, None]
    lw, lu = tl.load(layer_w + t), tl.load(layer_u + t)
    layer = tl.where((lw > 0) & (lu > 0), lw / lu, 1.0)
    is_matrix = tl.load(matrix + t) != 0
    lr_value = _learning_rate(lr, lr_ptr, LR_PTR)
    for j in tl.static_range(0, COLS, SUB):
        cols = col0 + j + tl.arange(0, SUB)
        flat = rows[:, None] * n_cols + cols[None, :]
        mask = row_mask[:, None] & (cols[None, :] < n_cols) & (flat < numel)
        p = tl.load(p_base + flat, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_base + flat, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_base + flat, mask=mask, other=0.0).to(tl.float32)
        u = m / (tl.sqrt(v) + eps) + weight_decay * p
        cw = tl.load(col_w + col_at + cols, mask=cols < n_cols, other=1.0)[None, :]
        cu = tl.load(col_u + col_at + cols, mask=cols < n_cols, other=1.0)[None, :]
        # max(row, column, layer) ratio; 1 wherever one of its maxima is 0
        tau = tl.maximum(tl.maximum(rw / ru, cw / cu), layer)
        degenerate = (rw == 0) | (ru == 0) | (cw == 0) | (cu == 0)
        tau = tl.where(degenerate, 1.0, tau)
        tau = tl.where(is_matrix, tau, layer)  # a vector has one ratio: its layer's
        step = tl.minimum(tl.maximum(u * tau, -1.0), 1.0)
        tl.store(p_base + flat, _rounded(p - step * lr_value, P), mask=mask)


# ---------------------------------------------------------------- layouts


@dataclass
class _Layout:
    """Device tables that map programs to tensors, for one set of shapes."""

    grid: int  # programs of the element-wise (or tile) kernels
    tables: dict[str, Tensor]
    sizes: tuple[int, ...] = ()  # host facts: the most chunks of a tensor; MERIT: all rows, columns


_layouts: dict[tuple, _Layout] = {}
_MAX_LAYOUTS = 64


def _cached(key: tuple, build: Callable[[], dict[str, list[int]]], device: torch.device) -> _Layout:
    layout = _layouts.get(key)
    if layout is None:
        lists = build()
        grid, sizes = lists.pop("grid")[0], tuple(lists.pop("sizes", ()))
        tables = {name: _to_device(torch.tensor(values), device) for name, values in lists.items()}
        if len(_layouts) >= _MAX_LAYOUTS:
            _layouts.pop(next(iter(_layouts)))
        layout = _layouts[key] = _Layout(grid, tables, sizes)
    return layout


def _chunk_layout(numels: Sequence[int], device: torch.device) -> _Layout:
    def build() -> dict[str, list[int]]:
        chunk_tensor, first_chunk = [], [0]
        for t, numel in enumerate(numels):
            count = triton.cdiv(numel, CHUNK)
            chunk_tensor += [t] * count
            first_chunk.append(first_chunk[-1] + count)
        most = max(b - a for a, b in itertools.pairwise(first_chunk))
        return {
            "grid": [len(chunk_tensor)],
            "sizes": [most],  # the most chunks of one tensor
            "chunk_tensor": chunk_tensor,
            "first_chunk": first_chunk,
            "numels": list(numels),
        }

    return _cached(("chunks", CHUNK, device, tuple(numels)), build, device)


def _matrix_shape(t: Tensor) -> tuple[int, int, bool]:
    """(rows, columns, is a matrix) of a MERIT tensor (at most two dimensions)."""
    if t.ndim == 2:
        return t.shape[0], t.shape[1], True
    width = max(1, min(t.numel(), FLAT_WIDTH))
    return triton.cdiv(t.numel(), width), width, False


def _tile_layout(tensors: Sequence[Tensor], device: torch.device) -> _Layout:
    shapes = [_matrix_shape(t) for t in tensors]

    def build() -> dict[str, list[int]]:
        tiles, flat_shapes, maxima_at, matrix = [], [], [], []
        rows_total = cols_total = 0
        for t, ((rows, cols, is_matrix), tensor) in enumerate(zip(shapes, tensors)):
            for row in range(0, rows, TILE_ROWS):
                for col in range(0, cols, TILE_COLS):
                    tiles += [t, row, col]
            flat_shapes += [rows, cols, tensor.numel()]
            maxima_at += [rows_total, cols_total]
            matrix.append(int(is_matrix))
            rows_total += rows
            cols_total += cols
        return {
            "grid": [len(tiles) // 3],
            "tiles": tiles,
            "shapes": flat_shapes,
            "maxima_at": maxima_at,
            "matrix": matrix,
            "sizes": [rows_total, cols_total],
        }

    key = ("tiles", TILE_ROWS, TILE_COLS, device, tuple(tuple(t.shape) for t in tensors))
    return _cached(key, build, device)


def _offsets(lists: Sequence[Sequence[Tensor]], device: torch.device) -> tuple[Tensor, int]:
    """Each tensor's element offset from its list's first, ``[len(lists), n]`` on device,
    and their common alignment (16 bytes, else 1 element)."""
    values, aligned = [], True
    for tensors in lists:
        base, size = tensors[0].data_ptr(), tensors[0].element_size()
        for t in tensors:
            address = t.data_ptr()
            aligned = aligned and address % 16 == 0
            values.append((address - base) // size)
    align = min(16 // tensors[0].element_size() for tensors in lists) if aligned else 1
    return _to_device(torch.tensor(values, dtype=torch.int64), device), align


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``; to a GPU from pinned memory, so the copy is no host sync."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _lr_args(lr: float | Tensor) -> tuple[float, Tensor | None, bool]:
    """A learning rate as the kernels take it: a float, or a tensor they read on the device."""
    if isinstance(lr, Tensor):
        return 0.0, lr, True
    return float(lr), None, False


def split_supported(
    lists: Sequence[list[Tensor]], accepts: Callable[[Tensor], bool] | None = None
) -> tuple[list[int], list[int]]:
    """Indices the kernels take, and the rest (float64, not contiguous, or not ``accepts``-ed)."""
    fused, other = [], []
    for i, p in enumerate(lists[0]):
        ok = p.dtype in DTYPES and (accepts is None or accepts(p))
        ok = ok and all(not lst or lst[i].is_contiguous() for lst in lists)
        (fused if ok else other).append(i)
    return fused, other


# ---------------------------------------------------------------- updates


def lamb_fused(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Tensor,
    clip: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float,
    bias_correction2: float,
    decoupled_weight_decay: bool,
    trust_clip: bool,
    always_adapt: bool,
) -> None:
    """The step of :func:`~bigbatch.optim.lamb.lamb_reference` in three kernels (CUDA)."""
    device = params[0].device
    check_device(device)
    scale = bias_correction2**0.5 / bias_correction1  # the foreach impl's folding
    eps_hat = eps * bias_correction2**0.5
    adapt = weight_decay != 0 or always_adapt
    coupled = weight_decay != 0 and not decoupled_weight_decay
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    layout = _chunk_layout([p.numel() for p in params], device)
    offsets, align = _offsets(lists, device)
    tables = layout.tables
    lr_value, lr_ptr, lr_is_ptr = _lr_args(lr)
    w_part = torch.empty(layout.grid if adapt else 1, dtype=torch.float32, device=device)
    u_part = torch.empty_like(w_part)
    chunks = (tables["chunk_tensor"], tables["first_chunk"], tables["numels"])
    _lamb_moments_kernel[(layout.grid,)](
        *(lst[0] for lst in lists), offsets, len(params), *chunks,
        clip.to(device) if clip is not None else None, lr_value, lr_ptr, w_part, u_part, scale,
        1.0 - beta1, beta2, 1.0 - beta2, eps_hat, weight_decay / scale, weight_decay,
        HAS_CLIP=clip is not None, COUPLED=coupled, DECOUPLED=weight_decay != 0 and not coupled,
        ADAPT=adapt, LR_PTR=lr_is_ptr, ALIGN=align, BLOCK=CHUNK, num_warps=NUM_WARPS,
    )  # fmt: skip
    if not adapt:
        return
    step_sizes = torch.empty(len(params), dtype=torch.float32, device=device)
    _lamb_ratio_kernel[(len(params),)](
        w_part, u_part, tables["first_chunk"], step_sizes, lr_value, lr_ptr, scale,
        TRUST_CLIP=trust_clip, LR_PTR=lr_is_ptr,
        ROUNDS=triton.cdiv(layout.sizes[0], REDUCE_BLOCK), BLOCK=REDUCE_BLOCK,
    )  # fmt: skip
    _lamb_apply_kernel[(layout.grid,)](
        params[0], exp_avgs[0], exp_avg_sqs[0], offsets, len(params), *chunks,
        step_sizes, lr_value, lr_ptr, eps_hat, weight_decay / scale, weight_decay,
        COUPLED=coupled, DECOUPLED=weight_decay != 0 and not coupled, LR_PTR=lr_is_ptr,
        ALIGN=align, BLOCK=CHUNK, num_warps=NUM_WARPS,
    )  # fmt: skip


def lars_fused(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    trust_coefficient: float,
    eps: float,
    trust_clip: bool,
    always_adapt: bool,
    first_step: bool,
) -> None:
    """The step of :func:`~bigbatch.optim.lars.lars_reference`: torch's multi-tensor
    norms, the ratios, then one kernel."""
    device = params[0].device
    check_device(device)
    adapt = weight_decay != 0 or always_adapt
    ratios = None
    if adapt:
        ratios = lars_ratio(
            torch.stack(norms(params)).float(),
            torch.stack(norms(grads)).float(),
            lr=lr,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            trust_clip=trust_clip,
        )
    lists = (params, grads, momentum_buffers) if momentum != 0 else (params, grads)
    layout = _chunk_layout([p.numel() for p in params], device)
    offsets, align = _offsets(lists, device)
    tables = layout.tables
    lr_value, lr_ptr, lr_is_ptr = _lr_args(lr)
    _lars_apply_kernel[(layout.grid,)](
        params[0], grads[0], momentum_buffers[0] if momentum != 0 else None, offsets,
        len(params), tables["chunk_tensor"], tables["first_chunk"], tables["numels"],
        ratios, lr_value, lr_ptr, weight_decay, momentum, 1.0 - dampening,
        ADAPT=adapt, HAS_DECAY=weight_decay != 0, MOMENTUM=momentum != 0, FIRST=first_step,
        NESTEROV=nesterov, LR_PTR=lr_is_ptr, ALIGN=align, BLOCK=CHUNK, num_warps=NUM_WARPS,
    )  # fmt: skip


def merit_supports(t: Tensor) -> bool:
    """MERIT's kernels take tensors of at most two dimensions."""
    return t.ndim <= 2


def merit_fused(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The step of :func:`~bigbatch.optim.merit.merit_reference` in two tiled kernels."""
    device = params[0].device
    check_device(device)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    layout = _tile_layout(params, device)
    offsets, align = _offsets(lists, device)
    tables = layout.tables
    rows, cols = layout.sizes
    n = len(params)
    # |x| >= 0, so zeros are the identity of the atomic maxima
    maxima = torch.zeros(2 * rows + 2 * cols + 2 * n, dtype=torch.float32, device=device)
    row_w, row_u, col_w, col_u, layer_w, layer_u = maxima.split([rows, rows, cols, cols, n, n])
    lr_value, lr_ptr, lr_is_ptr = _lr_args(lr)
    tile = (tables["tiles"], tables["shapes"], tables["maxima_at"])
    found = (row_w, row_u, col_w, col_u, layer_w, layer_u)
    sizes = dict(ALIGN=align, ROWS=TILE_ROWS, COLS=TILE_COLS, SUB=SUB_COLS, num_warps=NUM_WARPS)
    _merit_moments_kernel[(layout.grid,)](
        *(lst[0] for lst in lists), offsets, n, *tile, *found,
        1.0 - beta1, beta2, 1.0 - beta2, eps, weight_decay, **sizes,
    )  # fmt: skip
    _merit_apply_kernel[(layout.grid,)](
        params[0], exp_avgs[0], exp_avg_sqs[0], offsets, n, *tile, tables["matrix"], *found,
        lr_value, lr_ptr, eps, weight_decay, LR_PTR=lr_is_ptr, **sizes,
    )  # fmt: skip
