"""``Processes`` and ``in_processes``: the results in order, from fresh processes when asked
for, the processes kept from one map to the next."""

import os

import pytest

from bigbatch.experiments.pool import Processes, in_processes


def _pid_of(_item):
    return os.getpid()


@pytest.mark.processes
def test_results_come_back_in_order_from_other_processes():
    assert in_processes(abs, [-3, -1, -2], workers=2) == [3, 1, 2]
    pids = in_processes(_pid_of, [0, 1, 2], workers=2)
    assert os.getpid() not in pids


@pytest.mark.processes
def test_maps_share_the_processes_a_first_map_started():
    # a study's rungs: three maps in two workers, not two new workers for each
    with Processes(2) as processes:
        pids = {pid for _ in range(3) for pid in processes.map(_pid_of, [0, 1])}
    assert len(pids) <= 2 and os.getpid() not in pids


def test_one_worker_or_one_item_runs_here():
    assert in_processes(_pid_of, [0, 1], workers=1) == [os.getpid()] * 2
    assert in_processes(_pid_of, [0], workers=4) == [os.getpid()]
    with Processes(4) as processes:
        assert processes.map(_pid_of, [0]) == [os.getpid()]
