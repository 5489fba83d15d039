"""Large-batch optimizers and the registry that names them: :class:`LAMB`,
:class:`LARS`, :class:`MERIT`, the statistics wrappers :class:`VRGD` and
:class:`AGVM`, :func:`param_groups`, :func:`create_optimizer` and :data:`RECIPES`
(docs/optimizers.md)."""

from ._base import IMPLS, ImplFallbackWarning
from .agvm import AGVM, MODULE_RULES, module_groups, module_param_groups
from .lamb import LAMB
from .lars import LARS
from .merit import MERIT
from .param_groups import param_groups
from .recipes import RECIPES, Recipe
from .registry import (
    FAMILIES,
    OPTIMIZERS,
    OptimizerInfo,
    create_optimizer,
    get_optimizer_info,
    list_optimizers,
    optimizer_family,
)
from .vrgd import VRGD, FewSubBatchesWarning, gsnr_ratio
from .wrapper import StatisticsWrapper

__all__ = [
    "AGVM",
    "FAMILIES",
    "IMPLS",
    "LAMB",
    "LARS",
    "MERIT",
    "MODULE_RULES",
    "OPTIMIZERS",
    "RECIPES",
    "VRGD",
    "FewSubBatchesWarning",
    "ImplFallbackWarning",
    "OptimizerInfo",
    "Recipe",
    "StatisticsWrapper",
    "create_optimizer",
    "get_optimizer_info",
    "gsnr_ratio",
    "list_optimizers",
    "module_groups",
    "module_param_groups",
    "optimizer_family",
    "param_groups",
]
