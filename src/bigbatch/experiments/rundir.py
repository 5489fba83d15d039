"""Run directories on disk: naming, one writer at a time, atomic checkpoints, reading back."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch

from .config import ConfigError, load_toml, resolve
from .plan import RunPlan

CHECKPOINT = "checkpoint.pt"
#: the lock file of a run directory (held by the process that writes the run)
LOCK = ".lock"
#: the log of ``bigbatch train --nproc N``'s launcher (torch's elastic agent)
LAUNCHER_LOG = "launcher.log"
#: files a new run directory may already hold: its lock and its launcher's log
BOOKKEEPING = frozenset({LOCK, LAUNCHER_LOG})
#: what a run writes before its first checkpoint (a directory holding only these is no run)
BEFORE_FIRST_CHECKPOINT = frozenset({"config.toml", "metrics.jsonl"})
#: set by ``bigbatch train --nproc N`` for its ranks: the run directory its launcher has locked
LOCK_HELD = "BIGBATCH_LOCK_HELD"
#: a run needs room for this many checkpoints (the new one is written beside the old)
CHECKPOINTS_OF_ROOM = 2


def new_run_dir(root: str | Path = "runs", task: str = "run") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{stamp}-{task}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_new_run_dir(path: Path, resumable: bool = True) -> None:
    """A one-line error if ``path`` cannot become a new run (it holds one, or a file)."""
    # (resumable: the command continues a run with --resume)
    if path.exists() and (path.is_file() or _holds_files(path)):
        hint = " (use --resume to continue one)" if resumable else ""
        raise ConfigError(
            f"--out {str(path)!r} already exists and is not empty; runs are never overwritten{hint}"
        )


def _holds_files(folder: Path) -> bool:
    """Whether ``folder`` holds more than a new run's bookkeeping (its lock, a launcher's log)."""
    # (a staged write a kill kept from landing is not the folder's, nor a run's first files
    # before its first checkpoint: that run never started)
    names = {p.name for p in folder.iterdir() if not _is_staged(p.name)} - BOOKKEEPING
    return bool(names - BEFORE_FIRST_CHECKPOINT)


def _staged(path: Path) -> Path:
    # where a file is written before it is renamed over ``path`` (_is_staged knows the name)
    return path.with_name(f".{path.name}.tmp")


def _is_staged(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


class RunLock:
    """An exclusive lock on a run directory, held by the process that writes the run.

    ``fcntl.flock`` on ``<dir>/.lock``: the kernel drops it when the holder
    exits, however it exits, so a killed run never leaves a stale lock. The
    holder's pid is written in the file for the error a second writer gets.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: Any = None
        #: the folders above ``path`` that claiming it created (:func:`discard_if_unused`)
        self.made: tuple[Path, ...] = ()

    def acquire(self) -> RunLock:
        file = _open_for_writing(self.path / LOCK, "a+")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise ConfigError(
                f"{str(self.path)!r} is in use by process {holder} (another bigbatch command "
                "writes it); wait for it or stop it"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


def claim_new_run_dir(path: Path, resumable: bool = True) -> RunLock:
    """Create ``path`` (or take an empty one) and lock it, as one step: of two runs started
    on one ``--out`` at once, one gets it and the other a one-line error."""
    path = Path(path)
    made = tuple(p for p in path.parents if not p.exists())
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the directory, or one of its parents, should be
        raise ConfigError(f"--out {str(path)!r} cannot be created: a file is in its way") from None
    except OSError as err:
        raise ConfigError(f"--out {str(path)!r} cannot be created: {_reason(err)}") from None
    if not path.is_dir():
        raise ConfigError(f"--out {str(path)!r} is not a directory")
    lock = RunLock(path).acquire()
    lock.made = made
    try:
        check_new_run_dir(path, resumable)  # under the lock: nobody else can be filling it now
    except ConfigError:
        lock.release()
        raise
    return lock


def claim_plan(
    out: Path,
    file: str,
    plan: dict[str, Any],
    what: str,
    *,
    config_at: str,
    compared: Callable[[dict[str, Any]], Any] = lambda plan: plan,
) -> RunLock:
    """Lock ``out`` as the folder of ``plan`` (a comparison, a study, a measurement), which
    ``out / file`` keeps so that running it again continues it: a new or empty folder,
    where ``plan`` is written, or one whose saved plan is the same (``compared``: what must
    not change between sessions). Otherwise a :class:`ConfigError` naming the first
    difference, or the folder's other contents."""
    path = out / file
    if not path.is_file():
        if out.is_dir() and _holds_files(out):
            raise ConfigError(f"--out {str(out)!r} holds no {what}: choose a new folder")
        lock = claim_new_run_dir(out)
        write_atomically(path, json.dumps(plan, indent=2) + "\n")
        return lock
    saved, wanted = compared(read_json(path)), json.loads(json.dumps(compared(plan)))
    difference = plan_difference(saved, wanted, config_at)
    if difference:
        raise ConfigError(
            f"--out {str(out)!r} holds a {what} of other settings ({difference}); choose a new "
            "folder, or the same settings to continue it"
        )
    return RunLock(out).acquire()


def discard_if_unused(out: Path, made: tuple[Path, ...] = ()) -> None:
    """Remove a new run directory that a failure left holding only its bookkeeping (the
    lock, a launcher's log), so the same ``--out`` works again at once, and the folders
    above it that claiming it ``made`` (``runs/``), where they are left empty."""
    if out.is_dir() and not _holds_files(out):
        shutil.rmtree(out, ignore_errors=True)
        for folder in made:  # nearest first
            with contextlib.suppress(OSError):  # not empty: another run's, kept
                folder.rmdir()


def check_room(path: Path, need: int) -> None:
    """A one-line error if the file system of ``path`` has less than ``need`` bytes free."""
    free = shutil.disk_usage(path).free
    if free < need:
        raise ConfigError(
            f"{str(path)!r} has {free / 2**20:.1f} MiB free; the run needs about "
            f"{need / 2**20:.1f} MiB ({CHECKPOINTS_OF_ROOM} checkpoints)"
        )


def _open_for_writing(path: Path, mode: str) -> Any:
    try:
        return open(path, mode)
    except OSError as err:
        raise ConfigError(f"cannot write {str(path)!r}: {_reason(err)}") from None


def _reason(err: OSError) -> str:
    """An OSError as a short cause: "permission denied", "no space left on device"."""
    if err.errno is not None:
        return os.strerror(err.errno).lower()
    return str(err)


def disk_error(err: OSError, path: Path | str | None = None) -> ConfigError:
    """An OSError while a run writes, as the one-line error the command prints."""
    where = str(path if path is not None else err.filename or "the run directory")
    hint = "; free some space and resume" if err.errno == errno.ENOSPC else ""
    return ConfigError(f"writing {where!r} failed: {_reason(err)}{hint}")


def first_difference(saved: Any, wanted: Any, where: str = "") -> str:
    """Where two saved plans (JSON values) first differ, in words: ``base.noise_from =
    'sub_batches' there, 'auto' now`` (empty where they agree)."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        for key in sorted(saved.keys() | wanted.keys()):
            found = first_difference(saved.get(key), wanted.get(key), f"{where}{key}.")
            if found:
                return found
        return ""
    if saved == wanted:
        return ""
    return f"{where.rstrip('.') or 'the plan'} = {saved!r} there, {wanted!r} now"


def plan_difference(saved: Any, wanted: dict[str, Any], config_at: str) -> str:
    """:func:`first_difference` of a saved plan and the one asked for, where both hold a
    resolved config at ``config_at``; a saved config that lacks a key was written by an
    earlier bigbatch, and is said to be (no compatibility before 1.0)."""
    if isinstance(saved, dict) and isinstance(saved.get(config_at), dict):
        missing = sorted(wanted.get(config_at, {}).keys() - saved[config_at].keys())
        if missing:
            return f"written by an earlier bigbatch, before the key {missing[0]!r}"
    return first_difference(saved, wanted)


def previous(path: Path) -> Path:
    """Where the checkpoint before ``path``'s current one is kept."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_atomically(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """torch.save to a temporary file, flushed to disk, then renamed over ``path``; with
    ``keep_previous`` the file it replaces is kept as ``<name>.prev<suffix>``, so a checkpoint
    damaged later (a full disk, a bad copy) still has a good predecessor."""
    tmp = _staged(path)
    try:
        with _synced(tmp, "wb") as f:
            torch.save(obj, f)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        tmp.unlink(missing_ok=True)  # the last complete checkpoint stays as it was
        if isinstance(err, OSError):
            raise disk_error(err, path) from None
        raise ConfigError(f"writing {str(path)!r} failed: {err}") from None
    if keep_previous and path.exists():
        copy_atomically(path, previous(path))  # checkpoint.pt exists at every moment
    os.replace(tmp, path)


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text``, written beside it and renamed over it: never half written."""
    staged = _staged(path)
    with _synced(staged, "w") as f:
        f.write(text)
    os.replace(staged, path)


@contextlib.contextmanager
def _synced(path: Path, mode: str) -> Iterator[IO]:
    # a staged file is on disk before its rename: else a power loss may leave the renamed
    # file empty
    with open(path, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def copy_atomically(source: Path, target: Path) -> None:
    """``target`` becomes a copy of ``source`` in one rename: a hard link where the file
    system has them (``source`` is later replaced by a rename, never written in place, so
    the link keeps today's content), else a copy; a half-made copy is never ``target``."""
    staged = _staged(target)
    staged.unlink(missing_ok=True)
    try:
        os.link(source, staged)
    except OSError:  # a file system without hard links
        shutil.copy2(source, staged)
    os.replace(staged, target)


def resumable(path: Path) -> bool:
    """Whether the unfinished run in ``path`` resumes from its checkpoint; a directory that
    a kill left before the first checkpoint is removed, so the run starts again there."""
    if (path / CHECKPOINT).is_file():
        return True
    if path.exists():
        shutil.rmtree(path)
    return False


def load_checkpoint(path: Path, device: torch.device | None = None) -> tuple[dict[str, Any], Path]:
    """The checkpoint at ``path`` and the file it came from: its predecessor (with a
    warning) when ``path`` cannot be read, a one-line :class:`ConfigError` when neither
    can. Loaded with ``weights_only=True``; nothing on disk changes."""
    # a run trained on a GPU resumes on a CPU (its tensors were refused as "corrupted")
    map_location = "cpu" if device is not None and device.type == "cpu" else None
    kept = previous(path)
    if not path.is_file():
        hint = f"; the previous checkpoint is kept at {str(kept)!r}" if kept.is_file() else ""
        raise ConfigError(f"no checkpoint at {str(path)!r}: nothing to resume{hint}")
    try:
        return torch.load(path, weights_only=True, map_location=map_location), path
    except Exception as err:  # a truncated or corrupted file
        damage = f"checkpoint {str(path)!r} cannot be read ({first_line(err)})"
    if kept.is_file():
        try:
            checkpoint = torch.load(kept, weights_only=True, map_location=map_location)
        except Exception as err:  # reported beside the first file's damage
            damage += f", nor can the previous one ({first_line(err)})"
        else:
            warnings.warn(
                f"{damage}; resuming from the previous checkpoint {str(kept)!r}",
                RuntimeWarning,
                stacklevel=2,
            )
            return checkpoint, kept
    raise ConfigError(f"{damage}; it is truncated or corrupted")


def first_line(err: BaseException, width: int = 120) -> str:
    """An exception as ``Type: its first line``, cut to ``width`` (torch.load's are long)."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= width else text[: width - 1] + "…"


def read_json(path: Path) -> Any:
    """A JSON file bigbatch wrote; one that does not parse is a :class:`ConfigError` naming it."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({err}): damaged?") from None


def cut_lines(path: Path, keep: int) -> int:
    """``path`` cut in place to its first ``keep`` whole lines (made if missing): how many."""
    # one truncate, not a rewrite: a kill midway cannot leave fewer lines than were kept
    size, whole = 0, 0
    with _open_for_writing(path, "ab+") as file:
        file.seek(0)
        for line in file:
            if whole == keep or not line.endswith(b"\n"):  # (a torn last line goes)
                break
            size += len(line)
            whole += 1
        file.truncate(size)
    return whole


def read_metrics(out: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` (or another JSON-lines file), a record per line; a line
    that does not parse is a :class:`ConfigError` naming the file and the line."""
    path = Path(out) / name
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{str(path)!r} line {number} is not valid JSON ({err}): damaged?"
                ) from None
    return records


def read_config(out: Path) -> RunPlan:
    """The config a run saved, planned when it started (without its values' origins)."""
    path = Path(out) / "config.toml"
    saved = load_toml(path)  # (names the file where it does not parse)
    try:
        return RunPlan(resolve(saved))
    except ConfigError as err:  # a value edited there: the file named, not the user's flags
        raise ConfigError(f"{str(path)!r}: {err}") from None
