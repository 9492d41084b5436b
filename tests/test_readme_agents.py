"""The README's OpenAI Agents SDK block runs as written against the bundled model (a ``redlite
serve`` process; only the address is changed): the forced first turn calls the function tool
and the second turn answers in text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.model

README = Path(__file__).resolve().parents[1] / "README.md"


def agents_block() -> str:
    """The python block that follows the README's "OpenAI Agents SDK" paragraph."""
    text = README.read_text(encoding="utf-8")
    after = text.split("OpenAI Agents SDK (", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.timeout(300)
def test_readme_agents_block_runs(tmp_path):
    code = agents_block()
    assert "http://127.0.0.1:8080/v1" in code and "set_tracing_disabled(True)" in code
    with ServerProcess(engine="torch", timeout_s=120) as server:
        script = tmp_path / "agent.py"
        script.write_text(code.replace("http://127.0.0.1:8080", server.url), encoding="utf-8")
        env = {**os.environ, "OPENAI_API_KEY": ""}  # nothing may reach OpenAI
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.strip().splitlines()
        assert lines[0].startswith("['get_weather'") and lines[1].strip(), done.stdout
        log = server.log()
    assert log.count("POST /v1/chat/completions 200") == 2, log
