"""The DeepSpeed plugin with the real DeepSpeed on CPU: gloo, 1 and 2 processes, ZeRO 0-2.

Each program runs on every rank of a cluster of spawned processes (see
``deepspeed_programs``); the plain loop on the same run is the reference.
"""

import pytest
import torch

pytest.importorskip("deepspeed")

from ..parallel.cluster import Cluster
from . import deepspeed_programs as programs

STAGES = [0, 1, 2]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"{n}ranks")
def ranks(request):
    cluster = Cluster(request.param)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def one_rank():
    cluster = Cluster(1)
    yield cluster
    cluster.close()


def assert_same_run(results, atol=1e-6):
    for result in results:
        plain, ds = result["plain"], result["deepspeed"]
        assert ds["batch"] == plain["batch"]
        assert ds["indices"] == plain["indices"]
        assert ds["skipped"] == plain["skipped"]
        torch.testing.assert_close(ds["params"], plain["params"], rtol=0, atol=atol)
    first = results[0]["deepspeed"]
    for other in results[1:]:  # every rank decided the same and holds the same model
        assert other["deepspeed"]["batch"] == first["batch"]
        torch.testing.assert_close(other["deepspeed"]["params"], first["params"], rtol=0, atol=0)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["constant", "adaptive", "ramp"])
def test_same_batches_and_parameters_as_the_plain_loop(ranks, stage, kind):
    results = ranks.run(programs.compare, kind, stage)
    assert_same_run(results)
    if kind == "adaptive":  # the controller did decide something
        assert len(set(results[0]["deepspeed"]["batch"])) > 3
    if kind == "ramp":
        batches = results[0]["deepspeed"]["batch"]
        assert batches[4] < batches[5] == batches[-1]


def test_a_layerwise_optimizer_trains_as_in_the_plain_loop_at_stage_0(ranks):
    assert_same_run(ranks.run(programs.compare, "adaptive", 0, optimizer="lamb", lr=0.01))


@pytest.mark.parametrize("stage", [0, 2])
def test_an_optimizer_deepspeed_builds_from_its_config_trains_as_in_the_plain_loop(ranks, stage):
    assert_same_run(ranks.run(programs.compare, "adaptive", stage, optimizer="config:adamw"))


@pytest.mark.parametrize("stage", STAGES)
def test_a_non_finite_step_is_dropped_as_in_the_plain_loop(ranks, stage):
    # (under ZeRO-2 it stopped the run: the reduced gradient was held not droppable)
    results = ranks.run(programs.compare, "constant", stage, steps=8, nan_at=3)
    assert results[0]["deepspeed"]["skipped"][3] == 1.0
    assert_same_run(results)


@pytest.mark.parametrize(
    ("stage", "offload"), [(0, False), (1, False), (2, False), (2, True)], ids=str
)
def test_a_step_left_unapplied_leaves_no_gradient_as_in_the_plain_loop(ranks, stage, offload):
    # before, ZeRO 1-2 added it to the next step (the loop cleared the client optimizer's
    # .grad, not DeepSpeed's buffers), and with an offloaded optimizer the first step raised
    assert_same_run(ranks.run(programs.abandoned, stage, offload), atol=1e-5)


@pytest.mark.parametrize("lr_scaling", ["linear", "sqrt"])
def test_the_rate_follows_the_batch_as_in_the_plain_loop(ranks, lr_scaling):
    results = ranks.run(programs.compare, "ramp", 0, steps=8, lr_scaling=lr_scaling)
    assert_same_run(results)


def test_a_clip_is_refused_before_the_step_is_spent_and_a_bare_checkpoint_by_name(
    one_rank, tmp_path
):
    """A refused apply(max_grad_norm=) had marked the step applied: apply() again was an
    error, and the next step added to its gradient. DeepSpeed is told each new batch."""
    (answers,) = one_rank.run(programs.misuses, str(tmp_path))
    assert "gradient_clipping" in answers["clip"] and "no max_grad_norm" in answers["clip"]
    assert answers["train_batch_size"] == 32  # the ramp's second batch, as DeepSpeed logs it
    assert "holds no bigbatch state" in answers["bare"]


def test_each_rank_resumes_its_own_random_state(tmp_path):
    cluster = Cluster(2)
    try:
        assert cluster.run(programs.random_state_restored, str(tmp_path)) == [True, True]
    finally:
        cluster.close()


def test_a_checkpoint_of_another_controller_is_refused_in_one_error(one_rank, tmp_path):
    (answer,) = one_rank.run(programs.loaded_into_another_controller, str(tmp_path))
    assert "was it saved with another controller?" in answer


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_trains_and_every_rank_decides_the_same(ranks, stage):
    results = ranks.run(programs.bf16_run, stage)
    first = results[0]
    assert all(r["batch"] == first["batch"] for r in results)
    assert first["loss"][-1] < 0.5 * first["loss"][0]
    assert len(set(first["batch"])) > 3


@pytest.mark.parametrize("stage", [0, 2])
def test_a_run_resumed_from_a_deepspeed_checkpoint_continues_exactly(ranks, stage, tmp_path):
    for result in ranks.run(programs.resumed, stage, str(tmp_path)):
        straight, head, tail = result["straight"], result["head"], result["tail"]
        assert head["batch"] + tail["batch"] == straight["batch"]
        assert head["indices"] + tail["indices"] == straight["indices"]
        torch.testing.assert_close(tail["params"], straight["params"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("stage", "dtype", "optimizer", "config", "message"),
    [
        (0, "fp32", "sgd", {"managed_gradient_accumulation": True}, "managed_gradient_accum"),
        (1, "fp32", "lamb", {}, "LAMB works on whole parameter tensors"),
        (1, "bf16", "lars", {}, "flat partitions here (ZeRO stage 1, bf16)"),
        # bf16 at stage 0 keeps one fp32 master per parameter: whole tensors, accepted
        (0, "bf16", "lars", {}, "accepted"),
        (
            0,
            "fp32",
            "sgd",
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
            "a DeepSpeed scheduler is not supported",
        ),
        (3, "fp32", "sgd", {}, "ZeRO stage 3 is not supported"),
        (0, "fp32", "vr-sgd", {}, "VRGD is not supported under DeepSpeed"),
    ],
    ids=[
        "managed",
        "lamb-zero1",
        "lars-bf16-zero1",
        "lars-bf16-zero0",
        "scheduler",
        "zero3",
        "vrgd",
    ],
)
def test_an_engine_it_cannot_serve_gets_one_error_naming_why(
    one_rank, stage, dtype, optimizer, config, message
):
    (answer,) = one_rank.run(programs.refusal, stage, dtype, optimizer, **config)
    assert message in answer


def test_the_statistics_need_two_micro_batches_per_rank(one_rank):
    (answer,) = one_rank.run(programs.refusal_min_sub_batches)
    assert "min_sub_batches must be at least 2 under DeepSpeed" in answer


def test_fp16_is_refused(one_rank):
    # DeepSpeed itself refuses fp16 on a CPU: an fp32 engine that reports fp16
    (answer,) = one_rank.run(programs.refusal_fp16)
    assert "fp16 is not supported" in answer and "use bf16" in answer
