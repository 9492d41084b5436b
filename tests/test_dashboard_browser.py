"""GET /dashboard in a real headless browser (Debian's ``chromium`` through playwright's
``executable_path``; playwright's own browser download does not work offline).

The echo app is served by uvicorn on a thread of this process (a real socket for the browser),
behind an API key. After a few conversations the page must show the numbers
``/v1/conversations`` answers; the screenshot goes to ``$REDLITE_SCREENSHOT`` or tmp_path.
"""

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from echo_app import echo_state
from redlite.server.app import create_app
from redlite.server.security import SecurityOptions

KEY = "dash-key"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def serve(state):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def chat(http, session, messages) -> str:
    r = http.post("/v1/chat/completions", headers={"session_id": session},
                  json={"messages": messages, "max_tokens": 12})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_dashboard_shows_the_conversations(tmp_path):
    browser_path = find_browser()
    if browser_path is None:
        pytest.skip("no chromium found (apt-get install chromium): dashboard browser test not run")
    sync_api = pytest.importorskip("playwright.sync_api")
    state = echo_state(security=SecurityOptions(api_keys=[KEY]))
    server, thread, url = serve(state)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.Client(base_url=url, headers=auth, timeout=20) as http:
            assert httpx.get(url + "/dashboard", timeout=20).status_code == 401
            agent_a = [{"role": "user", "content": "Agent A: list the files under src/"}]
            answer = chat(http, "agent-a", agent_a)
            chat(http, "agent-b", [{"role": "user", "content": "Agent B: run the tests"}])
            chat(http, "agent-a", agent_a + [{"role": "assistant", "content": answer},
                                             {"role": "user", "content": "now open README.md"}])
            r = http.post("/v1/completions", json={"prompt": "a plain completion", "max_tokens": 5})
            assert r.status_code == 200, r.text
            expected = http.get("/v1/conversations").json()
            data = http.get("/dashboard/data").json()
            recent, reuse = data["recent"], data["reuse"]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, headless=True,
                                        args=["--no-sandbox"])
            try:
                page = browser.new_page(extra_http_headers=auth, viewport={"width": 1000, "height": 760})
                page.goto(url + "/dashboard", timeout=20000)
                page.wait_for_selector("body[data-updated]", timeout=20000)
                rows = page.eval_on_selector_all(
                    "#conversations tbody tr",
                    "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
                tiers = page.eval_on_selector_all(
                    "#tiers tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
                shown_recent = page.eval_on_selector_all(
                    "#recent tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
                hitrate = page.text_content("#hitrate")
                assert page.text_content("#error") == ""
                shot = Path(os.environ.get("REDLITE_SCREENSHOT") or tmp_path / "dashboard.png")
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        server.should_exit = True
        thread.join(10)
        state.worker.shutdown(wait_s=2.0)
    assert [r[:7] for r in rows] == [[c["id"], c["tier"], c["session_key"] or "-", str(c["tokens"]),
                                     str(c["bytes"]), str(len(c["checkpoints"])), str(c["hits"])]
                                    for c in expected["data"]]
    # agent A's second turn reused its first; agent B's first request reused the chat
    # template's opening that A held (its own count: another session key); the plain
    # completion shares nothing
    assert [(c["session_key"], c["hits"]) for c in expected["data"]] == [
        (None, 0), ("agent-b", 1), ("agent-a", 1)]
    assert [r[:4] for r in tiers] == [[tier, str(t["conversations"]), str(t["tokens"]), str(t["bytes"])]
                                      for tier, t in expected["tiers"].items()]
    assert [r[1:4] for r in shown_recent] == [[str(q["prompt"]), str(q["reused"]), str(q["prefilled"])]
                                             for q in reversed(recent)]
    assert hitrate.startswith(f"{reuse['reused_requests']} of {reuse['requests']} requests reused")
    assert f"{reuse['reused_tokens']} of {reuse['prompt_tokens']} prompt tokens" in hitrate
    assert reuse["requests"] == 4 and reuse["reused_requests"] == 2
    assert len(rows) == 3 and shot.stat().st_size > 0
