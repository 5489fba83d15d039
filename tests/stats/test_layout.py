"""The parameters a collector watches, grouped, and one step's sub-batches."""

import pytest
import torch

from bigbatch.parallel.world import World
from bigbatch.stats.layout import ParamLayout, SubBatches


def make_layout():
    a, b = torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)
    frozen = torch.zeros(5)  # no gradient: not watched, but its group stays
    c = torch.zeros(3, requires_grad=True)
    return ParamLayout([[a, b], {"params": [frozen, c]}]), (a, b, frozen, c)


def test_trainable_parameters_keep_their_groups():
    layout, (a, b, _, c) = make_layout()
    assert layout.params == [a, b, c] and layout.num_groups == 2
    assert [layout.group_of(i) for i in range(3)] == [0, 0, 1]
    assert layout.owner.tolist() == [0, 0, 1]
    assert layout.owners([0, 2]).tolist() == [0, 1]
    assert layout.owners([0, 2]) is layout.owners([0, 2])  # built once per pattern
    assert layout.owners([0, 1, 2]) is layout.owner
    assert layout.hooked == layout.params


def test_a_parameter_that_starts_to_train_later_is_refused_not_left_out():
    """Unfreezing, or ``add_param_group``: the statistics, and a measured step's finiteness
    check, would leave the new parameters out (a NaN in them reached the model)."""
    layout, (_, _, frozen, _) = make_layout()
    layout.check_unchanged()
    frozen.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"1 frozen parameter\(s\) now require grad"):
        layout.check_unchanged()
    optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    layout = ParamLayout(optimizer.param_groups)
    optimizer.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    with pytest.raises(RuntimeError, match="a param group was added to the optimizer"):
        layout.check_unchanged()


def test_per_group_sums_in_float64():
    layout, _ = make_layout()
    values = [torch.tensor(1.5), torch.tensor(2.0), torch.tensor(-3.0)]
    summed = layout.per_group(values)
    assert summed.dtype == torch.float64 and summed.tolist() == [3.5, -3.0]
    assert layout.per_group(values, square=True).tolist() == [6.25, 9.0]


def test_grads_are_zeros_where_a_parameter_has_none():
    layout, (a, b, _, c) = make_layout()
    b.grad = torch.ones(4)
    grads = layout.grads()
    assert [g.shape for g in grads] == [a.shape, b.shape, c.shape]
    assert grads[1] is b.grad and not grads[0].any() and not grads[2].any()


def test_hooks_go_on_the_source_of_a_sharded_parameter():
    shard, whole = torch.zeros(2, requires_grad=True), torch.zeros(4, requires_grad=True)
    other = torch.zeros(3, requires_grad=True)
    layout = ParamLayout([[shard, other]], sources={id(shard): whole})
    assert layout.params == [shard, other] and layout.hooked == [whole, other]


def test_no_trainable_parameter_is_an_error():
    with pytest.raises(ValueError, match="at least one trainable parameter"):
        ParamLayout([[torch.zeros(3)]])


def test_parameters_not_in_groups_are_refused():
    """A flat list was read as groups of each parameter's rows: views that never get a
    gradient, so the statistics came out 0 and NaN without a word."""
    weight, bias = torch.nn.Linear(3, 2).parameters()
    for flat in ([weight, bias], (p for p in (weight, bias)), weight):
        with pytest.raises(TypeError, match="must be groups of parameters"):
            ParamLayout(flat)
    assert ParamLayout(p for p in [[weight, bias]]).params == [weight, bias]


def test_sub_batches_on_one_process():
    batches = SubBatches([3, 5, 2, 6, 4], [[3, 5, 2, 6, 4]], [0.15, 0.25, 0.1, 0.3, 0.2], World())
    assert batches.total == 20 and batches.all_sizes == [3, 5, 2, 6, 4]
    assert batches.half == 2
    assert not batches.last
    batches.current = 4
    assert batches.last


def test_sub_batches_under_ddp_split_the_ranks():
    world = World(rank=1, size=4)  # no process group is needed to describe one
    rank_sizes = [[4, 4], [3, 5], [6], [2, 2]]
    batches = SubBatches([3, 5], rank_sizes, [3 / 26, 5 / 26], world, current=1)
    assert batches.total == 26 and batches.all_sizes == [4, 4, 3, 5, 6, 2, 2]
    assert batches.last
