"""Large-batch optimizers and the registry that names them.

- :class:`LAMB` (You et al. 2019), :class:`LARS` (You et al. 2017) and
  :class:`MERIT` (Luo et al. 2025), each with ``impl="reference" | "foreach" |
  "compiled"``;
- :class:`VRGD` (GSNR variance reduction, arXiv 2309.13681) and :class:`AGVM`
  (module-wise gradient variance modulation, Xue et al. 2022): wrappers
  that modulate any optimizer from the step's gradient statistics;
- :func:`param_groups` for weight-decay groups, :func:`module_param_groups`
  for AGVM's module groups;
- :func:`create_optimizer` / :func:`list_optimizers`, which also name torch's
  ``sgd``, ``plain-sgd`` and ``adamw`` so every experiment can name its optimizer;
- :data:`RECIPES`: what each name trains with unasked (weight decay, warm-up,
  decay, momentum, trust coefficient, γ).
"""

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
