"""``Processes`` and ``in_processes``: the results in order, from fresh processes when asked
for, the processes kept from one map to the next."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bigbatch.experiments.pool import Processes, in_processes
from bigbatch.experiments.signals import Stopped, stops_as_a_whole

from .test_cli_distributed import alive


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


def _ignores_sigint(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.processes
def test_a_ctrl_c_between_runs_stops_the_command_and_leaves_the_workers_standing(tmp_path):
    """A terminal's Ctrl-C reaches every process of the group: idle workers died of it (the
    pool broken: a traceback and exit 1) or the pool's manager wedged on a cancelled
    future (the command hung for good)."""
    with pytest.raises(Stopped), stops_as_a_whole(tmp_path), Processes(2) as processes:
        assert processes.map(_pid_of, [0, 1]) != [os.getpid()] * 2  # two workers, now idle
        workers = list(processes._pool._processes)
        deadline = time.monotonic() + 60  # each worker up (a signal while it starts breaks
        while not all(_ignores_sigint(pid) for pid in workers):  # the pool: Stopped too)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for pid in [*workers, os.getpid()]:  # the group's Ctrl-C, process by process
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(Path(f"/proc/{pid}").exists() for pid in workers)
        processes.map(_pid_of, [2, 3])  # no run starts: Stopped


def _sleep_in(folder):  # a long run: the worker's pid left in ``folder``, then a wait
    (Path(folder) / str(os.getpid())).touch()
    time.sleep(120)


@pytest.mark.processes
def test_the_workers_end_when_their_command_is_killed_outright(tmp_path):
    """A command SIGKILLed (the OOM killer, ``kill -9``) cannot stop its workers: they
    trained on, holding their runs' folders against the same command run again, for good."""
    script = (
        "import sys\n"
        "from bigbatch.experiments.pool import Processes\n"
        "from tests.experiments.test_pool import _sleep_in\n"
        "with Processes(2) as processes:\n"
        "    processes.map(_sleep_in, [sys.argv[1]] * 2)\n"
    )
    root = Path(__file__).parents[2]
    command = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=root)
    deadline = time.monotonic() + 60
    while len(workers := [int(p.name) for p in tmp_path.iterdir()]) < 2:
        assert command.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    command.kill()
    command.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived its command"
        time.sleep(0.1)
