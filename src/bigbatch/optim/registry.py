"""Optimizers by name: one frozen record per name, torch's SGD and AdamW among them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .._checks import check_number, did_you_mean, pair
from .lamb import LAMB
from .lars import LARS
from .merit import MERIT
from .param_groups import param_groups
from .recipes import RECIPES, Recipe
from .vrgd import VRGD
from .wrapper import StatisticsWrapper

__all__ = [
    "FAMILIES",
    "OPTIMIZERS",
    "OptimizerInfo",
    "create_optimizer",
    "get_optimizer_info",
    "list_optimizers",
]


#: how an optimizer's step responds to the gradient, which decides how its learning rate
#: should follow the batch size (``bigbatch.batch.lr.FAMILY_RULES``):
#: ``adam`` (per-coordinate normalised: Adam, AdamW, LAMB, MERIT and their VRGD forms),
#: ``sgd`` (the raw gradient: SGD, momentum SGD), ``lars`` (momentum SGD with a
#: layer-wise trust ratio: LARS, LARC)
FAMILIES = ("adam", "sgd", "lars")


@dataclass(frozen=True)
class OptimizerInfo:
    """One registered optimizer: what to build, with which fixed settings, and its source."""

    name: str
    factory: Callable[..., torch.optim.Optimizer]
    paper: str
    summary: str
    family: str
    #: the settings that define this name (LARC is LARS with ``trust_clip``)
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def recipe(self) -> Recipe:
        """What it trains with unasked: weight decay, warm-up, decay, settings (``RECIPES``)."""
        return RECIPES[self.name]

    def signature(self) -> inspect.Signature:
        return inspect.signature(self.factory)

    @property
    def vrgd_form(self) -> bool:
        # a VR form (with_vrgd): the base wrapped in VRGD, whose gamma its factory takes
        return "gamma" in self.signature().parameters


#: the families of torch's own optimizers; bigbatch's declare theirs (``family``). The
#: adaptive ones (a step divided by a running gradient scale) follow Adam's square-root rule
#: (Malladi et al. 2022), averaged SGD SGD's linear one
_TORCH_FAMILIES = {
    **{getattr(torch.optim, name): "adam" for name in (
        "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adagrad", "Adafactor"
    ) if hasattr(torch.optim, name)},
    torch.optim.SGD: "sgd",
    torch.optim.ASGD: "sgd",
}  # fmt: skip


def class_family(cls: type) -> str | None:
    """The family of an optimizer class: its own ``family``, or torch's table's."""
    own = getattr(cls, "family", None)
    if own is not None:
        return own
    return next((f for base, f in _TORCH_FAMILIES.items() if issubclass(cls, base)), None)


def _info(name: str, factory: Callable, paper: str, summary: str, **defaults: Any) -> OptimizerInfo:
    """A registry record; its family is the family of the class ``factory`` builds."""
    family = class_family(getattr(factory, "builds", factory))
    assert family in FAMILIES, (name, family)
    assert name in RECIPES, f"{name} has no recipe"
    return OptimizerInfo(name, factory, paper, summary, family, MappingProxyType(defaults))


def with_vrgd(base: Callable[..., torch.optim.Optimizer], gsnr_momentum: float) -> Callable:
    """A factory taking ``base``'s arguments plus VRGD's, building ``VRGD(base(...))``."""
    vr_names = ("gamma", "normalizer", "gsnr_momentum")

    def factory(params: Any, **kwargs: Any) -> VRGD:
        vr = {k: kwargs.pop(k) for k in vr_names if k in kwargs}
        return VRGD(base(params, **kwargs), **{"gsnr_momentum": gsnr_momentum, **vr})

    signature = inspect.signature(base)
    vr = inspect.signature(VRGD).parameters  # VRGD's own defaults, not copies
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=vr[name].default)
        for name in ("gamma", "normalizer")
    ]
    extra.append(
        inspect.Parameter("gsnr_momentum", inspect.Parameter.KEYWORD_ONLY, default=gsnr_momentum)
    )
    own = [q for q in signature.parameters.values() if q.kind != inspect.Parameter.VAR_KEYWORD]
    factory.__signature__ = signature.replace(parameters=[*own, *extra])  # type: ignore[attr-defined]
    factory.__name__ = f"vr_{getattr(base, '__name__', 'optimizer').lower()}"
    factory.builds = base  # type: ignore[attr-defined] - its family is the base's
    return factory


_VRGD = (
    "Accelerating Large Batch Training via Gradient Signal to Noise Ratio (GSNR), "
    "arXiv:2309.13681 (2023)"
)

_LAMB = "You et al. 2019, Large Batch Optimization for Deep Learning, arXiv:1904.00962"
_LARS = (
    "You, Gitman, Ginsburg 2017, Large Batch Training of Convolutional Networks, arXiv:1708.03888"
)

OPTIMIZERS: Mapping[str, OptimizerInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            _info(
                "lamb",
                LAMB,
                _LAMB,
                "Adam with layer-wise trust ratio (apex FusedLAMB / timm Lamb)",
            ),
            _info(
                "lambc",
                LAMB,
                _LAMB,
                "LAMB with the trust ratio clipped at 1",
                trust_clip=True,
            ),
            _info(
                "nvlamb",
                LAMB,
                _LAMB,
                "LAMB adapting every group, decayed or not",
                always_adapt=True,
            ),
            _info(
                "lars",
                LARS,
                _LARS,
                "SGD with momentum and layer-wise trust ratio (timm Lars)",
            ),
            _info(
                "larc",
                LARS,
                _LARS,
                "LARS with LARC clipping min(ratio/lr, 1)",
                trust_clip=True,
            ),
            _info(
                "merit",
                MERIT,
                "Luo et al. 2025, MERIT: Maximum-normalized Element-wise Ratio for Language "
                "Model Large-batch Training, ICML 2025",
                "Adam with max-norm element-wise trust ratios, update clipped to [-1, 1]",
            ),
            _info(
                "sgd",
                torch.optim.SGD,
                "Robbins & Monro 1951; momentum: Polyak 1964",
                "torch.optim.SGD, momentum 0.9 by default (as in timm)",
                momentum=0.9,
            ),
            _info(
                "plain-sgd",
                torch.optim.SGD,
                "Robbins & Monro 1951",
                "torch.optim.SGD without momentum: the base of the VRGD paper's VR-SGD",
            ),
            _info(
                "adamw",
                torch.optim.AdamW,
                "Loshchilov & Hutter 2019, Decoupled Weight Decay Regularization, arXiv:1711.05101",
                "torch.optim.AdamW",
            ),
            _info(
                "vr-sgd",
                with_vrgd(torch.optim.SGD, 0.0),
                _VRGD,
                "the paper's VR-SGD: plain SGD (no momentum) on the GSNR-scaled gradient",
            ),
            _info(
                "vr-momentum",
                with_vrgd(torch.optim.SGD, 0.0),
                _VRGD,
                "momentum SGD (0.9) on the GSNR-scaled gradient",
                momentum=0.9,
            ),
            _info(
                "vr-adam",
                with_vrgd(torch.optim.AdamW, 0.9),
                _VRGD,
                "AdamW on the GSNR-scaled gradient, momentum 0.9 on the ratio",
            ),
            _info("vr-lars", with_vrgd(LARS, 0.0), _VRGD, "LARS on the GSNR-scaled gradient"),
            _info(
                "vr-lamb",
                with_vrgd(LAMB, 0.9),
                _VRGD,
                "LAMB on the GSNR-scaled gradient, momentum 0.9 on the ratio",
            ),
        )
    }
)


def optimizer_family(optimizer: torch.optim.Optimizer) -> str | None:
    """The family of a built optimizer (looking inside statistics wrappers), None if unknown."""
    while isinstance(optimizer, StatisticsWrapper):
        optimizer = optimizer.base
    return class_family(type(optimizer))


def list_optimizers() -> list[str]:
    """The names :func:`create_optimizer` accepts, sorted."""
    return sorted(OPTIMIZERS)


def get_optimizer_info(name: str) -> OptimizerInfo:
    """The registry record for ``name`` (case-insensitive); ``ValueError`` if unknown."""
    key = str(name).lower()
    if key not in OPTIMIZERS:
        hint = did_you_mean(key, OPTIMIZERS)
        raise ValueError(
            f"unknown optimizer {name!r}{hint} (known: {', '.join(list_optimizers())})"
        )
    return OPTIMIZERS[key]


def create_optimizer(
    model_or_params: nn.Module | Iterable[Any],
    name: str,
    *,
    no_decay: Iterable[str] = (),
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name``.

    An ``nn.Module`` is split by :func:`param_groups`; parameters or groups are used as
    they are. The recipe (:data:`RECIPES`) fills what ``kwargs`` leave out. An argument
    the optimizer does not take is a ``ValueError``.

    Example:
        >>> opt = create_optimizer(model, "lamb", lr=2e-3, weight_decay=0.01)
    """
    info = get_optimizer_info(name)
    signature = info.signature()
    accepted = [n for n in signature.parameters if n != "params"]
    for key in kwargs:
        if key not in accepted:
            hint = did_you_mean(key, accepted)
            raise ValueError(f"optimizer {info.name!r} takes no argument {key!r}{hint}")
    recipe = info.recipe
    options = {
        "weight_decay": recipe.weight_decay,
        **recipe.options,
        **info.defaults,
        **kwargs,
    }
    lr = signature.parameters.get("lr")
    if "lr" not in options and lr is not None and lr.default is inspect.Parameter.empty:
        raise ValueError(f"optimizer {info.name!r} needs a learning rate: pass lr=...")
    _check_common(options)
    if isinstance(model_or_params, nn.Module):
        params: Any = param_groups(
            model_or_params, float(options["weight_decay"]), no_decay=no_decay
        )
    else:
        if no_decay:  # (it names a module's parameters: given parameters, it would be dropped)
            raise ValueError(
                f"no_decay={no_decay!r} splits a module's parameters; given parameters or "
                "groups, pass the model, or groups with their own weight_decay"
            )
        params = model_or_params
        if not isinstance(params, torch.Tensor):  # (torch's own error for a lone tensor)
            params = list(params)
            for group in params:  # a group's own values, as the keywords' (torch checks few)
                if isinstance(group, Mapping):
                    _check_common(group)
    return info.factory(params, **options)


def _check_common(options: Mapping[str, Any]) -> None:
    """The hyper-parameters every optimizer shares, checked for torch's too."""
    for key in ("lr", "weight_decay"):
        if key in options and not isinstance(options[key], torch.Tensor):  # a tensor lr
            check_number(key, options[key])
    if "momentum" in options:
        check_number("momentum", options["momentum"], high=1, high_open=True)
    if "betas" in options:
        for i, beta in enumerate(pair("betas", options["betas"], "(beta1, beta2)")):
            check_number(f"betas[{i}]", beta, high=1, high_open=True)
