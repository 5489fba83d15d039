"""AGVM: module-wise gradient variance modulation (Xue et al., NeurIPS 2022,
arXiv:2210.02157), for large-batch training whose modules (backbone, neck, head) see
gradient variances of very different size; from the statistics' per-group halves."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import check_number, pair, positive_int, whole_number
from ..batch.lr import scaled_lr
from ..knobs import Knob
from ..stats.result import GradientStats
from .param_groups import param_groups
from .wrapper import StatisticsWrapper

__all__ = [
    "AGVM",
    "MODULE_RULES",
    "RULE_NAMES",
    "cosine_of",
    "module_groups",
    "module_param_groups",
]


def cosine_of(sq_a: float, sq_b: float, dot: float, eps: float = 1e-30) -> float:
    """``dot / sqrt(sq_a sq_b)`` in [-1, 1] (``half_split_cosine`` for Python floats)."""
    return max(-1.0, min(1.0, dot / math.sqrt(max(sq_a, eps) * max(sq_b, eps))))


#: built-in module-group rules: group name -> name patterns (``fnmatch`` on
#: parameter names, first match wins); ``"top"`` and ``"ends"`` are computed
MODULE_RULES: Mapping[str, Mapping[str, Sequence[str]]] = {
    "detection": {
        "backbone": ["backbone.*"],
        "neck": ["neck.*", "fpn.*"],
        "head": ["*head*", "roi_*", "rpn*"],
    },
    "transformer": {
        "embedding": ["*embed*", "wte.*", "wpe.*", "pos*"],
        "blocks": ["blocks.*", "layers.*", "h.*", "encoder.*", "decoder.*", "transformer.*"],
        "head": ["*head*", "norm.*", "ln_f.*", "classifier.*", "fc.*"],
    },
}
COMPUTED_RULES = ("top", "ends")
#: every built-in rule's name
RULE_NAMES = (*COMPUTED_RULES, *MODULE_RULES)


#: a built-in rule's name, or group names mapped to parameter-name patterns
Rule = str | Mapping[str, Sequence[str]]


def module_groups(model: nn.Module, rule: Rule) -> dict[str, list[str]]:
    """Parameter names of ``model`` by module group, in the rule's order (the first is
    AGVM's reference).

    ``rule``: ``"top"`` (one group per top-level child), ``"ends"`` (first, last, and
    ``"body"``), ``"detection"`` (backbone / neck / head), ``"transformer"`` (embedding /
    blocks / head), or a mapping of group names to ``fnmatch`` patterns. Every trainable
    parameter must land in a group.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if isinstance(rule, str) and rule in COMPUTED_RULES:
        owners: dict[str, list[str]] = {}
        for name in names:
            owners.setdefault(name.split(".", 1)[0], []).append(name)
        if rule == "top":
            return owners
        children = list(owners)
        if len(children) < 2:
            raise ValueError(
                f"rule 'ends' needs at least 2 top-level modules with parameters, the model "
                f"has {children}"
            )
        body = [n for c in children[1:-1] for n in owners[c]]
        groups = {"first": owners[children[0]], "body": body, "last": owners[children[-1]]}
        return {g: members for g, members in groups.items() if members}
    if isinstance(rule, str):
        if rule not in MODULE_RULES:
            known = ", ".join([*COMPUTED_RULES, *MODULE_RULES])
            raise ValueError(f"unknown module-group rule {rule!r} (known: {known})")
        rule = MODULE_RULES[rule]
    if not isinstance(rule, Mapping):
        raise TypeError(
            f"rule must be a rule's name or a mapping of groups to patterns, got {rule!r}"
        )
    # one pattern as itself, as param_groups' no_decay takes it (not one per character)
    rule = {g: (p,) if isinstance(p, str) else tuple(p) for g, p in rule.items()}
    groups: dict[str, list[str]] = {g: [] for g in rule}
    for name in names:
        group = next(
            (
                g
                for g, patterns in rule.items()
                if any(fnmatch.fnmatchcase(name, p) for p in patterns)
            ),
            None,
        )
        if group is None:
            raise ValueError(
                f"parameter {name!r} matches no module group of the rule ({', '.join(rule)})"
            )
        groups[group].append(name)
    return {g: members for g, members in groups.items() if members}


def module_param_groups(
    model: nn.Module,
    weight_decay: float,
    rule: Rule = "ends",
    *,
    no_decay: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """:func:`~bigbatch.optim.param_groups` within each module group, tagged ``agvm_group``.

    Example:
        >>> groups = module_param_groups(model, 0.05, "detection")
        >>> optimizer = AGVM(torch.optim.AdamW(groups, lr=1e-3))
    """
    by_name = dict(model.named_parameters())
    decayed = {
        id(p)
        for g in param_groups(model, weight_decay, no_decay=no_decay)
        for p in g["params"]
        if g["weight_decay"]
    }
    out = []
    for group, names in module_groups(model, rule).items():
        params = [by_name[n] for n in names]
        for decays in (True, False):
            members = [p for p in params if (id(p) in decayed) == decays]
            if members:
                out.append(
                    {
                        "params": members,
                        "weight_decay": weight_decay if decays else 0.0,
                        "agvm_group": group,
                    }
                )
    return out


#: the config key (``agvm.rule``) of :func:`module_param_groups` (bigbatch.knobs)
GROUPS_CONFIG = {
    "rule": Knob(
        "rule",
        "AGVM module groups: top-level children, first/body/last, or by name",
        choices=RULE_NAMES,
    )
}


class AGVM(StatisticsWrapper):
    """Scale each module group's learning rate by its gradient-variance multiplier μ (AGVM).

    Every ``interval`` steps after ``start``, with ``D_i = 1 − cos(g_A, g_B)`` of group
    ``i``, ``μ_i ← m μ_i + (1 − m) sqrt(clamp(D_0 / D_i, *bounds))`` (each ``D`` + 1e-6);
    group ``i``'s rate is multiplied by ``μ_i`` around each step. Groups are the param
    groups' ``agvm_group`` tags (:func:`module_param_groups`), else each param group.

    Args:
        base: the optimizer to wrap (SGD, AdamW, LAMB, ...).
        interval: steps between updates of μ.
        start: steps before the first update (μ = 1 until then).
        momentum: m of μ's moving average.
        bounds: the clamp of the variance ratio before the square root.
    """

    #: the config keys (``agvm.<key>``) a run may set (bigbatch.knobs)
    CONFIG: ClassVar[dict[str, Knob]] = {
        "interval": Knob("interval", "steps between multiplier updates", low=1),
        # the paper's 500 steps are for ImageNet-length runs; the built-in tasks take 1-3k
        "start": Knob("start", "steps before the first update (paper: 500)", low=0, run_default=50),
        "momentum": Knob("momentum", "momentum of the multipliers", low=0, high=1, high_open=True),
    }

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        interval: int = 5,
        start: int = 500,
        momentum: float = 0.97,
        bounds: tuple[float, float] = (0.5, 10.0),
    ) -> None:
        positive_int("interval", interval)
        whole_number("start", start)
        momentum = check_number("momentum", momentum)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        low, high = (check_number("bounds", b) for b in pair("bounds", bounds, "(low, high)"))
        if not 0 < low <= high:
            raise ValueError(f"bounds must satisfy 0 < low <= high, got {bounds!r}")
        self.interval, self.start, self.momentum, self.bounds = (
            interval,
            start,
            momentum,
            (low, high),
        )
        super().__init__(base)
        self.group_names: list[str] = []
        #: μ per module group, the reference first
        self.multipliers: list[float] = []
        self._groups_changed()
        if len(self.group_names) < 2:
            raise ValueError(
                "AGVM needs at least 2 module groups: build the param groups with "
                "module_param_groups(model, weight_decay, rule)"
            )
        self._steps = 0

    def _groups_changed(self) -> None:
        names = self.group_names
        self._group_of_param_group = []
        for i, group in enumerate(self.param_groups):
            name = str(group.get("agvm_group", f"group{i}"))
            if name not in names:
                names.append(name)
            self._group_of_param_group.append(names.index(name))
        self.multipliers += [1.0] * (len(names) - len(self.multipliers))  # a new group's: 1

    def update(self, group_halves: Sequence[Sequence[float]]) -> None:
        """One μ update from the ``(3, param groups)`` half statistics of a step (floats)."""
        parts = [[0.0] * len(self.group_names) for _ in range(3)]
        for row, values in zip(parts, group_halves):
            for value, owner in zip(values, self._group_of_param_group):
                row[owner] += float(value)
        # a group with no gradient this step (unused, frozen) has nothing measured: its μ is
        # held, and without the reference's none is moved (both halves 0 read as D = 1)
        measured = [sq_a > 0 or sq_b > 0 for sq_a, sq_b, _ in zip(*parts)]
        if not measured[0]:
            return
        disagreement = [1 - cosine_of(sq_a, sq_b, dot) for sq_a, sq_b, dot in zip(*parts)]
        low, high = self.bounds
        ratio = [
            math.sqrt(min(high, max(low, (disagreement[0] + 1e-6) / (d + 1e-6))))
            for d in disagreement
        ]
        m = self.momentum
        self.multipliers = [
            m * mu + (1 - m) * s if seen else mu
            for mu, s, seen in zip(self.multipliers, ratio, measured, strict=True)
        ]

    def observe(self, stats: GradientStats) -> None:
        """Count the step and, when one is due, update μ (no host read of its own)."""
        super().observe(stats)
        self._steps += 1
        if self._steps > self.start and (self._steps - self.start) % self.interval == 0:
            if stats.group_halves is None:
                raise RuntimeError("AGVM needs GradientStats.group_halves (per-group halves)")
            self.update(stats.host_group_halves())

    def modulated_step(self, stats: GradientStats) -> None:
        """The base step with group ``i``'s rate multiplied by its ``μ_i``."""
        factors = [self.multipliers[owner] for owner in self._group_of_param_group]
        with scaled_lr(self, factors):
            self.base.step()

    def metrics(self) -> dict[str, float]:
        out = {f"agvm/{n}": mu for n, mu in zip(self.group_names, self.multipliers)}
        return {**super().metrics(), **out}

    def _wrapper_state(self) -> dict[str, Any]:
        return {"multipliers": list(self.multipliers), "steps": self._steps}

    def _check_wrapper_state(self, state: dict[str, Any]) -> None:
        saved = state.get("multipliers") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.group_names):
            count = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(
                f"the saved AGVM state has {count} multipliers where this AGVM has "
                f"{len(self.group_names)} module groups ({', '.join(self.group_names)}): "
                "was it saved with other agvm_group tags?"
            )

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        self.multipliers = [float(m) for m in state["multipliers"]]
        self._steps = int(state["steps"])
