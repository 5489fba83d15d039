"""How a run's parts fit together on one process: the controller, the statistics, the checks."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import bigbatch as bb
from bigbatch.assembly import (
    _check_sub_batches,
    assemble,
    describe_collector,
    measuring_every,
    resolve_controller,
)
from bigbatch.batch import BatchWarmup
from bigbatch.engine import StepEngine
from bigbatch.options import StepOptions
from bigbatch.parallel.world import World


def make_optimizer():
    return torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1)


def test_the_default_controller_warms_up_from_the_first_batch():
    parts = assemble(make_optimizer(), sub_batches=2)
    assert isinstance(parts.controller, bb.batch.BatchWarmup) and parts.controller.initial == 8
    # the default controller reads the statistics: they are collected
    assert parts.world == World() and parts.options == StepOptions(statistics=True)
    started = assemble(make_optimizer(), sub_batches=2, first_batch=128)
    assert started.controller.initial == 128


def test_a_controller_must_start_at_the_samplers_first_batch():
    controller = bb.batch.BatchWarmup(initial=32)
    assert resolve_controller(controller, None) is controller
    assert resolve_controller(controller, 32) is controller
    with pytest.raises(ValueError, match="starts at batch 32 but the sampler at 64"):
        resolve_controller(controller, 64)


def test_the_default_controller_starts_at_any_first_batch_a_sampler_gives():
    """A plugin's ``GlobalBatchSampler(N, 8)`` with no controller was refused: "initial (8)
    is outside [min, max] = [16, 16384]", naming arguments its user never passed."""
    small, large = resolve_controller(None, 4), resolve_controller(None, 32_768)
    assert (small.initial, small.min, small.max) == (4, 4, 16_384)  # below the default 8
    assert (large.initial, large.min, large.max) == (32_768, 8, 32_768)
    assert repr(resolve_controller(None, 64)) == repr(bb.batch.BatchWarmup(initial=64))


def test_statistics_on_one_process_need_two_sub_batches():
    with pytest.raises(ValueError, match=r"min_sub_batches .* must be at least 2"):
        assemble(make_optimizer(), sub_batches=1)
    parts = assemble(make_optimizer(), options=StepOptions(statistics=False), sub_batches=1)
    assert parts.collector is None and describe_collector(parts.collector) is None


def test_the_controllers_smallest_batch_must_hold_every_sub_batch():
    with pytest.raises(ValueError, match=r"smallest batch \(8\) is below min_sub_batches"):
        assemble(make_optimizer(), bb.batch.Constant(8), sub_batches=16)
    assemble(make_optimizer(), bb.batch.Constant(16), sub_batches=16)


def test_a_vrgd_optimizer_turns_the_gsnr_on():
    plain = assemble(make_optimizer(), sub_batches=8)
    assert not plain.collector.gsnr and "gsnr" not in plain.collector.provides()
    parts = assemble(bb.optim.VRGD(make_optimizer()), sub_batches=8)
    assert parts.collector.gsnr and "gsnr" in parts.collector.provides()


def test_describe_collector_lists_its_settings():
    options = StepOptions(ema_beta=0.9, similarity="scalar")
    parts = assemble(make_optimizer(), options=options, sub_batches=4, dataset_size=1000)
    assert describe_collector(parts.collector) == {
        "similarity": "scalar",
        "gsnr": False,
        "ema_beta": 0.9,
        "dataset_size": 1000,
        "lossy_reduction": False,
        "per_example": False,
    }
    uncorrected = StepOptions(finite_correction=False)
    parts = assemble(make_optimizer(), options=uncorrected, sub_batches=4, dataset_size=1000)
    assert describe_collector(parts.collector)["dataset_size"] is None


def test_a_comm_hook_needs_ranks():
    hook = (None, default_hooks.allreduce_hook)
    with pytest.raises(ValueError, match="comm_hook needs a DistributedDataParallel model"):
        assemble(make_optimizer(), model=nn.Linear(4, 3), sub_batches=2, comm_hook=hook)


@pytest.mark.parametrize(
    ("controller", "keywords", "every"),
    [
        (bb.batch.BatchWarmup(), {}, "auto"),  # it learns |G|^2 from the steps between
        (bb.batch.Constant(16), {"statistics": True}, "auto"),  # logged, nothing reads them
        (bb.batch.SimiGrad(), {}, 1),  # it decides on measured steps only
        (bb.batch.BatchWarmup(), {"gsnr": True}, 1),  # the GSNR reads every step
    ],
)
def test_auto_skips_steps_only_where_the_steps_between_lose_nothing(controller, keywords, every):
    options = StepOptions(statistics_every="auto", **keywords)
    engine = StepEngine.build(make_optimizer(), controller, options, sub_batches=2)
    assert engine.options.statistics_every == every


def test_auto_measures_every_step_where_a_lossy_reduction_leaves_no_batch_gradient():
    auto, optimizer, warmup = StepOptions(statistics_every="auto"), make_optimizer(), BatchWarmup()

    def every(lossy):
        collector = bb.stats.MicroBatchStatistics(
            optimizer.param_groups, lossy_reduction=lossy, grad_accumulates=not lossy
        )  # one process: the reduction is lossy only where the framework keeps no batch gradient
        return measuring_every(auto, optimizer, warmup, collector).statistics_every

    assert (every(False), every(True)) == ("auto", 1)


def test_a_lossy_reduction_keeps_two_micro_batches_a_rank_however_many_ranks():
    """With compression each rank measures the noise in its own micro-batches: 4 ranks got
    one each (4 in all) and every first step failed, a traceback a rank."""
    from bigbatch.assembly import fewest_sub_batches

    assert fewest_sub_batches(True, False, False, ranks=4) == 1  # exact: the 4 ranks' 4
    assert fewest_sub_batches(True, False, False, ranks=3) == 2  # 6, not 3: at least the 4
    assert fewest_sub_batches(True, False, False, ranks=4, lossy=True) == 2
    assert fewest_sub_batches(True, False, False, ranks=8, lossy=True) == 2
    assert fewest_sub_batches(True, False, False, ranks=1, lossy=True) == 4
    assert fewest_sub_batches(True, True, False, ranks=4, lossy=True) == 1  # per-example
    # one a rank asked for is refused when the engine is built (it failed inside the step)
    two = World(rank=0, size=2)
    check = functools.partial(_check_sub_batches, bb.batch.Constant(16), 1, two)
    with pytest.raises(ValueError, match="must be at least 2 under a lossy reduction"):
        check(StepOptions(statistics=True), None, "", lossy=True)
    check(StepOptions(statistics=True), None, "", lossy=False)  # exact: the ranks' noise
