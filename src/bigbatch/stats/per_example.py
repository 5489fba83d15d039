"""Gradient norms of units of examples, from the step's one backward pass (Gray et al. 2024,
arXiv:2411.00999; the ghost norm of Li et al. 2022): every covered layer (:data:`RULES`)
forms its weight gradient unit by unit. A model is covered when every trainable parameter
is the ``weight`` or ``bias`` of exactly one such module run once per forward, batch first
(:func:`uncovered`). Nothing is read to the host; ``torch.compile`` traces the layers.
docs/algorithms.md, "Gradient statistics" ("Noise from units of examples")."""

from __future__ import annotations

import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional

from .._tensors import norm_dtype
from ..batch.plan import loss_weights as default_loss_weights
from .estimators import inverse_size, population
from .layout import ParamLayout, SubBatches
from .noise import SmallNorms

__all__ = ["RULES", "PerExampleNorms", "uncovered", "unit_size"]

#: the default fewest units per micro-batch: 8 units covering the micro-batch estimate
#: the noise about as well as every example alone, and far better than a sample of the
#: micro-batch's examples: the units and the batch gradient come from the same examples,
#: so their noise largely cancels; fewer units, less work a layer
UNITS = 8
#: a layer forms its per-unit gradients (``k p q`` numbers) unless the Gram matrices of
#: its units (``2 (mT)² (p + q)`` multiply-adds) cost less than this many times fewer
#: multiply-adds: a number written and read twice costs about that many
_ELEMENT_COST = 16
#: the Gram form's eight operators more, as multiply-adds (about 2^17 each on a CPU, the
#: Python of a call; a GPU's launch costs more): a small layer takes the units' gradients
_GHOST_OPERATORS = 8 << 17
#: an embedding's units each take a table of their own while the tables hold at most this
#: many times the micro-batch's rows; beyond (a large vocabulary), the Gram matrices of
#: the units' output gradients while they hold at most this many numbers a row of the
#: micro-batch, else each unit's rows are summed by sorted key, in the micro-batch's memory
_TABLE_ROWS = 1
_GRAM_NUMBERS = 64

#: each collector's unit size as a shape, ``(m, 0)``: traced, a shape turns dynamic at its
#: second size where a number would be traced anew at each (and torch.compile holds a
#: module's tensors' shapes static, so it is kept here, not on the measured layers)
_UNIT_SHAPES: dict[int, Tensor] = {}
_KEYS = itertools.count()


def _unit_shape_key(probe: PerExampleNorms) -> int:
    # a new key for the probe's unit shape, given up when the probe is collected
    key = next(_KEYS)
    weakref.finalize(probe, _UNIT_SHAPES.pop, key, None)
    return key


#: the autograd graph task running on this thread, -1 outside a backward pass
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def unit_size(smallest: int, units: int | None = UNITS) -> int:
    """``⌊smallest / units⌋`` examples per unit, at least one (``units`` None: one)."""
    if units is None:
        return 1
    return max(1, smallest // units)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs a matrix product in on ``device``, or None where it is off."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
    except RuntimeError:  # a device autocast does not know (meta)
        return None
    return torch.get_autocast_dtype(kind)


#: the device types whose autocast runs layer_norm and group_norm in float32 (CUDA's list);
#: the CPU's runs them in their input's dtype (torch's autocast op reference)
_NORMS_IN_FLOAT32 = frozenset({"cuda"})


def _as_autocast(dtype: torch.dtype | None, *tensors: Tensor | None) -> tuple:
    # as autocast casts an op's arguments: floating tensors other than float64 only
    if dtype is None:
        return tensors
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64
        else t
        for t in tensors
    )  # fmt: skip


def _norm_autocast(device: torch.device) -> torch.dtype | None:
    # the dtype autocast runs a LayerNorm or GroupNorm in on the device; None: its input's
    widened = device.type in _NORMS_IN_FLOAT32 and _autocast_dtype(device) is not None
    return torch.float32 if widened else None


@dataclass
class _Step:
    """One step's measurements: a device scalar per part, with its parameter group."""

    #: examples per unit
    m: int
    #: this rank's micro-batch sizes (a measured layer's input has one of them as its rows)
    sizes: frozenset[int] = frozenset()
    norms: list[Tensor] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    #: the micro-batch under way (-1 before the first), and the one of each norm
    micro: int = -1
    micro_of: list[int] = field(default_factory=list)
    #: LayerNorms' (input, mean, rstd, output gradient, units, groups), taken at the end
    held: list[tuple] = field(default_factory=list)


#: the refusals' other cause: the model run with gradients on data other than the step's
_OTHER = (
    "; or, if the model ran on other data inside the step (an evaluation), run that under "
    "torch.no_grad() or after step.apply()"
)


class _Layer:
    """A covered layer as its function sees it: its step, groups and (traced) sinks."""

    def __init__(self, probe: PerExampleNorms, name: str, module: nn.Module,
                 groups: dict[str, int]) -> None:  # fmt: skip
        self.probe, self.name, self.module, self.groups = probe, name, module, groups
        #: this micro-batch's forwards through the layer (one is measured), and traced, the
        #: rows of its input
        self.uses = self.rows = 0
        self.make_sinks()

    def make_sinks(self) -> None:
        # a traced backward cannot record: there each norm is the gradient of a scalar
        # leaf of its own, read (and cleared) by the collector after the backward
        self.sinks = {
            n: torch.zeros((), dtype=norm_dtype(p), device=p.device, requires_grad=True)
            for n, p in self.module.named_parameters(recurse=False)
            if n in self.groups
        }

    def inputs(self) -> tuple[int, Tensor | None, Tensor | None]:
        """The function's last inputs: the unit size and, traced, the weight's and bias's sinks."""
        probe = self.probe
        if torch.compiler.is_compiling():
            probe.traced = True
            return _UNIT_SHAPES[probe.key], self.sinks.get("weight"), self.sinks.get("bias")
        return probe.step.m, None, None

    def record(
        self, names: Sequence[str], norms: Sequence[Tensor], micro: int | None = None
    ) -> None:
        """The norms of this layer's parameters ``names`` (a frozen one's are not kept)."""
        step = self.probe.step
        for name, norm in zip(names, norms):
            if name in self.groups:
                step.norms.append(norm)
                step.groups.append(self.groups[name])
                step.micro_of.append(step.micro if micro is None else micro)

    def refuse_second_use(self) -> None:
        self.probe.abandon()
        raise RuntimeError(
            f"per-example statistics: layer {self.name!r} ran twice in one "
            "micro-batch's forward (a shared layer, or one called twice); "
            "use the sub-batch statistics (noise_from='sub_batches') for such a model" + _OTHER
        )

    def refuse_rows(self, rows: int, sizes: frozenset[int]) -> None:
        # the rules read the input's first dimension as the micro-batch's examples
        self.probe.abandon()
        raise RuntimeError(
            f"per-example statistics: layer {self.name!r} got {rows} rows where a micro-batch "
            f"has {', '.join(map(str, sorted(sizes)))} examples (a sequence-first input, the "
            "batch flattened with its tokens, or a part of it such as positions without the "
            "batch dimension: give them one, e.g. pos.expand(len(x), -1)): its rows are not the "
            "examples; or use the sub-batch statistics (noise_from='sub_batches')" + _OTHER
        )

    def take_sinks(self) -> None:
        """The norms a traced backward left as the sinks' gradients, recorded and cleared."""
        if self.uses > 1:
            self.refuse_second_use()
        if self.uses and self.rows not in self.probe.step.sizes:
            self.refuse_rows(self.rows, self.probe.step.sizes)
        for name, sink in self.sinks.items():
            if sink.grad is not None:
                self.record((name,), (sink.grad,))
                sink.grad = None

    def offsets(self, n: int, k: int, m: int, rows: int, dims: int, device,
                cache: bool = True) -> Tensor:  # fmt: skip
        """Per example of a micro-batch of ``n``, where its unit's table starts (``cache``d)."""
        key = (n, k, m, rows, dims, device)
        cached = self.probe.offsets.get(key) if cache else None
        if cached is None:
            unit = torch.arange(n, device=device).div_(m, rounding_mode="floor").clamp_(max=k)
            cached = unit.mul_(rows).reshape(n, *([1] * (dims - 1)))  # (past the units: k)
            if cache:
                self.probe.offsets[key] = cached
        return cached


def _begin(ctx, layer: _Layer, m: int, sink_w: Tensor | None, sink_b: Tensor | None) -> None:
    # what every function's backward needs of its forward's last inputs (a traced
    # backward must not cache tensors, so the embeddings' offsets are made afresh there)
    ctx.layer, ctx.traced = layer, sink_w is not None or sink_b is not None
    ctx.m = m if isinstance(m, int) else m.shape[0]


def _units(n: int, m: int) -> tuple[int, int]:
    """``(k, m)``: the units of ``m`` examples in a micro-batch of ``n`` and their size."""
    return n // m, m


def _delivered(ctx, names: Sequence[str], norms: Sequence[Tensor]) -> tuple:
    """The sinks' gradients: the norms where the layer was traced; else None (recorded)."""
    if not ctx.traced:
        ctx.layer.record(names, norms)
        return None, None
    got = dict(zip(names, norms))
    need_w, need_b = ctx.needs_input_grad[-2:]
    return got.get("weight") if need_w else None, got.get("bias") if need_b else None


def _at_common_factor(step: _Step, batches: SubBatches) -> list[Tensor]:
    # under other loss weights w_i than W b_i / B (a framework's 1/k), a unit's share of
    # .grad is w_i m / b_i of its mean gradient: each micro-batch's norms are brought to
    # the common W m / B (unequal sizes had biased tr Σ by 14%)
    sizes, weights, world = batches.sizes, list(batches.loss_weights), batches.world.size
    if weights == default_loss_weights(sizes, batches.total, world):
        return step.norms
    ratio = [world * b / (w * batches.total) for b, w in zip(sizes, weights, strict=True)]
    return [n * ratio[i] for n, i in zip(step.norms, step.micro_of, strict=True)]


# ---------------------------------------------------------------- Linear (and convolutions)


def _by_units(x: Tensor, k: int, m: int) -> Tensor:
    """The first ``k m`` examples of ``x`` as ``(k, rows, features)``."""
    if k * m != len(x):
        x = x[: k * m]
    return x.reshape(k, -1, x.shape[-1])


def _ghost_is_cheaper(rows: int, p: int, q: int) -> bool:
    """A unit's Gram matrices (``2 rows² (p + q)``) against its gradient (``p q``, twice)."""
    return 2 * rows * rows * (p + q) + _GHOST_OPERATORS < _ELEMENT_COST * p * q


def _matrix_gradients(
    a: Tensor, d: Tensor, bias: bool, m: int
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """The weight and bias gradients of ``dᵀ a`` over the examples, and their units' norms."""
    n, p, q = len(a), a.shape[-1], d.shape[-1]
    k, m = _units(n, m)
    rows = (a.numel() // n) // p * m
    if rows == 1:  # one row an example, each its own unit: |g_i(W)|² = |a_i|² |δ_i|²
        a, d = a.reshape(n, p), d.reshape(n, q)
        grad_w = d.t().mm(a)
        wide = norm_dtype(a)
        rows_w = torch.linalg.vector_norm(a, dim=1, dtype=wide) * torch.linalg.vector_norm(
            d, dim=1, dtype=wide
        )
        if not bias:
            return grad_w, None, (torch.linalg.vector_norm(rows_w),)
        norm_w, norm_b = torch.linalg.vector_norm(rows_w), torch.linalg.vector_norm(d, dtype=wide)
        return grad_w, d.sum(0), (norm_w, norm_b)
    au, du = _by_units(a, k, m), _by_units(d, k, m)
    if _ghost_is_cheaper(rows, p, q):
        grad_w = d.reshape(-1, q).t().mm(a.reshape(-1, p))
        if au.dtype == torch.float16:  # a Gram of scaled gradients squares them: past 65,504
            au, du = au.float(), du.float()
        gram_a, gram_d = torch.bmm(au, au.mT), torch.bmm(du, du.mT)
        wide = norm_dtype(gram_a)
        norm_w = (gram_a.to(wide) * gram_d.to(wide)).sum().sqrt()
    else:
        units = torch.bmm(du.mT, au)  # (k, q, p): the simultaneous form
        grad_w = units.sum(0)
        if k * m != n:
            grad_w = grad_w.addmm_(d[k * m :].reshape(-1, q).t(), a[k * m :].reshape(-1, p))
        norm_w = None
    grad_b = None
    if bias:
        unit_b = du.sum(1)
        grad_b = unit_b.sum(0)
        if k * m != n:
            grad_b = grad_b + d[k * m :].reshape(-1, q).sum(0)
        if norm_w is None:
            norm_w, norm_b = torch._foreach_norm([units, unit_b], 2, dtype=norm_dtype(units))
        else:
            norm_b = torch.linalg.vector_norm(unit_b, dtype=norm_dtype(unit_b))
        return grad_w, grad_b, (norm_w, norm_b)
    if norm_w is None:
        norm_w = torch.linalg.vector_norm(units, dtype=norm_dtype(units))
    return grad_w, grad_b, (norm_w,)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, m, sink_w, sink_b):
        # as autocast would: the product in its dtype
        x, weight, bias = _as_autocast(_autocast_dtype(x.device), x, weight, bias)
        _begin(ctx, layer, m, sink_w, sink_b)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w, grad_b, norms = _matrix_gradients(x, grad, ctx.has_bias, ctx.m)
        names = ("weight", "bias")[: len(norms)]
        return grad_x, grad_w, grad_b, None, None, *_delivered(ctx, names, norms)


def _linear(module: nn.Linear, layer: _Layer, x: Tensor) -> Tensor:
    return _LinearFunction.apply(x, module.weight, module.bias, layer, *layer.inputs())


def _conv_geometry(module: nn.Module) -> tuple:
    """A convolution as a 2-D one: (kernel, dilation, padding, stride)."""
    if isinstance(module, nn.Conv1d):  # a 2-D convolution of height 1
        return (
            (1, *module.kernel_size),
            (1, *module.dilation),
            (0, *module.padding),
            (1, *module.stride),
        )
    return module.kernel_size, module.dilation, module.padding, module.stride


class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, m, sink_w, sink_b):
        x, weight, bias = _as_autocast(_autocast_dtype(x.device), x, weight, bias)
        _begin(ctx, layer, m, sink_w, sink_b)
        module, ctx.has_bias = layer.module, bias is not None
        ctx.save_for_backward(x, weight)
        return module._conv_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        module, grad = ctx.layer.module, grad.to(x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _conv_backward(module, grad, x, weight, 1, [True, False, False])[0]
        n, q = len(x), weight.shape[0]
        k, m = _units(n, ctx.m)
        if not _groups_units(x, m):
            grad_w, grad_b, norms = _conv_by_columns(module, x, grad, ctx.has_bias, m)
            names = ("weight", "bias")[: len(norms)]
            grads = grad_x, grad_w.reshape(weight.shape), grad_b, None, None
            return (*grads, *_delivered(ctx, names, norms))
        # the units as the groups of one grouped convolution, whose weight gradient is
        # theirs, unit by unit (Rochette et al. 2019): no unfolded copy of the input
        used = k * m
        xu, gu = (_units_as_channels(t[:used], k, m) for t in (x, grad))
        grouped = weight.repeat(k, *[1] * (weight.dim() - 1))  # only its shape is read
        units = _conv_backward(module, gu, xu, grouped, k, [False, True, False])[1]
        units = units.view(k, *weight.shape)
        grad_w = units.sum(0)
        if used != n:  # the examples past the units
            grad_w += _conv_backward(module, grad[used:], x[used:], weight, 1,
                                     [False, True, False])[1]  # fmt: skip
        parts, names, grad_b = [units], ("weight",), None
        if ctx.has_bias:
            per_example = grad.reshape(n, q, -1).sum(2)
            parts.append(per_example[:used].view(k, m, q).sum(1))
            names, grad_b = ("weight", "bias"), per_example.sum(0)
        norms = torch._foreach_norm(parts, 2, dtype=norm_dtype(units))
        return grad_x, grad_w, grad_b, None, None, *_delivered(ctx, names, norms)


#: on a CPU a 2-D convolution's units, and a 1-D one's of at least this many examples, are
#: the groups of one grouped convolution: torch's CPU unfold loops over the examples, and
#: its 2-D form costs most (docs/results.md, "Cost of a step")
_GROUPED_UNITS = 16


def _groups_units(x: Tensor, m: int) -> bool:
    """Whether a convolution's units are a grouped convolution's groups (else unfolded)."""
    return x.device.type == "cpu" and (x.dim() > 3 or m >= _GROUPED_UNITS)


def _conv_backward(module: nn.Module, grad: Tensor, x: Tensor, weight: Tensor, groups: int,
                   mask: list[bool]) -> tuple:  # fmt: skip
    """torch's convolution backward with ``module``'s geometry (``mask``: dx, dw, db)."""
    return torch.ops.aten.convolution_backward(
        grad, x, weight, None, module.stride, module.padding, module.dilation,
        False, [0] * len(module.padding), groups, mask,
    )  # fmt: skip


def _units_as_channels(t: Tensor, k: int, m: int) -> Tensor:
    """``(k m, C, ...)`` as ``(m, k C, ...)``: unit ``u``'s examples in channel group ``u``."""
    return t.reshape(k, m, *t.shape[1:]).transpose(0, 1).reshape(m, k * t.shape[1], *t.shape[2:])


def _conv_by_columns(
    module: nn.Module, x: Tensor, grad: Tensor, bias: bool, m: int
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """The weight and bias gradients from the unfolded input (a GPU's; a CPU's small 1-D units)."""
    one_d = isinstance(module, nn.Conv1d)
    x2, g2 = (x.unsqueeze(2), grad.unsqueeze(2)) if one_d else (x, grad)
    kernel, dilation, padding, stride = _conv_geometry(module)
    columns = functional.unfold(x2, kernel, dilation=dilation, padding=padding, stride=stride)
    n = len(x)
    a = columns.transpose(1, 2)  # (N, positions, C_in · kernel)
    d = g2.reshape(n, g2.shape[1], -1).transpose(1, 2)  # (N, positions, C_out)
    return _matrix_gradients(a, d, bias, m)


def _conv(module: nn.Module, layer: _Layer, x: Tensor) -> Tensor:
    return _ConvFunction.apply(x, module.weight, module.bias, layer, *layer.inputs())


def _conv_qualifies(module: nn.Module) -> bool:
    return (
        module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


# ---------------------------------------------------------------- Embedding


def _unit_keys(ctx, ids: Tensor, rows: int, padding: int | None) -> Tensor:
    """Each id moved into its unit's own table of ``rows`` rows (dropped ids: row ``k rows``)."""
    k, m = _units(len(ids), ctx.m)
    keys = ids + ctx.layer.offsets(len(ids), k, m, rows, ids.dim(), ids.device, not ctx.traced)
    if k * m != len(ids):
        keys[k * m :] = k * rows
    if padding is not None:
        keys = keys.masked_fill(ids == padding, k * rows)
    return keys


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, layer, m, sink_w, sink_b):
        _begin(ctx, layer, m, sink_w, sink_b)
        module = layer.module
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        return functional.embedding(ids, weight, module.padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        module, rows = ctx.layer.module, ctx.rows
        padding = -1 if module.padding_idx is None else module.padding_idx
        grad_w = torch.ops.aten.embedding_dense_backward(grad, ids, rows, padding, False)
        k, m = _units(len(ids), ctx.m)
        tokens = ids.numel() // len(ids) * m  # a unit's
        if k * rows <= _TABLE_ROWS * ids.numel():  # the units' tables hold no more rows
            keys = _unit_keys(ctx, ids, rows, module.padding_idx)
            tables = torch.ops.aten.embedding_dense_backward(
                grad, keys, k * rows + 1, k * rows, False
            )
            norm = torch.linalg.vector_norm(tables, dtype=norm_dtype(tables))
        elif k * tokens * tokens <= _GRAM_NUMBERS * ids.numel():
            norm = _gram_norm(ids, grad, k, m, module.padding_idx)
        else:  # each unit's rows summed by sorted key: memory of the micro-batch's rows
            keys = _unit_keys(ctx, ids, rows, module.padding_idx)
            tables = _summed_by_key(grad.reshape(-1, grad.shape[-1]), keys.reshape(-1), k * rows)
            norm = torch.linalg.vector_norm(tables, dtype=norm_dtype(tables))
        return None, grad_w, None, None, *_delivered(ctx, ("weight",), (norm,))


def _gram_norm(ids: Tensor, grad: Tensor, k: int, m: int, padding: int | None) -> Tensor:
    """Each unit's embedding-gradient norm from its output gradients' Gram (ghost) matrix."""
    # (for a vocabulary too large for a table per unit)
    ids, d = _by_units(ids.reshape(len(ids), -1, 1), k, m)[..., 0], _by_units(grad, k, m)
    if padding is not None:  # the padding row gets no gradient
        d = d * (ids != padding).unsqueeze(-1)
    gram = torch.bmm(d, d.mT)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    wide = norm_dtype(gram)
    return (gram.to(wide) * same).sum().sqrt()


def _summed_by_key(rows: Tensor, keys: Tensor, dropped: int) -> Tensor:
    """The rows of equal key summed (one output row per distinct key; key ``dropped`` as zero)."""
    rows = rows.masked_fill((keys == dropped).unsqueeze(1), 0)
    ordered, order = keys.sort()
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    segment = first.cumsum(0).sub_(1)
    out = rows.new_zeros(len(rows), rows.shape[1])
    return out.index_add_(0, segment, rows.index_select(0, order))


def _embedding(module: nn.Embedding, layer: _Layer, ids: Tensor) -> Tensor:
    return _EmbeddingFunction.apply(ids, module.weight, layer, *layer.inputs())


def _embedding_qualifies(module: nn.Module) -> bool:
    # max_norm renormalises rows in place and scale_grad_by_freq counts over the batch
    return not module.sparse and module.max_norm is None and not module.scale_grad_by_freq


# ---------------------------------------------------------------- LayerNorm


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, m, sink_w, sink_b):
        module = layer.module
        x, weight, bias = _as_autocast(_norm_autocast(x.device), x, weight, bias)
        out, mean, rstd = torch.native_layer_norm(x, module.normalized_shape, weight, bias,
                                                  module.eps)  # fmt: skip
        _begin(ctx, layer, m, sink_w, sink_b)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        layer = ctx.layer
        module = layer.module
        shape = module.normalized_shape
        names = tuple(n for n, t in (("weight", weight), ("bias", bias)) if t is not None)
        k, m = _units(len(x), ctx.m)
        if _batches_layer_norms(x) and not ctx.traced:
            # the per-unit sums wait for the step's end, where every LayerNorm of this shape
            # takes them together (a handful of operators for all, instead of eight each)
            grads = torch.ops.aten.native_layer_norm_backward(
                grad, x, shape, mean, rstd, weight, bias,
                [ctx.needs_input_grad[0], weight is not None, bias is not None],
            )  # fmt: skip
            step = layer.probe.step
            step.held.append((x, mean, rstd, grad, k, m, len(shape), layer, names, step.micro))
            return (*grads, None, None, None, None)
        # on a CPU (and traced) the parameters' gradients are the units' sums added up: one
        # pass over the activations fewer than torch's whole backward
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad, x, shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        used, units = k * m, (x, mean, rstd, grad)
        if used != len(x):
            units = tuple(t[:used] for t in units)
        sums = _layer_norm_unit_sums(units, k, len(shape), weight is not None, bias is not None)
        norms = torch._foreach_norm(sums, 2, dtype=norm_dtype(sums[0]))
        totals = [unit.sum(0) for unit in sums]
        if used != len(x):  # the examples past the units
            rest = torch.ops.aten.native_layer_norm_backward(
                grad[used:], x[used:], shape, mean[used:], rstd[used:], weight, bias,
                [False, weight is not None, bias is not None],
            )[1:]  # fmt: skip
            totals = [t + r for t, r in zip(totals, (r for r in rest if r is not None))]
        grad_w = totals[0] if weight is not None else None
        grad_b = totals[-1] if bias is not None else None
        return grad_x, grad_w, grad_b, None, None, *_delivered(ctx, names, norms)


def _batches_layer_norms(x: Tensor) -> bool:
    """Whether a LayerNorm's units' sums wait for the step's end, batched by shape (a GPU)."""
    return x.device.type != "cpu"  # on a CPU the stacking costs more than the launches saved


def _layer_norm_unit_sums(
    tensors: Sequence[Tensor], k: int, dims: int, weight: bool, bias: bool, layers: int = 0
) -> list[Tensor]:
    """The ``(k, *shape)`` unit sums ``Σ_{t∈u} x̂_t ⊙ δ_t`` (``weight``), ``Σ_{t∈u} δ_t``
    (``bias``) of a LayerNorm's whole units' ``(x, mean, rstd, δ)`` (``layers``: stacked)."""
    x, mean, rstd, grad = tensors
    sums = [(x - mean).mul_(rstd).mul_(grad)] if weight else []
    sums += [grad.to(mean.dtype)] if bias else []  # summed as the weight's (float32 under bf16)
    lead = (layers,) if layers else ()
    return [s.reshape(*lead, k, -1, *x.shape[x.dim() - dims :]).sum(len(lead) + 1) for s in sums]


def _layer_norm(module: nn.LayerNorm, layer: _Layer, x: Tensor) -> Tensor:
    return _LayerNormFunction.apply(x, module.weight, module.bias, layer, *layer.inputs())


def _layer_norm_sums(step: _Step) -> None:
    """Every held LayerNorm's per-unit gradient norms, batched over the layers of one shape."""
    batches: dict[tuple, list[tuple]] = defaultdict(list)
    for entry in step.held:
        x, _, _, grad, k, m, dims, _, names, _ = entry
        batches[(x.shape, x.dtype, grad.dtype, k, m, dims, names)].append(entry)
    for entries in batches.values():
        _layer_norm_units(entries)
    step.held.clear()


def _layer_norm_units(entries: list[tuple]) -> None:
    """Per-unit LayerNorm norms, ``Σ_{t∈u} x̂_t ⊙ δ_t`` and ``Σ_{t∈u} δ_t``, recorded."""
    x, mean, rstd, grad, k, m, dims, _, names, _ = entries[0]
    if len(entries) > 1:
        x, mean, rstd, grad = (torch.stack([e[i] for e in entries]) for i in range(4))
    else:
        x, mean, rstd, grad = x[None], mean[None], rstd[None], grad[None]
    used = k * m
    if used != x.shape[1]:
        x, mean, rstd, grad = x[:, :used], mean[:, :used], rstd[:, :used], grad[:, :used]
    parts = _layer_norm_unit_sums((x, mean, rstd, grad), k, dims, "weight" in names,
                                  "bias" in names, layers=len(entries))  # fmt: skip
    stacked = parts[0][:, None] if len(parts) == 1 else torch.stack(parts, 1)
    norms = torch.linalg.vector_norm(
        stacked, dim=tuple(range(2, stacked.dim())), dtype=norm_dtype(stacked)
    )
    flat = norms.reshape(-1).unbind(0)  # layer by layer, its parameters in order
    for i, (*_, layer, _, micro) in enumerate(entries):
        layer.record(names, flat[i * len(names) : (i + 1) * len(names)], micro)


# ---------------------------------------------------------------- GroupNorm


class _GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, m, sink_w, sink_b):
        module = layer.module
        x, weight, bias = _as_autocast(_norm_autocast(x.device), x, weight, bias)
        x = x.contiguous(memory_format=_memory_format(x))  # as torch's own kernel takes it
        n, c = x.shape[:2]
        out, mean, rstd = torch.native_group_norm(
            x, weight, bias, n, c, x[0, 0].numel(), module.num_groups, module.eps
        )
        _begin(ctx, layer, m, sink_w, sink_b)
        ctx.save_for_backward(x, weight, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        module = ctx.layer.module
        n, c, groups = len(x), x.shape[1], module.num_groups
        # the kernel reads grad in x's layout (torch's autograd makes it so): a transposed or
        # channels-last output's gradient gave a wrong input gradient
        grad = grad.contiguous(memory_format=_memory_format(x))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_group_norm_backward(
                grad, x, mean, rstd, weight, n, c, x[0, 0].numel(), groups, [True, False, False]
            )[0]
        # each example's Σ x̂ ⊙ δ and Σ δ over its positions, (n, c); then the units' sums
        normed = (x.reshape(n, groups, -1) - mean[..., None]).mul_(rstd[..., None])
        d = grad.reshape(n, c, -1)
        per_example = [normed.reshape(n, c, -1).mul_(d).sum(2), d.sum(2, dtype=mean.dtype)]
        k, m = _units(n, ctx.m)
        units = [e[: k * m].reshape(k, m, c).sum(1) for e in per_example]
        norms = torch._foreach_norm(units, 2, dtype=norm_dtype(units[0]))
        grad_w, grad_b = (e.sum(0) for e in per_example)
        return grad_x, grad_w, grad_b, None, None, *_delivered(ctx, ("weight", "bias"), norms)


def _memory_format(x: Tensor) -> torch.memory_format:
    # the layout torch's C++ `suggest_memory_format` gives (channels-last where x is so)
    if not x.is_contiguous():
        for layout, dims in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
            if x.dim() == dims and x.is_contiguous(memory_format=layout):
                return layout
    return torch.contiguous_format


def _group_norm(module: nn.Module, layer: _Layer, x: Tensor) -> Tensor:
    return _GroupNormFunction.apply(x, module.weight, module.bias, layer, *layer.inputs())


# ---------------------------------------------------------------- RMSNorm


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer, m, sink_w, sink_b):
        module = layer.module
        dims = tuple(range(-len(module.normalized_shape), 0))
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        eps = module.eps if module.eps is not None else torch.finfo(wide.dtype).eps
        rms = torch.rsqrt(wide.square().mean(dims, keepdim=True).add_(eps))
        normed = wide * rms
        _begin(ctx, layer, m, sink_w, sink_b)
        ctx.dims = dims
        ctx.save_for_backward(normed, weight, rms)
        return (normed * weight).to(x.dtype)  # as F.rms_norm: the input's dtype

    @staticmethod
    def backward(ctx, grad: Tensor):
        normed, weight, rms = ctx.saved_tensors
        dims = ctx.dims
        grad = grad.to(normed.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:  # d/dx of x̂ ⊙ w, x̂ = x / rms(x)
            g = grad * weight
            grad_x = (g - normed * (g * normed).mean(dims, keepdim=True)).mul_(rms)
        k, m = _units(len(normed), ctx.m)
        products = normed * grad
        units = products[: k * m].reshape(k, -1, *weight.shape).sum(1)
        norm = torch.linalg.vector_norm(units, dtype=norm_dtype(units))
        grad_w = units.sum(0)
        if k * m != len(normed):  # the examples past the units
            grad_w = grad_w + products[k * m :].reshape(-1, *weight.shape).sum(0)
        return grad_x, grad_w.to(weight.dtype), None, None, *_delivered(ctx, ("weight",), (norm,))


def _rms_norm(module: nn.Module, layer: _Layer, x: Tensor) -> Tensor:
    return _RMSNormFunction.apply(x, module.weight, layer, *layer.inputs())


# ---------------------------------------------------------------- the registry

#: a rule: (module, its layer record, its input) -> its output, through a function whose
#: backward records the units' norms
Rule = Callable[[nn.Module, _Layer, Tensor], Tensor]

#: the layers whose units' norms are known, and when a module qualifies
RULES: dict[type, tuple[Rule, Callable[[nn.Module], bool]]] = {
    nn.Linear: (_linear, lambda m: True),
    nn.Embedding: (_embedding, _embedding_qualifies),
    nn.LayerNorm: (_layer_norm, lambda m: True),
    nn.RMSNorm: (_rms_norm, lambda m: True),
    nn.GroupNorm: (_group_norm, lambda m: m.affine),
    nn.Conv1d: (_conv, _conv_qualifies),
    nn.Conv2d: (_conv, _conv_qualifies),
}


def _rule(module: nn.Module) -> Rule | None:
    for kind, (rule, qualifies) in RULES.items():
        if type(module) is kind or (isinstance(module, kind) and _is_fsdp_subclass(module, kind)):
            return rule if qualifies(module) else None
    return None


def _is_fsdp_subclass(module: nn.Module, kind: type) -> bool:
    """Whether ``module``'s class is FSDP2's subclass of a rule's (``FSDPLinear``)."""
    # (a user's own subclass may change forward, so it does not count)
    return type(module).__name__ == f"FSDP{kind.__name__}"


def _covered_modules(
    model: nn.Module, params: Sequence[Tensor]
) -> tuple[list[tuple[nn.Module, Rule]], list[str]]:
    """The modules to measure, and the names of the trainable parameters none covers."""
    wanted = {id(p) for p in params}
    owners: dict[int, int] = {}
    chosen = []
    for module in model.modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) in wanted]
        rule = _rule(module) if own else None
        if rule is None or any(n not in ("weight", "bias") for n, _ in own):
            continue
        chosen.append((module, rule))
        for _, p in own:
            owners[id(p)] = owners.get(id(p), 0) + 1
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    missing = [names.get(id(p), f"a parameter {tuple(p.shape)} outside the model")
               for p in params if owners.get(id(p)) != 1]  # fmt: skip
    return chosen, missing


def batch_coupled(model: nn.Module) -> list[str]:
    """The BatchNorm layers that normalise over the batch (training, or no running stats)."""
    # (through them an example's gradient depends on the others', whatever trains)
    batch_norm = nn.modules.batchnorm._BatchNorm
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, batch_norm) and (m.training or not m.track_running_stats)]  # fmt: skip


def shared_layers(model: nn.Module) -> list[str]:
    # the layers with parameters registered under two names or more (nn.ModuleList([block]
    # * n)): each registration usually runs, and a second run in one forward is refused
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if next(module.parameters(recurse=False), None) is not None:
            names.setdefault(id(module), []).append(name)
    return [", ".join(map(repr, found)) for found in names.values() if len(found) > 1]


def uncovered(model: nn.Module, params: Sequence[Tensor]) -> list[str]:
    """The trainable parameters (of ``params``) no rule covers: a bare parameter, a layer
    not in :data:`RULES`, a shared weight. Empty: the model is covered."""
    return _covered_modules(model, params)[1]


class _MeasuredForward:
    """A covered layer's ``forward`` while measured (an object, so a deep copy calls its own)."""

    def __init__(self, module: nn.Module, rule: Rule, layer: _Layer) -> None:
        self.module, self.rule, self.layer = module, rule, layer

    def __call__(self, *args, **kwargs):
        module, layer = self.module, self.layer
        # (a flag, not the step: torch.compile guards on what is read here, and a step is
        # a new object, the unit size a new number)
        if not layer.probe.measuring or not torch.is_grad_enabled():
            return type(module).forward(module, *args, **kwargs)
        if not args and len(kwargs) == 1:  # its one input by name (`layer(input=x)`)
            args, kwargs = tuple(kwargs.values()), {}
        if not args or kwargs or not isinstance(args[0], Tensor):
            raise RuntimeError(
                f"per-example statistics: layer {layer.name!r} was called without a "
                "positional input tensor, which its measurement reads; call it with one"
            )
        # the sum of two uses' gradients is not the sum of their norms; traced, the uses
        # are counted here and checked after the backward (PerExampleNorms.next_micro_batch).
        # Inside a backward pass the forward is activation checkpointing's recomputation
        # (non-reentrant): its function only gives the saved tensors of the one that ran
        if torch.compiler.is_compiling():
            layer.uses += 1
            layer.rows = args[0].shape[0]  # checked after the backward, as the uses are
        elif _graph_task_id() == -1:
            if layer.uses:
                layer.refuse_second_use()
            layer.uses += 1
            if len(args[0]) not in layer.probe.step.sizes:
                layer.refuse_rows(len(args[0]), layer.probe.step.sizes)
        return self.rule(module, layer, args[0])


class _Restore:
    """Puts back a module's own ``forward`` (what :meth:`PerExampleNorms.close` removes)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.installed = module, module.forward

    def remove(self) -> None:
        # (not a later loop's: closing a loop whose layers another took over leaves them)
        if self.module.__dict__.get("forward") is self.installed:
            del self.module.__dict__["forward"]


class PerExampleNorms:
    """``Σ_u |c_u|²`` over the units of each step, per covered parameter, from the backward.

    Each covered layer's ``forward`` is replaced on the instance (:meth:`close` puts the
    class's back); with gradients off it is the layer's own. :meth:`finish` returns one
    float32 device scalar per (parameter, micro-batch) and the group of each.

    Args:
        model: the trained module (every trainable parameter in ``layout`` covered).
        layout: the parameters and their groups.
        units: the most units per micro-batch (None: every example its own).
        dataset_size: samples in a finite dataset (the finite-population correction).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        units: int | None = UNITS,
        dataset_size: int | None = None,
    ) -> None:
        chosen, missing = _covered_modules(model, layout.params)
        if missing:
            raise ValueError(
                "per-example statistics need every trainable parameter in one layer of "
                f"{', '.join(k.__name__ for k in RULES)} (as its weight or bias), run once per "
                f"forward; not covered: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}"
            )
        coupled = batch_coupled(model)
        if coupled:  # an example's gradient depends on the others' through it
            raise ValueError(
                f"per-example statistics: BatchNorm {coupled[0]!r} normalises over the batch, "
                "so no example has a gradient of its own; use the sub-batch statistics"
            )
        group = {id(p): layout.group_of(i) for i, p in enumerate(layout.params)}
        names = {id(m): name for name, m in model.named_modules()}
        self.num_groups, self.device = layout.num_groups, layout.device
        #: the most units per micro-batch (None: every example its own)
        self.units = units
        self.dataset_size = dataset_size
        #: the step under way (None outside one), and whether there is one (a flag for
        #: torch.compile to guard on: a step is a new object each time)
        self.step: _Step | None = None
        self.measuring = False
        self.key = _unit_shape_key(self)
        #: whether torch.compile traced a measured layer (its norms are the sinks' gradients)
        self.traced = False
        #: the embeddings' unit offsets, by micro-batch shape
        self.offsets: dict[tuple, Tensor] = {}
        self.handles = []
        # a new loop on the model (the docs' way to change what trains) takes its layers over
        # from the one before, which refuses to measure again (one at a time)
        for module, _ in chosen:
            other = vars(module).get("forward")
            if isinstance(other, _MeasuredForward):
                other.layer.probe.close()
                other.layer.probe.taken_over = True
        self.taken_over = False
        self.layers: list[_Layer] = []
        for module, rule in chosen:
            groups = {
                n: group[id(p)] for n, p in module.named_parameters(recurse=False) if id(p) in group
            }
            layer = _Layer(self, names.get(id(module), type(module).__name__), module, groups)
            module.forward = _MeasuredForward(module, rule, layer)
            self.layers.append(layer)
            self.handles.append(_Restore(module))

    def begin(self, batches: SubBatches) -> None:
        """Start a step: its unit size from the smallest micro-batch of any rank."""
        if self.taken_over:
            raise RuntimeError(
                "per-example statistics: another loop (or collector) on this model measures "
                "its layers now; one at a time: use that one"
            )
        self.step = _Step(unit_size(min(batches.all_sizes), self.units), frozenset(batches.sizes))
        self.measuring, m = True, self.step.m
        self._follow_the_model()
        unit = _UNIT_SHAPES.get(self.key)
        if unit is None or len(unit) != m or unit.device != self.device:
            _UNIT_SHAPES[self.key] = torch.empty(m, 0, device=self.device)
        for layer in self.layers:  # nothing of a step left unfinished (an error) counts
            layer.uses = 0
            if self.traced:
                for sink in layer.sinks.values():
                    sink.grad = None

    def _follow_the_model(self) -> None:
        # the sinks made again on the parameters' device if the model moved since
        first = self.layers[0] if self.layers else None
        sink = next(iter(first.sinks.values()), None) if first is not None else None
        device = first.module.weight.device if first is not None else None
        if sink is not None and sink.device != device:
            self.device = device
            for layer in self.layers:
                layer.make_sinks()

    def __setstate__(self, state: dict) -> None:
        # a copy (of a copied model) measures with a unit shape of its own
        self.__dict__.update(state)
        self.key = _unit_shape_key(self)

    def abandon(self) -> None:  # the step under way ends: later forwards are the layers' own
        self.step, self.measuring = None, False

    def next_micro_batch(self) -> None:
        """The next forward is another micro-batch's: each layer may run once in it."""
        if self.step is not None:
            self._end_micro_batch()
            self.step.micro += 1

    def _end_micro_batch(self) -> None:
        """The traced backward's norms taken from the sinks; each layer's uses counted afresh."""
        for layer in self.layers:
            if self.traced:
                layer.take_sinks()
            layer.uses = 0

    def finish(self, batches: SubBatches) -> SmallNorms:
        """The step's norms (device scalars), their groups and units, over every rank."""
        step = self.step
        if step is None:
            raise RuntimeError("per-example norms: finish() without begin()")
        self._end_micro_batch()
        _layer_norm_sums(step)
        self.step, self.measuring = None, False
        m = step.m
        count = sum(b // m for b in batches.all_sizes)
        if count < 2:
            raise ValueError(f"statistics need at least 2 examples per step, got sizes "
                             f"{batches.rank_sizes}")  # fmt: skip
        # a unit's share of .grad is W m / B times its mean gradient (DDP averages W ranks)
        factor = (batches.total / (batches.world.size * m)) ** 2
        return SmallNorms(
            count=count,
            h=inverse_size(m, population(self.dataset_size, batches.total)),
            factor=factor,
            norms=_at_common_factor(step, batches),
            groups=step.groups,
        )

    def check_single_path(self, loss: Tensor) -> None:
        """``RuntimeError`` where ``loss``'s graph reaches a measured parameter elsewhere."""
        # (a gradient there, a tied weight's or a penalty's, the norms would not see)
        names = {id(p): f"{layer.name}.{n}" for layer in self.layers
                 for n, p in layer.module.named_parameters(recurse=False)}  # fmt: skip
        outside = sorted(_reached_outside_the_rules(loss, names))
        if outside:
            raise RuntimeError(
                f"per-example statistics: {', '.join(outside[:3])} also get a gradient "
                "outside their layer (a tied weight used as a tensor, or a penalty on it in "
                "the loss), which the per-example norms cannot see; measure with "
                "noise_from='sub_batches' (a penalty: the optimizer's weight decay)"
            )

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        _UNIT_SHAPES.pop(self.key, None)


def _reached_outside_the_rules(loss: Tensor, names: dict[int, str]) -> set[str]:
    # the names of parameters an edge of loss's graph reaches from a node that is not a
    # measured layer's (a compiled graph's own node is not looked into)
    ours = (_LinearFunction, _ConvFunction, _EmbeddingFunction, _LayerNormFunction,
            _GroupNormFunction, _RMSNormFunction)  # fmt: skip
    found: set[str] = set()
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        foreign = getattr(node, "_forward_cls", None) not in ours and (
            type(node).__name__ != "CompiledFunctionBackward"
        )
        for child, _ in node.next_functions:
            variable = getattr(child, "variable", None)
            if variable is None:
                stack.append(child)
            elif foreign and id(variable) in names:
                found.add(names[id(variable)])
    return found
