"""A Flower app whose clients train adaptive local batches, runnable here or under ``flwr run``.

    python examples/flower_app.py            # 4 clients in this process, no Ray

``client`` (a ``ClientApp``) and ``server`` (a ``ServerApp``) are ordinary
Flower apps: name them in a Flower project's ``pyproject.toml``
(``serverapp = "flower_app:server"``, ``clientapp = "flower_app:client"``)
and ``flwr run`` deploys them on real nodes, each node reading its
``partition-id`` from its node config. Run as a script, the ServerApp's main
is called with bigbatch's ``InProcessGrid``, which hands each message to the
ClientApp in this process. The lines marked ``# bigbatch`` are what a plain
FedAvg app changes. Each client holds a non-IID share of a synthetic
teacher-student task (most of its samples from two of the ten classes); the
server grows the local batch when the clients' pooled noise scale says the
global batch may grow, and scales the SGD rate with it. About 15 s on one
CPU core.
"""

import logging

import torch
from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.utils.data import TensorDataset

from bigbatch.batch import BatchWarmup
from bigbatch.batch.lr import warmup_cosine
from bigbatch.federated import ControllerScheme, RoundPlanner
from bigbatch.integrations.flower import (
    AdaptiveBatchStrategy,
    ClientSetup,
    InProcessGrid,
    client_app,
)

CLASSES, DIMS = 10, 32


def teacher_student(n: int, seed: int = 0) -> TensorDataset:
    """Inputs from N(0, I), labels from a fixed random linear teacher (the same for all)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(DIMS, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, DIMS, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(1))


def client_share(partition: int, partitions: int, n: int = 4_000) -> TensorDataset:
    """A non-IID share: 80% of the samples from two classes of the partition's own."""
    x, y = teacher_student(20 * n, seed=100 + partition).tensors
    own = (y == (2 * partition) % CLASSES) | (y == (2 * partition + 1) % CLASSES)
    rows = torch.cat([torch.nonzero(own)[: int(0.8 * n), 0], torch.nonzero(~own)[: n // 5, 0]])
    return TensorDataset(x[rows], y[rows])


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIMS, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def loss(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(net(x), y)


def setup(context: Context) -> ClientSetup:  # bigbatch: what one client trains
    part = int(context.node_config["partition-id"])
    parts = int(context.node_config["num-partitions"])
    return ClientSetup(
        model(),
        client_share(part, parts),
        loss,
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        min_sub_batches=2,
        seed=part,
    )


client = client_app(setup)  # bigbatch: the ClientApp trains each round's plan
server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    clients = int(context.run_config.get("clients", 4))
    rounds = int(context.run_config.get("rounds", 15))
    local_samples = int(context.run_config.get("local-samples", 1024))
    total = clients * rounds * local_samples
    planner = RoundPlanner(  # bigbatch: each round's local batch and rate
        ControllerScheme(BatchWarmup(initial=clients * 8, min=clients * 8), clients),
        clients=clients,
        local_samples=local_samples,
        lr=0.05,
        lr_scaling="linear",
        total_samples=total,
        schedule=warmup_cosine(total, total // 20),
    )
    fedavg = FedAvg(fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients)
    strategy = AdaptiveBatchStrategy(planner, fedavg)  # bigbatch: wraps FedAvg
    test = teacher_student(5_000, seed=7)
    scorer = model()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        scorer.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            accuracy = (scorer(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean()
        return MetricRecord({"accuracy": accuracy.item()})

    result = strategy.start(
        grid, ArrayRecord(model().state_dict()), num_rounds=rounds, evaluate_fn=evaluate
    )
    for record in strategy.history:
        accuracy = result.evaluate_metrics_serverapp[record["round"]]["accuracy"]
        print(
            f"round {record['round']:2d}  local batch {record['local_batch']:4d}  "
            f"steps {record['local_steps']:3d}  lr {record['lr']:.3f}  "
            f"noise scale {record['noise_scale']:7.1f}  accuracy {accuracy:.3f}"
        )
    context.state["history"] = MetricRecord(
        {"local_batch": [r["local_batch"] for r in strategy.history]}
    )


def run_here(clients: int = 4, rounds: int = 15, local_samples: int = 1024) -> Context:
    """The ServerApp with an in-process grid of ``clients`` ClientApps; returns its context."""
    logging.getLogger("flwr").setLevel(logging.ERROR)
    config = {"clients": clients, "rounds": rounds, "local-samples": local_samples}
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    server(InProcessGrid(client, clients, run_config=config), context)
    return context


if __name__ == "__main__":
    run_here()
