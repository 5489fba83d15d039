"""What LAMB, LARS and MERIT share: validation, state gathering and the dispatch to
their ``reference``, ``foreach``, ``compiled`` and ``fused`` updates."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import check_number, choice
from .._tensors import norm_dtype, norms
from .._warn import warn_at_caller
from ._shards import local, shards_of

IMPLS = ("reference", "foreach", "compiled", "fused")


class ImplFallbackWarning(UserWarning):
    """``impl="compiled"`` could not compile here and fell back to ``"foreach"``."""


# ---------------------------------------------------------------- validation


def check_impl(impl: str) -> str:
    impl = choice("impl", impl, IMPLS)
    if impl == "fused":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ValueError(
                "impl='fused' needs Triton, which ships with CUDA builds of PyTorch; "
                "use impl='foreach'"
            ) from None
        from ._fused import interpreted  # imports Triton, which only impl="fused" needs

        if not torch.cuda.is_available() and not interpreted():
            raise ValueError(
                "impl='fused' runs on CUDA, and no GPU is available; use impl='foreach'"
            )
    return impl


def check_betas(betas: Any, *, count: int = 2) -> tuple[float, ...]:
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        raise ValueError(f"betas must be a tuple of {count} numbers in [0, 1), got {betas!r}")
    return tuple(
        check_number(f"betas[{i}]", b, low=0.0, high=1.0, high_open=True)
        for i, b in enumerate(betas)
    )


def check_adam_group(group: dict[str, Any]) -> None:
    """Check and normalise the Adam-style hyper-parameters of a group (LAMB, MERIT)."""
    group["lr"] = check_lr(group["lr"])
    group["betas"] = check_betas(group["betas"])
    group["eps"] = check_number("eps", group["eps"], low_open=True)  # v can be 0
    group["weight_decay"] = check_number("weight_decay", group["weight_decay"])


# ---------------------------------------------------------------- helpers


def global_grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """The L2 norm of all ``grads`` in float32 (float64 if any is), on the first grad's
    device, with no host sync; on FSDP2 shards summed over the ranks."""
    shards = shards_of(grads)
    if shards is not None:
        (norm,) = shards.norms(global_grad_norm([local(g) for g in grads]).reshape(1))
        return norm[0]
    first = grads[0].device
    wide = max((norm_dtype(g) for g in grads), key=lambda d: d.itemsize)
    by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    per_device = [
        torch.linalg.vector_norm(torch.stack([n.to(wide) for n in norms(gs)])).to(first)
        for gs in by_device.values()
    ]
    return torch.linalg.vector_norm(torch.stack(per_device))


def add_scaled(targets: list[Tensor], updates: list[Tensor], coefficient: float | Tensor) -> None:
    """``targets += coefficient * updates`` (``updates`` may be overwritten); a tensor
    coefficient stays on the device."""
    if isinstance(coefficient, Tensor):
        torch._foreach_mul_(updates, coefficient)
        torch._foreach_add_(targets, updates)
    else:
        torch._foreach_add_(targets, updates, alpha=coefficient)


def check_lr(value: Any) -> float | Tensor:
    """A learning rate: a number, or a 0-dim floating tensor (as torch.optim accepts), >= 0."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"lr must be a number or a 0-dim floating tensor, got {value!r}")
        check_number("lr", float(value))  # read once, at construction, never in step()
        return value
    return check_number("lr", value)


LOW_PRECISION = (torch.float16, torch.bfloat16)


def state_dtype(p: Tensor) -> torch.dtype:
    """float32 for float16/bfloat16 params, the param's dtype otherwise."""
    return torch.float32 if p.dtype in LOW_PRECISION else p.dtype


def group_by_device_and_dtype(*lists: list[Tensor]) -> list[tuple[list[Tensor], ...]]:
    """Split parallel lists by the (device, dtype) of the first list, order kept."""
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(lists[0]):
        buckets[(t.device, t.dtype)].append(i)
    return [
        tuple([lst[i] for i in idx] if lst else [] for lst in lists) for idx in buckets.values()
    ]


# ---------------------------------------------------------------- compiled impl

#: Keyword arguments the compiled impl gets as CPU scalar tensors, foreach as floats.
SCALAR_ARGS = ("lr", "bias_correction1", "bias_correction2")

#: Graphs one update function may compile (distinct shape sets and constants).
RECOMPILE_LIMIT = 64

_compiled_cache: dict[tuple[Callable, tuple], Callable] = {}
_broken: set[tuple[Callable, tuple]] = set()


def _key(fn: Callable, options: dict[str, Any] | None) -> tuple[Callable, tuple]:
    return fn, tuple(sorted((options or {}).items()))


def compiled(fn: Callable, options: dict[str, Any] | None = None) -> Callable:
    """``torch.compile(fn, dynamic=False, options=options)``, made once and shared; the lr
    and bias corrections arrive as tensors, so they never recompile."""
    key = _key(fn, options)
    if key not in _compiled_cache:
        if not torch._dynamo.is_dynamo_supported():
            raise CompilerUnavailableError("torch.compile does not support this Python/platform")
        _compiled_cache[key] = torch.compile(fn, dynamic=False, options=options)
    return _compiled_cache[key]


class CompilerUnavailableError(RuntimeError):
    """torch.compile cannot run here at all."""


def _is_compiler_failure(err: BaseException) -> bool:
    """The compiler failed, as opposed to the traced code raising (which must surface)."""
    from torch._dynamo import exc

    failures: tuple[type[BaseException], ...] = (
        CompilerUnavailableError,
        exc.BackendCompilerFailed,  # inductor, incl. a missing or broken C++ compiler
        exc.InternalTorchDynamoError,
    )
    return isinstance(err, failures)


def run_compiled(
    fn: Callable, fallback: Callable, options: dict[str, Any] | None, *args, **kwargs
) -> None:
    """Run ``compiled(fn, options)``; where it cannot compile (before any state is
    touched), run ``fallback`` and warn once. Errors of the traced code are raised."""
    key = _key(fn, options)
    if key not in _broken:
        try:
            # Each optimizer and param group has its own shape set and constants,
            # so one function can see more than dynamo's default 8 graphs.
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                compiled(fn, options)(*args, **kwargs)
            return
        except Exception as err:
            if not _is_compiler_failure(err):
                raise
            _broken.add(key)
            first_line = str(err).splitlines()[0] if str(err) else ""
            warn_at_caller(
                f"impl='compiled' is unavailable for {fn.__name__} here "
                f"({type(err).__name__}: {first_line}); using impl='foreach'",
                ImplFallbackWarning,
            )
    kwargs = {
        k: (v.item() if k in SCALAR_ARGS and isinstance(v, Tensor) else v)
        for k, v in kwargs.items()
    }
    fallback(*args, **kwargs)


# ---------------------------------------------------------------- base class


#: what an LR scheduler puts on the optimizer it drives: ``step`` wrapped (calling the
#: original through a weak reference) and the flag it sets; a copy steps itself
_SCHEDULERS_PATCH = ("step", "_opt_called")


def own_state(optimizer: torch.optim.Optimizer, cache: Sequence[str] = ()) -> dict[str, Any]:
    # what a copy or a pickle of optimizer keeps: every attribute but its hooks (as torch's),
    # an LR scheduler's patch and cache; torch's own keeps defaults, state and groups alone
    skip = (*_SCHEDULERS_PATCH, *cache)
    own = vars(optimizer).items()
    return {k: v for k, v in own if not k.startswith("_optimizer_") and k not in skip}


class BigBatchOptimizer(torch.optim.Optimizer):
    """Shared plumbing; subclasses define ``_check_group`` and ``_step``."""

    #: inductor options for impl="compiled" (see ``compiled``)
    compile_options: ClassVar[dict[str, Any] | None] = None
    #: names in ``_fused`` of the impl="fused" update and of the test of which
    #: tensors it takes (None: every float32/bfloat16/float16 contiguous tensor)
    fused_update: ClassVar[str]
    fused_accepts: ClassVar[str | None] = None

    def __init__(self, params: Iterable, defaults: dict[str, Any], impl: str) -> None:
        # impl is a property of this object, not of a param group: state_dict()
        # carries groups, and a state saved under one impl loads under another.
        self.impl = check_impl(impl)
        self._scalars: dict[tuple[int, str, torch.device], Tensor] = {}
        defaults = dict(defaults)
        self._check_group(defaults)
        super().__init__(params, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        if self.impl != "foreach" and shards_of(all_params) is not None:
            raise ValueError(
                f"impl={self.impl!r} does not run on FSDP2 shards (DTensor parameters); "
                "use impl='foreach'"
            )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}impl: {self.impl}\n)"

    def __getstate__(self) -> dict[str, Any]:
        return own_state(self, cache=("_scalars",))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._scalars = {}

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:  # pragma: no cover - abstract
        """Validate and normalise a group's hyper-parameters in place (``ValueError``)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, then the group's hyper-parameters are checked like the defaults."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
            complex_shape = next(
                (tuple(p.shape) for p in self.param_groups[-1]["params"] if p.is_complex()), None
            )
            if complex_shape is not None:  # a norm of a complex tensor is no trust ratio's
                raise ValueError(
                    f"{type(self).__name__} does not support complex parameters (one of shape "
                    f"{complex_shape}); hold it as a real tensor (torch.view_as_real) instead"
                )
        except ValueError:
            self.param_groups.pop()
            raise

    def _params_with_grad(self, group: dict[str, Any]) -> list[Tensor]:
        params = []
        for p in group["params"]:
            if p.grad is None or p.numel() == 0:  # an empty tensor has nothing to update
                continue
            if p.grad.is_sparse:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients "
                    f"(parameter of shape {tuple(p.shape)}); use torch.optim.SparseAdam "
                    "for sparse embeddings, or nn.Embedding(sparse=False)"
                )
            params.append(p)
        return params

    def _scalar(
        self, group_index: int, name: str, value: float | Tensor, device: torch.device
    ) -> float | Tensor:
        """``value`` as a float, or for the compiled impl in a reused float32 tensor on
        ``device``; a tensor rate on ``device``, in its dtype (float32 at least)."""
        if isinstance(value, Tensor):
            return value.to(device=device, dtype=torch.promote_types(value.dtype, torch.float32))
        if self.impl != "compiled":
            return float(value)
        key = (group_index, name, device)
        t = self._scalars.get(key)
        if t is None:
            t = self._scalars[key] = torch.zeros((), dtype=torch.float32, device=device)
        return t.fill_(float(value))

    def _state_for(self, p: Tensor) -> dict[str, Tensor]:
        """The Adam-style state of ``p`` (LAMB, MERIT), created on its first step."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = self._zeros_for(p)
            state["exp_avg_sq"] = self._zeros_for(p)
        return state

    @staticmethod
    def _zeros_for(p: Tensor) -> Tensor:
        return torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's load, then the float32 moments of low-precision params restored at
        full precision and ``step`` moved back to a CPU float32 scalar."""
        # the dict the pre-hooks leave is the one restored; the post-hooks see it restored
        seen: list[dict[str, Any]] = []
        last = self.register_load_state_dict_pre_hook(lambda _, loaded: seen.append(loaded))
        post, self._optimizer_load_state_dict_post_hooks = (
            self._optimizer_load_state_dict_post_hooks,
            OrderedDict(),
        )
        try:
            super().load_state_dict(state_dict)
        finally:
            last.remove()
            self._optimizer_load_state_dict_post_hooks = post
        self._restore_precision(seen[-1])
        for hook in post.values():
            hook(self)

    def _restore_precision(self, state_dict: dict[str, Any]) -> None:
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            state = self.state[p]
            if "step" in state:
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            if p.dtype not in LOW_PRECISION:
                continue
            for key, value in saved.items():
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    state[key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    @staticmethod
    def _increment_steps(steps: list[Tensor]) -> None:
        torch._foreach_add_(steps, 1.0)

    @staticmethod
    def _partition_by_step(steps: list[Tensor]) -> dict[float, list[int]]:
        """Indices grouped by step count (a CPU tensor: reading it is no device sync)."""
        parts: dict[float, list[int]] = defaultdict(list)
        for i, s in enumerate(steps):
            parts[float(s)].append(i)
        return parts

    def _dispatch(
        self, reference: Callable, foreach: Callable, *lists: list[Tensor], **kwargs
    ) -> None:
        """Run the update with this optimizer's impl on each (device, dtype) bucket of
        ``lists`` (params, grads, then state)."""
        for bucket in group_by_device_and_dtype(*lists):
            device = bucket[0][0].device
            kwargs = {
                k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
                for k, v in kwargs.items()
            }
            shards = shards_of(bucket[0])
            if shards is not None:  # FSDP2: the local shards, whole-tensor reductions in `shards`
                bucket = tuple([local(t) for t in lst] for lst in bucket)
                kwargs = {**kwargs, "shards": shards}
            if self.impl == "fused":
                self._run_fused(foreach, bucket, kwargs)
            else:
                self._run_eager(reference, foreach, bucket, kwargs)

    def _run_eager(
        self,
        reference: Callable,
        foreach: Callable,
        lists: Sequence[list[Tensor]],
        kwargs: dict[str, Any],
    ) -> None:
        """The reference, foreach or compiled update of one bucket (impl "fused": foreach)."""
        params, grads, *state = lists
        low_precision = params[0].dtype in LOW_PRECISION
        if low_precision:
            # Compute in float32 against the float32 state, round into p once.
            work, grads = [p.float() for p in params], [g.float() for g in grads]
        else:
            work = params
        if self.impl == "reference":
            reference(work, grads, *state, **kwargs)
        elif self.impl == "compiled":
            # torch.compile drops in-place updates of a 0-dim float64 CPU input: a scalar
            # parameter (cheap) and its state take the foreach update
            lists = (work, grads, *state)
            rest = [i for i, p in enumerate(work) if p.dim() > 0]
            scalars = [i for i, p in enumerate(work) if p.dim() == 0]
            if rest:
                run_compiled(
                    reference, foreach, self.compile_options, *_pick(lists, rest), **kwargs
                )
            if scalars:
                foreach(*_pick(lists, scalars), **kwargs)
        else:
            foreach(work, grads, *state, **kwargs)
        if low_precision:
            torch._foreach_copy_(params, work)

    def _run_fused(
        self, foreach: Callable, lists: Sequence[list[Tensor]], kwargs: dict[str, Any]
    ) -> None:
        """The Triton update of one bucket; what its kernels do not take runs through foreach."""
        from . import _fused  # imports Triton, which only impl="fused" needs

        device = lists[0][0].device
        _fused.check_device(device)
        accepts = getattr(_fused, self.fused_accepts) if self.fused_accepts else None
        take, rest = _fused.split_supported(lists, accepts)
        for indices, run in ((take, getattr(_fused, self.fused_update)), (rest, None)):
            if not indices:
                continue
            part = _pick(lists, indices)
            if run is not None:
                # Triton launches on the current device's stream: the parameters' (on cuda:1
                # with cuda:0 current, the launch failed or raced the backward)
                on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
                with on_device:  # (the CPU: Triton's interpreter, in tests)
                    run(*part, **kwargs)
            else:
                self._run_eager(foreach, foreach, part, kwargs)

    # inside a user's torch.compile'd step, a graph break: traced, the rates and corrections
    # that change each step became symbolic floats that inductor's LAMB update drifted from
    # (0.3% of the movement by step 5); impl="compiled" compiles the update itself
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def _pick(lists: Sequence[list[Tensor]], indices: list[int]) -> list[list[Tensor]]:
    # the tensors at `indices` of each parallel list (an empty list stays empty)
    return [[lst[i] for i in indices] if lst else [] for lst in lists]
