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


def test_the_results_index_names_commits_by_7_digits_whatever_git_s_default():
    """git abbreviates a hash by more digits as a repository's objects grow (core.abbrev's default): a copy of this
    repository holding more objects must still write the index's 7-digit cells."""
    import os

    env = {**os.environ, "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.abbrev", "GIT_CONFIG_VALUE_0": "9"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_index.py"), "--check"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "written:" not in done.stderr, done.stderr  # (a shallow clone: commits not checked)


def test_the_results_index_checks_its_rows_without_the_history_it_was_written_from(tmp_path):
    """A copy of the repository without git (or shallow, or with history rewritten) cannot name the commits the index
    names: the check leaves the commits out and says so, and still fails on a row that is not what the script writes,
    showing that row."""
    import os
    import shutil

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "results_index.py", tmp_path / "scripts")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    for entry in (ROOT / "docs" / "results").iterdir():
        if entry.name != "index.md":
            (results / entry.name).symlink_to(entry)
    index = (ROOT / "docs" / "results" / "index.md").read_text()
    (results / "index.md").write_text(index)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "GIT_DIR": str(tmp_path / "no-git")}

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(tmp_path / "scripts" / "results_index.py"), "--check"], env=env,
                              capture_output=True, text=True)

    done = check()
    assert done.returncode == 0 and "commits not checked" in done.stderr, done.stderr
    (results / "index.md").write_text(index.replace("the static backend compiled on an H200", "an edited row"))
    done = check()
    assert done.returncode == 1 and "written: | [gpu.md](gpu.md) | an edited row" in done.stderr, done.stderr


def test_every_generated_table_of_the_results_pages_is_what_its_command_prints():
    """gpu.md's tables are printed from a lent GPU's JSON, cpu.md's from bench runs: a page edited by hand, or a JSON
    replaced without its tables, fails here as the README would."""
    pages = [page for page in sorted((ROOT / "docs").rglob("*.md")) if "<!-- generated:" in page.read_text()]
    assert {"cpu.md", "gpu.md"} <= {page.name for page in pages}
    for page in pages:
        done = script("readme_tables.py", "--check", str(page))
        assert done.returncode == 0, (page, done.stdout, done.stderr)


def test_a_gpu_table_of_a_run_without_its_section_is_one_line(tmp_path):
    """A GPU call cut off by its limit leaves a JSON without its last sections: each table names what it lacks."""
    import json

    path = tmp_path / "gpu.json"
    failed = {"error": "Traceback ..."}  # (gpu_static.py keeps a reference's error in its row)
    path.write_text(json.dumps({"device": "a GPU", "torch": "2", "tests": {"counts": {"PASSED": 3}, "failed": []},
                                "ar": {"transformers generate, dynamic cache": failed}}))
    assert "3 passed" in script("gpu_table.py", str(path), "--table", "machinery").stdout
    assert "| failed (its error is in the JSON) |" in script("gpu_table.py", str(path), "--table", "ar").stdout
    for table in ("summary", "tw", "speculation", "syncs"):
        done = script("gpu_table.py", str(path), "--table", table)
        assert done.returncode == 1 and "no `" + table + "` table in it" in done.stderr, (table, done.stderr)
        assert "Traceback" not in done.stderr and not done.stdout  # (not half a table)
    done = script("gpu_table.py", str(tmp_path / "none.json"))
    assert done.returncode == 1 and "cannot read" in done.stderr and "Traceback" not in done.stderr


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


def test_the_gpu_projection_refuses_a_run_its_costs_do_not_price(tmp_path):
    """The H100's compiled costs are the 1.5B's and the 0.5B's: a run of another target, or a method drafting with
    another model (`self`), was projected at them without a word, and a run without `ar` was a KeyError."""
    import json

    def run_of(target, methods):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"config": {"target": target, "prompts": None, "dataset": "humaneval[:1]"},
                                    "rows": [{"method": m, "prompt_id": "p", "stats": None} for m in methods]}))
        return str(path)

    for path, said in ((run_of("smollm2-135m", ["ar"]), "this run's target is smollm2-135m"),
                       (run_of("qwen2.5-coder-1.5b", ["sd:k=4"]), "this run has no `ar` rows"),
                       (run_of("qwen2.5-coder-1.5b", ["ar", "sd:drafter=self,k=4"]), "drafts with self"),
                       (run_of("qwen2.5-coder-1.5b", ["ar", "cascade:drafters=qwen2.5-coder-0.5b,smollm2-135m"]),
                        "drafts with smollm2-135m")):
        done = script("gpu_projection.py", path, cwd=tmp_path)
        assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, (path, done.stderr)
