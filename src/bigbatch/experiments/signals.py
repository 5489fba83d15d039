"""Stopping a run cleanly on a signal: finish the optimizer step, checkpoint, say so, exit.

:class:`StopRequest` turns the first SIGTERM or SIGINT into a request the loop reads
between optimizer steps; it then checkpoints and raises :class:`Stopped`, which the
command line turns into one line and exit code 128 + the signal's number. A second
signal exits at once. Under data parallelism every rank stops after the same step
(the checkpoint is a collective): :meth:`StopRequest.agreed` takes the largest request
over the ranks by a one-integer all-reduce on a gloo group (host memory: it never waits
for a GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.world import World

__all__ = [
    "LAUNCHER_PID",
    "STOP_SIGNALS",
    "StopRequest",
    "Stopped",
    "stop_between_runs",
    "stop_requested",
    "stops_as_a_whole",
    "watch_launcher",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: set by ``bigbatch train --nproc N`` for its ranks: the launcher's pid, watched by each rank
LAUNCHER_PID = "BIGBATCH_LAUNCHER_PID"


class Stopped(Exception):  # noqa: N818 - a stop on request, not an error
    """The run stopped on a signal after a checkpoint; ``code`` is the exit code."""

    def __init__(self, signum: int, step: int | None, out: str, again: str | None = None) -> None:
        self.signum, self.step, self.out, self.again = signum, step, out, again
        self.code = 128 + signum
        again = again or f"resume with --resume {out}"
        at = f"at step {step}" if step is not None else "between runs"
        super().__init__(f"stopped by {signal.Signals(signum).name} {at}; {again}")

    def __reduce__(self) -> tuple:
        # a worker of a sweep or a study hands it to the parent, which stops with its code
        return type(self), (self.signum, self.step, self.out, self.again)


#: the requests of the commands of many runs under way (the innermost last)
_COMMANDS: list[StopRequest] = []


@contextlib.contextmanager
def stops_as_a_whole(out: Path | str) -> Iterator[None]:
    """A command of many runs, stopped by a signal in one, between them or after the last."""
    # (its advice: the same command again, --out; a run resumed alone would pass its pause)
    again = f"run the same command again (--out {out}) to continue"
    with StopRequest() as request:
        _COMMANDS.append(request)
        try:
            yield
        except Stopped as err:
            raise Stopped(err.signum, err.step, str(out), again) from None
        finally:
            _COMMANDS.remove(request)
    if request.signum is not None:  # after the last run: every run's result is kept
        raise Stopped(request.signum, None, str(out), again)


def stop_requested() -> bool:
    """Whether a command of many runs got a signal."""
    return bool(_COMMANDS) and _COMMANDS[-1].signum is not None


def stop_between_runs(out: Path | str | None) -> None:
    """:class:`Stopped` where a command of many runs got a signal: no next run starts."""
    if stop_requested():
        raise Stopped(_COMMANDS[-1].signum, None, str(out))


class StopRequest:
    """The first SIGTERM or SIGINT while the block runs, as a request (``signum``).

    Installed only in the main thread (where Python delivers signals)."""

    def __init__(self, world: World | None = None, timeout: float | None = None) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        if world is not None and world.distributed:
            # host-memory agreement beside an NCCL group (a gloo group of the same ranks),
            # bounded like the run's other collectives (a new group's default is 30 minutes)
            limit = datetime.timedelta(seconds=timeout) if timeout is not None else None
            self._group = dist.new_group(backend="gloo", timeout=limit)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        # a run's request its loop never read (the signal came after its last step) goes to
        # the command of many runs around it, which stops before the next
        enclosing = _COMMANDS[-1] if _COMMANDS and _COMMANDS[-1] is not self else None
        if enclosing is not None and enclosing.signum is None:
            enclosing.signum = self.signum

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second signal: at once, as if unhandled
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def agreed(self) -> int | None:
        """The signal any rank received (the largest number), the same on every rank."""
        if self._group is None:
            return self.signum
        flag = torch.tensor([self.signum or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item()) or None


def watch_launcher(interval: float = 1.0) -> None:
    """When this rank's launcher (``bigbatch train --nproc N``) disappears, even killed with
    SIGKILL, send this process SIGTERM: it checkpoints and exits instead of training on
    as an orphan."""
    pid = os.environ.get(LAUNCHER_PID)
    if not pid:
        return

    def watch() -> None:
        # a rank whose launcher died is handed to another parent (init or a subreaper)
        while os.getppid() == int(pid):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="bigbatch-launcher-watch", daemon=True).start()
