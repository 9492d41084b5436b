"""The CLI as a new user meets it: the README's option table names every option of
``redlite serve --help`` and only those; ``python -m redlite`` runs the CLI; a bad ``--ctx-size``
is a usage error and a missing or non-GGUF ``--model`` one error line (no traceback)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from redlite.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m redlite ARGS`` with this checkout's sources first on the path."""
    src = str(README.parent / "src")
    env = {**os.environ, **env, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "redlite", *args], env=env,
                          capture_output=True, text=True, timeout=60)


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
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("redlite ")


@pytest.mark.parametrize("option", ["--ctx-size", "--prefill-chunk"])
def test_non_positive_sizes_are_usage_errors(option):
    done = run_cli("serve", "--engine", "echo", "--port", "0", option, "0")
    assert done.returncode == 2
    assert f"argument {option}: must be at least 1" in done.stderr


def test_missing_or_bad_model_is_one_error_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"hello")
    for model, fragment in ((tmp_path / "nope.gguf", "does not exist"), (bad, "not a GGUF file")):
        done = run_cli("serve", "--port", "0", "--model", str(model),
                       REDLITE_CACHE_DIR=str(tmp_path / "cache"))
        output = (done.stdout + done.stderr).strip()
        assert done.returncode == 1, output
        assert "Traceback" not in output
        errors = [line for line in output.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "cannot load the model" in errors[0] and fragment in errors[0]


@pytest.mark.timeout(90)
def test_kv_dtype_with_the_echo_engine_is_one_error_line():
    """The echo engine has no KV cache: ``--kv-dtype float16`` there stops the start with one
    error line and status 1 (it used to be ignored, and the server served)."""
    done = run_cli("serve", "--engine", "echo", "--port", "0", "--kv-dtype", "float16")
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 1, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "--kv-dtype float16" in errors[0] and "echo engine" in errors[0]


@pytest.mark.timeout(30)
def test_kv_dtype_help_claims_no_speed_up():
    """The README (and bench/results/long-decode-*-s34-notes.md) measured float16 decoding at
    float32's speed: ``--help`` must not promise faster decode (it did)."""
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    action = next(a for a in commands.choices["serve"]._actions if "--kv-dtype" in a.option_strings)
    assert "half the cache memory" in action.help and "faster" not in action.help
