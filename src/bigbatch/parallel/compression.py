"""Gradient compression (Top-K, Rand-K) with error control as a DDP communication hook,
in gradient units; state per parameter, the first ``warmup`` steps uncompressed
(docs/algorithms.md, "Compression with error control")."""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._checks import check_number, choice
from ..batch.sampler import MAX_SEED
from ..knobs import Knob
from . import error_control
from .error_control import METHODS, SHARED_ESTIMATE

__all__ = [
    "COMPRESSORS",
    "DEFAULT_ETA",
    "METHODS",
    "CompressionState",
    "compression_hook",
    "kept",
    "rand_k",
    "top_k",
]

COMPRESSORS = ("topk", "randk")


def kept(d: int, ratio: float) -> int:
    """How many of ``d`` coordinates a compression ratio keeps: ``⌈ratio·d⌉``, at least one."""
    # (rounded first: 0.07 * 100 is 7.000000000000001 in binary, which ceil made 8)
    return max(1, min(d, math.ceil(round(ratio * d, 9))))


def top_k(message: Tensor, ratio: float) -> tuple[Tensor, Tensor]:
    """Top-K: the values and indices of the ``kept(d, ratio)`` largest-magnitude coordinates."""
    indices = message.abs().topk(kept(message.numel(), ratio), sorted=False).indices
    return message[indices], indices


def rand_k(message: Tensor, ratio: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Rand-K: ``kept(d, ratio)`` coordinates drawn by ``generator`` (unscaled values,
    indices); every rank must pass a generator in the same state."""
    d = message.numel()
    indices = torch.randperm(d, generator=generator, device=message.device)[: kept(d, ratio)]
    return message[indices], indices


#: each method's η when none is given (docs/algorithms.md, "Compression with error control")
DEFAULT_ETA = {"ef21-sgdm": 0.1, "econtrol": 0.1}
# torch 2.10 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CompressionState:
    """The state of :func:`compression_hook`: Top-K or Rand-K with an error-control method.

    Args:
        model: the ``DistributedDataParallel`` model (its parameters key the state).
        method: ``"ef"``, ``"ef21"``, ``"ef21-sgdm"``, ``"econtrol"`` or ``"none"``.
        compressor: ``"topk"`` (all-gather of values and indices) or ``"randk"``
            (shared seed; all-reduce of the values).
        ratio: the fraction ``K/d`` of each bucket sent (0 < ratio ≤ 1).
        eta: the method's η (``None``: :data:`DEFAULT_ETA`; ignored by ef and none).
        warmup: steps of plain all-reduce first (at least 1).
        seed: Rand-K's shared seed.

    Register with ``ddp.register_comm_hook(state, compression_hook)`` or
    ``AdaptiveBatch(comm_hook=(state, compression_hook))``; save ``state_dict()``.
    """

    #: the config keys (``dist.<key>``) a run may set (bigbatch.knobs); the method's η is two
    #: keys there, one per meaning (see ``DEFAULT_ETA``)
    CONFIG: ClassVar[dict[str, Knob]] = {
        "compressor": Knob("compressor", "what dist.compression sends", choices=COMPRESSORS),
        "ratio": Knob(
            "ratio", "fraction of each gradient bucket sent", low=0, high=1, low_open=True
        ),
        "warmup": Knob("warmup", "steps of uncompressed all-reduce before compressing", low=1),
    }

    def __init__(
        self,
        model: nn.parallel.DistributedDataParallel,
        method: str = "ef",
        compressor: str = "topk",
        ratio: float = 0.01,
        *,
        eta: float | None = None,
        warmup: int = 10,
        seed: int = 0,
    ) -> None:
        self.method = choice("method", method, METHODS)
        self.compressor = self.CONFIG["compressor"].check("compressor", compressor, "str")
        ratio = self.CONFIG["ratio"].check("ratio", ratio, "float")
        if eta is None:
            eta = DEFAULT_ETA.get(self.method, 0.0)
        averaging = self.method == "ef21-sgdm"  # a weight in (0, 1]; else any η >= 0
        name = f"eta of {self.method}"
        eta = check_number(name, eta, low_open=averaging, high=1 if averaging else math.inf)
        self.CONFIG["warmup"].check("warmup", warmup, "int")
        seed = check_number("seed", seed, high=MAX_SEED, whole=True)
        self.ratio, self.eta, self.warmup, self.seed = ratio, eta, warmup, seed
        # The state is in the units of the bucket: with a GradScaler, loss-scaled.
        # Overflowed steps leave it untouched (see _keep_finite); a change of
        # scale rescales what it means (a bounded, transient error).
        if not hasattr(model, "process_group"):  # (DDP's; a plain module has none)
            raise ValueError(
                f"CompressionState needs the DistributedDataParallel model, got "
                f"{type(model).__name__}"
            )
        self.group = model.process_group
        self.world_size = dist.get_world_size(self.group)
        self._index = {id(p): i for i, p in enumerate(model.parameters())}
        self._device = next(model.parameters()).device
        #: per parameter index, the method's state tensors (flattened)
        self._state: dict[int, dict[str, Tensor]] = {}
        #: the shared aggregate (EF21's G, EControl's H) per parameter index
        self._shared: dict[int, Tensor] = {}
        self.iteration = 0
        # the state as the step under way found it (references: the hook replaces tensors,
        # never writes into them), put back where the loop skips the step
        self._before: tuple[dict, dict] | None = None
        self._in_step = False
        #: bytes this rank put into collectives, and what plain all-reduce would have
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self._steps_counted = 0  # steps behind the byte counters (saved with them)

    @property
    def lossless(self) -> bool:
        """Whether the result is the plain mean (ratio 1, except EF21-SGDM with η < 1)."""
        return self.ratio >= 1.0 and (self.method != "ef21-sgdm" or self.eta == 1.0)

    @property
    def stateful(self) -> bool:
        # whether a step changes the state (every method but "none"): AdaptiveBatch asks
        return self.method != "none"

    # ------------------------------------------------------------ the hook

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """What :func:`compression_hook` does with one bucket."""
        buffer = bucket.buffer()
        params = bucket.parameters()
        keys = [self._index[id(p)] for p in params]
        sizes = [p.numel() for p in params]
        itemsize = buffer.element_size()
        offsets = [(g.data_ptr() - buffer.data_ptr()) // itemsize for g in bucket.gradients()]
        order = sorted(range(len(params)), key=offsets.__getitem__)
        keys, sizes = [keys[i] for i in order], [sizes[i] for i in order]
        # fp16/bf16 buckets are compressed in float32; others keep their precision
        low = buffer.dtype in (torch.float16, torch.bfloat16)
        x = (buffer.float() if low else buffer) / self.world_size
        self.bytes_uncompressed += buffer.numel() * buffer.element_size()
        iteration = self.iteration
        if not self._in_step:  # the step's first bucket
            state = {k: dict(v) for k, v in self._state.items()}
            self._before = (state, dict(self._shared), iteration)
            self._in_step = True
        if bucket.is_last():
            self.iteration += 1
            self._steps_counted += 1
            self._in_step = False
        if iteration < self.warmup:
            return self._plain(buffer, x, keys, sizes)

        state = self._gather(keys, sizes, x)
        values, indices, new = error_control.local_step(
            self.method, x, state, self.eta, lambda m: self._select(m, keys, sizes, iteration)
        )
        self._scatter(keys, sizes, new)

        def finish(total: Tensor) -> Tensor:
            if self.method in SHARED_ESTIMATE:
                shared = self._gather_shared(keys, sizes, total) + total
                self._scatter_shared(keys, sizes, shared)
                total = shared
            buffer.copy_(total)
            return buffer

        return self._reduce(values, indices, x.numel()).then(lambda f: finish(f.value()))

    # ------------------------------------------------------------ pieces

    def _plain(self, buffer: Tensor, x: Tensor, keys: list[int], sizes: list[int]):
        """Uncompressed all-reduce that also (re)starts the estimators at the gradient."""
        total = x.clone()
        self.bytes_sent += total.numel() * total.element_size()
        work = dist.all_reduce(total, group=self.group, async_op=True)

        def finish(_: Any) -> Tensor:
            # (every warm-up step, the first too: the state is kept per parameter, so DDP's
            # bucket layout of its first iteration does not matter; warmup=1 started none)
            self._scatter(keys, sizes, error_control.start(self.method, x))
            if self.method in SHARED_ESTIMATE:
                self._scatter_shared(keys, sizes, total)
            buffer.copy_(total)
            return buffer

        return work.get_future().then(finish)

    def _select(
        self, message: Tensor, keys: list[int], sizes: list[int], iteration: int
    ) -> tuple[Tensor, Tensor]:
        if self.compressor == "topk":
            return top_k(message, self.ratio)
        # Rand-K: the same indices on every rank, from a generator seeded by the step and the
        # bucket's first parameter, drawn over its parameters in their own order: DDP lays a
        # bucket out one way in its first iteration (a resumed one's too) and another after
        generator = torch.Generator(device=message.device).manual_seed(
            (self.seed * 1_000_003 + iteration) * 4099 + min(keys)
        )
        ordered = sorted(range(len(keys)), key=keys.__getitem__)
        starts = [0, *itertools.accumulate(sizes)]
        layout = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in ordered])
        layout = layout.to(message.device)
        indices = layout[rand_k(message[layout], self.ratio, generator)[1]]
        return message[indices], indices

    def _reduce(self, values: Tensor, indices: Tensor, d: int) -> torch.futures.Future:
        """The sum over ranks of the sparse messages, as a dense tensor (a future)."""
        if self.compressor == "randk":
            summed = values.clone()
            self.bytes_sent += summed.numel() * summed.element_size()
            work = dist.all_reduce(summed, group=self.group, async_op=True)

            def dense_randk(_: Any) -> Tensor:
                return torch.zeros(d, dtype=values.dtype, device=values.device).index_put_(
                    (indices,), summed
                )

            return work.get_future().then(dense_randk)
        world = self.world_size
        all_values = values.new_empty(world * values.numel())
        all_indices = indices.new_empty(world * indices.numel())
        self.bytes_sent += values.numel() * values.element_size()
        self.bytes_sent += indices.numel() * indices.element_size()
        works = [
            _all_gather(all_values, values, group=self.group, async_op=True),
            _all_gather(all_indices, indices, group=self.group, async_op=True),
        ]
        futures = [w.get_future() for w in works]

        def dense_topk(_: Any) -> Tensor:
            out = torch.zeros(d, dtype=values.dtype, device=values.device)
            return out.index_add_(0, all_indices, all_values)

        return torch.futures.collect_all(futures).then(dense_topk)

    def _gather(self, keys: list[int], sizes: list[int], like: Tensor) -> dict[str, Tensor]:
        """The method's state for these parameters, flattened like the bucket (zeros if new)."""
        flat = {}
        for name in error_control.STATE[self.method]:
            parts = []
            for key, size in zip(keys, sizes):
                slot = self._state.setdefault(key, {})
                if name not in slot:
                    slot[name] = torch.zeros(size, dtype=like.dtype, device=like.device)
                parts.append(slot[name])
            flat[name] = torch.cat(parts)
        return flat

    def _scatter(self, keys: list[int], sizes: list[int], flat: dict[str, Tensor]) -> None:
        for name, tensor in flat.items():
            for key, piece in zip(keys, tensor.split(sizes)):
                slot = self._state.setdefault(key, {})
                slot[name] = _keep_finite(piece, slot.get(name))

    def _gather_shared(self, keys: list[int], sizes: list[int], like: Tensor) -> Tensor:
        parts = [
            self._shared.get(key, torch.zeros(size, dtype=like.dtype, device=like.device))
            for key, size in zip(keys, sizes)
        ]
        return torch.cat(parts)

    def _scatter_shared(self, keys: list[int], sizes: list[int], flat: Tensor) -> None:
        for key, piece in zip(keys, flat.split(sizes)):
            self._shared[key] = _keep_finite(piece, self._shared.get(key))

    # ------------------------------------------------------------ state

    def settle(self, applied: bool) -> None:
        """Where the step just reduced was skipped, the state as it was before that step."""
        # (a non-finite gradient on any rank: every rank skips it, and undoes it here)
        if not applied and self._before is not None:
            # the step count too: it decides the warm-up and seeds Rand-K's indices
            self._state, self._shared, self.iteration = self._before
        self._before, self._in_step = None, False

    def traffic(self) -> dict[str, float]:
        # the name every hook state answers to (the summary reads it): bytes_per_step
        return self.bytes_per_step()

    def bytes_per_step(self) -> dict[str, float]:
        """Average bytes per step this rank sent, compressed and as plain all-reduce would."""
        steps = max(1, self._steps_counted)
        return {
            "compressed_bytes_per_step": self.bytes_sent / steps,
            "uncompressed_bytes_per_step": self.bytes_uncompressed / steps,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's error and estimator state (every rank saves its own: they differ)."""
        return {
            "iteration": self.iteration,
            "state": {k: {n: t.cpu() for n, t in v.items()} for k, v in self._state.items()},
            "shared": {k: t.cpu() for k, t in self._shared.items()},
            "traffic": [self.bytes_sent, self.bytes_uncompressed, self._steps_counted],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` onto the model's device."""
        self.iteration = int(state["iteration"])
        device = self._device
        self._state = {
            int(k): {n: t.to(device) for n, t in v.items()} for k, v in state["state"].items()
        }
        self._shared = {int(k): t.to(device) for k, t in state["shared"].items()}
        self.bytes_sent, self.bytes_uncompressed, self._steps_counted = map(int, state["traffic"])


# unannotated: DDP checks a hook's annotations by identity, which string annotations fail
def compression_hook(state, bucket):
    """DDP comm hook: compress the bucket as ``state`` (a :class:`CompressionState`) says."""
    return state.reduce_bucket(bucket)


def _keep_finite(new: Tensor, old: Tensor | None) -> Tensor:
    """``new``, except where it is not finite (an overflowed GradScaler step): ``old`` there."""
    if old is None:
        return torch.nan_to_num(new, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(torch.isfinite(new), new, old)
