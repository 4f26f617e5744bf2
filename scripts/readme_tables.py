"""Regenerate, or check, every generated table of a markdown file (README.md by default).

    python scripts/readme_tables.py --check          # exit 1 where a table differs from what its command prints
    python scripts/readme_tables.py --write          # replace each table with its command's output

A generated table is the block of `|` lines right after a comment `<!-- generated: COMMAND -->`; COMMAND is one of
this directory's scripts (`python scripts/readme_table.py ...`), run from the repository root with this Python.
Why: a results table in the README must come from a results file in the repository, never be typed by hand, and
be replaced, not appended to, when a new run supersedes it. Pure Python (runs the table scripts, which need no
torch).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- generated: (.*) -->$")


def render(command: str) -> list[str]:
    """What COMMAND prints: one of this directory's scripts, run by this Python (anything else is refused: a marker
    is text in a file, not a command line to trust)."""
    try:
        args = shlex.split(command)
    except ValueError as error:
        raise SystemExit(f"<!-- generated: {command} -->: {error}") from None
    script = Path(args[1]) if len(args) > 1 else None
    if args[:1] not in (["python"], ["python3"]) or script is None or script.parent != Path("scripts") or \
            not (ROOT / script).is_file():
        raise SystemExit(f"<!-- generated: {command} -->: not one of this directory's scripts "
                         "(python scripts/NAME.py ...)")
    args[0] = sys.executable
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{command}: exit {out.returncode}\n{out.stderr}")
    return out.stdout.rstrip("\n").split("\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", type=Path, default=ROOT / "README.md",
                        help="the markdown file (default: the repository's README.md)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true")
    what.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    path = args.file
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"{path}: cannot be read ({error})") from None
    out, i, stale = [], 0, []
    while i < len(lines):
        out.append(lines[i])
        match = MARK.match(lines[i].strip())
        i += 1
        if not match:
            continue
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        new = render(match[1])
        if lines[i:j] != new:
            stale.append(match[1])
        out += new
        i = j
    for command in stale:
        print(f"differs: {command}", file=sys.stderr)
    if args.write:
        path.write_text("\n".join(out))
    elif stale:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
