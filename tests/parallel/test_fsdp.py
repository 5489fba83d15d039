"""AdaptiveBatch on a model sharded with FSDP2's ``fully_shard`` (gloo, 2 and 4 ranks).

The model's last layer has one output row, so with 2+ ranks some ranks hold
empty shards of it.
"""

import pytest
import torch

from . import programs


def test_fsdp_statistics_equal_the_sub_batch_by_sub_batch_values(cluster):
    batch = 11 * cluster.world_size + 1  # uneven shards and micro-batches
    results = cluster.run(programs.one_step_statistics, "scalar", batch, True)
    first = results[0]
    for other in results[1:]:
        assert other["got"] == first["got"]  # bitwise identical on every rank
    got, expected = first["got"], first["expected"]
    assert sum(first["sizes"]) == batch
    assert got["signal"] == pytest.approx(expected["signal"], rel=1e-6)
    assert got["trace"] == pytest.approx(expected["trace"], rel=1e-6)
    assert got["similarity"] == pytest.approx(expected["similarity"], rel=1e-6, abs=1e-9)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_fsdp_per_example_statistics_equal_the_example_by_example_values(cluster):
    # the layers run unsharded in the forward: their hooks see whole weights' activations
    batch = 11 * cluster.world_size + 1
    results = cluster.run(programs.one_step_statistics, "scalar", batch, True, True)
    got, expected = results[0]["got"], results[0]["expected"]
    assert all(other["got"] == got for other in results[1:])
    assert got["signal"] == pytest.approx(expected["signal"], rel=1e-6)
    assert got["trace"] == pytest.approx(expected["trace"], rel=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fsdp_trains_like_one_process_on_the_same_global_batches(cluster, optimizer):
    batch, steps = 10 * cluster.world_size + 3, 8
    results = cluster.run(programs.constant_run, batch, steps, True, optimizer)
    single = programs.make_loop(programs.Constant(batch), ddp=False, optimizer=optimizer)
    record = programs.train(single, steps)
    for result in results:
        torch.testing.assert_close(result["params"], programs.flat_params(single))
        assert result["loss"] == pytest.approx(record["loss"], rel=1e-9)
        # the statistics' one all-reduce: 2 groups x (sub-batch norms, shards' |g|²) + the loss
        assert result["traffic"] == (2 * 2 + 1) * 8


def test_fsdp_decides_like_ddp_and_alike_on_every_rank(cluster2):
    sharded = cluster2.run(programs.adaptive_run, 60, "scalar", True)
    replicated = cluster2.run(programs.adaptive_run, 60, "scalar", False)
    assert len(set(sharded[0]["batch"])) > 3  # the batch really adapts
    assert sharded[1]["batch"] == sharded[0]["batch"] == replicated[0]["batch"]
    assert sharded[1]["noise_scale"] == sharded[0]["noise_scale"]
    assert sharded[0]["noise_scale"] == pytest.approx(replicated[0]["noise_scale"], rel=1e-9)
    torch.testing.assert_close(sharded[0]["params"], replicated[0]["params"])


def test_only_a_steps_last_micro_batch_reduce_scatters(cluster2):
    # the earlier ones accumulate unsharded: no communication (and no sharded .grad) yet
    assert cluster2.run(programs.fsdp_gradients_by_micro_batch) == [[False, True]] * 2


def test_what_fsdp_does_not_support_gets_one_clear_error(cluster2):
    split, dtensor, rootless = cluster2.run(programs.fsdp_refusals)[0]
    assert "similarity='split' and lossy comm hooks need a DDP model" in split
    assert "sharded (DTensor parameters)" in dtensor and "fully_shard" in dtensor
    assert "fully_shard(model) on the root too makes it FSDP2's" in rootless


def test_gsnr_under_fsdp_equals_the_sub_batch_by_sub_batch_value(cluster):
    results = cluster.run(programs.two_step_gsnr, 10 * cluster.world_size + 2, True)
    result = results[0]
    for other in results[1:]:
        assert torch.equal(other["got"], result["got"])  # whole tensors, alike on every rank
    keep = result["variance"] > 1e-12  # coordinates with a variance to speak of
    torch.testing.assert_close(result["got"][keep], result["expected"][keep], rtol=1e-3, atol=1e-6)


def test_vrgd_on_shards_decides_and_trains_like_ddp(cluster2):
    sharded = cluster2.run(programs.adaptive_run, 20, "scalar", True, "vr-sgd")
    replicated = cluster2.run(programs.adaptive_run, 20, "scalar", False, "vr-sgd")
    assert sharded[1]["batch"] == sharded[0]["batch"] == replicated[0]["batch"]
    torch.testing.assert_close(sharded[0]["params"], replicated[0]["params"])


@pytest.mark.parametrize("optimizer", ["lamb", "lars", "merit"])
def test_large_batch_optimizers_on_shards_equal_one_process(cluster, optimizer):
    batch, steps = 10 * cluster.world_size + 3, 6
    results = cluster.run(programs.constant_run, batch, steps, True, optimizer)
    single = programs.make_loop(programs.Constant(batch), ddp=False, optimizer=optimizer)
    programs.train(single, steps)
    for result in results:
        torch.testing.assert_close(result["params"], programs.flat_params(single))


def test_lamb_on_shards_with_adaptive_batches_decides_and_trains_like_ddp(cluster2):
    sharded = cluster2.run(programs.adaptive_run, 40, "scalar", True, "lamb")
    replicated = cluster2.run(programs.adaptive_run, 40, "scalar", False, "lamb")
    assert len(set(sharded[0]["batch"])) > 3
    assert sharded[1]["batch"] == sharded[0]["batch"] == replicated[0]["batch"]
    torch.testing.assert_close(sharded[0]["params"], replicated[0]["params"])


@pytest.mark.parametrize("optimizer, expected", [("lamb", 2), ("lars", 1), ("merit", 2)])
def test_a_step_on_shards_makes_a_fixed_number_of_collectives(cluster2, optimizer, expected):
    # LAMB: the global clip, and the trust ratios of the group with weight decay;
    # LARS: that group's ratios (without decay LAMB and LARS adapt nothing);
    # MERIT: one per group (it adapts every tensor)
    for layers in (2, 5):
        calls = cluster2.run(programs.sharded_optimizer_collectives, optimizer, layers)
        assert calls == [expected, expected], (layers, calls)


def test_an_fsdp_run_resumed_with_the_same_ranks_is_identical(cluster2):
    result = cluster2.run(programs.resume_same_world, 30, 12, True, "lamb")[0]
    assert result["again"] == result["rest"]  # batches, similarities, losses, shards
    torch.testing.assert_close(result["resumed"], result["straight"], rtol=0, atol=0)


def test_a_state_taken_before_the_first_step_leaves_the_optimizer_as_built(cluster2):
    """torch's full-state helpers stepped an empty optimizer once at rate 0: AdamW's step
    count one ahead (its first update 0.74x), on the run and on one resumed from it."""
    sharded = cluster2.run(programs.trained_from_the_first_state, "adamw", True)[0]
    replicated = cluster2.run(programs.trained_from_the_first_state, "adamw", False)[0]
    assert replicated["straight"]["step_counts"] == {3.0}
    for run in (sharded["straight"], sharded["resumed"]):
        assert run["step_counts"] == {3.0}
        torch.testing.assert_close(run["params"], replicated["straight"]["params"])


def test_a_ddp_checkpoint_resumes_under_fsdp_with_its_optimizer_state(cluster2, tmp_path):
    """A state saved without FSDP2 keys the optimizer's by position; torch's sharded load
    took it without a word and left every moment empty (the run went on from fresh ones)."""
    path = str(tmp_path / "state.pt")
    cluster2.run(programs.save_run, 20, path, False, "lamb")
    sharded = cluster2.run(programs.resume_run, 5, path, True, "lamb")[0]
    replicated = cluster2.run(programs.resume_run, 5, path, False, "lamb")[0]
    assert sharded["batch"] == replicated["batch"]
    assert sharded["loss"] == pytest.approx(replicated["loss"], rel=1e-5)


def test_an_fsdp_checkpoint_resumes_on_four_ranks_and_on_one_process(cluster2, cluster4, tmp_path):
    path = str(tmp_path / "state.pt")
    saved = cluster2.run(programs.save_run, 20, path, True, "lamb")[0]
    for resumed in (
        cluster4.run(programs.resume_run, 10, path, True, "lamb")[0],
        programs.resume_run(10, path, optimizer="lamb", ddp=False),  # whole tensors: plain module
    ):
        assert resumed["start"] == {
            "batch": saved["next_batch"], "samples": saved["samples"], "step": 20
        }  # fmt: skip
        assert resumed["batch"][0] == saved["next_batch"]
        assert resumed["loss"][-1] < saved["loss"][0]


def test_the_command_lines_fsdp_strategy_trains_like_its_ddp(cluster2):
    sharded = cluster2.run(programs.cli_build, "fsdp", 5)
    replicated = cluster2.run(programs.cli_build, "ddp", 5)[0]
    assert sharded[0]["sharded"] and sharded[0]["model"].startswith("FSDP")
    assert replicated["model"] == "DistributedDataParallel"
    assert sharded[0]["losses"] == sharded[1]["losses"]
    assert sharded[0]["losses"] == pytest.approx(replicated["losses"], rel=1e-5)
    assert sharded[0]["accuracy"] == pytest.approx(replicated["accuracy"], abs=1e-3)


def test_agvm_on_shards_decides_and_trains_like_ddp(cluster2):
    # AGVM's per-group cosines come from the statistics' scalars, which FSDP2 shares
    sharded = cluster2.run(programs.adaptive_run, 30, "scalar", True, "agvm")
    replicated = cluster2.run(programs.adaptive_run, 30, "scalar", False, "agvm")
    assert sharded[1]["batch"] == sharded[0]["batch"] == replicated[0]["batch"]
    torch.testing.assert_close(sharded[0]["params"], replicated[0]["params"])
