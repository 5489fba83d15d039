import warnings
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigbatch.batch import VariableBatchSampler, shard_batch
from bigbatch.batch.plan import plan_step

#: these tests draw batches larger than their small datasets on purpose (across epochs)
repeats_allowed = pytest.mark.filterwarnings("ignore:a batch of .* samples from a dataset")


@repeats_allowed
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 200),
    sizes=st.lists(st.integers(1, 90), min_size=1, max_size=40),
    cut=st.integers(0, 40),
    seed=st.integers(0, 10),
)
def test_every_sample_once_per_epoch_and_exact_resume(n, sizes, cut, seed):
    sampler = VariableBatchSampler(n, seed=seed)
    drawn = [sampler.take(s) for s in sizes]
    flat = [i for batch in drawn for i in batch]
    for epoch in range(len(flat) // n):
        assert sorted(flat[epoch * n : (epoch + 1) * n]) == list(range(n))
    rest = flat[(len(flat) // n) * n :]
    assert max(Counter(rest).values(), default=1) == 1
    # resume after `cut` batches: the same batches follow
    cut = min(cut, len(sizes))
    first = VariableBatchSampler(n, seed=seed)
    for s in sizes[:cut]:
        first.take(s)
    resumed = VariableBatchSampler(n, seed=seed)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.take(s) for s in sizes[cut:]] == drawn[cut:]


def test_epochs_differ_and_shuffle_off_is_in_order():
    sampler = VariableBatchSampler(10, seed=3)
    assert sampler.take(10) != sampler.take(10)
    ordered = VariableBatchSampler(5, shuffle=False)
    with pytest.warns(UserWarning, match="a batch of 7 samples from a dataset of 5: it holds"):
        assert ordered.take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_a_batch_larger_than_the_dataset_is_said_once():
    sampler = VariableBatchSampler(4, weight_fn=lambda i: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler.take(4)  # the whole dataset: nothing repeats
        assert not caught
        sampler.take(6)
        sampler.take(9)
    assert [str(w.message).split(":")[0] for w in caught] == [
        "a batch of 6 samples from a dataset of 4"
    ]


def test_weight_fn_counts_tokens():
    lengths = [5, 1, 7, 3, 2, 8]
    sampler = VariableBatchSampler(6, shuffle=False, weight_fn=lambda i: lengths[i])
    assert sampler.take(10) == [0, 1, 2]  # 5 + 1 + 7 >= 10


def test_state_checks_the_dataset():
    state = VariableBatchSampler(10).state_dict()
    with pytest.raises(ValueError, match="10 samples"):
        VariableBatchSampler(11).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size"):
        VariableBatchSampler(0)


@repeats_allowed
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 300),
    sizes=st.lists(st.integers(4, 120), min_size=1, max_size=30),
    world=st.integers(1, 4),
    seed=st.integers(0, 5),
)
def test_shards_cover_each_global_batch_once_across_ranks(n, sizes, world, seed):
    samplers = [VariableBatchSampler(n, seed=seed) for _ in range(world)]  # one per rank
    seen = []
    for size in sizes:
        parts = [shard_batch(s.take(size), rank, world) for rank, s in enumerate(samplers)]
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        seen += [i for part in parts for i in part]
    assert len({tuple(s.state_dict().items()) for s in samplers}) == 1
    for epoch in range(len(seen) // n):
        assert sorted(seen[epoch * n : (epoch + 1) * n]) == list(range(n))


def test_shard_errors_name_the_value():
    with pytest.raises(ValueError, match="rank must be in"):
        shard_batch([1, 2, 3], 3, 3)
    with pytest.raises(ValueError, match="cannot give each of 4 ranks"):
        shard_batch([1, 2, 3], 0, 4)
    # a batch in tokens of a few long sequences, mid-run: the weight and the fix named
    message = r"a batch of 94 in weight \(weight_fn\) drew 2 samples, fewer than the 3 ranks"
    with pytest.raises(ValueError, match=message + ".*controller's smallest batch"):
        plan_step([0, 1], rank=0, world_size=3, weight_fn=lambda i: 47)


def draw(sampler, sizes):
    """Set each step's batch size before its first micro-batch, as a callback would."""
    it = iter(sampler)
    steps = []
    for size in sizes:
        sampler.batch_size = size
        steps.append([next(it) for _ in range(sampler.micro_batches)])
    return steps


@repeats_allowed
@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(20, 150),
    world=st.integers(1, 4),
    k=st.integers(1, 4),
    sizes=st.lists(st.integers(16, 60), min_size=1, max_size=25),
    cut=st.integers(0, 25),
)
def test_global_batches_are_sharded_exactly_and_resume(n, world, k, sizes, cut):
    from bigbatch.batch import GlobalBatchSampler

    ranks = [
        GlobalBatchSampler(n, 16, micro_batches=k, rank=r, world_size=world, seed=3)
        for r in range(world)
    ]
    per_rank = [draw(s, sizes) for s in ranks]
    reference = VariableBatchSampler(n, seed=3)
    for step, size in enumerate(sizes):
        batch = reference.take(size)
        parts = [mb for r in range(world) for mb in per_rank[r][step]]
        assert [i for mb in parts for i in mb] == batch  # the global batch, each sample once
        counts = [len(mb) for mb in parts]
        assert max(counts) - min(counts) <= 1 and all(c >= 1 for c in counts)
        expected = tuple(tuple(len(mb) for mb in per_rank[r][step]) for r in range(world))
        if step in ranks[0].plans:  # the recent ones are kept
            assert ranks[0].plans[step].rank_sizes == expected
    # resume after `cut` steps: the same micro-batches follow
    cut = min(cut, len(sizes))
    first = GlobalBatchSampler(n, 16, micro_batches=k, world_size=world, seed=3)
    draw(first, sizes[:cut])
    resumed = GlobalBatchSampler(n, 16, micro_batches=k, world_size=world, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert draw(resumed, sizes[cut:]) == per_rank[0][cut:]


def test_global_batch_sampler_ends_at_the_sample_budget_and_checks_sizes():
    from bigbatch.batch import GlobalBatchSampler

    sampler = GlobalBatchSampler(100, 10, micro_batches=2, max_samples=35)
    assert len(sampler) == 36  # an upper bound: every step at the smallest batch (2)
    sampler.min_batch_size = 10
    assert len(sampler) == 8
    assert len(list(sampler)) == 8 and sampler.samples == 40  # the last step may overshoot
    # while an iteration runs, its length counts from its start: a loader's workers draw
    # ahead of the framework that reads it (Lightning ended the epoch short of the budget)
    ahead = GlobalBatchSampler(100, 10, micro_batches=2, max_samples=35)
    ahead.min_batch_size = 10
    drawing = iter(ahead)
    [next(drawing) for _ in range(4)]  # two steps drawn
    assert ahead.samples == 20 and len(ahead) == 8
    drawing.close()
    assert len(ahead) == 4  # between iterations: what is left
    with pytest.raises(ValueError, match="cannot give 4 micro-batches to each of 2 ranks"):
        GlobalBatchSampler(100, 7, micro_batches=4, world_size=2)
    sampler = GlobalBatchSampler(100, 8, micro_batches=4)
    it = iter(sampler)
    next(it)
    sampler.batch_size = 3
    with pytest.raises(ValueError, match="batch_size 3 is below 4"):
        [next(it) for _ in range(4)]


def test_a_used_sampler_loading_another_seeds_state_draws_that_order():
    """A sampler that had drawn (its order cached under its own seed) took the saved
    position in its own order: the resumed batches were another run's."""
    straight = VariableBatchSampler(10, seed=0)
    straight.take(3)
    state = straight.state_dict()
    used = VariableBatchSampler(10, seed=1)
    used.take(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (told: the saved order wins)
        used.load_state_dict(state)
    assert used.take(3) == straight.take(3)


def test_a_global_sampler_resumed_from_a_step_its_loader_drew_past_replays_the_steps_after():
    """A loader's workers draw steps ahead of training: a checkpoint at step 2 of 5 drawn
    redraws steps 2-4 at the sizes they were drawn with, whatever the size is now."""
    from bigbatch.batch import GlobalBatchSampler

    def draw(sampler, sizes):
        it, out = iter(sampler), []
        for size in sizes:
            sampler.batch_size = size
            out.append([next(it) for _ in range(sampler.micro_batches)])
        return out

    first = GlobalBatchSampler(50, 8, micro_batches=2, seed=1)
    steps = draw(first, [8, 12, 16, 10, 14])
    resumed = GlobalBatchSampler(50, 8, micro_batches=2, seed=1)
    resumed.load_state_dict(first.state_dict(step=2))
    assert resumed.samples == 20 and resumed.steps == 2
    assert draw(resumed, [8, 8, 8]) == steps[2:]


def test_a_budget_of_whole_batches_ends_on_it():
    from bigbatch.batch import GlobalBatchSampler

    sampler = GlobalBatchSampler(100, 10, micro_batches=2, max_samples=30)
    assert len(list(sampler)) == 6 and sampler.samples == 30
