import numpy as np

from bigbatch.experiments import tasks


def test_mnist1d_is_generated_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path))
    # 2,000 samples: the task's 50,000 take half a minute to generate on two cores
    first = tasks.mnist1d_arrays(samples=2_000)
    assert first["x"].shape == (1_600, 40) and first["x_test"].shape == (400, 40)
    assert sorted(np.unique(first["y"])) == list(range(10))
    assert len(list(tmp_path.glob("mnist1d-*.npz"))) == 1
    again = tasks.mnist1d_arrays(samples=2_000)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_markov_language_entropy_is_the_loss_floor():
    transition, floor = tasks.markov_language(vocab=4, alpha=1.0, seed=0)
    rows = transition.sum(1)
    assert np.allclose(rows.numpy(), 1.0)
    assert 0 < floor < np.log(4)
