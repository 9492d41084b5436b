"""The llama.cpp-compatible slot API (save / restore / erase) against echo-engine servers."""

import stat
import threading

import httpx
import pytest

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.server.slots import validate_filename

tok = ByteTokenizer()
CONV = [{"role": "user", "content": "Remember the number 42 and the word lighthouse."}]

HOSTILE = [
    "", ".", "..", "../x.bin", "../../etc/passwd", "/etc/passwd", "a/b.bin", "a\\b.bin",
    ".hidden", ".bashrc", "x/../y", "..%2f..%2fetc", "x\x00y", "name with space", "~root",
    "a" * 129, "файл.bin", "x..bin", "C:evil", "x|y", "$(reboot)", "rl-0123456789abcdef.rlsession",
    "x.bin\n", "x.bin\r", "\nx.bin", "x.bin\n\n",
]


def test_validate_filename_rejects_hostile_names():
    for name in HOSTILE + [None, 42, ["x"]]:
        with pytest.raises(ValueError):
            validate_filename(name)
    for name in ("x.bin", "slot-0_backup.v2", "A", "a" * 128):
        assert validate_filename(name) == name


def slot(server, action, body=None, id_slot="0"):
    if body is None:
        body = {"filename": "unused.bin"}  # every action takes the same body
    return httpx.post(f"{server.url}/slots/{id_slot}", params={"action": action}, json=body, timeout=30)


def ask(server, messages):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_disabled_without_slot_save_path(echo_server):
    r = slot(echo_server, "save", {"filename": "x.bin"})
    assert r.status_code == 501
    error = r.json()["error"]
    assert "--slot-save-path" in error["message"] and error["type"] == "not_implemented_error"
    assert set(error) == {"message", "type", "param", "code", "request_id"}


def test_save_erase_restore(start_server, tmp_path):
    server = start_server("--slot-save-path", str(tmp_path / "slots"))
    tmp_path = tmp_path / "slots"
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700  # they decode to whole conversations
    answer, _ = ask(server, CONV)
    held = len(tok.render_chat(CONV).token_ids) + len(answer.encode())
    r = slot(server, "save", {"filename": "conv.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == 0 and saved["filename"] == "conv.bin"
    assert saved["n_saved"] == held
    assert saved["n_written"] == (tmp_path / "conv.bin").stat().st_size
    assert stat.S_IMODE((tmp_path / "conv.bin").stat().st_mode) == 0o600
    assert saved["timings"]["save_ms"] >= 0
    r = slot(server, "erase")
    assert r.status_code == 200 and r.json() == {"id_slot": 0, "n_erased": held}
    r = slot(server, "restore", {"filename": "conv.bin"})
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["n_restored"] == held and restored["n_read"] == saved["n_written"]
    assert restored["timings"]["restore_ms"] >= 0
    follow = CONV + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    reply, cached = ask(server, follow)
    assert cached == held and reply == "And?"


def test_hostile_filenames_get_400(start_server, tmp_path):
    server = start_server("--slot-save-path", str(tmp_path / "slots"))
    ask(server, CONV)
    for action in ("save", "restore"):
        for name in HOSTILE + [None, 42, ["x"], {"a": 1}]:
            r = slot(server, action, {"filename": name})
            assert r.status_code == 400, (action, name, r.text)
            assert r.json()["error"]["param"] == "filename"
        r = slot(server, action, {})
        assert r.status_code == 400
    assert list((tmp_path / "slots").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slots"]


def test_bad_requests(start_server, tmp_path):
    server = start_server("--slot-save-path", str(tmp_path))
    assert slot(server, "save", {"filename": "x.bin"}, id_slot="1").status_code == 400
    assert slot(server, "explode", {"filename": "x.bin"}).status_code == 400
    assert slot(server, "restore", {"filename": "missing.bin"}).status_code == 404
    r = httpx.post(f"{server.url}/slots/0?action=save", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    for action in ("save", "erase"):  # a cross-site form post cannot write or erase
        r = httpx.post(f"{server.url}/slots/0?action={action}", content=b'{"filename": "f.bin"}',
                       headers={"content-type": "text/plain"}, timeout=10)
        assert r.status_code == 415
    assert not (tmp_path / "f.bin").exists()
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 64)
    r = slot(server, "restore", {"filename": "junk.bin"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("cannot restore junk.bin: ")
    assert str(tmp_path) not in r.json()["error"]["message"]
    ask(server, CONV)  # the server still serves


def test_file_of_another_model_is_refused(start_server, tmp_path):
    other = start_server("--slot-save-path", str(tmp_path), "--echo-no-rewind")
    ask(other, CONV)
    assert slot(other, "save", {"filename": "other.bin"}).status_code == 200
    server = start_server("--slot-save-path", str(tmp_path))
    r = slot(server, "restore", {"filename": "other.bin"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "fingerprint" in message
    assert "this model is" in message  # what differs, not only the tag


def test_save_waits_for_the_running_generation(start_server, tmp_path):
    server = start_server("--slot-save-path", str(tmp_path), "--echo-delay-ms", "20")
    results = {}
    thread = threading.Thread(target=lambda: results.update(answer=ask(server, CONV)))
    thread.start()
    server.wait_for_log("prefill")
    r = slot(server, "save", {"filename": "during.bin"})  # queued behind the generation
    thread.join()
    answer, _ = results["answer"]
    assert r.status_code == 200
    assert r.json()["n_saved"] == len(tok.render_chat(CONV).token_ids) + len(answer.encode())
