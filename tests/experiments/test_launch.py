"""The launcher's one line for ranks that failed (``launch._report``), from their failures."""

from pathlib import Path
from types import SimpleNamespace

from bigbatch.experiments.launch import WORKER_FAILED, _report


def failure(code: int, line: str | None = None, signal: str = "") -> SimpleNamespace:
    data = {"message": line, "bigbatch": True} if line else {}
    return SimpleNamespace(exitcode=code, error_file_data=data, signal_name=lambda: signal)


def test_one_ranks_line_with_the_others_stopped_by_the_agent_is_that_line_and_code():
    """The agent stops the other ranks (SIGTERM) once one fails: a config error a rank
    reported came out as exit 4 and a list of ranks, or exit 2, by which rank was first."""
    line = "bigbatch: error: dist.compression is no good here"
    stopped = failure(-15, signal="SIGTERM")
    # (a rank stopped after writing its line: a resume's config refused under --nproc 2)
    wrote_then_stopped = failure(-15, line, signal="SIGTERM")
    for failures in (
        {0: stopped, 1: failure(2, line)},
        {0: failure(2, line), 1: failure(2, line)},
        {0: failure(2, line), 1: wrote_then_stopped},
    ):
        assert _report(SimpleNamespace(failures=failures), 2, Path("out")) == (2, line)
    # a rank killed otherwise, or two lines that differ, are each named
    for failures in (
        {0: failure(-9, signal="SIGKILL"), 1: failure(2, line)},
        {0: failure(2, line), 1: failure(3, "bigbatch: error: another")},
        {0: stopped, 1: stopped},
    ):
        code, text = _report(SimpleNamespace(failures=failures), 2, Path("out"))
        assert code == WORKER_FAILED and text.startswith("2 of 2 training processes failed (rank 0")
