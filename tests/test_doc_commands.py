"""Every command the docs quote still runs as written: its flags, keys, values and files.

The pages say how each figure was made (``bigbatch compare --config
benchmarks/studies/... --set ...``, ``python benchmarks/step_cost.py --every 8``);
a renamed flag or key, a removed choice or a moved study file would leave a page
whose figures no one can make again. Nothing is run: each command is parsed as the
CLI (or the script) would parse it. Placeholders (``KEY``, ``RATE``, ``K``,
``a|b``, ``...``) are skipped.
"""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from bigbatch import cli
from bigbatch.experiments.config import RENAMED, ConfigError, defaults, schema, with_overrides

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    # the archive keeps the commands of earlier releases as they were run
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results_archive.md"),
    *sorted((ROOT / "benchmarks" / "studies").glob("*.toml")),
]
#: scripts a study file replaced; their commands stay in the pages as measured, beside
#: the study file that makes the same figures now
RETIRED = {
    "benchmarks/evidence_batch.py": "benchmarks/studies/adaptive_vs_static.toml",
    "benchmarks/recipes.py": "benchmarks/studies/recipes.toml",
    "benchmarks/tune_vs_grid.py": "benchmarks/studies/tune_vs_grid.toml",
}
COMMAND = re.compile(
    r"(bigbatch (?:train|compare|tune|report|critical-batch|federated|tasks)\b"
    r"|python benchmarks/\w+\.py\b).*"
)
PLACEHOLDER = re.compile(r"\b[A-Z]{1,}\b|\||<|\.\.\.|[^\x00-\x7f]")
SUBCOMMANDS = next(
    a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)
).choices
KEYS = set(schema()) | set(RENAMED)


def quoted_commands(text: str) -> list[tuple[int, list[str]]]:
    """Each command in ``text`` (its line, its words), continued lines joined, cut at the
    end of an inline code span, a shell comment or the next command of the line."""
    found, lines, fenced = [], text.splitlines(), False
    for number, line in enumerate(lines, 1):
        fenced ^= line.lstrip().startswith("```")
        match = COMMAND.search(line)
        inline = match and line[: match.start()].count("`") % 2
        # a command opens a line of a code block or of a study file's comment
        opens = match and line[: match.start()].strip("# \t") == ""
        if not match or not (inline or (opens and (fenced or line.startswith("#")))):
            continue  # prose or help text that names a command
        command, follow = match.group(0), number
        if inline:  # a `...` span, which may wrap
            while "`" not in command and follow < len(lines):
                command += " " + lines[follow].strip()
                follow += 1
            command = command.split("`")[0]
        while command.rstrip().endswith("\\") and follow < len(lines):
            command = command.rstrip()[:-1] + " " + lines[follow].strip().lstrip("#")
            follow += 1
        command = re.split(r"&&|;|\s\|\s", command)[0]
        found.append((number, [w.strip("[]") for w in shlex.split(command, comments=True)]))
    return found


def problems(words: list[str], page: str) -> list[str]:
    if words[0] == "python":
        script = words[1]
        if script in RETIRED:
            return [] if RETIRED[script] in page else [f"{script} is gone: name {RETIRED[script]}"]
        if not (ROOT / script).is_file():
            return [f"{script} does not exist"]
        source = (ROOT / script).read_text()
        flags = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
        return [f"{script} has no {flag}" for flag in sorted(flags) if f'"{flag}"' not in source]
    parser = SUBCOMMANDS[words[1]]
    known = {option for action in parser._actions for option in action.option_strings}
    found, assignments = [], []
    for flag, value in zip(words[2:], [*words[3:], ""]):
        if not flag.startswith("--"):
            continue
        if flag.split("=")[0] not in known:
            found.append(f"bigbatch {words[1]} has no {flag.split('=')[0]}")
        keys = []
        if flag in ("--set", "--vary", "--search"):
            keys = [value.split("=")[0]]
            if flag == "--set" and not PLACEHOLDER.search(value):
                assignments.append(value)
        elif flag == "--arm":
            keys = [kv.split("=")[0] for kv in re.split(r",(?=[\w.]+=)", value.split(":", 1)[-1])]
        elif flag == "--config" and not (ROOT / value).is_file() and "benchmarks/" in value:
            found.append(f"{value} does not exist")
        found += [f"no key {k}" for k in keys if k not in KEYS and not PLACEHOLDER.search(k)]
    try:
        with_overrides(defaults(), assignments)
    except ConfigError as err:
        found.append(str(err))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_command_parses_as_written(page):
    text = page.read_text()
    bad = [
        f"line {number}: {problem}  ({' '.join(words)[:100]})"
        for number, words in quoted_commands(text)
        for problem in problems(words, text)
    ]
    assert not bad, "\n".join(bad)


def test_the_reader_finds_a_stale_flag_key_value_and_script():
    text = (
        "```bash\nbigbatch train --set batch.controler=ramp --sett x=1 \\\n"
        "    --set seed=2\npython benchmarks/nowhere.py --fast\n```\n"
        'and inline `bigbatch compare --vary batch.initial=64,256 --arm "a:lr=1,oops=2"`,\n'
        "one that wraps, `bigbatch train --set\noptimizer=adamx`.\n"
    )
    commands = quoted_commands(text)
    assert [n for n, _ in commands] == [2, 4, 6, 7]
    found = [p for _, words in commands for p in problems(words, text)]
    assert "no key batch.controler" in found
    assert "bigbatch train has no --sett" in found
    assert any("adamx" in p for p in found)
    assert "benchmarks/nowhere.py does not exist" in found
    assert "no key oops" in found
