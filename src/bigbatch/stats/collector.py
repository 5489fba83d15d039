"""Gradient statistics from the sub-batches of one optimizer step.

The sub-batches (REFERENCE.md §1) are the micro-batches of gradient
accumulation on one process, and under DDP the micro-batches of every rank.
Per step this costs, on top of the backward passes:

- per micro-batch, one read of its gradient (its squared norm, taken in a
  gradient hook before it is added to ``.grad``, so before DDP reduces it)
  and one Python call;
- under DDP, one all-reduce of ``2 G + 1`` float64 scalars (``G`` parameter
  groups): the summed sub-batch norms, ``|g|²`` and the loss;
- the similarity: with ``similarity="split"`` on one process, one copy of
  ``.grad`` at the half-way micro-batch into a persistent buffer and three
  reductions at the end; under DDP the exact split of the ranks into two
  groups, through the :class:`~bigbatch.dist.TwoGroupCosine` comm hook (one
  extra gradient-sized all-reduce); with ``similarity="scalar"`` nothing more:
  it is estimated from the noise scalars;
- with ``gsnr=True``, a second buffer and a few element-wise passes per
  micro-batch for the element-wise variance (weighted Welford on one
  process; under DDP shifted sums of squares, a third buffer holding the
  shift, and one gradient-sized float32 all-reduce).

Nothing syncs with the host until the caller reads a value.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._tensors import dots, norms
from ..dist.world import World
from .estimators import ema_update, half_split_cosine, noise_from_mean, scalar_halves

SIMILARITY_MODES = ("split", "scalar")


@dataclass
class GradientStats:
    """What one optimizer step measured; tensors on the parameters' device.

    ``similarity`` is the cosine of the mean gradients of the two halves of the
    micro-batches (SimiGrad's signal); ``group_similarity`` the same per
    parameter group. ``grad_sq_norm`` (|G|²) and ``trace`` (tr Σ) are this
    step's unbiased estimates; ``noise_scale`` is ``B_simple = trΣ/|G|²`` from
    their exponential moving averages (numerator and denominator smoothed
    apart). ``gsnr`` (when collected) holds per parameter the element-wise
    ``mean² / variance`` of the micro-batch gradients.
    """

    similarity: Tensor
    group_similarity: Tensor
    grad_sq_norm: Tensor
    trace: Tensor
    noise_scale: Tensor
    grad_sq_norm_ema: Tensor
    trace_ema: Tensor
    sizes: list[int]
    gsnr: list[Tensor] | None = field(default=None, repr=False)
    #: the batch's mean loss, when the caller passed its local share to ``finish``
    loss: Tensor | None = None
    #: per group, ``(|g_A|², |g_B|², <g_A, g_B>)`` (measured, or their scalar
    #: estimates), shape ``(3, groups)``: the cosine of any set of groups
    #: is ``Σ dot / sqrt(Σ sq_a · Σ sq_b)`` over its columns (AGVM's module groups)
    group_halves: Tensor | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return sum(self.sizes)

    def as_floats(self) -> dict[str, float]:
        """The scalar statistics as Python floats (one host sync for all of them)."""
        names = [
            "similarity",
            "grad_sq_norm",
            "trace",
            "noise_scale",
            "grad_sq_norm_ema",
            "trace_ema",
        ]
        if self.loss is not None:
            names.append("loss")
        values = torch.stack([getattr(self, n).detach().float().cpu() for n in names]).tolist()
        out = dict(zip(names, values))
        for i, s in enumerate(self.group_similarity.detach().float().cpu().tolist()):
            out[f"similarity/group{i}"] = s
        return out


class MicroBatchStatistics:
    """Collects :class:`GradientStats` over the micro-batches of each step.

    Use it around an ordinary accumulation loop (``bigbatch.AdaptiveBatch``
    does this for you)::

        stats = MicroBatchStatistics(optimizer.param_groups)
        stats.begin(sizes)                      # sizes of this step's micro-batches
        for i, (x, y) in enumerate(micro_batches):
            stats.before_backward(i)
            (loss_fn(model(x), y) * sizes[i] / sum(sizes)).backward()
        result = stats.finish()                 # before optimizer.step()

    The loss of micro-batch ``i`` must be its mean loss times ``W b_i / B``
    (``W`` ranks, ``W = 1`` on one process), so that ``.grad`` ends as the
    batch's mean gradient after DDP averages over the ranks (what
    ``AdaptiveBatch`` does). A loss scale (``GradScaler``) is passed to
    ``finish`` and divided out; the similarity and the noise scale do not
    depend on it.

    Under DDP every rank calls ``begin`` with its own micro-batch sizes and
    the sizes of all ranks (``rank_sizes``); ``finish`` is then a collective
    and returns identical values on every rank.

    Args:
        param_groups: lists of parameters (or torch.optim param-group dicts);
            statistics are per group and overall.
        ema_beta: smoothing of |G|² and tr Σ for the noise scale (gpt-neox: 0.99).
        gsnr: also collect the element-wise gradient signal-to-noise ratio.
        dataset_size: apply the finite-population correction for a dataset of
            this many samples drawn without replacement (None: no correction).
        similarity: ``"split"`` measures the cosine of two halves exactly (the
            micro-batch halves on one process, two groups of ranks under DDP,
            where it needs ``comm_hook`` registered on the DDP model);
            ``"scalar"`` estimates it from the noise scalars (REFERENCE.md §1),
            with no gradient-sized buffer or traffic. Default: ``"split"`` on
            one process, ``"scalar"`` under DDP.
        world: the data-parallel world (``bigbatch.dist.World.of(ddp_model)``);
            one process by default.
        lossy_reduction: DDP reduces the gradients with a lossy comm hook
            (compression): the noise estimates then use only each rank's own,
            uncompressed micro-batches (``|g|²`` of the rank's local mean, not
            of the reduced gradient) and are averaged over the ranks; needs 2+
            micro-batches per rank.
    """

    def __init__(
        self,
        param_groups: Sequence[Sequence[Tensor] | dict],
        *,
        ema_beta: float = 0.99,
        gsnr: bool = False,
        dataset_size: int | None = None,
        similarity: str | None = None,
        world: World | None = None,
        lossy_reduction: bool = False,
    ) -> None:
        self.world = world if world is not None else World()
        # the reduced .grad is not the exact mean (a compression hook): estimate
        # the noise from each rank's own micro-batches and average the estimates
        self.lossy_reduction = lossy_reduction and self.world.distributed
        if similarity is None:
            similarity = "scalar" if self.world.distributed else "split"
        if similarity not in SIMILARITY_MODES:
            raise ValueError(f"similarity must be one of {SIMILARITY_MODES}, got {similarity!r}")
        self.similarity = similarity
        groups = [list(g["params"]) if isinstance(g, dict) else list(g) for g in param_groups]
        self.params = [p for g in groups for p in g if p.requires_grad]
        if not self.params:
            raise ValueError("MicroBatchStatistics needs at least one trainable parameter")
        owner = [i for i, g in enumerate(groups) for p in g if p.requires_grad]
        self.num_groups = len(groups)
        device = self.params[0].device
        self._owner = torch.tensor(owner, device=device)
        if not 0 <= ema_beta < 1:
            raise ValueError(f"ema_beta must be in [0, 1), got {ema_beta!r}")
        self.ema_beta = ema_beta
        self.gsnr = gsnr
        self.dataset_size = dataset_size
        self._half: list[Tensor] | None = None  # .grad after the first half (allocated once)
        self._m2: list[Tensor] | None = None  # Welford sum of squared deviations
        self._m1: list[Tensor] | None = None  # under DDP: Σ w (x - shift)
        self._local_sq: Tensor | None = None  # lossy: |local sum|² per group
        # under DDP: the shift of the sums of squares (the previous step's mean gradient)
        self._shift: list[Tensor] | None = None
        self._signal_ema = torch.zeros((), device=device, dtype=torch.float64)
        self._trace_ema = torch.zeros((), device=device, dtype=torch.float64)
        self._ema_steps = 0
        self._sizes: list[int] = []
        self._rank_sizes: list[list[int]] = []
        self._total = 0  # samples (or weight) in the step, all ranks
        self._current: int | None = None
        self._sub_sq: Tensor | None = None
        #: bytes this collector sent in its own all-reduces (under DDP)
        self.bytes_communicated = 0
        #: the DDP comm hook that measures the split under DDP (register it on the model)
        self.comm_hook = None
        if self.world.distributed and similarity == "split":
            from ..dist.hooks import TwoGroupCosine

            self.comm_hook = TwoGroupCosine(groups, self.world.group)
        self._hooks = [
            torch.autograd.graph.register_multi_grad_hook(
                self.params, self._on_gradients, mode="all"
            )
        ]
        if self.lossy_reduction:
            self._hooks += [
                p.register_hook(functools.partial(self._local_total, i))
                for i, p in enumerate(self.params)
            ]
        if gsnr:
            # Welford needs .grad before this micro-batch is added. A multi-grad
            # hook fires after the last gradient arrives, when the others may
            # already be accumulated; a tensor hook fires before its own.
            self._hooks += [
                p.register_hook(functools.partial(self._welford, i))
                for i, p in enumerate(self.params)
            ]

    # ------------------------------------------------------------ step lifecycle

    def begin(
        self,
        sizes: Sequence[int],
        rank_sizes: Sequence[Sequence[int]] | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> None:
        """Start a step made of micro-batches of these sizes.

        ``rank_sizes`` (under DDP) lists every rank's micro-batch sizes, this
        rank's among them; there must be at least 2 sub-batches in all, and
        with ``similarity="split"`` on one process at least 2 micro-batches.
        ``loss_weights`` are the factors this rank's micro-batch mean losses
        are multiplied by before backward (default ``W b_i / B``, which makes
        ``.grad`` the sample-weighted mean after DDP averages). Loops that
        weight every micro-batch equally (``1/k``: Lightning, the Hugging
        Face Trainer) pass theirs; the sub-batch gradients are then still
        exact, and ``.grad`` is the mean of the micro-batch means, which
        differs from the sample mean only by the ±1 sample between sizes.
        """
        local = [int(s) for s in sizes]
        every = [[int(s) for s in r] for r in rank_sizes] if rank_sizes is not None else [local]
        if len(every) != self.world.size:
            raise ValueError(f"rank_sizes has {len(every)} entries for {self.world.size} ranks")
        if every[self.world.rank] != local:
            raise ValueError(
                f"rank {self.world.rank}'s entry of rank_sizes {every[self.world.rank]} "
                f"differs from its sizes {local}"
            )
        if sum(len(r) for r in every) < 2 or (
            self.similarity == "split" and not self.world.distributed and len(local) < 2
        ):
            raise ValueError(f"statistics need at least 2 micro-batches, got sizes {local}")
        self._sizes, self._rank_sizes = local, every
        self._total = sum(sum(r) for r in every)
        if loss_weights is None:
            loss_weights = [self.world.size * b / self._total for b in local]
        if len(loss_weights) != len(local) or not all(w > 0 for w in loss_weights):
            raise ValueError(
                f"loss_weights must be {len(local)} positive numbers, got {list(loss_weights)}"
            )
        self._loss_weights = [float(w) for w in loss_weights]
        if self.comm_hook is not None:
            self.comm_hook.reset()
        device = self.params[0].device
        self._sub_sq = torch.zeros(len(sizes), self.num_groups, device=device, dtype=torch.float64)
        self._current = None
        if self.gsnr:
            if self._m2 is None:
                self._m2 = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
                if self.world.distributed:
                    self._m1 = [torch.zeros_like(m) for m in self._m2]
                    self._shift = [torch.zeros_like(m) for m in self._m2]
            torch._foreach_zero_(self._m2)
            if self._m1 is not None:
                torch._foreach_zero_(self._m1)
        if self.lossy_reduction:
            if len(local) < 2:
                raise ValueError(
                    "with a lossy comm hook the noise is estimated within each rank: every rank "
                    f"needs 2+ micro-batches, got sizes {local} (raise min_sub_batches)"
                )
            self._local_sq = torch.zeros(self.num_groups, device=device, dtype=torch.float64)

    @property
    def half(self) -> int:
        """Micro-batches ``[0, half)`` form half A, the rest half B."""
        return len(self._sizes) // 2

    def before_backward(self, index: int) -> None:
        """Announce that the next backward pass is micro-batch ``index``'s.

        At the first micro-batch of half B, ``.grad`` holds half A's gradient
        and is copied into the buffer (``similarity="split"`` on one process).
        """
        if not self._sizes:
            raise RuntimeError("call begin(sizes) before before_backward")
        if index == self.half and self.similarity == "split" and not self.world.distributed:
            self._snapshot_half()
        self._current = index

    def finish(
        self, loss_scale: Tensor | float | None = None, loss: Tensor | None = None
    ) -> GradientStats:
        """The step's statistics; call after the last backward, before the optimizer step.

        ``loss`` (optional) is this rank's share of the batch loss, summed as
        its micro-batch losses were weighted in backward; under DDP it travels
        in the same all-reduce and comes back as the batch's mean loss.
        """
        if self._sub_sq is None or self._current is None:
            raise RuntimeError("finish() without a step: call begin() and before_backward()")
        world = self.world
        all_sizes = [b for r in self._rank_sizes for b in r]
        total = sum(all_sizes)
        scale_sq = _as_tensor(loss_scale, self._sub_sq) ** 2
        grads = [_grad_or_zeros(p) for p in self.params]
        sq_full = self._per_group(norms(grads), square=True)

        # micro-batch i's mean gradient is its increment / its loss weight
        weights = torch.tensor(self._loss_weights, dtype=torch.float64).to(self._sub_sq.device)
        sub_sq_sum = (self._sub_sq / weights[:, None] ** 2).sum(0) / scale_sq
        loss_sum = (
            _as_tensor(loss, self._sub_sq) if loss is not None else torch.zeros_like(scale_sq)
        )
        groups = self.num_groups
        if self.lossy_reduction:
            # this rank's estimates from its own micro-batches, averaged over the ranks
            assert self._local_sq is not None
            # the rank's local mean: its accumulated gradient over the summed loss weights
            local_sq = self._local_sq / sum(self._loss_weights) ** 2 / scale_sq
            signal_g, trace_g = noise_from_mean(
                sub_sq_sum / len(self._sizes), self._sizes, local_sq, self.dataset_size
            )
            packed = torch.cat([signal_g, trace_g, loss_sum[None]]) / world.size
            world.all_reduce_sum(packed)
            self.bytes_communicated += packed.numel() * packed.element_size()
            signal_g, trace_g, loss_sum = packed[:groups], packed[groups:-1], packed[-1]
        else:
            if world.distributed:
                # one all-reduce: the summed sub-batch norms, and |g|² and the loss
                # averaged, so every rank decides from bitwise identical numbers
                packed = torch.cat(
                    [sub_sq_sum, sq_full / world.size, (loss_sum / world.size)[None]]
                )
                world.all_reduce_sum(packed)
                self.bytes_communicated += packed.numel() * packed.element_size()
                sub_sq_sum, sq_full, loss_sum = packed[:groups], packed[groups:-1], packed[-1]
            signal_g, trace_g = noise_from_mean(
                sub_sq_sum / len(all_sizes), all_sizes, sq_full / scale_sq, self.dataset_size
            )
        signal, trace = signal_g.sum(), trace_g.sum()
        size_a = sum(self._half_sizes())
        if self.similarity == "scalar":
            sq_a, sq_b, dot_ab = scalar_halves(
                signal_g, trace_g, size_a, total - size_a, self.dataset_size
            )
        else:
            sq_a, sq_b, dot_ab = self._split(grads, sq_full)
        group_similarity = half_split_cosine(sq_a, sq_b, dot_ab)
        similarity = half_split_cosine(sq_a.sum(), sq_b.sum(), dot_ab.sum())

        beta = self.ema_beta
        ema_update(self._signal_ema, signal, beta)
        ema_update(self._trace_ema, trace, beta)
        self._ema_steps += 1
        correction = 1 - beta**self._ema_steps
        signal_ema, trace_ema = self._signal_ema / correction, self._trace_ema / correction

        gsnr = self._finish_gsnr(grads) if self.gsnr else None
        self._sizes, self._current, self._sub_sq = [], None, None
        return GradientStats(
            similarity=similarity.float(),
            group_similarity=group_similarity.float(),
            grad_sq_norm=signal.float(),
            trace=trace.float(),
            noise_scale=(trace_ema / signal_ema).float(),
            grad_sq_norm_ema=signal_ema.float(),
            trace_ema=trace_ema.float(),
            sizes=all_sizes,
            gsnr=gsnr,
            loss=loss_sum.float() if loss is not None else None,
            group_halves=torch.stack([sq_a, sq_b, dot_ab]).float(),
        )

    def _half_sizes(self) -> list[int]:
        """Sizes of half A's sub-batches: the first micro-batches, or the first ranks under DDP."""
        if self.world.distributed:
            return [b for r in self._rank_sizes[: self.world.size // 2] for b in r]
        return self._sizes[: self.half]

    def _split(self, grads: list[Tensor], sq_full: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(|g_A|², |g_B|², <g_A, g_B>)`` per group, up to positive factors per half."""
        if self.comm_hook is not None:
            return self.comm_hook.read()
        if self._half is None:
            raise RuntimeError("the half-way micro-batch was never announced")
        sq_a = self._per_group(norms(self._half), square=True)
        dot_a_full = self._per_group(dots(self._half, grads))
        return sq_a, sq_full - 2 * dot_a_full + sq_a, dot_a_full - sq_a

    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, object]:
        return {
            "signal_ema": self._signal_ema.clone(),
            "trace_ema": self._trace_ema.clone(),
            "ema_steps": self._ema_steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._signal_ema.copy_(state["signal_ema"])  # type: ignore[arg-type]
        self._trace_ema.copy_(state["trace_ema"])  # type: ignore[arg-type]
        self._ema_steps = int(state["ema_steps"])  # type: ignore[call-overload]

    # ------------------------------------------------------------ internals

    def _on_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """Gradient hook: ``grads`` are this backward's increments, not yet in ``.grad``."""
        index = self._current
        if index is None or self._sub_sq is None:
            return  # a backward outside a step (e.g. the user's own): not ours
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        sq = torch.stack([n.double() for n in norms([grads[i] for i in present])]).square()
        owner = self._owner if len(present) == len(grads) else self._owner[present]
        self._sub_sq[index].index_add_(0, owner, sq)

    def _snapshot_half(self) -> None:
        grads = [_grad_or_zeros(p) for p in self.params]
        if self._half is None:
            self._half = [torch.empty_like(g) for g in grads]
        torch._foreach_copy_(self._half, grads)

    def _per_group(self, values: list[Tensor], square: bool = False) -> Tensor:
        v = torch.stack([x.double() for x in values])
        if square:
            v = v.square()
        out = torch.zeros(self.num_groups, dtype=torch.float64, device=v.device)
        return out.index_add_(0, self._owner, v)

    def _local_total(self, param_index: int, increment: Tensor) -> None:
        """At the last micro-batch, |this rank's accumulated gradient|² (before DDP reduces it).

        A tensor hook fires before its own increment is added, so ``.grad``
        holds the earlier micro-batches (accumulated under ``no_sync``).
        """
        if self._current is None or self._current != len(self._sizes) - 1:
            return
        assert self._local_sq is not None
        p = self.params[param_index]
        total = increment if p.grad is None else p.grad + increment
        owner = self._owner[param_index]
        self._local_sq[owner] += norms([total])[0].double().square()

    def _welford(self, param_index: int, increment: Tensor) -> None:
        """Weighted Welford update of parameter ``param_index``'s element-wise M2.

        With ``x_i = incr_i / l_i`` (micro-batch i's mean gradient, times the
        loss scale, ``l_i`` its loss weight), weights ``w_i = l_i / Σ l`` (the
        sample weights ``b_i / B`` by default) and ``W`` the weight so far:
        ``M2 += w (x - mean_old)(x - mean_new)`` (West 1979), where ``mean_old``
        is ``.grad / (W Σ l)`` before this increment is added, which is what a
        tensor hook sees. Under DDP, where the other ranks' micro-batches are
        not here, it accumulates ``Σ w (x - c)²`` with the sample weights about
        a shift ``c`` common to all ranks instead (see :meth:`_finish_gsnr`).
        """
        index = self._current
        if index is None or not self._sizes or self._m2 is None:
            return
        p, m2 = self.params[param_index], self._m2[param_index]
        total = self._total
        w = self._sizes[index] / total  # the sample weight of this sub-batch
        x = increment.float() / self._loss_weights[index]  # its mean gradient
        if self._shift is not None and self._m1 is not None:
            deviation = x - self._shift[param_index]
            self._m1[param_index].add_(deviation, alpha=w)
            m2.add_(deviation.square_(), alpha=w)
            return
        if index == 0:
            return  # one sub-batch has no deviation yet
        scale = sum(self._loss_weights)  # .grad is Σ l x: the weights that define it
        w = self._loss_weights[index] / scale
        before = sum(self._loss_weights[:index]) / scale
        acc = _grad_or_zeros(p).float() / scale
        mean_old = acc / before
        mean_new = (acc + x * w) / (before + w)
        m2.add_((x - mean_old) * (x - mean_new), alpha=w)

    def _finish_gsnr(self, grads: list[Tensor], eps: float = 1e-30) -> list[Tensor]:
        """Element-wise ``mean² / variance`` (population variance over all sub-batches).

        Under DDP the ranks' ``Σ w (x - c)`` and ``Σ w (x - c)²`` are summed in
        one float32 all-reduce (two gradient-sized rows); the mean is
        ``c + Σ w (x - c)`` and ``var = Σ w (x - c)² - (Σ w (x - c))²``. The
        shift ``c`` is the previous step's mean gradient (zero at first), close
        to the mean, so the subtraction does not cancel the way ``E x² - g²``
        would; and the mean is that of the uncompressed sub-batch gradients
        whatever comm hook reduced ``.grad``.
        """
        assert self._m2 is not None
        if self._shift is None or self._m1 is None:
            scale = sum(self._loss_weights)  # 1 unless the caller weighted differently
            return [(g.float() / scale).square() / (m2 + eps) for g, m2 in zip(grads, self._m2)]
        flat = torch.cat([m.flatten() for m in (*self._m1, *self._m2)])
        self.world.all_reduce_sum(flat)
        self.bytes_communicated += flat.numel() * flat.element_size()
        half = flat.numel() // 2
        out, start = [], 0
        for m2, c in zip(self._m2, self._shift):
            first = flat[start : start + m2.numel()].view_as(m2)
            second = flat[half + start : half + start + m2.numel()].view_as(m2)
            start += m2.numel()
            mean = c + first
            variance = (second - first.square()).clamp_(min=0)
            out.append(mean.square() / (variance + eps))
            # an overflowed step (GradScaler) must not poison the next shift
            c.copy_(torch.where(torch.isfinite(mean), mean, c))
        return out


def _grad_or_zeros(p: Tensor) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _as_tensor(value: Tensor | float | None, like: Tensor) -> Tensor:
    if value is None:
        return torch.ones((), dtype=like.dtype, device=like.device)
    if isinstance(value, Tensor):
        return value.detach().to(device=like.device, dtype=like.dtype).reshape(())
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)
