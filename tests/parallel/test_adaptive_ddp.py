"""AdaptiveBatch under DDP with gloo: same decisions on every rank, exact statistics, sharding."""

import math

import pytest
import torch

from . import programs


def test_statistics_equal_the_sub_batch_by_sub_batch_values(cluster):
    for similarity in ("scalar", "split"):
        batch = 11 * cluster.world_size + 1  # uneven shards and micro-batches
        results = cluster.run(programs.one_step_statistics, similarity, batch)
        first = results[0]
        for other in results[1:]:
            assert other["got"] == first["got"]  # bitwise identical on every rank
        got, expected = first["got"], first["expected"]
        assert sum(first["sizes"]) == batch
        assert len(set(first["micro_counts"])) == 1  # every rank joins the same forwards
        assert got["similarity"] == pytest.approx(expected["similarity"], rel=1e-6, abs=1e-9)
        assert got["overall"] == pytest.approx(expected["overall"], rel=1e-6, abs=1e-9)
        assert got["signal"] == pytest.approx(expected["signal"], rel=1e-6)
        assert got["trace"] == pytest.approx(expected["trace"], rel=1e-6)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)  # float32


def test_per_example_statistics_equal_the_example_by_example_values(cluster):
    # one micro-batch per rank: the ranks reduce the sums of their examples' squared norms
    batch = 11 * cluster.world_size + 1
    results = cluster.run(programs.one_step_statistics, "scalar", batch, False, True)
    first = results[0]
    for other in results[1:]:
        assert other["got"] == first["got"]
    got, expected = first["got"], first["expected"]
    assert len(set(first["micro_counts"])) == 1  # (two micro-batches of at most 8 each)
    assert got["signal"] == pytest.approx(expected["signal"], rel=1e-6)
    assert got["trace"] == pytest.approx(expected["trace"], rel=1e-6)
    assert got["similarity"] == pytest.approx(expected["similarity"], rel=1e-6, abs=1e-9)


def test_every_rank_makes_the_same_batch_decisions_for_100_steps(cluster):
    # the batch grows from 16 per rank to the cap (512) within them: 40-odd sizes
    results = cluster.run(programs.adaptive_run, 100, "scalar")
    batches = results[0]["batch"]
    assert len(batches) == 100 and len(set(batches)) > 5  # the batch really adapts
    for other in results[1:]:
        assert other["batch"] == batches
        assert other["similarity"] == results[0]["similarity"]
        assert other["loss"] == results[0]["loss"]
        assert torch.equal(other["params"], results[0]["params"])
    assert results[0]["loss"][-1] < 0.5 * results[0]["loss"][0]


def test_an_asynchronous_run_decides_the_same_on_every_rank(cluster2):
    """Each step's numbers, reduced over the ranks, are read at the next step on every
    rank: the same late decisions, skips and parameters everywhere."""
    results = cluster2.run(programs.asynchronous_run, 60)
    first = results[0]["metrics"]
    assert first[0] == {} and [m["step"] for m in first[1:]] == list(range(1, 61))
    assert len({m["batch_size"] for m in first[1:]}) > 2  # the batch really adapts
    assert results[1]["metrics"] == first
    assert torch.equal(results[1]["params"], results[0]["params"])


def test_statistics_every_third_step_decides_the_same_on_every_rank(cluster2):
    """The ranks agree on which steps measure (the step counter decides): one micro-batch
    per rank between measurements, the same batches and parameters on every rank."""
    results = cluster2.run(programs.adaptive_run, 30, "scalar", every=3, max_micro_batch=64)
    first = results[0]
    assert [s is not None for s in first["similarity"]] == [i % 3 == 0 for i in range(30)]
    # min_sub_batches (2) on a measured step, else only what max_micro_batch (64) asks
    fewest = [2 if i % 3 == 0 else 1 for i in range(30)]
    memory = [math.ceil(math.ceil(b / 2) / 64) for b in first["batch"]]
    assert first["micro_batches"] == [max(f, m) for f, m in zip(fewest, memory)]
    assert 1 in first["micro_batches"]
    assert len(set(first["batch"])) > 1  # the batch adapts at the measured steps
    assert results[1]["batch"] == first["batch"] and results[1]["loss"] == first["loss"]
    assert torch.equal(results[1]["params"], first["params"])


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_a_step_between_measurements_gives_the_whole_batch_gradients_norm(cluster2, fsdp):
    """Between measurements a controller that learns from them gets ``|g_B|²`` of the
    global batch's gradient: replicated under DDP, summed over the shards under FSDP2."""
    for seen in cluster2.run(programs.norm_between_measurements, fsdp):
        assert [norm is None for norm, _ in seen] == [True, False, True, False]
        for norm, full in seen[1::2]:
            assert norm == pytest.approx(full, rel=1e-6)


def test_split_mode_also_decides_the_same_on_every_rank(cluster2):
    results = cluster2.run(programs.adaptive_run, 60, "split")
    assert results[0]["batch"] == results[1]["batch"]
    assert results[0]["similarity"] == results[1]["similarity"]


def test_ddp_trains_like_one_process_on_the_same_global_batches(cluster):
    batch, steps = 10 * cluster.world_size + 3, 8
    results = cluster.run(programs.constant_run, batch, steps)
    single = programs.make_loop(programs.Constant(batch), ddp=False)
    record = programs.train(single, steps)
    torch.testing.assert_close(results[0]["params"], programs.flat_params(single))
    assert results[0]["loss"] == pytest.approx(record["loss"], rel=1e-9)
    # the ranks' shards are the one-process batches, each sample once
    for step in range(steps):
        shards = [r["indices"][step] for r in results]
        assert sorted(i for s in shards for i in s) == sorted(record["indices"][step])


def test_shards_cover_every_sample_once_per_epoch(cluster):
    size = len(programs.regression_data())
    batch = 7 * cluster.world_size + 1
    steps = size // batch + 1
    results = cluster.run(programs.constant_run, batch, steps)
    seen = [i for step in range(steps) for r in results for i in r["indices"][step]]
    epoch = seen[:size]
    assert sorted(epoch) == list(range(size))


def test_a_resumed_run_with_the_same_ranks_is_identical(cluster):
    result = cluster.run(programs.resume_same_world, 40, 15)[0]
    # the statistics' bytes over the whole run: the counter resumes with it
    assert result["traffic"][0] == result["traffic"][1] > 0
    if cluster.world_size == 2:
        assert result["again"] == result["rest"]  # batches, similarities, losses, shards
        assert torch.equal(result["resumed"], result["straight"])
    else:
        # A new DDP model reduces its first step in the initial bucket layout
        # and rebuilds the buckets afterwards; with 3+ ranks gloo's ring then
        # sums some elements in another order on that one step (last-bit
        # differences, 2e-16 here), which the float64 statistics show too; the
        # decisions are the same. Documented in docs/distributed.md.
        again, rest = result["again"], result["rest"]
        assert again["batch"] == rest["batch"] and again.keys() == rest.keys()
        for key in again:
            torch.testing.assert_close(again[key], rest[key], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(result["resumed"], result["straight"], rtol=1e-13, atol=1e-15)


def test_resume_with_another_number_of_ranks_continues(cluster2, cluster4, tmp_path):
    path = str(tmp_path / "state.pt")
    saved_ranks = cluster2.run(programs.save_run, 25, path)
    saved = saved_ranks[0]
    resumed = cluster4.run(programs.resume_run, 20, path)
    start = resumed[0]["start"]
    assert start == {"batch": saved["next_batch"], "samples": saved["samples"], "step": 25}
    assert resumed[0]["batch"][0] == saved["next_batch"]
    assert all(r["batch"] == resumed[0]["batch"] for r in resumed)
    # the sampler continues where it stopped: no sample twice within the epoch
    size = len(programs.regression_data())
    seen = [i for step in range(25) for r in saved_ranks for i in r["indices"][step]]
    seen += [i for step in range(20) for r in resumed for i in r["indices"][step]]
    assert len(seen) > size // 2
    epoch = seen[:size]
    assert len(set(epoch)) == len(epoch)
    assert resumed[0]["loss"][-1] < saved["loss"][0]


def test_two_group_hook_wraps_another_hook_without_changing_the_gradient(cluster2):
    results = cluster2.run(programs.hook_with_inner, 5, "allreduce")
    torch.testing.assert_close(results[0]["wrapped"], results[0]["plain"])
    assert results[0]["cosines"] == results[1]["cosines"]
    assert all(-1 <= c <= 1 for c in results[0]["cosines"])
    assert results[0]["extra_bytes"] > 0
    if torch.cuda.is_available():
        pytest.skip(
            "torch's PowerSGD hook calls torch.cuda.synchronize() whenever CUDA is available, "
            "which fails for the CPU tensors of these gloo ranks"
        )
    # around PowerSGD the model gets the compressed gradient, the cosine the exact one
    compressed = cluster2.run(programs.hook_with_inner, 5, "powersgd")
    assert compressed[0]["cosines"][0] == results[0]["cosines"][0]
    assert not torch.allclose(compressed[0]["wrapped"], results[0]["wrapped"])
    assert torch.equal(compressed[0]["wrapped"], compressed[1]["wrapped"])


def test_scalar_similarity_agrees_with_the_exact_two_group_cosine(cluster):
    batch = 64 * cluster.world_size
    result = cluster.run(programs.similarity_series, 300, batch)[0]
    split = sum(result["split"]) / len(result["split"])
    scalar = sum(result["scalar"]) / len(result["scalar"])
    # Both follow the similarity the mean noise estimates imply (docs/algorithms.md,
    # "Gradient statistics"); the measured cosine lies ~0.02 above it, the scalar estimate ~0.01
    # below (ratios of noisy numbers), as 1500-step runs show.
    signal = sum(s for s, _ in result["noise"]) / len(result["noise"])
    trace = sum(t for _, t in result["noise"]) / len(result["noise"])
    first = result["first"]
    expected = 1 / ((1 + trace / signal / first) * (1 + trace / signal / (batch - first))) ** 0.5
    assert abs(split - expected) < 0.04
    assert abs(scalar - expected) < 0.04
    assert abs(split - scalar) < 0.06

    # the scalar estimate is the steadier signal
    def spread(values, mean):
        return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5

    assert spread(result["scalar"], scalar) < spread(result["split"], split)


def test_gsnr_under_ddp_equals_the_sub_batch_by_sub_batch_value(cluster):
    results = cluster.run(programs.two_step_gsnr, 10 * cluster.world_size + 2)
    for r in results[1:]:
        assert torch.equal(r["got"], results[0]["got"])
    got, expected = results[0]["got"], results[0]["expected"]
    informative = results[0]["variance"] > 1e-12
    torch.testing.assert_close(got[informative], expected[informative], rtol=1e-3, atol=1e-6)


def test_a_resumed_vrgd_run_is_identical(cluster2):
    """The GSNR's shift (the last mean gradient) was not saved: a resumed run summed about 0
    and rounded otherwise (2e-7 off after 8 steps in float32), where the docs say bitwise."""
    result = cluster2.run(programs.resume_same_world, 12, 5, False, "vr-sgd")[0]
    assert result["again"] == result["rest"]
    assert torch.equal(result["resumed"], result["straight"])


def test_vrgd_and_agvm_train_identically_on_every_rank(cluster2):
    for optimizer in ("vr-sgd", "agvm"):
        results = cluster2.run(programs.wrapped_run, optimizer, 30)
        assert torch.equal(results[0]["params"], results[1]["params"])
        assert results[0]["loss"][-1] < results[0]["loss"][0]
    assert results[0]["agvm"] == results[1]["agvm"] and results[0]["agvm"][1] != 1.0


@pytest.mark.parametrize(
    "batch, max_micro_batch, weighted", [(9, 1, False), (17_000, 512, True), (13, 4, False)]
)
def test_every_rank_runs_the_same_number_of_micro_batches(
    cluster2, batch, max_micro_batch, weighted
):
    sizes = cluster2.run(programs.micro_batch_counts, batch, max_micro_batch, weighted)[0]
    assert len(sizes[0]) == len(sizes[1])


@pytest.mark.parametrize("registered", [False, True], ids=["given", "registered"])
def test_with_a_comm_hook_the_noise_is_estimated_within_each_rank(cluster, registered):
    # a hook the user registered on the model was taken to be exact: the statistics read
    # its (compressed) reduction as the mean gradient, |G|^2 came out negative
    batch = 10 * cluster.world_size + 3
    result = cluster.run(programs.within_rank_statistics, batch, registered)[0]
    assert result["got"] == pytest.approx(result["expected"], rel=1e-5)


def test_split_similarity_runs_the_users_comm_hook_inside_its_own(cluster2):
    assert cluster2.run(programs.users_hook_under_split_similarity) == [2, 2]  # a bucket a step


def test_a_plugin_builds_the_loops_engine_from_a_framework_wrapped_model(cluster2):
    result = cluster2.run(programs.engines_built_by_the_loop_and_a_plugin)[0]
    assert result["plugin"] == result["loop"]
    assert result["plugin"]["collector"]["lossy_reduction"] is True  # the framework's hook
    assert "similarity='split' under DDP" in result["refused"]


def test_auto_takes_the_ranks_gradients_from_four_ranks_and_the_examples_below(cluster):
    """From 4 ranks on, each rank's own gradient before the all-reduce is a small batch's
    (McCandlish et al. 2018, App. A): one micro-batch a rank, no layer measured."""
    result = cluster.run(programs.auto_noise_source)[0]
    assert result["micro_batches"] == 1 and math.isfinite(result["trace"])
    if cluster.world_size >= 4:
        assert not result["per_example"]
        assert "4 ranks: each rank's own gradient is a small batch's" in result["why"]
    else:
        assert result["per_example"] and "every trained parameter" in result["why"]


@pytest.mark.compile
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_a_compiled_model_gives_the_eager_statistics_on_every_rank(cluster2, fsdp):
    results = cluster2.run(programs.compiled_per_example_run, 30, fsdp)
    for result in results:
        eager, compiled = (
            torch.tensor(result[k], dtype=torch.float64) for k in ("eager", "compiled")
        )
        assert len(eager[:, 0].unique()) > 2  # the batch grows (48 a rank: two micro-batches)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-9)
    assert results[0] == results[1]


def test_asynchronous_compression_unalike_ranks_and_an_unwrapped_model_are_named(cluster2):
    refused = cluster2.run(programs.refused_or_warned, "compressed")[0]
    assert "asynchronous=True: a step proves non-finite one step late" in refused
    warned = cluster2.run(programs.refused_or_warned, "unwrapped")[0]
    assert "torch.distributed runs 2 processes, but the model is not wrapped" in warned
    unalike = cluster2.run(programs.refused_or_warned, "unalike")
    assert unalike[0] == unalike[1]  # every rank refuses (none waits on the others)
    assert "max_micro_batch differs between the ranks (rank 0: 8; rank 1: 4)" in unalike[0]
