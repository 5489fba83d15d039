"""Flower: the ClientApp helper, the strategy wrapper and the in-process grid, through
Flower's own FedAvg and message types (no Ray)."""

import logging
import math
import random

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from bigbatch.batch import BatchWarmup  # noqa: E402
from bigbatch.federated import ControllerScheme, Fixed, RoundPlan, RoundPlanner  # noqa: E402
from bigbatch.integrations.flower import (  # noqa: E402
    AdaptiveBatchStrategy,
    ClientSetup,
    InProcessGrid,
    client_app,
    plan_from_config,
    train_round,
)

logging.getLogger("flwr").setLevel(logging.ERROR)


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def data(n, seed, noise=0.1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + noise * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def setup_for(dataset, seed=0, momentum=0.0):
    torch.manual_seed(seed)
    return ClientSetup(
        nn.Linear(4, 1),
        dataset,
        mse,
        lambda params: torch.optim.SGD(params, lr=1.0, momentum=momentum),
        min_sub_batches=2,
        seed=seed,
    )


def plan(batch=8, steps=3, lr=0.05):
    return RoundPlan(round=1, local_batch=batch, local_steps=steps, lr=lr, clients=1)


def test_a_round_trains_its_steps_at_the_plans_batch_and_measures_each():
    setup = setup_for(data(256, 0))
    report = train_round(setup, plan(batch=16, steps=5))
    assert report.samples == 80
    assert list(report.batches) == [16] * 5
    assert len(report.grad_sq_norm) == len(report.trace) == len(report.similarity) == 5
    assert all(math.isfinite(v) and v > 0 for v in report.grad_sq_norm)
    assert all(math.isfinite(v) and v >= 0 for v in report.trace)
    assert math.isfinite(report.loss)


def test_a_round_steps_at_the_plans_rate():
    """Identical samples: every draw has the same gradient, so one SGD step is known."""
    x = torch.ones(64, 4)
    dataset = TensorDataset(x, torch.zeros(64, 1))
    setup = setup_for(dataset)
    before = [p.detach().clone() for p in setup.model.parameters()]
    setup.model.zero_grad()
    mse(setup.model, (x[:8], torch.zeros(8, 1))).backward()
    grads = [p.grad.clone() for p in setup.model.parameters()]
    setup.model.zero_grad()
    train_round(setup, plan(batch=8, steps=1, lr=0.125))
    for p, b, g in zip(setup.model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), b - 0.125 * g)


def test_a_round_keeps_each_param_groups_ratio_to_the_optimizers_rate():
    # a group built at 10x the optimizer's rate had trained at the round's rate, as the rest
    x = torch.ones(64, 4)
    setup = setup_for(TensorDataset(x, torch.zeros(64, 1)))
    model = setup.model
    setup.make_optimizer = lambda params: torch.optim.SGD(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": 10.0}], lr=1.0
    )
    before = [p.detach().clone() for p in model.parameters()]
    mse(model, (x[:8], torch.zeros(8, 1))).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    train_round(setup, plan(batch=8, steps=1, lr=0.125))
    for p, b, g, lr in zip(model.parameters(), before, grads, (0.125, 1.25)):
        torch.testing.assert_close(p.detach(), b - lr * g)


def test_each_round_draws_a_fresh_order_of_the_clients_data():
    def first_batch(round_):
        setup = setup_for(data(64, 0))
        seen = []
        loss = setup.loss_fn

        def recording(model, batch):
            seen.append(batch[0].clone())
            return loss(model, batch)

        setup.loss_fn = recording
        train_round(setup, RoundPlan(round_, 8, 1, 0.0, 1))
        return torch.cat(seen)

    assert torch.equal(first_batch(1), first_batch(1))
    assert not torch.equal(first_batch(1), first_batch(2))


def federation(
    scheme, clients=3, local_samples=32, lr=0.05, fail=None, noise=0.1, made=None, **base
):
    datasets = [data(128 + 32 * i, 10 + i, noise) for i in range(clients)]
    setups = {}
    failing = fail if isinstance(fail, (set, frozenset)) else {fail}

    def make(context):
        part = int(context.node_config["partition-id"])
        if made is not None:
            made.append(part)
        if part in failing:
            raise RuntimeError("this client's device is gone")
        setups[part] = setup_for(datasets[part], seed=part)
        return setups[part]

    planner = RoundPlanner(
        scheme, clients=clients, local_samples=local_samples, lr=lr, total_samples=10**6
    )
    strategy = AdaptiveBatchStrategy(
        planner, FedAvg(**{"fraction_evaluate": 0.0, "min_available_nodes": clients, **base})
    )
    grid = InProcessGrid(client_app(make), clients)
    torch.manual_seed(0)
    initial = ArrayRecord(nn.Linear(4, 1).state_dict())
    return strategy, grid, initial, setups


def test_fedavg_weighs_the_clients_by_their_data_and_the_history_records_each_round():
    strategy, grid, initial, setups = federation(Fixed(8))
    result = strategy.start(grid, initial, num_rounds=1)
    merged = result.arrays.to_torch_state_dict()
    sizes = torch.tensor([len(s.dataset) for s in setups.values()], dtype=torch.float32)
    assert sizes.unique().numel() == 3  # unequal, so the weighting is seen
    for key, value in merged.items():
        stacked = torch.stack([s.model.state_dict()[key] for s in setups.values()])
        weights = (sizes / sizes.sum()).view(-1, *[1] * (stacked.dim() - 1))
        torch.testing.assert_close(value, (stacked * weights).sum(0))
    (record,) = strategy.history
    assert (record["local_batch"], record["local_steps"], record["global_batch"]) == (8, 4, 24)
    assert record["samples"] == 3 * 32
    assert record["clients_trained"] == 3
    assert math.isfinite(record["noise_scale"]) and record["noise_scale"] > 0
    assert result.train_metrics_clientapp[1]["bigbatch.local_batch"] == 8


def test_a_failing_client_is_an_error_reply_and_the_round_goes_on_without_it():
    strategy, grid, initial, _ = federation(Fixed(8), fail=1)
    strategy.start(grid, initial, num_rounds=2)
    assert [r["clients_trained"] for r in strategy.history] == [2, 2]
    assert len(grid.failures) == 2 and "this client's device is gone" in grid.failures[0]
    assert strategy.history[-1]["samples"] == 2 * 2 * 32


def test_a_failing_client_does_not_move_the_adaptive_batch():
    quiet = ControllerScheme(BatchWarmup(multiple=0.25, initial=12, min=12, window=4), clients=3)
    strategy, grid, initial, _ = federation(quiet, local_samples=64, fail=2)
    strategy.start(grid, initial, num_rounds=2)
    assert [r["local_batch"] for r in strategy.history] == [4, 4]


def test_the_controller_grows_the_local_batch_on_noisy_clients_and_steps_fall():
    noisy = ControllerScheme(BatchWarmup(multiple=0.25, initial=12, min=12, window=4), clients=3)
    strategy, grid, initial, _ = federation(noisy, local_samples=64, noise=30.0)
    strategy.start(grid, initial, num_rounds=3)
    batches = [r["local_batch"] for r in strategy.history]
    steps = [r["local_steps"] for r in strategy.history]
    assert batches[0] == 4 and batches[-1] > batches[0]
    assert steps[-1] < steps[0]
    # the rate follows the batch by the linear rule from the starting batch
    last = strategy.history[-1]
    assert last["lr"] == pytest.approx(0.05 * last["local_batch"] / 4)


def test_two_simulations_with_one_seed_are_identical():
    def history():
        random.seed(0)  # Flower samples (and so orders) the round's clients with it
        strategy, grid, initial, _ = federation(
            ControllerScheme(BatchWarmup(multiple=0.25, initial=12, min=12, window=4), clients=3),
            noise=30.0,
        )
        strategy.start(grid, initial, num_rounds=2)
        return strategy.history

    assert history() == history()


def test_a_train_message_without_a_plan_is_refused_naming_the_keys():
    with pytest.raises(KeyError, match=r"bigbatch\.local_batch"):
        plan_from_config({"bigbatch.round": 1})


def test_the_example_flower_app_runs_its_server_app_on_the_in_process_grid():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "flower_app.py"
    spec = importlib.util.spec_from_file_location("flower_app", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    context = example.run_here(clients=2, rounds=2, local_samples=64)
    assert len(context.state["history"]["local_batch"]) == 2


def test_every_client_starts_each_round_from_the_global_model(monkeypatch):
    """A client that trained on from its own last round's model (not the server's merge)
    passed every other test here: FedAvg's merge was checked against what clients ended
    with, whatever they started from."""
    from bigbatch.integrations import flower

    starts: dict[int, list] = {}

    def recording(setup, plan):
        starts.setdefault(plan.round, []).append(
            {k: v.clone() for k, v in setup.model.state_dict().items()}
        )
        return train_round(setup, plan)

    monkeypatch.setattr(flower, "train_round", recording)
    strategy, grid, initial, _ = federation(Fixed(8))
    strategy.start(grid, initial, num_rounds=2)
    first = initial.to_torch_state_dict()
    for start in starts[1]:  # each client's own initial model is another (seeded apart)
        assert all(torch.equal(start[k], first[k]) for k in first)
    merged = starts[2][0]
    assert not all(torch.equal(merged[k], first[k]) for k in first)
    for start in starts[2][1:]:
        assert all(torch.equal(start[k], merged[k]) for k in merged)


def test_a_default_setup_trains_a_local_batch_below_its_fewest_sub_batches():
    """A local batch of 2 (the planner allows it) under the default micro-batch count."""
    setup = ClientSetup(
        nn.Linear(4, 1), data(64, 0), mse, lambda params: torch.optim.SGD(params, lr=0.1)
    )
    report = train_round(setup, plan(batch=2, steps=3))
    assert list(report.batches) == [2] * 3 and math.isfinite(report.loss)


def test_a_round_whose_pooled_gradient_norm_is_not_positive_has_no_noise_scale():
    """|G|² is estimated without bias, so below the noise it comes out negative (a client
    reported -1.08): a negative or infinite B_simple would steer the planner."""
    from bigbatch.integrations.flower import _pooled_noise

    for sq in (-1.08, 0.0):
        pooled = [{"grad_sq_norm": sq, "trace": 2.0, "similarity": 0.1}] * 2
        assert math.isnan(_pooled_noise(pooled)["noise_scale"])
    pooled = [{"grad_sq_norm": 0.5, "trace": 2.0, "similarity": 0.1}]
    assert _pooled_noise(pooled)["noise_scale"] == 4.0


def test_each_node_is_set_up_once_for_the_whole_run():
    made = []
    strategy, grid, initial, _ = federation(Fixed(8), made=made)
    strategy.start(grid, initial, num_rounds=2)
    assert sorted(made) == [0, 1, 2]


def test_a_round_in_which_every_client_fails_leaves_the_plan_as_it_was():
    strategy, grid, initial, _ = federation(Fixed(8), clients=2, fail={0, 1})
    result = strategy.start(grid, initial, num_rounds=2)
    assert strategy.history == [] and strategy.planner.samples == 0
    assert len(grid.failures) == 4
    merged = result.arrays.to_torch_state_dict()
    assert all(torch.equal(v, initial.to_torch_state_dict()[k]) for k, v in merged.items())


def test_a_round_trains_a_model_its_evaluation_left_in_eval_mode():
    """Dropout off in a round's training: the model as the last evaluation left it."""
    setup = setup_for(data(64, 0))
    setup.model.eval()
    modes, loss = [], setup.loss_fn

    def recording(model, batch):
        modes.append(model.training)
        return loss(model, batch)

    setup.loss_fn = recording
    train_round(setup, plan(batch=8, steps=2))
    assert modes and all(modes)


def test_an_evaluation_asked_of_a_client_without_one_is_an_error_reply_naming_it():
    strategy, grid, initial, _ = federation(Fixed(8), clients=2, fraction_evaluate=1.0)
    strategy.start(grid, initial, num_rounds=1)
    assert len(strategy.history) == 1 and len(grid.failures) == 2
    assert all("has no evaluate function" in why for why in grid.failures)
