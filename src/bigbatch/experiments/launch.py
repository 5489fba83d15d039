"""``bigbatch train --nproc N``: N local training processes under torch's elastic agent,
run inside the command's own process (docs/cli.md). Over ``torchrun`` as a child: a
SIGTERM or Ctrl-C reaches the agent, which forwards it once to every rank and waits for
their checkpoint (``experiments/signals.py``), so no process outlives the command; the
launcher holds the run directory's lock for its ranks; the agent's log goes to
``<run>/launcher.log``, and a failure is one line naming the ranks. Exit codes: those of
:mod:`bigbatch.cli`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .device import share_of_cores
from .rundir import LAUNCHER_LOG, LOCK_HELD, RunLock, claim_new_run_dir, discard_if_unused
from .signals import LAUNCHER_PID

__all__ = ["COLLECTIVE_FAILED", "WORKER_FAILED", "WorkerFailedError", "launch", "on_ranks"]

#: exit code of a run whose training process failed
WORKER_FAILED = 4
#: exit code of a rank whose collective failed or timed out (a peer died or stopped answering)
COLLECTIVE_FAILED = 4


class WorkerFailedError(Exception):
    """Training processes failed; the message says which and how, ``code`` is the exit code."""

    def __init__(self, line: str, code: int = WORKER_FAILED) -> None:
        super().__init__(line)
        self.code = code


def launch(nproc: int, out: Path, arguments: Sequence[str], *, resume: bool) -> int:
    """Run ``python -m bigbatch.cli train <arguments>`` in ``nproc`` local processes that
    train ``out`` together; return the exit code (0, or 128 + a forwarding signal)."""
    lock = RunLock(out).acquire() if resume else claim_new_run_dir(out)
    environment = {
        LOCK_HELD: str(out.resolve()),
        LAUNCHER_PID: str(os.getpid()),
        **_threads(nproc),
    }
    try:
        with _environment(environment), _agent_log(out / LAUNCHER_LOG):
            elastic_launch(_local(nproc), entrypoint=sys.executable)(
                "-m", "bigbatch.cli", *arguments
            )
    except SignalException as err:  # the ranks checkpointed and said so
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        code, line = _report(err, nproc, out)
        if not resume:
            discard_if_unused(out, lock.made)
        raise WorkerFailedError(line, code) from None
    finally:
        lock.release()
    return 0


def on_ranks(nproc: int, function: Callable[..., Any], *args: Any) -> Any:
    # function(*args) in each of nproc local processes (torch's elastic agent, its log
    # kept off the console): rank 0's return value
    try:
        with _environment(_threads(nproc)), _agent_log(Path(os.devnull)):
            return elastic_launch(_local(nproc), entrypoint=function)(*args)[0]
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        raise WorkerFailedError(
            f"{len(err.failures)} of {nproc} processes failed (rank {rank}: "
            f"{str(failure.message).splitlines()[0] if failure.message else failure.exitcode})"
        ) from None


def _local(nproc: int) -> LaunchConfig:
    # nproc processes on this machine, started once
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
    )


def _threads(nproc: int) -> dict[str, str]:
    # one share of the cores per process (and no launcher warning about it)
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(share_of_cores(nproc))}


def _report(err: ChildFailedError, nproc: int, out: Path) -> tuple[int, str]:
    """The exit code and the one line for a launch whose ranks failed.

    A rank's own one-line error is in the error file the agent gave it. The same line
    from every rank, or from some with the rest stopped by the agent (a config error),
    is that line with its code; else each failed rank is named, with those that
    stopped answering, code 4."""
    failures = dict(sorted(err.failures.items()))
    own = {rank: _own_line(f) for rank, f in failures.items()}
    reported = {line for line in own.values() if line is not None}
    # (a rank that wrote its line and was stopped before it exited has the agent's code)
    codes = {
        failures[rank].exitcode
        for rank, line in own.items()
        if line is not None and not _terminated(failures[rank])
    }
    # a rank without a line of its own that the agent stopped (SIGTERM) once another failed
    alike = all(line is not None or _terminated(failures[r]) for r, line in own.items())
    if len(failures) == nproc and len(reported) == 1 and len(codes) == 1 and alike:
        return codes.pop(), reported.pop()
    timed_out = [r for r, f in failures.items() if f.exitcode == COLLECTIVE_FAILED]
    parts = []
    for rank, failure in failures.items():
        if failure.exitcode < 0:
            how = f"killed by {failure.signal_name()}"
            if timed_out and failure.signal_name() == "SIGKILL":
                how = "stopped answering (killed by SIGKILL)"
        else:
            how = _cause(_own_line(failure) or f"exit code {failure.exitcode}")
        parts.append(f"rank {rank}: {how}")
    if timed_out:
        parts += [f"rank {r}: stopped answering" for r in range(nproc) if r not in failures]
    return WORKER_FAILED, (
        f"{len(failures)} of {nproc} training processes failed ({'; '.join(parts)}); "
        f"the launcher's log: {out / LAUNCHER_LOG}"
    )


def _terminated(failure: Any) -> bool:
    return failure.exitcode < 0 and failure.signal_name() == "SIGTERM"


def _own_line(failure: Any) -> str | None:
    """The line a rank wrote with :func:`report_to_launcher`, if it wrote one."""
    data = failure.error_file_data or {}
    message = data.get("message") if isinstance(data, dict) else None
    return message if isinstance(message, str) and data.get("bigbatch") else None


def _cause(line: str) -> str:
    """A rank's line without the command's prefix, to sit inside the launcher's line."""
    return line.removeprefix("bigbatch: ").removeprefix("error: ")


def report_to_launcher(message: str) -> bool:
    """Hand a rank's one-line error to its ``bigbatch train --nproc N`` launcher (through the
    error file torch's agent reads), instead of printing it beside every other rank's;
    False when this process has no such launcher."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (path and os.environ.get(LAUNCHER_PID)):
        return False
    record = {"message": message, "timestamp": int(time.time()), "bigbatch": True}
    Path(path).write_text(json.dumps(record))
    return True


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the ranks to inherit, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _agent_log(path: Path) -> Iterator[None]:
    """torch's elastic agent logs to ``path`` instead of the console (where its warnings
    and tracebacks would bury the one line that matters)."""
    logger = logging.getLogger("torch.distributed")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # torch gives this logger a console handler of its own and no propagation: swap it
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        handler.close()
        logger.handlers, logger.propagate, _ = saved
        logger.setLevel(saved[2])
