"""Signals in a command of many runs (``signals.stops_as_a_whole``)."""

import os
import signal

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
