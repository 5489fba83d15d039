"""Each optimizer's default recipe: the weight decay, warm-up, decay and settings it
trains with when a user names it and nothing else (docs/optimizers.md, "Recipes")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .._checks import check_number, choice
from ..batch.lr import SCHEDULES, Schedule, schedule_by_name

__all__ = ["RECIPES", "Recipe"]


@dataclass(frozen=True)
class Recipe:
    """How one optimizer trains unasked (docs/optimizers.md, "Recipes").

    Args:
        weight_decay: on the decayed group only (:func:`bigbatch.optim.param_groups`);
            coupled for SGD and LARS, decoupled for AdamW and LAMB.
        warmup: linear warm-up, a fraction of the training budget.
        schedule: the decay after warm-up (``bigbatch.batch.lr.SCHEDULES``).
        options: the optimizer's own settings, passed to its constructor.
        evidence: where the values come from.
    """

    weight_decay: float
    warmup: float = 0.05
    schedule: str = "cosine"
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    evidence: str = ""

    def __post_init__(self) -> None:
        # frozen: a checked number is stored through object.__setattr__, as dataclasses do
        object.__setattr__(self, "weight_decay", check_number("weight_decay", self.weight_decay))
        object.__setattr__(self, "warmup", check_number("warmup", self.warmup, high=1))
        choice("schedule", self.schedule, SCHEDULES)

    def schedule_over(self, total: int) -> Schedule:
        """The recipe's warm-up and decay over ``total`` samples (a ``StepOptions.schedule``),
        or over ``total`` steps as torch's ``LambdaLR`` multiplier::

            recipe = get_optimizer_info("lars").recipe
            callback = AdaptiveBatchCallback(sampler, schedule=recipe.schedule_over(max_samples))
        """
        return schedule_by_name(self.schedule, total, int(self.warmup * total))


def _recipe(weight_decay: float, evidence: str, **options: Any) -> Recipe:
    return Recipe(weight_decay, options=MappingProxyType(options), evidence=evidence)


#: decoupled weight decay 0.01 as in the LAMB paper's BERT runs and timm's defaults
_ADAM = _recipe(0.01, "the LAMB paper's BERT runs; timm")
#: coupled L2 5e-4 as in the LARS paper and torchvision's ResNet recipes (a coupled decay
#: of the Adam-type 0.01 is far too strong: docs/optimizers.md, "Recipes")
_SGD = _recipe(5e-4, "the LARS paper; torchvision's ResNet recipes")
_LARS = _recipe(
    5e-4,
    "the LARS paper; MLPerf's ResNet-50",
    trust_coefficient=0.001,
)
#: the VRGD paper's γ (its good range: 0.04-0.2)
_GAMMA = 0.1


def _vrgd(base: Recipe) -> Recipe:
    """A VRGD form's recipe: its base optimizer's, plus the GSNR clip γ."""
    options = MappingProxyType({**base.options, "gamma": _GAMMA})
    return replace(base, options=options, evidence=f"{base.evidence}; γ: the VRGD paper's")


#: the recipe of every registered optimizer, by name
RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        "lamb": _ADAM,
        "lambc": _ADAM,
        "nvlamb": _ADAM,
        "merit": _ADAM,
        "adamw": _ADAM,
        "sgd": _SGD,
        "plain-sgd": _SGD,
        "lars": _LARS,
        "larc": _LARS,
        "vr-adam": _vrgd(_ADAM),
        "vr-lamb": _vrgd(_ADAM),
        "vr-sgd": _vrgd(_SGD),
        "vr-momentum": _vrgd(_SGD),
        "vr-lars": _vrgd(_LARS),
    }
)
