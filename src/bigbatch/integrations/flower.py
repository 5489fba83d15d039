"""Adaptive local batches in Flower: a ClientApp helper (:func:`client_app`) and a
strategy wrapper (:class:`AdaptiveBatchStrategy`) around a
:class:`~bigbatch.federated.RoundPlanner`; no Ray needed. Needs ``bigbatch[flower]``
(docs/federated.md)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

try:
    from flwr.app import (
        ArrayRecord,
        ConfigRecord,
        Context,
        Error,
        Message,
        MetricRecord,
        RecordDict,
    )
    from flwr.clientapp import ClientApp
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg, Strategy
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "bigbatch.integrations.flower needs Flower: pip install 'bigbatch[flower]'"
    ) from error

try:  # where Flower keeps the sending task's identity (its runtimes set it)
    from flwr.supercore.task_identity import TaskIdentity
except ImportError:  # pragma: no cover - Flower releases whose messages need no identity
    TaskIdentity = None

from ..assembly import fewest_sub_batches
from ..batch.controllers import Constant
from ..batch.plan import MAX_MICRO_BATCH
from ..federated import ClientReport, RoundPlan, RoundPlanner, finite_mean
from ..loop import AdaptiveBatch

__all__ = [
    "AdaptiveBatchStrategy",
    "ClientSetup",
    "InProcessGrid",
    "client_app",
    "train_round",
]

#: the config keys a train message carries, and the metric keys a client replies with
PLAN_KEYS = ("round", "local_batch", "local_steps", "lr", "clients")
PREFIX = "bigbatch."
NUM_EXAMPLES = "num-examples"  # Flower's weighting key: the client's data size
SAMPLES = PREFIX + "samples"  # what the client trained this round


@dataclass
class ClientSetup:
    """A client's model, data, loss, ``make_optimizer(params)`` and optional ``evaluate``."""

    model: nn.Module
    dataset: Dataset
    loss_fn: Callable[[nn.Module, Any], Tensor]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    max_micro_batch: int = MAX_MICRO_BATCH
    #: the fewest micro-batches of a local step (at most its batch); None: what the
    #: statistics need, as for :class:`~bigbatch.AdaptiveBatch`
    min_sub_batches: int | None = None
    seed: int = 0
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None


def plan_to_config(plan: RoundPlan) -> dict[str, int | float]:
    return {PREFIX + key: getattr(plan, key) for key in PLAN_KEYS}


def plan_from_config(config: Any) -> RoundPlan:
    missing = [PREFIX + k for k in PLAN_KEYS if PREFIX + k not in config]
    if missing:
        raise KeyError(
            f"the train message's config lacks {', '.join(missing)}: "
            "train with AdaptiveBatchStrategy, which sends each round's plan"
        )
    values = {k: config[PREFIX + k] for k in PLAN_KEYS}
    return RoundPlan(
        round=int(values["round"]),
        local_batch=int(values["local_batch"]),
        local_steps=int(values["local_steps"]),
        lr=float(values["lr"]),
        clients=int(values["clients"]),
    )


def _sub_batches(setup: ClientSetup) -> int:
    """The client's fewest micro-batches per local step."""
    if setup.min_sub_batches is not None:
        return setup.min_sub_batches
    return fewest_sub_batches(statistics=True, per_example=False, split=False)


def train_round(setup: ClientSetup, plan: RoundPlan) -> ClientReport:
    """Train the plan's steps at its local batch and held rate (a param group at its ratio
    to the optimizer's) through :class:`~bigbatch.AdaptiveBatch`, seeded by client and round."""
    optimizer = setup.make_optimizer(setup.model.parameters())
    base = float(optimizer.defaults.get("lr", 0.0))
    for group in optimizer.param_groups:
        # the round's rate for the optimizer's own; a group built at another (a head at
        # 10x) keeps its ratio to it, as a rate schedule would
        group["lr"] = plan.lr * (float(group["lr"]) / base if base > 0 else 1.0)
    loop = AdaptiveBatch(
        setup.model,
        optimizer,
        setup.dataset,
        controller=Constant(plan.local_batch),
        max_micro_batch=setup.max_micro_batch,
        min_sub_batches=min(_sub_batches(setup), plan.local_batch),
        seed=setup.seed * 1_000_003 + plan.round,
        lr_scaling="none",
        statistics=True,  # the server's planner reads them, not the client's controller
        # the client's micro-batch rule (_sub_batches) is the sub-batch statistics'; kept so
        noise_from="sub_batches",
    )
    setup.model.train()
    batches, sq, trace, similarity, losses = [], [], [], [], []
    for step in loop.steps(max_steps=plan.local_steps):
        for batch in step.micro_batches():
            step.backward(setup.loss_fn(setup.model, batch))
        step.apply()
        m = step.metrics
        batches.append(step.batch_size)
        sq.append(m.get("grad_sq_norm", math.nan))
        trace.append(m.get("trace", math.nan))
        similarity.append(m.get("similarity", math.nan))
        losses.append(m.get("loss", math.nan))
    return ClientReport(
        samples=loop.samples,
        batches=batches,
        grad_sq_norm=sq,
        trace=trace,
        similarity=similarity,
        loss=finite_mean(losses),
    )


def report_to_metrics(report: ClientReport, data_size: int) -> dict[str, Any]:
    """The fit metrics a client replies with (``num-examples``, ``bigbatch.samples``, ...)."""
    return {
        NUM_EXAMPLES: data_size,
        SAMPLES: report.samples,
        PREFIX + "steps": len(report.batches),
        PREFIX + "loss": report.loss,
        PREFIX + "batches": [int(b) for b in report.batches],
        PREFIX + "grad_sq_norm": [float(v) for v in report.grad_sq_norm],
        PREFIX + "trace": [float(v) for v in report.trace],
        PREFIX + "similarity": [float(v) for v in report.similarity],
    }


def report_from_metrics(metrics: Any) -> ClientReport:
    return ClientReport(
        samples=int(metrics[SAMPLES]),
        batches=list(metrics[PREFIX + "batches"]),
        grad_sq_norm=list(metrics[PREFIX + "grad_sq_norm"]),
        trace=list(metrics[PREFIX + "trace"]),
        similarity=list(metrics[PREFIX + "similarity"]),
        loss=float(metrics[PREFIX + "loss"]),
    )


def client_app(setup_fn: Callable[[Context], ClientSetup]) -> ClientApp:
    """A Flower ``ClientApp`` running :func:`train_round`; ``setup_fn`` once per node."""
    setups: dict[int, ClientSetup] = {}
    app = ClientApp()

    def setup_for(context: Context) -> ClientSetup:
        if context.node_id not in setups:
            setups[context.node_id] = setup_fn(context)
        return setups[context.node_id]

    def load_global(setup: ClientSetup, message: Message) -> None:
        arrays = next(iter(message.content.array_records.values()))
        setup.model.load_state_dict(arrays.to_torch_state_dict())

    @app.train()
    def train(message: Message, context: Context) -> Message:
        setup = setup_for(context)
        load_global(setup, message)
        config = next(iter(message.content.config_records.values()))
        report = train_round(setup, plan_from_config(config))
        content = RecordDict(
            {
                "arrays": ArrayRecord(setup.model.state_dict()),
                "metrics": MetricRecord(report_to_metrics(report, len(setup.dataset))),
            }
        )
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        setup = setup_for(context)
        if setup.evaluate is None:
            raise RuntimeError("this ClientSetup has no evaluate function")
        load_global(setup, message)
        scores = setup.evaluate(setup.model)
        metrics = {NUM_EXAMPLES: len(setup.dataset), **scores}  # type: ignore[arg-type]
        return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)

    return app


class AdaptiveBatchStrategy(Strategy):
    """A Flower strategy (around ``base``, default ``FedAvg()``) that sends each round's
    local batch and rate and pools the clients' statistics; ``history`` per round."""

    def __init__(self, planner: RoundPlanner, base: Strategy | None = None) -> None:
        self.planner = planner
        self.base = base if base is not None else FedAvg()
        self.history: list[dict[str, Any]] = []
        self._plan: RoundPlan | None = None

    def summary(self) -> None:
        self.base.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._plan = self.planner.plan()
        round_config = ConfigRecord({**dict(config), **plan_to_config(self._plan)})
        return self.base.configure_train(server_round, arrays, round_config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        arrays, metrics = self.base.aggregate_train(server_round, replies)
        plan = self._plan
        if plan is None:
            raise RuntimeError("aggregate_train before configure_train")
        reports = [
            report_from_metrics(next(iter(m.content.metric_records.values())))
            for m in replies
            if not m.has_error()
        ]
        if not reports:
            return arrays, metrics
        pooled = self.planner.update(plan, reports)
        record = {
            **plan.as_dict(),
            "clients_trained": len(reports),
            "samples": self.planner.samples,
            # one diverged client's NaN loss does not hide the others'
            "loss": finite_mean([r.loss for r in reports], [r.samples for r in reports]),
            **_pooled_noise(pooled),
            "next_local_batch": self.planner.local_batch,
        }
        self.history.append(record)
        if metrics is not None:
            for key in ("local_batch", "global_batch", "local_steps", "lr", "noise_scale"):
                metrics[PREFIX + key] = record[key]
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.base.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.base.aggregate_evaluate(server_round, replies)


def _pooled_noise(pooled: list[dict[str, float]]) -> dict[str, float]:
    """The round's pooled ``B_simple`` and mean similarity."""

    def mean(key: str) -> float:
        return finite_mean([s[key] for s in pooled])

    sq, trace = mean("grad_sq_norm"), mean("trace")
    noise = trace / sq if sq > 0 and math.isfinite(trace) else math.nan
    return {
        "grad_sq_norm": sq,
        "trace": trace,
        "noise_scale": noise,
        "similarity": mean("similarity"),
    }


class InProcessGrid(Grid):
    """A Flower ``Grid`` that delivers each message to a ClientApp in this process, one
    after another, to ``num_nodes`` nodes with persistent contexts."""

    def __init__(self, app: ClientApp, num_nodes: int, run_config: dict | None = None) -> None:
        self.app = app
        self.node_ids = [SUPERLINK_NODE_ID + 1 + i for i in range(num_nodes)]
        self.contexts = {
            node: Context(
                run_id=0,
                node_id=node,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, node in enumerate(self.node_ids)
        }
        # Flower has no public query for an unset identity
        if TaskIdentity is not None and TaskIdentity._run_id is None:
            TaskIdentity.task_id, TaskIdentity.run_id = 1, 0
            TaskIdentity.node_id = SUPERLINK_NODE_ID
        self._run: Any = None
        self._replies: dict[str, Message] = {}
        #: each failed client reply's reason, in order
        self.failures: list[str] = []

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = str(uuid.uuid4())
            message.metadata.__dict__["_message_id"] = message_id
            self._replies[message_id] = self._deliver(message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))

    def _deliver(self, message: Message) -> Message:
        node = message.metadata.dst_node_id
        started = time.perf_counter()
        try:
            return self.app(message, self.contexts[node])
        except Exception as error:  # a failing client is an error reply, not a crashed server
            reason = (
                f"{type(error).__name__}: {error} (after {time.perf_counter() - started:.1f} s)"
            )
            self.failures.append(reason)
            return Message(Error(code=0, reason=reason), reply_to=message)
