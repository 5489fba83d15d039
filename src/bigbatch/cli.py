"""The ``bigbatch`` command: ``train``, ``compare``, ``critical-batch``, ``tune``,
``federated``, ``report``, ``tasks`` (docs/cli.md). Every failure is one line on stderr
with an exit code: 2 a config or environment error, 3 training stopped on non-finite
steps, 4 a training process or collective failed, 128 + N stopped by signal N after a
checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from ._checks import whole_number
from .experiments.config import (
    ConfigError,
    help_text,
    load_toml,
    parse_assignment,
    resolve,
)
from .experiments.flags import add_flags, flag_named, given, settings_from
from .experiments.launch import COLLECTIVE_FAILED, WorkerFailedError, report_to_launcher
from .experiments.options import (
    SECTIONS,
    CriticalSettings,
    FederatedSettings,
    Protocol,
    TuneSettings,
)
from .experiments.rundir import first_line
from .experiments.signals import Stopped

#: what ``pip install bigbatch[cli]`` adds to the core (torch, numpy): the commands' needs
CLI_EXTRA = ("matplotlib", "mnist1d", "tqdm", "tomli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="Adaptive batching and large-batch optimizers for PyTorch.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    parser.set_defaults(commands=commands.choices)  # (for main: a command's own usage)
    _train_arguments(
        _config_command(commands, "train", "train one run and write its directory", TRAIN_NOTES)
    )
    _compare_arguments(
        _config_command(
            commands,
            "compare",
            "train a grid of runs, each at its best rate of a grid, and write one comparison "
            "report",
        )
    )
    _critical_arguments(
        _config_command(
            commands,
            "critical-batch",
            "measure the critical batch along a small-batch run by branched training "
            "(Merrill et al. 2025)",
        )
    )
    _tune_arguments(
        _config_command(
            commands,
            "tune",
            "search the rate (and any number key) by successive halving: runs paused at "
            "fidelities, the best continued (Optuna); resumable; writes best.toml",
        )
    )
    _federated_arguments(
        commands.add_parser(
            "federated",
            help="simulate a Flower federation on one machine (FedAvg) with fixed, switched or "
            "adaptive local batches; writes rounds.jsonl and report.md",
            description=FEDERATED_NOTES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    report = commands.add_parser(
        "report",
        help="re-render the report of a run, a comparison, a tuning study, a critical-batch "
        "measurement or a federated run",
    )
    report.add_argument("dir", metavar="DIR")
    commands.add_parser("tasks", help="list the built-in tasks")
    return parser


TRAIN_NOTES = """\
Train one run into its directory, locked for the run (a second writer exits 2).
SIGTERM or Ctrl-C finishes the current optimizer step, writes a checkpoint and
exits 143 or 130 (a second signal exits at once); --resume DIR continues it.
Exit codes: 0 done; 2 config or environment (one line); 3 training stopped
(non-finite steps); 4 a training process or collective failed (dist.timeout);
130/143 stopped by a signal after a checkpoint. Details: docs/cli.md."""


FEDERATED_NOTES = """\
Simulate a federation of Flower ClientApps in this process (no Ray): every round
each client trains --local-samples samples at the round's local batch; the
server averages the weights (FedAvg), scores the global model on the task's
test set and picks the next local batch by --scheme: fixed (--local-batch),
switch (--large, then --local-batch after --switch of the samples) or
adaptive (bigbatch's controller on the clients' pooled noise statistics, from
--local-batch). Needs the flower extra. Details: docs/federated.md."""


def _federated_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file whose [federated] table sets these")
    add_flags(p, FederatedSettings)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", metavar="DIR", help="output directory (default: under runs/)")


def _config_command(
    commands: Any, name: str, summary: str, notes: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand taking a config: --config, --set, --quiet; its --help lists every key."""
    p = commands.add_parser(
        name,
        help=summary,
        description=notes or summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=help_text(),
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of config keys; its [compare], [tune] or [critical] table sets the "
        "command's own options (a flag overrides them)",
    )
    p.add_argument("--task", metavar="NAME", help="the task (the same as --set task=NAME)")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one config key (repeatable), e.g. --set batch.target=0.5",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument(
        "--out",
        metavar="DIR",
        help="run directory (default: a new timestamped directory under runs/)",
    )
    train.add_argument(
        "--resume", metavar="DIR", help="continue the run in DIR from its checkpoint"
    )
    train.add_argument(
        "--explain",
        action="store_true",
        help="print the run's rate, schedule and every value filled in for it, with where "
        "each came from, and exit without training",
    )
    train.add_argument(
        "--nproc",
        metavar="N",
        type=int,
        default=1,
        help="train data-parallel in N local processes (torch's elastic agent, DDP); "
        "a run may resume with another N",
    )


def _compare_arguments(compare: argparse.ArgumentParser) -> None:
    compare.add_argument(
        "--vary",
        metavar="KEY=V1,V2,...",
        action="append",
        default=[],
        help="a key and its values; several --vary make a grid; keys joined by + vary "
        "together (model.width+model.depth=64+2,32+3)",
    )
    compare.add_argument(
        "--arm",
        metavar="NAME:KEY=V,...",
        action="append",
        default=[],
        help="an arm written out (repeatable): its name and the keys it sets; each --vary "
        "applies to every one",
    )
    add_flags(compare, Protocol)
    # a tuned comparison's studies: bigbatch tune's options, its runs at a time --jobs
    add_flags(compare, TuneSettings, skip=("jobs",), when="with --tune: ")
    compare.add_argument("--out", metavar="DIR", help="comparison directory (default: under runs/)")


def _critical_arguments(critical: argparse.ArgumentParser) -> None:
    add_flags(critical, CriticalSettings)
    critical.add_argument("--out", metavar="DIR", help="output directory (default: under runs/)")


def _tune_arguments(tune: argparse.ArgumentParser) -> None:
    tune.add_argument(
        "--search",
        metavar="KEY=LOW:HIGH[:log]",
        action="append",
        default=[],
        help="a number key and its range (repeatable; default: lr from 1/8 to 8 times the "
        "task's rate, log)",
    )
    add_flags(tune, TuneSettings)
    tune.add_argument(
        "--out", metavar="DIR", help="study folder, new or one to continue (default: under runs/)"
    )


def _file(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` file's keys, flattened (none without one); read once a command,
    however many of its tables the command asks for."""
    if "file_keys" not in vars(args):
        args.file_keys = load_toml(args.config) if getattr(args, "config", None) else {}
    return args.file_keys


def _section(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The ``[name]`` table of the ``--config`` file: a command's own options."""
    prefix = f"{name}."
    return {k.removeprefix(prefix): v for k, v in _file(args).items() if k.startswith(prefix)}


def _settings(args: argparse.Namespace, name: str) -> Any:
    """A command's settings: their defaults, the file's ``[name]`` table, the flags."""
    cls = SECTIONS[name]
    return settings_from(cls, name, _section(args, name), given(cls, args))


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's config: ``--config``'s keys (less the commands' tables), --task, --set."""
    commands = tuple(f"{name}." for name in SECTIONS)
    layers = [{k: v for k, v in _file(args).items() if not k.startswith(commands)}]
    if args.task:
        layers.append({"task": args.task})
    layers.append(dict(parse_assignment(a) for a in args.set))
    return resolve(*layers)


def _train(args: argparse.Namespace) -> int:
    from .experiments.launch import launch
    from .experiments.plan import plan_run
    from .experiments.rundir import new_run_dir, read_config
    from .experiments.runner import train
    from .experiments.signals import LAUNCHER_PID

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if args.resume:
        if args.config or args.set or args.out or args.task:
            raise ConfigError(
                "--resume takes its config from the run; drop --config/--task/--set/--out"
            )
        out = Path(args.resume)
        if not (out / "config.toml").is_file():
            raise ConfigError(f"{str(out)!r} is not a run directory (no config.toml)")
        config = read_config(out)
    else:
        config = _config(args)
        out = Path(args.out) if args.out else None
    if args.explain:
        if args.resume:  # a saved config is already filled in: nothing left to explain
            raise ConfigError("--explain explains a new run's config; drop --resume")
        from .experiments.explain import explain

        print(explain(config, processes=args.nproc))
        return 0
    with warnings.catch_warnings():
        if os.environ.get(LAUNCHER_PID):  # a rank of --nproc: its launcher printed them
            warnings.simplefilter("ignore")
        config = plan_run(config)  # checked here, before a launcher starts processes
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        out = out or new_run_dir(task=config.run.task)
        return launch(args.nproc, out, _rank_arguments(args, out), resume=bool(args.resume))
    summary = train(config, out, resume=bool(args.resume), quiet=args.quiet)
    if _rank() == 0:
        _print_summary(Path(summary["run_dir"]), summary)
    return 0


def _rank_arguments(args: argparse.Namespace, out: Path) -> list[str]:
    """The ``train`` command each of ``--nproc`` ranks runs."""
    command = ["train", "--resume", str(out)] if args.resume else ["train", "--out", str(out)]
    if not args.resume:
        command += ["--config", args.config] if args.config else []
        command += ["--task", args.task] if args.task else []
        for assignment in args.set:
            command += ["--set", assignment]
    return command + (["--quiet"] if args.quiet else [])


def _print_summary(out: Path, summary: dict[str, Any]) -> None:
    # the task's own score first: the eval loss on the language tasks, else the accuracy
    score = "eval_loss" if summary["target_metric"].endswith("loss") else "accuracy"
    print(
        f"{out}: best {score.replace('_', ' ')} {summary[f'best_{score}']:.4f}, "
        f"final {summary[f'final_{score}']:.4f}, "
        f"{summary['steps']} steps ({summary['skipped_steps']} skipped), "
        f"{summary['samples']} samples, average batch "
        f"{summary['avg_batch_size']:.0f}, {summary['wall_seconds']:.0f} s; "
        f"{summary['target_note']}; report: {out / 'report.md'}"
    )


def _compare(args: argparse.Namespace) -> None:
    from .experiments.compare import ARM_OPTIONS, plan, run_comparison

    table, flags = _section(args, "compare"), given(Protocol, args)
    arms = {k: table.pop(k) for k in ARM_OPTIONS if k in table}
    settings_from(Protocol, "compare", table, flags, also=ARM_OPTIONS)  # errors say where
    arms.update({k: v for k, v in (("vary", args.vary), ("arms", args.arm)) if v})
    comparison = plan(_config(args), **{**table, **flags, **arms})
    studies_asked = [k for k in given(TuneSettings, args) if k != "jobs"]  # jobs: compare's
    if studies_asked and not comparison.protocol.tune:
        asked = flag_named(TuneSettings, studies_asked[0])
        raise ConfigError(f"{asked} sets the rate study of --tune: add --tune or drop it")
    out = Path(args.out) if args.out else None
    studies = _settings(args, "tune")  # each arm's rate study, with --tune
    print(f"comparison report: {run_comparison(comparison, out, quiet=args.quiet, tune=studies)}")


def _critical_batch(args: argparse.Namespace) -> None:
    from .experiments.critical import measure
    from .experiments.rundir import new_run_dir

    config, settings = _config(args), _settings(args, "critical")
    out = Path(args.out) if args.out else new_run_dir(task=f"critical-{config['task']}")
    measured = measure(config, out, settings, quiet=args.quiet)
    print((out / "critical_batch.md").read_text())
    print(f"{len(measured)} points measured; report: {out / 'critical_batch.md'}")


def _tune(args: argparse.Namespace) -> None:
    from .experiments.rundir import new_run_dir
    from .experiments.tune import parse_space, tune

    config, settings = _config(args), _settings(args, "tune")  # checked before a folder
    space = parse_space(args.search, config) or None
    out = Path(args.out) if args.out else new_run_dir(task=f"tune-{config['task']}")
    tune(config, out, space, settings, quiet=args.quiet)
    print((out / "tune.md").read_text())
    print(f"best config: {out / 'best.toml'} (bigbatch train --config {out / 'best.toml'})")


def _federated(args: argparse.Namespace) -> None:
    from .experiments.federated import simulate
    from .experiments.rundir import claim_new_run_dir, discard_if_unused, new_run_dir

    stray = [k for k in _file(args) if not k.startswith("federated.")]
    if stray:  # another command's keys: this file is not for this command
        raise ConfigError(
            f"bigbatch federated reads only the [federated] table of {args.config}, "
            f"not {stray[0]!r}"
        )
    try:
        whole_number("--threads", args.threads)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    settings = _settings(args, "federated")
    out = Path(args.out) if args.out else new_run_dir(task=f"federated-{settings.task}")
    # claimed before the rounds: a file in the way failed after them, and two runs on one
    # --out both trained, the last to end the one kept
    lock = claim_new_run_dir(out, resumable=False)  # (a federated run has no --resume)
    try:
        simulate(settings, out, threads=args.threads)
    except BaseException:
        discard_if_unused(out, lock.made)
        raise
    finally:
        lock.release()
    print((out / "report.md").read_text())
    print(f"report: {out / 'report.md'}")


def _report(args: argparse.Namespace) -> None:
    """Re-render the report of whatever command wrote the folder."""
    from .experiments.report import render

    print(render(Path(args.dir)))


def _tasks(args: argparse.Namespace) -> None:
    from .experiments.tasks import TASKS

    for task in TASKS.values():
        name = task.target_metric.removeprefix("eval_")
        rates = ", ".join(f"{k} {v:g}" for k, v in task.lrs.items())
        print(f"{task.name}: {task.summary}")
        print(f"    data      {task.size}")
        print(f"    expected  {task.expected}; target {name} {task.target:g}")
        print(f"    budget    {task.max_samples:,} samples")
        print(f"    rates     {rates} (scaled rates at batch {task.base_batch})")
        for batch, table in task.lrs_at.items():
            measured = ", ".join(f"{k} {v:g}" for k, v in table.items())
            print(f"    at {batch:<6} {measured} (scaled rates measured at batch {batch})")
        if task.lr_rules:
            rules = ", ".join(f"{k} {v}" for k, v in task.lr_rules.items())
            print(f"    rules     {rules} (measured here; else the family's)")
        if task.lr_max:
            ceilings = ", ".join(f"{k} {v:g}" for k, v in task.lr_max.items())
            print(f"    lr_max    {ceilings} (ceilings on a step's rate)")


def main(argv: list[str] | None = None) -> int:
    """The command; its exit code (docs/cli.md: 0 done, 2 config or environment, 3 training
    stopped, 4 a training process or collective failed, 128 + N stopped by signal N)."""
    args, unknown = _parser().parse_known_args(argv)
    if unknown:  # the command's usage, not the top level's (argparse's own gives that)
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    _one_line_warnings()
    try:
        return _run(args)
    except BaseException as err:
        code = _reported(err)
        if code is None:  # not an ordinary failure: a bug, whose traceback helps
            raise
        return code


def _one_line_warnings() -> None:
    """bigbatch's own warnings (a renamed key, a damaged checkpoint: raised in its code or
    of its own category) as one line each on stderr, as its errors are; other packages'
    warnings keep Python's format."""
    default = warnings.formatwarning
    if getattr(default, "one_line", False):  # main() called again in one process
        return

    def one_line(message, category, filename, lineno, line=None):
        ours = category.__module__.partition(".")[0] == "bigbatch"
        if ours or f"{os.sep}bigbatch{os.sep}" in filename:
            # one rank speaks for all of a distributed run, which warn alike
            return f"bigbatch: warning: {message}\n" if _rank() == 0 else ""
        return default(message, category, filename, lineno, line)

    one_line.one_line = True  # type: ignore[attr-defined]
    warnings.formatwarning = one_line


def _rank() -> int:
    # this process's rank in a distributed run (torch's launchers set RANK); 0 alone
    return int(os.environ.get("RANK", "0"))


def _run(args: argparse.Namespace) -> int:
    for name in ("out", "resume", "config", "task", "dir"):  # "" would mean "not given"
        if getattr(args, name, None) is not None and not getattr(args, name).strip():
            raise ConfigError(f"{'DIR' if name == 'dir' else '--' + name} is empty")
    if args.command == "train":
        return _train(args)
    commands = {
        "compare": _compare,
        "critical-batch": _critical_batch,
        "tune": _tune,
        "federated": _federated,
        "report": _report,
        "tasks": _tasks,
    }
    commands[args.command](args)
    return 0


def _reported(err: BaseException) -> int | None:
    """Report an ordinary failure in one line on stderr and return its exit code; None for
    anything else."""
    if isinstance(err, BrokenPipeError):  # `bigbatch tasks | head`: the reader left
        # point stdout at devnull so the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if isinstance(err, ModuleNotFoundError):
        return _missing_extra(err)
    if isinstance(err, ConfigError):
        _error(err)
        return 2
    if isinstance(err, OSError):  # a file the command reads or writes: its path and cause
        _error(f"{err.filename or 'a file'}: {err.strerror or err}")
        return 2
    if isinstance(err, Stopped):  # a signal, after a checkpoint
        if _rank() == 0:
            print(f"bigbatch: {err}", file=sys.stderr)
        return err.code
    if isinstance(err, WorkerFailedError):  # the ranks' lines, gathered into one
        print(err if str(err).startswith("bigbatch: ") else f"bigbatch: error: {err}",
              file=sys.stderr)  # fmt: skip
        return err.code
    if isinstance(err, FloatingPointError):  # non-finite under "raise", or too many skipped
        _error(err, "training stopped")
        return 3
    if isinstance(err, KeyboardInterrupt):
        print("bigbatch: interrupted", file=sys.stderr)
        return 130
    if _out_of_memory(err):
        _error(
            f"out of memory ({first_line(err, 200)}): a smaller model (model.width, "
            "model.depth, model.context) or micro-batch (max_micro_batch) needs less"
        )
        return 2
    if _collective_failure(err):
        _error(f"a collective failed or timed out: {first_line(err, 300)}")
        return COLLECTIVE_FAILED
    return None


#: packages of the optional extras a command may need, and the extra that brings each
OPTIONAL_EXTRAS = {
    "optuna": ("bigbatch tune", "tune"),
    "flwr": ("bigbatch federated", "flower"),
    "tensorboard": ("log.tensorboard", "tensorboard"),
    "mlflow": ("log.mlflow", "mlflow"),
    "wandb": ("log.wandb", "wandb"),
}


def _missing_extra(err: ModuleNotFoundError) -> int | None:
    """The extra that brings a missing package, in one line (exit 2); None for another."""
    package = (err.name or "").partition(".")[0]
    if package in OPTIONAL_EXTRAS:
        what, extra = OPTIONAL_EXTRAS[package]
        _error(f"{what} needs the {extra} extra ({package}): pip install 'bigbatch[{extra}]'")
        return 2
    if package not in CLI_EXTRA:
        return None
    _error(
        f"the command line needs the cli extra ({err.name} is not installed): "
        "pip install 'bigbatch[cli]'"
    )
    return 2


def _error(message: object, prefix: str = "error") -> None:
    """One line on stderr, or, in a rank of ``bigbatch train --nproc N``, to its launcher
    (which prints one line for all ranks)."""
    if report_to_launcher(f"bigbatch: {prefix}: {message}"):
        return
    rank = _rank()
    where = "" if rank == 0 else f" (rank {rank})"  # a failure of one rank only is seen
    print(f"bigbatch: {prefix}{where}: {message}", file=sys.stderr)


def _out_of_memory(err: BaseException) -> bool:
    """An allocation the machine refused: a GPU's, or the CPU's (a RuntimeError)."""
    import torch

    return isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err)
    )


def _collective_failure(err: BaseException) -> bool:
    """A process-group error: a peer died, or stopped answering for dist.timeout."""
    import torch.distributed as dist

    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and "gloo" in str(err).lower()
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
