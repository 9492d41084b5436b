"""The README's option table names every option of ``redlite serve --help``, and only those;
``python -m redlite`` runs the CLI."""

from __future__ import annotations

import re
from pathlib import Path

from redlite.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def serve_options() -> set[str]:
    """Every long option of the ``serve`` sub-command (``--help`` aside)."""
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    serve = commands.choices["serve"]
    return {o for a in serve._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def readme_table_options() -> set[str]:
    """The options written in the README's "Options" table."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = [re.split(r"(?<!\\)\|", line)[1] for line in section.splitlines()
            if line.startswith("| `")]  # first cell; "\|" is a pipe inside a cell
    return set(re.findall(r"--[a-z][a-z0-9-]*", " ".join(rows)))


def test_readme_lists_every_serve_option():
    missing = serve_options() - readme_table_options()
    assert not missing, f"options of `redlite serve` missing from the README table: {sorted(missing)}"


def test_readme_lists_no_unknown_option():
    unknown = readme_table_options() - serve_options()
    assert not unknown, f"README table names options `redlite serve` does not have: {sorted(unknown)}"


def test_python_dash_m_runs_the_cli():
    """``python -m redlite`` is the console script (the way to run a source checkout)."""
    import os
    import subprocess
    import sys

    src = str(README.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "redlite", "--version"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("redlite ")
