"""Every report bigbatch writes, rendered from the files a command left in its folder.

One module per kind of folder, each with a ``render(folder) -> report path``
(a tuning study's is :func:`bigbatch.experiments.tune.render_report`, which
reads the study's database before :mod:`.tuning` draws it); :func:`render`
tells the kind by the file that only it has, so ``bigbatch report DIR``
re-renders any of them. The figures share :mod:`.figures`.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..rundir import first_line, read_json
from . import comparison, critical_batch, rounds, run

__all__ = ["render"]


def render(folder: str | Path) -> Path:
    """Re-render the report of a run, a comparison, a tuning study, a critical-batch
    measurement or a federated run; the report's path. A folder whose files are damaged,
    or not what this release writes, is one :class:`ConfigError` naming what failed."""
    folder = Path(folder)
    try:
        return _render(folder)
    except ConfigError:
        raise
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as err:
        missing = isinstance(err, OSError) and err.filename
        why = f"{err.strerror}: {err.filename}" if missing else first_line(err, 300)
        raise ConfigError(
            f"the report of {str(folder)!r} cannot be made from its files ({why})"
        ) from None


def _render(folder: Path) -> Path:
    if (folder / "tune.json").is_file():
        from ..tune import render_report  # reads the study's database (optuna)

        return render_report(folder)
    for marker, kind in (
        ("critical_batch.json", critical_batch),
        ("compare.json", comparison),
        ("rounds.jsonl", rounds),
        ("summary.json", run),
    ):
        if (folder / marker).is_file():
            if kind is run and "config" in read_json(folder / marker):
                kind = rounds  # a federated run's summary (its rounds.jsonl lost)
            return kind.render(folder)
    if (folder / "config.toml").is_file() and (folder / "metrics.jsonl").is_file():
        raise ConfigError(  # a run killed outright (SIGKILL, a lost machine) has no summary
            f"{str(folder)!r} holds a run that has not ended (no summary.json): finish it "
            f"with bigbatch train --resume {folder}, which writes its report"
        )
    if (folder / critical_batch.PLAN).is_file():  # a critical-batch measurement's, written first
        raise ConfigError(
            f"{str(folder)!r} holds a critical-batch measurement that has not measured a point "
            f"yet: run the same bigbatch critical-batch command (--out {folder}) to go on"
        )
    if not folder.is_dir():
        raise ConfigError(f"{str(folder)!r} does not exist")
    raise ConfigError(
        f"{str(folder)!r} is not the folder of a run, a comparison, a tuning study, "
        "a critical-batch measurement or a federated run"
    )
