"""Data sources: what a loop draws and loads, and where it resumes."""

import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from bigbatch.batch.source import IterableSource, MapSource, make_source


def test_map_source_loads_the_planned_micro_batches_and_resumes():
    data = TensorDataset(torch.arange(20.0))
    source = MapSource(data, seed=1)
    drawn = source.draw(6)
    assert len(set(drawn)) == 6
    loaded = [b[0].tolist() for b in source.load([drawn[:2], drawn[2:]])]
    assert loaded == [[float(i) for i in drawn[:2]], [float(i) for i in drawn[2:]]]
    state = source.state_dict()
    expected = source.draw(9)
    again = MapSource(data, seed=1)
    again.load_state_dict(state)
    assert again.draw(9) == expected


class Counting(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor(float(i)) for i in range(5))


def test_iterable_source_restarts_a_finite_stream_and_skips_on_resume():
    source = IterableSource(Counting())
    with pytest.warns(UserWarning, match="a batch of 7 samples from a dataset of 5"):
        positions = source.draw(7)  # runs past the end: the stream starts again
    assert positions == list(range(7))
    assert [b.tolist() for b in source.load([[0, 1, 2, 3, 4], [5, 6]])] == [
        [0.0, 1.0, 2.0, 3.0, 4.0],
        [0.0, 1.0],
    ]
    resumed = IterableSource(Counting())
    resumed.load_state_dict(source.state_dict())
    resumed.draw(2)
    assert [b.tolist() for b in resumed.load([[0, 1]])] == [[2.0, 3.0]]


def test_a_batch_within_one_pass_of_a_stream_is_not_warned_of_repeats():
    source = IterableSource(Counting())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.draw(3)
        source.draw(5)  # across the restart (3, 4, 0, 1, 2): each sample once


def test_an_iterable_that_yields_nothing_is_one_error_naming_it():
    class Empty(IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(ValueError, match="the iterable dataset Empty yielded no samples"):
        IterableSource(Empty()).draw(4)


def test_make_source_picks_by_kind_and_refuses_weights_on_a_stream():
    import pytest

    assert isinstance(
        make_source(Counting(), shuffle=True, seed=0, weight_fn=None, loader_options={}),
        IterableSource,
    )
    with pytest.raises(ValueError, match="weight_fn needs a map-style dataset"):
        make_source(Counting(), shuffle=True, seed=0, weight_fn=len, loader_options={})


def test_a_loader_option_dataloader_does_not_take_is_refused_before_the_first_step():
    """``loader_options={'bogus': 1}`` failed inside ``DataLoader`` at the first step."""
    import pytest

    import bigbatch as bb

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(20.0))
    with pytest.raises(
        TypeError, match=r"\['num_worker'\] is not a DataLoader keyword; did you mean"
    ):
        bb.AdaptiveBatch(model, optimizer, data, loader_options={"num_worker": 2})
    with pytest.raises(TypeError, match=r"loader_options\['batch_size'\]: the loop sets it"):
        bb.AdaptiveBatch(model, optimizer, data, loader_options={"batch_size": 8})
    # an iterable dataset is read in order in this process: a worker option would do nothing
    with pytest.warns(UserWarning, match="loader_options pin_memory are not used") as caught:
        bb.AdaptiveBatch(model, optimizer, Counting(), loader_options={"pin_memory": True})
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_a_numpy_integer_seed_seeds_the_loader_as_its_int_does():
    """``seed=np.int64(5)`` (``for seed in np.arange(3)``): the sampler took it, the loader's
    generator raised a bare ``TypeError``."""
    data = TensorDataset(torch.arange(20.0))
    source, plain = MapSource(data, seed=np.int64(5)), MapSource(data, seed=5)
    assert source.draw(7) == plain.draw(7)
    assert torch.equal(source.state_dict()["loader_rng"], plain.state_dict()["loader_rng"])


class Augmented(torch.utils.data.Dataset):
    """Each read a random draw: the sample's index plus noise from torch's generator."""

    def __len__(self):
        return 40

    def __getitem__(self, index):
        return index + torch.rand(())


def _reads(source, steps):
    out = []
    for _ in range(steps):
        drawn = source.draw(6)
        out += [b.clone() for b in source.load([drawn[:4], drawn[4:]])]
    return out


class AugmentedBy(Augmented):
    """Augmented's noise drawn from Python's ``random`` or numpy's global generator."""

    def __init__(self, draw):
        self.draw = draw

    def __getitem__(self, index):
        return index + torch.tensor(self.draw(), dtype=torch.float32)


def _python_draw():
    return random.random()


def _numpy_draw():
    return float(np.random.rand())


@pytest.mark.parametrize(
    "draw", [None, _python_draw, _numpy_draw], ids=["torch", "random", "numpy"]
)
def test_persistent_workers_read_alike_after_a_resume(draw):
    """Persistent workers were seeded once and carried their random state on, unsaved: a
    resumed loop's augmentations (and parameters) differed from an uninterrupted one's,
    whichever generator the dataset draws from."""
    options = {"num_workers": 2, "persistent_workers": True}
    make = Augmented if draw is None else lambda: AugmentedBy(draw)
    source = MapSource(make(), seed=3, loader_options=options)
    _reads(source, 2)
    state = source.state_dict()
    expected = _reads(source, 2)
    resumed = MapSource(make(), seed=3, loader_options=options)
    resumed.load_state_dict(state)
    got = _reads(resumed, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_each_ranks_workers_draw_augmentations_of_their_own():
    """Under DDP every rank's loader generator is alike: with workers, the j-th sample of a
    micro-batch got the same random draw on every rank (num_workers=0 drew apart)."""
    options = {"num_workers": 2}
    ranks = [MapSource(Augmented(), seed=3, loader_options=options) for _ in range(2)]
    drawn = [source.draw(8) for source in ranks]
    noise = [
        [b - torch.tensor(indices[:4] if i == 0 else indices[4:]) for i, b in enumerate(
            source.load([indices[:4], indices[4:]], rank=rank))]
        for rank, (source, indices) in enumerate(zip(ranks, drawn, strict=True))
    ]  # fmt: skip
    assert not any(torch.equal(a, b) for a, b in zip(*noise, strict=True))
    again = MapSource(Augmented(), seed=3, loader_options=options)  # rank 1 again: the same
    indices = again.draw(8)
    rows = list(again.load([indices[:4], indices[4:]], rank=1))
    assert all(torch.equal(a - torch.tensor(i), b) for a, i, b in
               zip(rows, (indices[:4], indices[4:]), noise[1], strict=True))  # fmt: skip


def test_a_dropped_loop_ends_its_persistent_workers_at_once():
    """A cycle (the source and its loader's batch sampler; a loop and its last step) kept a
    dropped loop's workers alive until a garbage collection."""
    import gc
    import multiprocessing

    import bigbatch as bb

    def run():
        model = torch.nn.Linear(1, 1)
        loop = bb.AdaptiveBatch(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TensorDataset(torch.randn(32, 1)),
            controller=bb.batch.Constant(8),
            loader_options={"num_workers": 1, "persistent_workers": True},
        )
        for step in loop.steps(max_steps=2):
            for (x,) in step.micro_batches():
                step.backward(model(x).square().mean())
            step.apply()
        assert set(multiprocessing.active_children()) - before

    # torch imports dynamo at the first optimizer a process makes, and that import keeps the
    # frames that called it (run's: the loop) alive: made here first. A pytest worker may
    # hold other tests' processes (the clusters of tests/parallel)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    before = set(multiprocessing.active_children())
    gc.disable()
    try:
        run()
        assert set(multiprocessing.active_children()) <= before
    finally:
        gc.enable()


class _Opened(torch.utils.data.Dataset):
    handle = None

    def open(self):
        self.handle = "open"

    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.tensor(float(index)) if self.handle == "open" else torch.tensor(-1.0)


def _open_in_the_worker(_):
    torch.utils.data.get_worker_info().dataset.open()


def _set_in_the_worker(_):  # torch's recipe: the handle set on the dataset itself
    dataset = torch.utils.data.get_worker_info().dataset
    assert isinstance(dataset, _Opened)
    dataset.handle = "open"


@pytest.mark.parametrize("init", [_open_in_the_worker, _set_in_the_worker])
def test_a_worker_init_fn_reaches_the_users_dataset(init):
    """The loop reads through a wrapper of the dataset (seeded reads): a ``worker_init_fn``
    that opens the user's dataset (``get_worker_info().dataset``) must still find it, and
    an attribute it sets there be what the reads see."""
    options = {"num_workers": 1, "worker_init_fn": init}
    source = MapSource(_Opened(), seed=0, loader_options=options)
    drawn = source.draw(4)
    (batch,) = source.load([drawn])
    assert sorted(batch.tolist()) == sorted(float(i) for i in drawn)


class Hundred(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor(float(i)) for i in range(100))


def test_a_used_iterable_source_loading_a_state_reads_on_from_that_state():
    """The stream it had read further (to 15) was kept: after loading the state at 10 it
    read 15, 16, 17."""
    source = IterableSource(Hundred())
    source.draw(10)
    source.load([list(range(10))])
    state = source.state_dict()
    source.draw(5)
    source.load([list(range(5))])
    source.load_state_dict(state)
    source.draw(3)
    assert [b.tolist() for b in source.load([[0, 1, 2]])] == [[10.0, 11.0, 12.0]]
