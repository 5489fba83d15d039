"""Signals in a command of many runs (``signals.stops_as_a_whole``)."""

import os
import signal
import subprocess
import sys

import pytest

from bigbatch.experiments.signals import Stopped, StopRequest, stop_between_runs, stops_as_a_whole

AGAIN = r"between runs; run the same command again \(--out out\)"


def test_a_signal_between_runs_stops_the_command_before_the_next():
    """Between two runs of a compare, critical-batch or tune no handler was installed:
    SIGTERM killed the command without its line, SIGINT printed only 'interrupted'."""
    with pytest.raises(Stopped, match="SIGTERM " + AGAIN), stops_as_a_whole("out"):
        stop_between_runs("run0")  # nothing asked: the run starts
        os.kill(os.getpid(), signal.SIGTERM)
        stop_between_runs("run1")
        pytest.fail("the next run started")


def test_a_signal_after_a_runs_last_step_reaches_the_command():
    """A run's own request, set after its loop's last read (while it evaluated or wrote its
    report), was dropped with it: the command trained every other run and exited 0."""
    with pytest.raises(Stopped, match="SIGINT " + AGAIN), stops_as_a_whole("out"):
        with StopRequest():  # a run
            os.kill(os.getpid(), signal.SIGINT)
        stop_between_runs("run1")
    last_run = StopRequest()
    with pytest.raises(Stopped, match="SIGINT " + AGAIN), stops_as_a_whole("out"), last_run:
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_the_process_at_once(sig):
    """The first signal asks for a checkpoint after the step; a second (the user pressing
    Ctrl-C again while a long step or checkpoint runs) must not wait for it."""
    script = (
        "import os, signal, time\n"
        "from bigbatch.experiments.signals import StopRequest\n"
        "with StopRequest() as request:\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    print(request.signum, flush=True)\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    time.sleep(20)\n"
        "print('waited', flush=True)\n"
    )
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert ended.stdout.decode().split() == [str(int(sig))]  # asked once, then ended
    assert ended.returncode == -sig  # by the signal itself, as if never handled


def test_a_signal_while_the_run_is_built_stops_it_after_its_first_step(tmp_path, monkeypatch):
    """A signal while the data and model are built (minutes for a long `lm` context) is
    held, not lost nor fatal: the run takes its first step, checkpoints, and stops."""
    from bigbatch.experiments import runner
    from bigbatch.experiments.config import resolve

    build = runner.build

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*args, **kwargs)

    monkeypatch.setattr(runner, "build", signalled)
    config = resolve({"task": "digits", "device": "cpu", "threads": 1, "max_samples": 2000})
    with pytest.raises(Stopped, match="stopped by SIGTERM at step 1; resume with --resume"):
        runner.train(config, tmp_path / "run", quiet=True)
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"ended": "signal"' in summary and '"steps": 1' in summary
