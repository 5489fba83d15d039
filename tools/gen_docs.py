"""Write the parts of the docs that are generated from the code.

    python tools/gen_docs.py            # rewrite them
    python tools/gen_docs.py --check    # exit 1 if any is out of date

- docs/cli.md, "## Config keys": the listing ``bigbatch train --help`` prints
  (``bigbatch.experiments.config.help_text``), every key with its default and meaning;
- docs/cli.md, each table after ``<!-- generated: options NAME -->``: that command's
  options, from its settings class (``bigbatch.experiments.options.SECTIONS``).
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


def options_tables(text: str) -> str:
    """docs/cli.md with the table after each ``<!-- generated: options NAME -->`` made from
    the command's settings class."""
    from bigbatch.experiments.flags import options_table
    from bigbatch.experiments.options import SECTIONS

    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        marker = re.fullmatch(r"<!-- generated: options (\w+) -->", lines[i])
        i += 1
        if marker:
            while i < len(lines) and (lines[i].startswith("|") or not lines[i].strip()):
                i += 1  # the old table and the blank lines around it
            out += [options_table(SECTIONS[marker[1]]), ""]
    return "\n".join(out) + "\n"


GENERATED = {ROOT / "docs" / "cli.md": lambda text: options_tables(config_keys(text))}


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
