"""The launcher's one line for ranks that failed (``launch._report``), from their failures."""

from pathlib import Path
from types import SimpleNamespace

from bigbatch.experiments.launch import COLLECTIVE_FAILED, WORKER_FAILED, _report, _threads


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
    # one rank of two with its line, the other not failed: not the whole launch's line
    code, text = _report(SimpleNamespace(failures={0: failure(2, line)}), 2, Path("out"))
    assert code == WORKER_FAILED and text.startswith("1 of 2 training processes failed (rank 0")


def test_a_rank_killed_beside_one_that_timed_out_stopped_answering_and_the_silent_are_named():
    # a SIGKILL alone is named as such; beside a collective's timeout it stopped answering,
    # and the ranks that never failed are named as silent
    alone = {0: failure(-9, signal="SIGKILL"), 1: failure(-15, signal="SIGTERM")}
    assert "rank 0: killed by SIGKILL;" in _report(SimpleNamespace(failures=alone), 2, Path("o"))[1]
    timed = {0: failure(COLLECTIVE_FAILED), 1: failure(-9, signal="SIGKILL")}
    text = _report(SimpleNamespace(failures=timed), 3, Path("o"))[1]
    assert "rank 1: stopped answering (killed by SIGKILL)" in text
    assert text.count("rank 2: stopped answering") == 1


def test_the_users_omp_num_threads_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads(2) == {"OMP_NUM_THREADS": "3"}
