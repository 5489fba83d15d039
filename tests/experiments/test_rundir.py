"""Run-directory helpers: a copy made in one rename, what a killed run leaves, a folder kept
by its plan."""

import errno
import json

import pytest
import torch

from bigbatch.experiments.config import ConfigError
from bigbatch.experiments.rundir import (
    CHECKPOINT,
    RunLock,
    claim_new_run_dir,
    claim_plan,
    copy_atomically,
    cut_lines,
    discard_if_unused,
    disk_error,
    first_difference,
    load_checkpoint,
    resumable,
    save_atomically,
    write_atomically,
)


def test_a_copy_keeps_the_content_it_was_made_from(tmp_path):
    source, target = tmp_path / "checkpoint.pt", tmp_path / "snapshot-0.pt"
    save_atomically({"step": 1}, source)
    copy_atomically(source, target)
    save_atomically({"step": 2}, source, keep_previous=True)  # replaced by a rename
    assert target.read_bytes() == (tmp_path / "checkpoint.prev.pt").read_bytes()
    assert target.read_bytes() != source.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))  # nothing staged is left behind


def test_a_file_written_atomically_is_the_old_or_the_new_one(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old")
    write_atomically(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]

    def killed(*args):
        raise KeyboardInterrupt  # the process dies between writing and renaming

    monkeypatch.setattr("os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, "half")
    assert path.read_text() == "new"


def test_a_folder_whose_plan_a_kill_left_staged_is_claimed_again(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    (out / ".compare.json.tmp").write_text('{"pla')  # killed before the rename
    claim_plan(out, "compare.json", {"plan": 1}, "comparison", config_at="base").release()
    assert json.loads((out / "compare.json").read_text()) == {"plan": 1}


def test_a_resumed_runs_metrics_are_cut_back_in_place(tmp_path):
    # in place (one truncate): a kill while a resume cuts them cannot lose the kept rows,
    # as rewriting the file could (it was emptied first)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"step": {i}}}\n' for i in range(1, 6)))
    inode = metrics.stat().st_ino
    assert cut_lines(metrics, 3) == 3
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert metrics.stat().st_ino == inode
    assert cut_lines(metrics, 10) == 3  # fewer lines than kept: as they are, counted
    assert metrics.read_text().count("\n") == 3
    with metrics.open("a") as file:
        file.write('{"st')  # a torn last line: not a row
    assert cut_lines(metrics, 10) == 3 and metrics.read_text().endswith("3}\n")
    assert cut_lines(tmp_path / "missing.jsonl", 2) == 0
    assert (tmp_path / "missing.jsonl").read_text() == ""


def test_a_run_resumes_from_its_checkpoint_and_a_run_killed_before_one_starts_again(tmp_path):
    assert not resumable(tmp_path / "never")  # nothing there: a new run
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text("")
    assert not resumable(killed) and not killed.exists()  # cleared for the new run
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    save_atomically({"step": 3}, stopped / CHECKPOINT)
    assert resumable(stopped) and (stopped / CHECKPOINT).is_file()


def test_the_first_difference_of_two_plans_names_its_key_and_both_values():
    there = {"base": {"noise_from": "sub_batches", "seed": 0}, "seeds": 3}
    now = {"base": {"noise_from": "auto", "seed": 0}, "seeds": 3}
    assert first_difference(there, now) == "base.noise_from = 'sub_batches' there, 'auto' now"
    assert first_difference(now, now) == ""
    assert first_difference({"a": 1}, {}) == "a = 1 there, None now"


def test_a_plan_claims_a_new_folder_continues_the_same_plan_and_refuses_another(tmp_path):
    out, plan = tmp_path / "study", {"config": {"lr": 0.1}, "trials": 4}
    lock = claim_plan(out, "plan.json", plan, "study", config_at="config")
    assert json.loads((out / "plan.json").read_text()) == plan
    with pytest.raises(ConfigError, match="in use by process"):  # one writer at a time
        claim_plan(out, "plan.json", plan, "study", config_at="config")
    lock.release()
    claim_plan(out, "plan.json", plan, "study", config_at="config").release()
    other = {**plan, "trials": 5}
    with pytest.raises(ConfigError, match=r"holds a study of other settings \(trials = 4 there"):
        claim_plan(out, "plan.json", other, "study", config_at="config")
    # what may change between sessions is left out of the comparison
    drop_trials = lambda p: {k: v for k, v in p.items() if k != "trials"}  # noqa: E731
    claim_plan(out, "plan.json", other, "study", config_at="config", compared=drop_trials).release()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds no study"):
        claim_plan(tmp_path / "mine", "plan.json", plan, "study", config_at="config")


def test_a_plan_saved_before_a_key_existed_is_refused_in_one_line(tmp_path):
    out, plan = tmp_path / "study", {"config": {"lr": 0.1, "added": 0}, "trials": 4}
    (tmp_path / "study").mkdir()
    (out / "plan.json").write_text(json.dumps({"config": {"lr": 0.1}, "trials": 4}))
    with pytest.raises(ConfigError, match="written by an earlier bigbatch, before the key 'added'"):
        claim_plan(out, "plan.json", plan, "study", config_at="config")


def test_a_new_run_directory_takes_the_next_free_name(tmp_path, monkeypatch):
    from bigbatch.experiments import rundir

    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20261201-120000")
    base = tmp_path / "20261201-120000-digits"
    base.mkdir()
    base.with_name(base.name + "-2").mkdir()
    assert rundir.new_run_dir(tmp_path, "digits") == base.with_name(base.name + "-3")


def test_a_file_at_out_is_one_line(tmp_path):
    from bigbatch.experiments.rundir import check_new_run_dir

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"notes\.txt' already exists and is not empty"):
        check_new_run_dir(tmp_path / "notes.txt")


def test_a_file_written_atomically_is_on_disk_before_its_rename(tmp_path, monkeypatch):
    """write_atomically renamed a file it never synced: after a power loss a summary or
    config.toml could be there and empty."""
    import os

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_size)) or fsync(fd)
    )
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace",)) or replace(a, b))
    write_atomically(tmp_path / "summary.json", "{}\n")
    assert events == [("fsync", 3), ("replace",)]


def test_blank_lines_in_a_metrics_log_are_no_records(tmp_path):
    from bigbatch.experiments.rundir import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n  \n{"step": 2}\n')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]


class _Pickled:
    """An object torch.load can only rebuild by running code (weights_only refuses it)."""


def test_a_checkpoint_that_needs_code_to_load_is_refused_in_one_line(tmp_path):
    path = tmp_path / CHECKPOINT
    torch.save({"run": _Pickled()}, path)
    with pytest.raises(ConfigError, match=r"cannot be read .*truncated or corrupted"):
        load_checkpoint(path)


def test_a_refused_claim_leaves_the_folder_unlocked(tmp_path):
    """The folder's other contents refuse it, under the lock: held after the refusal (while
    the error is kept), the lock would refuse the next claim as "in use by another run"."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("someone's")
    with pytest.raises(ConfigError, match="run") as refused:
        claim_new_run_dir(out)
    RunLock(out).acquire().release()  # (the error kept, and with it the claim's frame)
    assert refused.traceback


def test_a_failed_runs_folders_go_as_far_up_as_its_claim_made_them(tmp_path):
    (tmp_path / "runs" / "kept").mkdir(parents=True)
    out = tmp_path / "runs" / "a" / "b"
    lock = claim_new_run_dir(out)
    assert lock.made == (tmp_path / "runs" / "a",)
    lock.release()
    discard_if_unused(out, lock.made)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["kept"]
    lock = claim_new_run_dir(tmp_path / "new" / "c")
    lock.release()
    discard_if_unused(tmp_path / "new" / "c", lock.made)
    assert not (tmp_path / "new").exists()


def test_a_full_disk_is_one_line_that_says_to_free_space_and_resume(tmp_path):
    full = disk_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "x.pt")
    assert str(full).endswith("failed: no space left on device; free some space and resume")
    denied = disk_error(OSError(errno.EACCES, "Permission denied", str(tmp_path / "y")))
    assert "y' failed: permission denied" in str(denied) and "free" not in str(denied)
