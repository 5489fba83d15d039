"""Fixtures of the task tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Torch on one thread: the fastest for a test's tiny matrices, and no thread waits on
    a core another process keeps busy (two threads took 40x longer on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
