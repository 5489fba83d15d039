"""Each optimizer's default recipe: what it trains with when a user names it and nothing else.

A rate alone does not make an optimizer train: LARS and momentum SGD with an
Adam-type weight decay of 0.01 lose 4-30 points on MNIST-1D against the same
rate at 5e-4 (docs/results.md, "Recipes"). A :class:`Recipe` holds the rest:
weight decay, warm-up, decay shape and the optimizer's own settings. The
rate itself depends on the task and batch, so it lives beside the task
(``Task.lrs``, measured per optimizer), and so does the batch rule that
carries it where the task measured one (``Task.lr_rules``); else the
family's (``bigbatch.batch.lr.FAMILY_RULES``).

Who reads a recipe: :func:`bigbatch.optim.create_optimizer` (weight decay and
settings, so the plugins that build their optimizer through it get them too),
the CLI's config (``weight_decay``, ``schedule.kind``, ``schedule.warmup`` and
``vrgd.gamma`` left at ``"auto"``) and :meth:`Recipe.schedule_over` (the
schedule in samples that the loop and the Lightning and Hugging Face plugins
take, or torch's ``LambdaLR`` multiplier in steps).
"""

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
        weight_decay: on the decayed group only (biases, norms and
            ``no_decay`` parameters get none and, for LARS/LAMB, no trust
            ratio: :func:`bigbatch.optim.param_groups`). Coupled (added to
            the gradient) for SGD and LARS, decoupled for AdamW and LAMB, so
            the two families' values differ by orders of magnitude.
        warmup: linear warm-up, a fraction of the training budget.
        schedule: the decay after warm-up (``bigbatch.batch.lr.SCHEDULES``).
        options: the optimizer's own settings (momentum, trust coefficient,
            VRGD's γ), passed to its constructor.
        evidence: where the values come from (the paper, and the measurement).
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
        """The recipe's warm-up and decay over ``total`` samples, the schedule that
        ``StepOptions(schedule=...)`` (the loop, the Lightning and Hugging Face plugins)
        takes; over ``total`` optimizer steps it is the multiplier of torch's ``LambdaLR``::

            optimizer = create_optimizer(model, "lars", lr=4.0)
            recipe = get_optimizer_info("lars").recipe
            callback = AdaptiveBatchCallback(sampler, schedule=recipe.schedule_over(max_samples))
        """
        return schedule_by_name(self.schedule, total, int(self.warmup * total))


def _recipe(weight_decay: float, evidence: str, **options: Any) -> Recipe:
    return Recipe(weight_decay, options=MappingProxyType(options), evidence=evidence)


#: decoupled weight decay 0.01 as in the LAMB paper's BERT runs and timm's defaults
_ADAM = _recipe(0.01, "LAMB paper (BERT: 0.01); evidence grids of issues 13 and 21")
#: coupled L2 5e-4 as in the LARS paper and torchvision's ResNet recipes; 0.01 costs 4
#: points on MNIST-1D (docs/results.md, "Recipes")
_SGD = _recipe(5e-4, "LARS paper and torchvision (5e-4); docs/results.md, Recipes")
_LARS = _recipe(
    5e-4,
    "LARS paper, MLPerf ResNet-50 (trust 0.001, wd 5e-4..1e-4); docs/results.md, Recipes",
    trust_coefficient=0.001,
)
#: the VRGD paper's γ (good range 0.04-0.2); a grid on MNIST-1D (docs/results.md,
#: claim 3) found no better one
_GAMMA = 0.1


def _vrgd(base: Recipe) -> Recipe:
    """A VRGD form's recipe: its base optimizer's, plus the GSNR clip γ."""
    return replace(base, options=MappingProxyType({**base.options, "gamma": _GAMMA}))


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
