"""Batch-size control: controllers, learning-rate rules, micro-batch plans, the sampler."""

from . import contrib  # registers the research controllers beside the public ones
from .controllers import (
    CONTROLLERS,
    BatchWarmup,
    Constant,
    Contract,
    Controller,
    Ramp,
    Seesaw,
    SimiGrad,
    contract_of,
)
from .lr import LR_RULES, adascale_gain, lr_factor, scaled_lr
from .plan import (
    StepPlan,
    loss_weights,
    micro_batch_sizes,
    plan_step,
    shard_batch,
    split_by_weight,
)
from .sampler import GlobalBatchSampler, VariableBatchSampler
from .smoothing import LossSlope, SmoothedNoise, SmoothedValue

__all__ = [
    "CONTROLLERS",
    "LR_RULES",
    "BatchWarmup",
    "Constant",
    "Contract",
    "Controller",
    "GlobalBatchSampler",
    "LossSlope",
    "Ramp",
    "Seesaw",
    "SimiGrad",
    "SmoothedNoise",
    "SmoothedValue",
    "StepPlan",
    "VariableBatchSampler",
    "adascale_gain",
    "contract_of",
    "contrib",
    "loss_weights",
    "lr_factor",
    "micro_batch_sizes",
    "plan_step",
    "scaled_lr",
    "shard_batch",
    "split_by_weight",
]
