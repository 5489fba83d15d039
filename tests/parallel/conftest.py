"""Gloo clusters of 2 and 4 processes, started once and shared by the tests that need them."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from .cluster import Cluster

_clusters: dict[int, Cluster] = {}


def get_cluster(world_size: int) -> Cluster:
    """The shared cluster of this size, restarted if an earlier test broke it."""
    cluster = _clusters.get(world_size)
    if cluster is None or cluster.broken:
        cluster = _clusters[world_size] = Cluster(world_size)
    return cluster


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}ranks")
def cluster(request) -> Cluster:
    return get_cluster(request.param)


@pytest.fixture
def cluster2() -> Cluster:
    return get_cluster(2)


@pytest.fixture
def cluster4() -> Cluster:
    return get_cluster(4)


@pytest.fixture
def one_rank():
    """A process group of this process alone, for the one-rank cases."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def pytest_sessionfinish(session, exitstatus):
    for cluster in _clusters.values():
        cluster.close()
