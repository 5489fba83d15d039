import numpy as np
import pytest
import torch

from bigbatch.experiments import tasks
from bigbatch.experiments.build import build
from bigbatch.experiments.config import ConfigError, resolve


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


@pytest.mark.parametrize("name", ["digits", "teacher"])
def test_train_samples_keeps_the_first_samples_and_scores_the_gap_on_them(name):
    config = resolve({"task": name, "train_samples": 300})
    config = {**config, "model.width": 8, "model.depth": 1}
    problem = tasks.TASKS[name].build(config)
    full = tasks.TASKS[name].build({**config, "train_samples": 0})
    assert len(problem.train) == 300
    assert all(torch.equal(a, b) for a, b in zip(problem.train[:300], full.train[:300]))
    assert all(torch.equal(a, b) for a, b in zip(problem.test, full.test))  # the same test set
    if problem.evaluate_train is not None:  # train accuracy over exactly the kept samples
        model = problem.model
        x, y = problem.train.tensors
        expected = (model(x).argmax(1) == y).float().mean().item()
        assert problem.evaluate_train(model)["eval_accuracy"] == pytest.approx(expected)


def test_more_train_samples_than_the_task_has_is_one_error():
    config = resolve({"task": "digits", "train_samples": 5000})
    with pytest.raises(ConfigError, match=r"train_samples = 5000 is more than the task's 1,437"):
        build(config)
