"""A federated simulation on one machine (``bigbatch federated``): Flower's FedAvg with
bigbatch's local batches, on IID or non-IID splits of a classification task.

Each round each client (an even random part of the training set, or Dirichlet(α) shares
per class: Hsu et al. 2019) trains ``local_samples`` with momentum SGD at the round's local
batch; the server (:class:`~bigbatch.integrations.flower.AdaptiveBatchStrategy`) averages,
scores and chooses the next local batch (``fixed``, ``switch`` or ``adaptive``).
Writes ``rounds.jsonl``, ``summary.json`` and ``report.md``; docs/federated.md.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ..batch.controllers import BatchWarmup
from ..batch.lr import warmup_cosine
from ..federated import ControllerScheme, Fixed, RoundPlanner, Scheme, SmallLargeSwitch
from .config import ConfigError
from .device import set_threads
from .launch import WorkerFailedError
from .options import FederatedSettings
from .plan import plan_run
from .report.rounds import render


def split_indices(
    labels: np.ndarray, clients: int, kind: str, alpha: float, seed: int
) -> list[list[int]]:
    """The training set's indices per client: an even random split (``iid``) or, per class,
    Dirichlet(α) shares (``dirichlet``). Every client gets at least one sample."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    if kind == "iid":
        order = rng.permutation(n)
        return [sorted(order[i::clients].tolist()) for i in range(clients)]
    parts: list[list[int]] = [[] for _ in range(clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(clients, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for part, chunk in zip(parts, np.split(members, cuts)):
            part.extend(chunk.tolist())
    for i, part in enumerate(parts):
        if not part:  # a client without data cannot train: give it one sample of the largest
            donor = max(range(clients), key=lambda j: len(parts[j]))
            part.append(parts[donor].pop())
        parts[i] = sorted(part)
    return parts


def _labels(train: Dataset) -> np.ndarray:
    if isinstance(train, TensorDataset):
        return train.tensors[1].numpy()
    return np.asarray([int(train[i][1]) for i in range(len(train))])  # type: ignore[arg-type]


def own_rows(train: Dataset, indices: list[int]) -> Dataset:
    """A client's part of the training set: its own tensors where the set is tensors (each
    step then indexes them at once), else a ``Subset``."""
    if isinstance(train, TensorDataset):
        rows = torch.tensor(indices)
        return TensorDataset(*(t[rows] for t in train.tensors))
    return Subset(train, indices)


def make_scheme(cfg: FederatedSettings) -> Scheme:
    """The config's scheme (its ``lr`` is given at ``local_batch`` whatever the scheme)."""
    if cfg.scheme == "fixed":
        return Fixed(cfg.local_batch)
    if cfg.scheme == "switch":
        return SmallLargeSwitch(cfg.large, cfg.local_batch, cfg.switch)
    # κ = 1 weighed by the schedule, κ fixed: the settings the federated results were measured
    # with (docs/results.md, "Federated"), not bigbatch train's default
    controller = BatchWarmup(
        multiple=1.0,
        initial=cfg.clients * cfg.local_batch,
        min=cfg.clients * cfg.local_batch,
        max=cfg.clients * cfg.local_samples,
        decay_power=1.0,
        loss_lag=0.0,
    )
    return ControllerScheme(controller, cfg.clients)


def simulate(cfg: FederatedSettings, out: Path | None = None, threads: int | None = None) -> dict:
    """Run the federation; return (and, with ``out``, write) its rows and summary."""
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.serverapp.strategy import FedAvg

    from ..integrations.flower import (
        SAMPLES,
        AdaptiveBatchStrategy,
        ClientSetup,
        InProcessGrid,
        client_app,
    )

    set_threads(threads or 0)
    _quiet_flower()
    random.seed(cfg.seed)  # Flower samples the round's clients with Python's random
    run = plan_run({"task": cfg.task, "seed": cfg.seed})
    problem = run.task.build(run.task_args)
    labels = _labels(problem.train)
    if cfg.clients > len(labels):  # each client needs a sample of its own
        raise ConfigError(
            f"clients = {cfg.clients} is more than the {len(labels)} training samples of "
            f"{cfg.task}: at most one client per sample"
        )
    parts = split_indices(labels, cfg.clients, cfg.split, cfg.alpha, cfg.seed)

    def setup(context: Any) -> ClientSetup:
        part = int(context.node_config["partition-id"])
        return ClientSetup(
            copy.deepcopy(problem.model),
            own_rows(problem.train, parts[part]),
            problem.loss,
            lambda params: torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=5e-4),
            min_sub_batches=cfg.min_sub_batches,
            seed=cfg.seed * 1000 + part,
        )

    planner = RoundPlanner(
        make_scheme(cfg),
        clients=cfg.clients,
        local_samples=cfg.local_samples,
        lr=cfg.lr,
        lr_scaling="linear",
        base_batch=cfg.local_batch,
        total_samples=cfg.total_samples,
        schedule=warmup_cosine(cfg.total_samples, int(cfg.warmup * cfg.total_samples)),
    )
    # every client trains every round and the same samples, and FedAvg weighs them by
    # those samples (equal work, equal weight); the server scores the global model itself
    fedavg = FedAvg(
        fraction_evaluate=0.0,
        min_train_nodes=cfg.clients,
        min_available_nodes=cfg.clients,
        weighted_by_key=SAMPLES,
    )
    strategy = AdaptiveBatchStrategy(planner, fedavg)
    scores: dict[int, dict[str, float]] = {}
    evaluator = copy.deepcopy(problem.model)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        evaluator.load_state_dict(arrays.to_torch_state_dict())
        scores[server_round] = problem.evaluate(evaluator)
        return MetricRecord(scores[server_round])

    grid = InProcessGrid(client_app(setup), cfg.clients)
    started = time.perf_counter()
    strategy.start(
        grid, ArrayRecord(problem.model.state_dict()), num_rounds=cfg.rounds, evaluate_fn=evaluate
    )
    wall = time.perf_counter() - started
    if grid.failures:  # FedAvg went on with fewer clients, or none: not the run asked for
        raise WorkerFailedError(
            f"{len(grid.failures)} client updates failed in {cfg.rounds} rounds; the first: "
            f"{grid.failures[0]}"
        )
    rows = _rows(strategy.history, scores)
    result = {"config": asdict(cfg), "rounds": rows, "summary": summarize(cfg, rows, wall, parts)}
    if out is not None:
        write(out, result)
    return result


def _quiet_flower() -> None:
    """Flower logs every round at INFO and warns that client evaluation is off (the server
    scores the model here): the report says what happened."""
    logging.getLogger("flwr").setLevel(logging.ERROR)


def _rows(history: list[dict[str, Any]], scores: dict[int, dict[str, float]]) -> list[dict]:
    rows, client_steps = [], 0
    for record in history:
        client_steps += record["local_steps"]
        rows.append({**record, "client_steps": client_steps, **scores.get(record["round"], {})})
    return rows


def first_reach(rows: list[dict], target: float) -> tuple[int, int] | None:
    """``(round, client steps)`` of the first row whose test accuracy reaches ``target``."""
    for row in rows:
        if row.get("eval_accuracy", -1) >= target:
            return row["round"], row["client_steps"]
    return None


def summarize(
    cfg: FederatedSettings, rows: list[dict], wall: float, parts: list[list[int]]
) -> dict:
    """Final and best accuracy, and the rounds and client steps (the sequential local steps
    of one client, summed over rounds) at which each target was first reached."""
    accuracy = [r.get("eval_accuracy", math.nan) for r in rows]
    reached = {}
    for target in cfg.targets:
        hit = first_reach(rows, target)
        reached[str(target)] = {"round": hit[0], "client_steps": hit[1]} if hit else None
    return {
        "final_accuracy": accuracy[-1] if accuracy else math.nan,
        "best_accuracy": max(accuracy) if accuracy else math.nan,
        "client_steps": rows[-1]["client_steps"] if rows else 0,
        "samples": rows[-1]["samples"] if rows else 0,
        "local_batches": [r["local_batch"] for r in rows],
        "targets": reached,
        "client_sizes": [len(p) for p in parts],
        "wall_seconds": wall,
    }


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rounds.jsonl", "w") as f:
        for row in result["rounds"]:
            f.write(json.dumps(row) + "\n")
    (out / "summary.json").write_text(
        json.dumps(result["summary"] | {"config": result["config"]}, indent=1)
    )
    render(out)
