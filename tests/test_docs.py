"""The docs tell the current truth: every generated README table is what its command prints from the results files,
and docs/results/index.md is what its script writes from the entries and git (`scripts/readme_tables.py`,
`scripts/results_index.py`); a table's marker runs only this repository's scripts."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def script(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=cwd, capture_output=True,
                          text=True)


def test_the_readme_s_tables_and_the_results_index_are_what_their_scripts_write():
    for name in ("readme_tables.py", "results_index.py"):
        done = script(name, "--check")
        assert done.returncode == 0, (name, done.stderr)


def test_a_table_marker_runs_only_this_repository_s_scripts_and_a_file_is_read_where_it_is_named(tmp_path):
    """A marker is text in a file: `touch`, say, ran; a relative path named the repository's README, whatever the
    directory (so --write would have written over it); a missing file, an empty marker and an unclosed quote were
    tracebacks."""
    (tmp_path / "README.md").write_text("<!-- generated: python scripts/results_index.py --nosuch -->\n| stale |\n")
    (tmp_path / "marked.md").write_text(f"<!-- generated: touch {tmp_path / 'ran'} -->\n| a |\n")
    (tmp_path / "empty.md").write_text("<!-- generated:  -->\n| a |\n")
    (tmp_path / "quote.md").write_text('<!-- generated: python "scripts/x -->\n| a |\n')
    for name, said in (("README.md", "results_index.py --nosuch: exit 2"), ("marked.md", "not one of this directory's"),
                       ("empty.md", "not one of this directory's"), ("quote.md", "No closing quotation"),
                       ("missing.md", "missing.md: cannot be read")):
        done = script("readme_tables.py", "--check", name, cwd=tmp_path)
        assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, (name, done.stderr)
    assert not (tmp_path / "ran").exists()
