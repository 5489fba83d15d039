"""Write the parts of the docs that are generated from the code.

    python tools/gen_docs.py            # rewrite them
    python tools/gen_docs.py --check    # exit 1 if any is out of date

- docs/cli.md, "## Config keys": the listing ``bigbatch train --help`` prints
  (``bigbatch.experiments.config.help_text``), every key with its default and meaning;
- after each ``<!-- generated: NAME -->`` marker, a table made from the code: a command's
  options from its settings class (``options COMMAND``: ``experiments.options.SECTIONS``),
  the controllers from their signatures and docstrings (``controllers``), the optimizers'
  recipes (``recipes``: ``bigbatch.optim.RECIPES``) and the built-in tasks (``tasks``).
  A name, a default or a rule is written once, in the code; the docs repeat none by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config_keys(text: str) -> str:
    """docs/cli.md with its config-key listing replaced by the help's."""
    from bigbatch.experiments.config import help_text

    head, rest = text.split("## Config keys", 1)
    before, _, after = rest.split("```", 2)
    return f"{head}## Config keys{before}```\n{help_text()}\n```{after}"


def _cell(text: str) -> str:
    """Docstring text as a table cell: reST roles and literals as markdown code, one line."""
    text = re.sub(r":\w+:`~?([^`]*)`", r"`\1`", " ".join(text.split()))
    return text.replace("``", "`").replace("|", "\\|")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def controllers_table() -> str:
    """Every registered controller: its constructor with its defaults, its config name, and
    its rule (the second paragraph of its docstring, whose last sentence names its section
    of docs/algorithms.md, linked here)."""
    import inspect

    from bigbatch.batch import CONTROLLERS
    from bigbatch.experiments.config import BatchKeys

    default = BatchKeys.controller
    rows = ["| controller | `batch.controller` | rule |", "|---|---|---|"]
    for name, cls in CONTROLLERS.items():
        params = inspect.signature(cls).parameters.values()
        shown = ", ".join(
            p.name if p.default is inspect.Parameter.empty else f"{p.name}={_shown(p.default)}"
            for p in params
            if p.kind is not p.VAR_KEYWORD
        )
        contrib = " (contrib)" if "contrib" in cls.__module__ else ""
        where = " (the default)" if name == default else contrib
        paragraphs = inspect.getdoc(cls).split("\n\n")
        rule = " ".join(paragraphs[:2])
        section = re.search(r'docs/algorithms\.md, "([^"]+)"\.?', rule)
        if section:
            link = f"[algorithms.md](algorithms.md#{_anchor(' '.join(section[1].split()))})"
            rule = rule.replace(section[0], link)
        rows.append(f"| `{cls.__name__}({shown})`{where} | `{name}` | {_cell(rule)} |")
    return "\n".join(rows)


def recipes_table() -> str:
    """The optimizers' recipes (``bigbatch.optim.RECIPES``), the names that share one in a
    row: weight decay (decoupled for the Adam family), warm-up and decay, own settings."""
    from bigbatch.optim import RECIPES, get_optimizer_info

    groups: dict[object, list[str]] = {}
    for name, recipe in RECIPES.items():
        family = get_optimizer_info(name).family
        key = (recipe.weight_decay, family == "adam", recipe.warmup, recipe.schedule,
               tuple(sorted(recipe.options.items())), recipe.evidence)  # fmt: skip
        groups.setdefault(key, []).append(name)
    rows = ["| optimizers | weight decay | warm-up, decay | settings | from |", "|---" * 5 + "|"]
    for (decay, adam, warmup, schedule, options, evidence), names in groups.items():
        settings = ", ".join(f"{k.replace('_', ' ')} {_shown(v)}" for k, v in options)
        cells = (
            ", ".join(f"`{n}`" for n in names),
            f"{decay:g}, {'decoupled' if adam else 'coupled (L2)'}",
            f"{warmup:.0%}, {schedule}",
            settings,
            evidence,
        )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tasks_table() -> str:
    """The built-in tasks: what each is, its data, model shape, budget, target and the
    Adam family's rates at its base batch (``bigbatch tasks`` prints every rate)."""
    from bigbatch.experiments.tasks import TASKS

    rows = [
        "| task | what | data | width, depth (context) | budget | target | Adam-type rate "
        "(scaled; held) |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in TASKS.values():
        shape = f"{task.width}, {task.depth}" + (f" ({task.context})" if task.context else "")
        metric = task.target_metric.removeprefix("eval_").replace("_", " ")
        rates = f"{_shown(task.lrs['adam'])}; {_shown(task.lrs['adam/held'])} at {task.base_batch}"
        cells = (f"`{task.name}`", task.summary, task.size, shape, f"{task.max_samples:,}",
                 f"{metric} {_shown(task.target)}", rates)  # fmt: skip
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def generated_tables(text: str) -> str:
    """``text`` with the table after each ``<!-- generated: NAME -->`` made from the code."""
    from bigbatch.experiments.flags import options_table
    from bigbatch.experiments.options import SECTIONS

    tables = {"controllers": controllers_table, "recipes": recipes_table, "tasks": tasks_table}
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        marker = re.fullmatch(r"<!-- generated: (\w+)(?: (\w+))? -->", lines[i])
        i += 1
        if marker:
            while i < len(lines) and (lines[i].startswith("|") or not lines[i].strip()):
                i += 1  # the old table and the blank lines around it
            kind, name = marker.groups()
            table = options_table(SECTIONS[name]) if kind == "options" else tables[kind]()
            out += [table, ""]
    return "\n".join(out) + "\n"


DOCS = ROOT / "docs"
GENERATED = {
    DOCS / "cli.md": lambda text: generated_tables(config_keys(text)),
    DOCS / "adaptive_batching.md": generated_tables,
    DOCS / "optimizers.md": generated_tables,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say what is out of date")
    args = parser.parse_args()
    stale = []
    for path, generate in GENERATED.items():
        text = path.read_text()
        new = generate(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path}: {'out of date' if args.check else 'written'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
