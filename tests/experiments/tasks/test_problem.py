"""A task's record: its learning rate per optimizer family and whether a run reached its target."""

import pytest

from bigbatch.experiments.tasks import Task


def make_task(**fields):
    defaults = {
        "name": "toy",
        "summary": "",
        "size": "",
        "expected": "",
        "target": 0.9,
        "lrs": {"adam": 1e-3, "adam/held": 4e-3, "sgd": 0.1, "sgd/held": 0.4},
        "max_samples": 1000,
        "width": 8,
        "depth": 1,
        "build": lambda config: None,
    }
    return Task(**{**defaults, **fields})


def test_a_family_without_a_measured_rate_takes_the_adam_one():
    task = make_task()
    assert (task.lr("sgd", held=False), task.lr("sgd", held=True)) == (0.1, 0.4)
    assert (task.lr("lars", held=False), task.lr("lars", held=True)) == (1e-3, 4e-3)


def test_an_optimizer_measured_by_name_takes_its_own_rate_before_its_familys():
    task = make_task(lrs={"adam": 1e-3, "sgd": 0.1, "vr-sgd": 1.0, "vr-sgd/held": 4.0})
    assert task.lr("vr-sgd", held=False) == 1.0
    assert task.lr("vr-sgd", held=True) == 4.0
    assert task.lr("vr-momentum", held=False) == 0.1  # the family's


def test_a_task_without_an_adam_rate_names_the_optimizer_it_cannot_serve():
    task = make_task(lrs={"sgd": 0.1})
    with pytest.raises(KeyError, match="no rate for 'lamb'"):
        task.lr("lamb", held=False)


@pytest.mark.parametrize(
    "metric, target, row, reached",
    [
        ("eval_accuracy", 0.9, {"eval_accuracy": 0.9}, True),
        ("eval_accuracy", 0.9, {"eval_accuracy": 0.89}, False),
        ("eval_loss", 2.0, {"eval_loss": 1.9}, True),
        ("eval_loss", 2.0, {"eval_loss": 2.1}, False),
        ("eval_loss", 2.0, {"eval_accuracy": 1.0}, False),  # the metric was not evaluated
    ],
)
def test_an_accuracy_is_reached_from_below_a_loss_from_above(metric, target, row, reached):
    task = make_task(target_metric=metric, target=target)
    assert task.lower_is_better == (metric == "eval_loss")
    assert task.reached(row) is reached
