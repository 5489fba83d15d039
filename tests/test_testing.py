"""The helpers tests and benchmarks share."""

import socket

import torch

from bigbatch.testing import free_port, host_syncs


def test_host_syncs_counts_nothing_off_cuda():
    with host_syncs("cpu") as syncs:
        torch.ones(3).sum().item()
    assert syncs.count == 0


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
