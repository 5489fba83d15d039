"""Data sources: what a loop draws and loads, and where it resumes."""

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


def test_an_iterable_that_yields_nothing_is_one_error_naming_it():
    import pytest

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
    import numpy as np

    data = TensorDataset(torch.arange(20.0))
    source, plain = MapSource(data, seed=np.int64(5)), MapSource(data, seed=5)
    assert source.draw(7) == plain.draw(7)
    assert torch.equal(source.state_dict()["loader_rng"], plain.state_dict()["loader_rng"])
