"""Per-example squared gradient norms in the backward pass the step already runs.

The noise scale needs ``E|g|²`` at two batch sizes (docs/algorithms.md,
"Gradient statistics"). The sub-batch estimator gets the small one from
micro-batches, which costs a split of every step. The per-example gradients
give it at batch 1, and for the layers that hold almost all of a model's
parameters their squared norms come from what the layer's backward already
has, its input ``a`` and its output's gradient ``δ``, without forming the
per-example gradient (Goodfellow 2015, "Efficient per-example gradient
computations"):

- ``Linear`` on ``(N, d_in)``: ``|g_i(W)|² = |a_i|² |δ_i|²``; on sequences
  ``(N, T, d_in)`` either the "ghost norm" ``Σ_{t,t'} (a_t·a_t')(δ_t·δ_t')``
  (Li et al. 2022, "Large language models can be strong differentially
  private learners") or ``|δ_iᵀ a_i|²``, whichever costs less (``2T²`` against
  ``d_in d_out``); the bias ``|Σ_t δ_t|²``;
- ``Embedding``: ``Σ_{t,t'} [x_t = x_t'] δ_t·δ_t'`` (rows hit twice add up);
- ``LayerNorm``: ``|Σ_t x̂_t ⊙ δ_t|²`` and ``|Σ_t δ_t|²`` (Gray et al. 2024 find
  these alone track a transformer's noise scale);
- ``Conv1d``/``Conv2d`` (one group): the ``Linear`` rule on the unfolded input.

:data:`RULES` is the registry, as data. A model is *covered* when every
trainable parameter belongs to exactly one module of a type in it, as that
module's own ``weight`` or ``bias``, and every such module runs once per
forward; then :class:`PerExampleNorms` gives ``Σ_i |g_i|²`` per parameter group
for each micro-batch, and the step needs micro-batches only for memory.
A model that is not covered (a bare ``nn.Parameter``, a BatchNorm, which
couples the examples, tied weights) keeps the sub-batch estimator;
:func:`uncovered` names what is missing.

Examples are the first dimension of each layer's input (batch-first models).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional

from .layout import ParamLayout

__all__ = ["RULES", "PerExampleNorms", "uncovered"]

#: ``torch.compiler.disable`` that imports Dynamo when first called (torch >= 2.1 has it)
_eager_under_compile = getattr(torch, "_disable_dynamo", torch.compiler.disable)

#: a rule: (module, its input, its output's gradient) -> {parameter name: Σ_i |g_i|²}, each
#: a 0-dimensional tensor (the sum over the examples: the estimator needs no more)
Rule = Callable[[nn.Module, Tensor, Tensor], dict[str, Tensor]]


def _sq(x: Tensor) -> Tensor:
    """``|x|²`` in one kernel (two from bf16: summed in fp32)."""
    flat = _wide(x).reshape(-1)
    return flat.dot(flat)


def _matrix_sq(a: Tensor, d: Tensor) -> Tensor:
    """``Σ_i |d_iᵀ a_i|²`` for ``a`` ``(N, T, p)`` and ``d`` ``(N, T, q)``, the cheaper way."""
    steps, p, q = a.shape[1], a.shape[2], d.shape[2]
    if steps == 1:
        return _wide(a).square().sum((1, 2)).dot(_wide(d).square().sum((1, 2)))
    if 2 * steps * steps <= p * q:  # the ghost norm: two T x T Gram matrices
        grams = torch.bmm(a, a.transpose(1, 2)), torch.bmm(d, d.transpose(1, 2))
        return _wide(grams[0]).reshape(-1).dot(_wide(grams[1]).reshape(-1))
    return _sq(torch.bmm(d.transpose(1, 2), a))


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32 at least, for element-wise work and sums."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _for_products(x: Tensor, like: Tensor) -> Tensor:
    """``x`` in the dtype the matrix products run in: bf16 where the gradient is bf16 (the
    tensor cores, accumulating in fp32; bf16 has fp32's range), else fp32 at least (an
    fp16 product of activations can overflow)."""
    if like.dtype == torch.bfloat16:
        return x.to(torch.bfloat16)
    return _wide(x)


def _sequence(x: Tensor) -> Tensor:
    """``(N, ..., f)`` as ``(N, T, f)``."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _linear(module: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    a, d = _for_products(_sequence(a), d), _for_products(_sequence(d), d)
    out = {"weight": _matrix_sq(a, d)}
    if module.bias is not None:
        out["bias"] = _sq(d.sum(1))
    return out


def _embedding(module: nn.Module, x: Tensor, d: Tensor) -> dict[str, Tensor]:
    ids = x.reshape(x.shape[0], -1)
    d = _for_products(_sequence(d), d)
    if module.padding_idx is not None:  # the padding row gets no gradient
        d = d * (ids != module.padding_idx).unsqueeze(-1)
    gram = _wide(torch.bmm(d, d.transpose(1, 2)))
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(gram.dtype)
    return {"weight": same.reshape(-1).dot(gram.reshape(-1))}


def _layer_norm(module: nn.Module, x: Tensor, d: Tensor) -> dict[str, Tensor]:
    shape = module.normalized_shape
    n = x.shape[0]
    d = _wide(d).reshape(n, -1, *shape)
    out = {}
    if module.weight is not None:
        normed = functional.layer_norm(_wide(x), shape, None, None, module.eps)
        out["weight"] = _sq((normed.reshape(d.shape) * d).sum(1))
    if module.bias is not None:
        out["bias"] = _sq(d.sum(1))
    return out


def _conv(module: nn.Module, x: Tensor, d: Tensor) -> dict[str, Tensor]:
    one_d = isinstance(module, nn.Conv1d)
    if one_d:  # as a 2-D convolution of height 1
        x, d = x.unsqueeze(2), d.unsqueeze(2)
        kernel, dilation = (1, *module.kernel_size), (1, *module.dilation)
        padding, stride = (0, *module.padding), (1, *module.stride)
    else:
        kernel, dilation = module.kernel_size, module.dilation
        padding, stride = module.padding, module.stride
    x = _for_products(x, d)
    columns = functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    n = x.shape[0]
    a = columns.transpose(1, 2)  # (N, positions, C_in · kernel)
    d = _for_products(d, d).reshape(n, d.shape[1], -1).transpose(1, 2)  # (N, positions, C_out)
    out = {"weight": _matrix_sq(a, d)}
    if module.bias is not None:
        out["bias"] = _sq(d.sum(1))
    return out


def _conv_supported(module: nn.Module) -> bool:
    return (
        module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


#: the layers whose per-example norms are known, and when a module qualifies
RULES: dict[type, tuple[Rule, Callable[[nn.Module], bool]]] = {
    nn.Linear: (_linear, lambda m: True),
    nn.Embedding: (_embedding, lambda m: not m.sparse),
    nn.LayerNorm: (_layer_norm, lambda m: True),
    nn.Conv1d: (_conv, _conv_supported),
    nn.Conv2d: (_conv, _conv_supported),
}


def _rule(module: nn.Module) -> Rule | None:
    for kind, (rule, qualifies) in RULES.items():
        if type(module) is kind or (isinstance(module, kind) and _is_fsdp_subclass(module, kind)):
            return rule if qualifies(module) else None
    return None


def _is_fsdp_subclass(module: nn.Module, kind: type) -> bool:
    """FSDP2 swaps a module's class for a subclass named after it (``FSDPLinear``); a user's
    own subclass may change ``forward``, so only those count."""
    return type(module).__name__ == f"FSDP{kind.__name__}"


def _covered_modules(
    model: nn.Module, params: Sequence[Tensor]
) -> tuple[list[tuple[nn.Module, Rule]], list[str]]:
    """The modules to hook, and the names of the trainable parameters none covers."""
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
    missing = [names.get(id(p), "?") for p in params if owners.get(id(p)) != 1]
    return chosen, missing


def uncovered(model: nn.Module, params: Sequence[Tensor]) -> list[str]:
    """The trainable parameters (of ``params``) whose per-example norms no rule gives: a
    bare parameter, a layer not in :data:`RULES` (BatchNorm couples the examples), a weight
    shared by two layers. Empty: the model is covered."""
    return _covered_modules(model, params)[1]


class PerExampleNorms:
    """``Σ_i |g_i|²`` per parameter group over each step, from hooks on the covered layers.

    ``g_i`` is example ``i``'s gradient of its own loss: ``B`` times its share of
    the batch's mean gradient, so each share's squared norm is scaled by ``B²``
    (``(B/W)²`` on each of ``W`` ranks, whose ``.grad`` DDP averages;
    :meth:`set_scale`). With ``sample``, only the first ``sample`` examples of each
    micro-batch are measured: the examples of a shuffled batch are exchangeable, so
    their mean squared norm is still an unbiased estimate of every example's, at a
    cost that stops growing with the micro-batch (it matters for long sequences,
    where a layer's norms cost about what its weight gradient does). Nothing is read
    to the host.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout, sample: int | None = None) -> None:
        chosen, missing = _covered_modules(model, layout.params)
        if missing:
            raise ValueError(
                "per-example statistics need every trainable parameter in one layer of "
                f"{', '.join(k.__name__ for k in RULES)} (as its weight or bias), run once per "
                f"forward; not covered: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}"
            )
        group = {id(p): layout.group_of(i) for i, p in enumerate(layout.params)}
        # each hooked layer's trained parameters and their groups (a frozen one has none)
        self._groups = {
            id(m): {n: group[id(p)] for n, p in m.named_parameters(recurse=False) if id(p) in group}
            for m, _ in chosen
        }
        self._rules = {id(m): rule for m, rule in chosen}
        self._names = {id(m): name for name, m in model.named_modules()}
        self.num_groups, self.device = layout.num_groups, layout.device
        #: the examples of each micro-batch whose norms are taken (its first ones; None: all)
        self.sample = sample
        #: this step's per-layer sums, per group (None outside a step)
        self.parts: list[list[Tensor]] | None = None
        self._scale = 1.0
        self._ran: set[int] = set()
        self.handles = [m.register_forward_hook(self._on_forward) for m, _ in chosen]

    def begin(self) -> None:
        """Start a step: no sums yet."""
        self.parts = [[] for _ in range(self.num_groups)]
        self._ran.clear()

    def set_scale(self, scale: float) -> None:
        """The factor of the squared shares of the step (its micro-batch whose backward runs
        next has had its forward; the next forward is the next micro-batch's)."""
        self._scale = scale
        self._ran.clear()

    # under torch.compile the hook runs eagerly, between the compiled graphs of the layers
    # around it (Dynamo cannot trace a hook that registers a gradient hook on a closure);
    # torch's lazy form imports Dynamo at the first call, not with bigbatch (importing it
    # with bigbatch also imported Triton before TRITON_INTERPRET could apply)
    @_eager_under_compile
    def _on_forward(self, module: nn.Module, inputs: tuple, output: Tensor) -> None:
        if self.parts is None or not torch.is_grad_enabled() or not isinstance(output, Tensor):
            return
        if not output.requires_grad:
            return
        key = id(module)
        if key in self._ran:  # the sum of two uses' gradients is not the sum of their norms
            raise RuntimeError(
                f"per-example statistics: layer {self._names.get(key, key)!r} ran twice in one "
                "micro-batch's forward (shared, or re-run by activation checkpointing); use "
                "the sub-batch statistics (noise_from='sub_batches') for such a model"
            )
        if not inputs or not isinstance(inputs[0], Tensor):
            raise RuntimeError(
                f"per-example statistics: layer {self._names.get(key, key)!r} was called "
                "without a positional input tensor, which its hook reads; call it with one"
            )
        self._ran.add(key)
        # the input as autograd keeps it anyway (no detach: nothing flows back through it)
        saved = inputs[0]
        if self.sample is not None and len(saved) > self.sample:
            saved = saved[: self.sample]
        output.register_hook(lambda grad: self._on_grad(module, saved, grad))

    def _on_grad(self, module: nn.Module, saved: Tensor, grad: Tensor) -> None:
        parts = self.parts
        if parts is None:
            return
        if len(grad) > len(saved):  # a sample of the micro-batch
            grad = grad[: len(saved)]
        groups = self._groups[id(module)]
        with torch.no_grad():
            for name, total in self._rules[id(module)](module, saved, grad).items():
                if name in groups:
                    parts[groups[name]].append(total)

    def finish(self) -> Tensor:
        """``Σ_i |g_i|²`` per group over the step's examples measured (this rank's), in
        float64; ends the step."""
        parts, self.parts = self.parts, None
        if parts is None:
            raise RuntimeError("per-example norms: finish() without begin()")
        sums = [
            torch.stack(p).sum().double()
            if p
            else torch.zeros((), dtype=torch.float64, device=self.device)
            for p in parts
        ]
        return torch.stack(sums) * self._scale

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
