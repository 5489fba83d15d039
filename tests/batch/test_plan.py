import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigbatch.batch import micro_batch_sizes, split_by_weight


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 100_000), micro=st.integers(1, 4096), minimum=st.integers(1, 16))
def test_any_batch_is_realised_exactly(batch, micro, minimum):
    if batch < minimum:
        with pytest.raises(ValueError, match="min_sub_batches"):
            micro_batch_sizes(batch, max_micro_batch=micro, min_sub_batches=minimum)
        return
    sizes = micro_batch_sizes(batch, max_micro_batch=micro, min_sub_batches=minimum)
    assert sum(sizes) == batch
    assert len(sizes) >= minimum
    assert max(sizes) - min(sizes) <= 1
    assert max(sizes) <= micro or len(sizes) == minimum
    assert min(sizes) >= 1


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 500), min_size=4, max_size=200), micro=st.integers(50, 5000))
def test_weighted_split_covers_every_sample_in_order(weights, micro):
    counts = split_by_weight(weights, max_micro_batch=micro, min_sub_batches=4)
    assert sum(counts) == len(weights)
    assert len(counts) >= 4 and min(counts) >= 1
    starts = [sum(counts[:i]) for i in range(len(counts))]
    parts = [weights[s : s + c] for s, c in zip(starts, counts)]
    # the cap holds, but for a sample heavier than it alone (equal-weight goals alone
    # put two samples of 2 over a cap of 3)
    assert all(sum(part) <= micro or len(part) == 1 for part in parts)


def test_weighted_split_keeps_the_cap_where_the_weights_do_not_divide_evenly():
    assert split_by_weight([2] * 5, max_micro_batch=3, min_sub_batches=1) == [1] * 5
    assert split_by_weight([2] * 6, max_micro_batch=4, min_sub_batches=1) == [2, 2, 2]


def test_weighted_split_balances_tokens():
    counts = split_by_weight([10] * 40 + [40] * 10, max_micro_batch=1000, min_sub_batches=4)
    assert counts == [20, 20, 5, 5]


def test_plan_step_shards_then_splits_every_rank_into_the_same_count():
    from bigbatch.batch import plan_step

    indices = list(range(101))
    plans = [
        plan_step(indices, rank=r, world_size=3, max_micro_batch=10, min_sub_batches=2)
        for r in range(3)
    ]
    assert all(p.rank_sizes == plans[0].rank_sizes for p in plans)
    counts = {len(sizes) for sizes in plans[0].rank_sizes}
    assert counts == {4}  # the 34-sample shard needs 4 parts of <= 10
    drawn = [i for p in plans for mb in p.micro_batches for i in mb]
    assert drawn == indices  # each sample once, in order
    assert plans[0].batch_size == 101


def test_loss_weights_make_grad_the_sample_mean_after_ranks_average():
    from bigbatch.batch import StepPlan, loss_weights

    plan = StepPlan(((3, 2), (3, 2)), rank=1)
    assert plan.loss_weights() == [2 * 3 / 10, 2 * 2 / 10]
    # summed over ranks and divided by W, the weights of all micro-batches sum to 1
    assert sum(plan.loss_weights()) * 2 / 2 == 1.0
    assert loss_weights([4, 4], 8, 1, "sum") == [1 / 8, 1 / 8]


def test_a_fixed_count_with_weights_places_boundaries_by_weight():
    from bigbatch.batch import plan_step

    plan = plan_step(list(range(6)), count=2, weight_fn=lambda i: 10 if i == 0 else 1)
    assert plan.rank_sizes == ((10, 5),) and plan.micro_batches == ((0,), (1, 2, 3, 4, 5))


def test_a_heavy_draw_of_fewer_samples_than_sub_batches_is_split_as_far_as_it_goes():
    """A batch counted in weight may draw fewer samples than ``min_sub_batches``: each
    sample its own micro-batch (it raised, naming an option the user never set)."""
    from bigbatch.batch import plan_step

    plan = plan_step([0, 1, 2], min_sub_batches=4, weight_fn=lambda i: 11)
    assert plan.rank_sizes == ((11, 11, 11),) and plan.micro_batches == ((0,), (1,), (2,))
    assert plan_step([7], min_sub_batches=4, weight_fn=lambda i: 50).rank_sizes == ((50,),)


def test_a_summed_losss_weights_are_the_ranks_over_the_batch():
    from bigbatch.batch.plan import loss_weights

    # DDP averages over W ranks: W / B makes .grad the batch's mean (1 / B: W times small)
    assert loss_weights([4, 4], 16, 2, "sum") == [2 / 16, 2 / 16]
    assert loss_weights([4, 4], 16, 2) == [2 * 4 / 16, 2 * 4 / 16]
