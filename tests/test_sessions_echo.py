"""Parking, disk sessions and restarts against real server processes with the echo engine.

The echo engine's held state after a turn is the rendered prompt plus every answer byte, so
cached_tokens are predictable exactly; its state costs 8 bytes per token (plus 8 for the held
ids in the pool), so a fractional ``--park-mib`` makes the RAM bound bite.
"""

import re
import signal
import threading
import time

import httpx

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.session_file import read_meta
from redlite.core.parking import RESTORE_MIN_TOKENS

tok = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are a coding agent. Keep answers short."}
A = [SYSTEM, {"role": "user", "content": "Main conversation: refactor the parser module so that "
                                          "every error names its line and column, then run the tests."}]
B = [SYSTEM, {"role": "user", "content": "Sub-agent: list every to-do comment in src/ and group them "
                                          "by file, most recent first, with their authors."}]
C = [SYSTEM, {"role": "user", "content": "One-off question: what does the --park-mib flag bound, "
                                          "and what happens to a conversation evicted from RAM?"}]


def ask(server, messages):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def held(messages, answer):
    return len(tok.render_chat(messages).token_ids) + len(answer.encode())


def again(messages, answer):
    return messages + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": "Now continue where we left off."}]


def test_a_b_a_restored_from_ram(start_server):
    server = start_server()
    answer, _ = ask(server, A)
    ask(server, B)
    reply, cached = ask(server, again(A, answer))
    assert cached == held(A, answer)
    assert reply == "Now continue where we left off."
    log = server.log()
    assert re.search(rf"restored from ram {cached} tok in [\d.]+ ms", log)
    assert re.search(r"parked \d+ tok \(\d+ bytes\) in [\d.]+ ms", log)


def test_a_b_a_through_disk_when_ram_is_too_small(start_server, tmp_path):
    server = start_server("--park-mib", "0.001", "--session-dir", str(tmp_path),
                          "--session-min-tokens", "1")
    answer, _ = ask(server, A)
    ask(server, B)
    _, cached = ask(server, again(A, answer))
    assert cached == held(A, answer)
    log = server.log()
    assert "reason=no-room -> disk" in log
    assert re.search(r"saved \d+ tok \(\d+ bytes\) in [\d.]+ ms", log)
    assert re.search(rf"restored from disk {cached} tok in [\d.]+ ms", log)


def test_pool_of_one_spills_the_least_valuable_to_disk(start_server, tmp_path):
    # room for one of these conversations (about 4 KB each), not two
    server = start_server("--park-mib", "0.006", "--session-dir", str(tmp_path),
                          "--session-min-tokens", "1")
    answer, _ = ask(server, A)
    ask(server, B)  # A parked in RAM
    ask(server, C)  # B parked: A (older) is evicted to disk
    _, cached = ask(server, again(A, answer))
    assert cached == held(A, answer)
    log = server.log()
    assert "reason=value -> disk" in log and "restored from disk" in log
    sizes = [int(m) for m in re.findall(r"pool \d+ entries, (\d+) bytes host", log)]
    assert sizes and max(sizes) <= 0.006 * (1 << 20)


def test_restart_restores_from_disk(start_server, tmp_path):
    args = ("--session-dir", str(tmp_path), "--session-min-tokens", "1")
    first = start_server(*args)
    answer_a, _ = ask(first, A)
    answer_b, _ = ask(first, B)
    assert first.stop() == 0
    # the live conversation (B) and the parked one (A)
    assert len(re.findall(r"saved \d+ tok", first.log())) == 2
    second = start_server(*args)
    assert "2 saved conversations indexed" in second.log()
    _, cached = ask(second, again(A, answer_a))
    assert cached == held(A, answer_a)
    assert "restored from disk" in second.log()
    _, cached = ask(second, again(B, answer_b))
    assert cached == held(B, answer_b)


def test_corrupted_truncated_and_foreign_files_run_cold(start_server, tmp_path):
    args = ("--session-dir", str(tmp_path), "--session-min-tokens", "1")
    first = start_server(*args)
    answer_a, _ = ask(first, A)
    answer_b, _ = ask(first, B)
    answer_c, _ = ask(first, C)
    first.stop()
    files = sorted(tmp_path.glob("rl-*.rlsession"))
    assert len(files) == 3
    by_first_id = {}
    for path in files:
        ids = read_meta(path)[0]["held_ids"]
        for name, messages in (("A", A), ("B", B), ("C", C)):
            prompt = tok.render_chat(messages).token_ids
            if ids[:len(prompt)] == prompt:
                by_first_id[name] = path
    flipped = bytearray(by_first_id["A"].read_bytes())
    flipped[-5] ^= 0x01
    by_first_id["A"].write_bytes(flipped)
    truncated = by_first_id["B"].read_bytes()
    by_first_id["B"].write_bytes(truncated[:len(truncated) // 2])
    second = start_server(*args)
    reply, cached = ask(second, again(A, answer_a))
    assert reply == "Now continue where we left off."
    # A's file is refused at load; another file shares only the system prompt, fewer tokens than
    # RESTORE_MIN_TOKENS and under half what it holds: not worth reading, the request runs cold
    shared = len(tok.render_chat([SYSTEM]).token_ids)
    assert cached == 0 and shared < RESTORE_MIN_TOKENS and 2 * shared < held(C, answer_c)
    log = second.log()
    assert f"refused file {by_first_id['A'].name} reason=checksum" in log
    assert f"refused file {by_first_id['B'].name} reason=truncated" in log
    _, cached = ask(second, again(C, answer_c))
    assert cached == held(C, answer_c)  # the intact file still works
    second.stop()
    # another model (the echo engine without rewind has another fingerprint): refused, cold
    other = start_server(*args, "--echo-no-rewind")
    reply, cached = ask(other, again(C, answer_c))
    assert cached == 0 and reply == "Now continue where we left off."
    assert "reason=fingerprint" in other.log()


def test_pruning_keeps_the_newest_and_leaves_other_files(start_server, tmp_path):
    (tmp_path / "my-notes.txt").write_text("not a session")
    server = start_server("--park-mib", "0", "--session-dir", str(tmp_path),
                          "--session-min-tokens", "1", "--session-keep", "2")
    for i in range(5):
        ask(server, [SYSTEM, {"role": "user", "content": f"conversation number {i} " * 4}])
    server.stop()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "my-notes.txt" in names
    assert len([n for n in names if n.endswith(".rlsession")]) == 2
    assert "reason=prune" in server.log()


def test_stop_during_a_generation_saves_the_stopped_conversation(start_server, tmp_path):
    args = ("--session-dir", str(tmp_path), "--session-min-tokens", "1")
    server = start_server(*args, "--echo-delay-ms", "30")
    results = {}

    def run():
        try:
            results["r"] = httpx.post(server.url + "/v1/chat/completions", json={"messages": A}, timeout=30)
        except httpx.HTTPError as error:
            results["r"] = error
    thread = threading.Thread(target=run)
    thread.start()
    server.wait_for_log("prefill")
    time.sleep(0.3)  # a few tokens generated
    server.signal(signal.SIGTERM)
    thread.join()
    assert server.proc.wait(15) == 0
    match = re.search(r"saved (\d+) tok", server.log())
    assert match, server.log()
    n_saved = int(match.group(1))
    prompt = len(tok.render_chat(A).token_ids)
    assert prompt < n_saved < held(A, A[1]["content"])  # the prompt plus part of the answer
    restarted = start_server(*args)
    assert "1 saved conversations indexed" in restarted.log()
    _, cached = ask(restarted, A)  # the same prompt: restored, then rewound to prompt - 1
    assert cached == prompt - 1
    assert "restored from disk" in restarted.log()
