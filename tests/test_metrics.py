"""GET /metrics, /v1/conversations, /slots and /dashboard/data on the in-process echo app:
after a known sequence of requests the counters are exactly what the server did."""

from prometheus_client.parser import text_string_to_metric_families

import time

import pytest

from echo_app import echo_client
from redlite.server.metrics import MOVE_BUCKETS


def samples(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out

def value(metrics, name, **labels):
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)

def moves(metrics, kind) -> dict:
    """Observations per tier of ``redlite_{kind}_seconds`` (its ``_count``)."""
    return {tier: value(metrics, f"redlite_{kind}_seconds_count", tier=tier)
            for tier in ("device", "ram", "disk")}


def recorded(parking) -> list:
    """Record the ``on_timing`` calls the metrics also receive."""
    calls, observe = [], parking.on_timing

    def both(kind, tier, seconds):
        calls.append((kind, tier, seconds))
        observe(kind, tier, seconds)

    parking.on_timing = both
    return calls


def complete(client, prompt, max_tokens=4):
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return response.json()["usage"]

def test_counters_after_a_known_sequence():
    with echo_client() as client:
        first = complete(client, "hello world, this is one")           # cold: empty
        other = complete(client, "zzz other prompt")                  # parks the first in RAM
        again = complete(client, "hello world, this is one more")     # restores it from RAM
        assert client.get("/nope").status_code == 404
        assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
        m = samples(client)
        reuse = client.get("/dashboard/data").json()["reuse"]
    usages = [first, other, again]
    assert value(m, "redlite_requests_total", route="/v1/completions", method="POST", status="200") == 3
    assert value(m, "redlite_requests_total", route="/v1/completions", method="POST", status="400") == 1
    assert value(m, "redlite_requests_total", route="unmatched", method="GET", status="404") == 1
    prompt = sum(u["prompt_tokens"] for u in usages)
    reused = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert (prompt, reused) == (24 + 16 + 29, 24)
    assert reuse == {"requests": 3, "reused_requests": 1, "prompt_tokens": prompt,
                     "reused_tokens": reused}
    assert value(m, "redlite_tokens_total", kind="prompt") == prompt
    assert value(m, "redlite_tokens_total", kind="reused") == reused
    assert value(m, "redlite_tokens_total", kind="prefilled") == prompt - reused
    assert value(m, "redlite_tokens_total", kind="generated") == 12
    assert value(m, "redlite_time_to_first_token_seconds_count") == 3
    assert value(m, "redlite_time_per_output_token_seconds_count") == 3
    assert value(m, "redlite_cache_misses_total", action="reset", reason="empty") == 1
    assert value(m, "redlite_cache_misses_total", action="reset", reason="token-mismatch") == 1
    # the restored conversation held 3 generated tokens the new prompt does not have
    assert value(m, "redlite_cache_misses_total", action="rewind", reason="token-mismatch") == 1
    # the first parked when the second came, the second when the first came back
    assert moves(m, "restore") == {"device": 0, "ram": 1, "disk": 0}
    assert moves(m, "park") == {"device": 0, "ram": 2, "disk": 0}
    assert value(m, "redlite_restore_seconds_sum", tier="ram") > 0
    # live: the third prompt + 3 fed-back tokens; RAM: the first (24 + 3) and second (16 + 3)
    assert value(m, "redlite_conversations", tier="live") == 1
    assert value(m, "redlite_conversation_tokens", tier="live") == 29 + 3
    assert value(m, "redlite_conversations", tier="ram") == 2
    assert value(m, "redlite_conversation_tokens", tier="ram") == 27 + 19
    assert value(m, "redlite_tier_budget_bytes", tier="ram") == 1 << 20
    assert value(m, "redlite_queue_depth") == 0
    assert value(m, "redlite_running_sequences") == 0
    assert value(m, "redlite_session_file_refusals_total") == 0

def test_streamed_chat_is_counted_once_with_its_tokens():
    with echo_client() as client:
        body = {"messages": [{"role": "user", "content": "Paris!"}], "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
        assert '"completion_tokens":6' in text.replace(" ", "")
        m = samples(client)
    assert value(m, "redlite_requests_total", route="/v1/chat/completions", method="POST",
                 status="200") == 1
    assert value(m, "redlite_tokens_total", kind="generated") == 6

def test_conversations_slots_and_dashboard_data_match_the_metrics():
    with echo_client() as client:
        complete(client, "first conversation here")
        complete(client, "second one")
        conversations = client.get("/v1/conversations").json()
        m = samples(client)
        slots = client.get("/slots").json()
        data = client.get("/dashboard/data").json()
    tiers = [c["tier"] for c in conversations["data"]]
    assert tiers == ["live", "ram"]
    live, parked = conversations["data"]
    assert live["tokens"] == len("second one") + 3 and parked["tokens"] == len("first conversation here") + 3
    assert live["session_key"] is None and parked["last_used"] > 0
    for tier, totals in conversations["tiers"].items():
        assert totals["conversations"] == value(m, "redlite_conversations", tier=tier)
        assert totals["bytes"] == value(m, "redlite_conversation_bytes", tier=tier)
    assert conversations["tiers"]["ram"]["budget_bytes"] == 1 << 20
    # an engine without device memory: no device budget (none in the metrics either)
    assert conversations["tiers"]["device"]["budget_bytes"] is None
    assert ("redlite_tier_budget_bytes", (("tier", "device"),)) not in m
    assert slots == [{"id": 0, "id_task": -1, "n_ctx": 1 << 20, "is_processing": False,
                      "n_past": live["tokens"], "checkpoints": [], "hits": 0}]
    assert [r["prompt"] for r in data["recent"]] == [23, 10]
    assert data["outcomes"] == {"empty": 1, "token-mismatch": 1}
    assert data["reuse"] == {"requests": 2, "reused_requests": 0, "prompt_tokens": 33,
                             "reused_tokens": 0}

@pytest.mark.timeout(60)
def test_live_conversation_has_its_last_use_time():
    """The live conversation's ``last_used`` is when its last request ended, in seconds since
    the epoch like the parked ones' (it was null)."""
    with echo_client() as client:
        before = time.time()
        complete(client, "first conversation here")
        first = client.get("/v1/conversations").json()["data"][0]
        assert first["tier"] == "live" and before <= first["last_used"] <= time.time()
        time.sleep(0.01)
        complete(client, "second one")
        live, parked = client.get("/v1/conversations").json()["data"]
    assert live["tier"] == "live" and parked["tier"] == "ram"
    assert live["last_used"] > first["last_used"] and live["last_used"] >= parked["last_used"] - 1.0


def test_no_metrics_has_no_route_and_counts_nothing():
    with echo_client(metrics=False) as client:
        complete(client, "abc")
        assert client.get("/metrics").status_code == 404
        assert client.get("/dashboard/data").json() == {"recent": [], "outcomes": {}, "reuse": {}}
        assert client.get("/v1/conversations").status_code == 200


def test_disk_tier_restores_and_refusals(tmp_path):
    from redlite.core.conversations import Conversations
    from redlite.core.parking import ParkingPool
    from redlite.core.sessions import SessionStore, expected_for

    (tmp_path / "rl-00000000000000ab.rlsession").write_bytes(b"not a session file")
    stores = []

    def parking(engine):
        stores.append(SessionStore(tmp_path, expected_for(engine), min_tokens=1))
        stores[0].scan()  # refuses the bad file
        return Conversations(ParkingPool(64, 4), stores[0])  # RAM too small: disk

    with echo_client(parking=parking) as client:
        store = stores[0]
        calls = recorded(client.state.worker.generator.parking)
        first = complete(client, "a first conversation about parsers")
        complete(client, "something else entirely")
        again = complete(client, "a first conversation about parsers, continued")
        m = samples(client)
        listed = client.get("/v1/conversations").json()
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == len("a first conversation about parsers")
    # the first written when the second came, the second when the first came back
    assert moves(m, "restore") == {"device": 0, "ram": 0, "disk": 1}
    assert moves(m, "park") == {"device": 0, "ram": 0, "disk": 2}
    # the live conversation is parked before the chosen one is installed
    assert [(kind, tier) for kind, tier, _ in calls] == [("save", "disk"), ("save", "disk"),
                                                         ("restore", "disk")]
    for kind, name in (("save", "park"), ("restore", "restore")):
        seconds = [s for k, _, s in calls if k == kind]
        assert value(m, f"redlite_{name}_seconds_sum", tier="disk") == pytest.approx(sum(seconds))
        for bound in MOVE_BUCKETS:
            assert value(m, f"redlite_{name}_seconds_bucket", tier="disk", le=repr(float(bound))) \
                == sum(s <= bound for s in seconds)
    assert value(m, "redlite_session_file_refusals_total") == 1
    disk = [c for c in listed["data"] if c["tier"] == "disk"]
    assert len(disk) == value(m, "redlite_conversations", tier="disk") >= 1
    assert sum(c["bytes"] for c in disk) == value(m, "redlite_conversation_bytes", tier="disk") > 0
    assert [c["hits"] for c in disk] == [None] * len(disk)  # files do not keep it
    assert listed["tiers"]["disk"]["budget_bytes"] == store.max_bytes


def test_session_keys_in_conversations():
    def chat(client, session, content):
        r = client.post("/v1/chat/completions", headers={"session_id": session},
                        json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text

    with echo_client() as client:
        chat(client, "agent-a", "first conversation of agent a")
        chat(client, "agent-b", "agent b asks something else")
        listed = client.get("/v1/conversations").json()["data"]
    assert [(c["tier"], c["session_key"]) for c in listed] == [("live", "agent-b"), ("ram", "agent-a")]


def test_device_tier_parks_and_restores():
    with echo_client(park_device_bytes=1 << 20) as client:
        calls = recorded(client.state.worker.generator.parking)
        complete(client, "conversation one, on the device")
        complete(client, "conversation two")                         # parks one on the device
        again = complete(client, "conversation one, on the device again")  # restores it
        m = samples(client)
        listed = client.get("/v1/conversations").json()
    assert again["prompt_tokens_details"]["cached_tokens"] == len("conversation one, on the device")
    assert moves(m, "restore") == {"device": 1, "ram": 0, "disk": 0}
    assert moves(m, "park") == {"device": 2, "ram": 0, "disk": 0}
    assert [(kind, tier) for kind, tier, _ in calls] == [("park", "device"), ("park", "device"),
                                                         ("restore", "device")]
    restore = [s for kind, _, s in calls if kind == "restore"]
    assert value(m, "redlite_restore_seconds_sum", tier="device") == pytest.approx(sum(restore))
    # parked on the device: listed in the device tier, against --park-device-mib
    assert [c["tier"] for c in listed["data"]] == ["live", "device", "device"]
    device = listed["tiers"]["device"]
    assert device["budget_bytes"] == 1 << 20 == value(m, "redlite_tier_budget_bytes", tier="device")
    assert device["conversations"] == 2 == value(m, "redlite_conversations", tier="device")
    assert device["bytes"] == sum(c["bytes"] for c in listed["data"][1:]) \
        == value(m, "redlite_conversation_bytes", tier="device") > 0
    assert listed["tiers"]["ram"]["conversations"] == 0


def test_hits_follow_each_conversation_through_parking():
    def listing(client):
        return [(c["tier"], c["tokens"], c["hits"]) for c in client.get("/v1/conversations").json()["data"]]

    with echo_client() as client:
        seen = []
        for prompt in ("alpha conversation", "alpha conversation", "beta talk", "alpha conversation"):
            complete(client, prompt)  # the echo answers "alph" / "beta": 3 tokens fed back
            seen.append(listing(client))
        slots = client.get("/slots").json()
    assert seen == [
        [("live", 21, 0)],                                  # cold
        [("live", 21, 1), ("ram", 21, 0)],                  # reused (17 tok); the answer's tail parked
        [("live", 12, 0), ("ram", 21, 1)],                  # new; alpha parked with its hit
        [("live", 21, 2), ("ram", 21, 1), ("ram", 12, 0)],  # alpha restored (a copy stays parked)
    ]
    assert slots[0]["hits"] == 2


def test_slot_erase_ends_the_count(tmp_path):
    with echo_client(slot_dir=tmp_path) as client:
        complete(client, "alpha conversation")
        complete(client, "alpha conversation")
        assert client.get("/slots").json()[0]["hits"] == 1
        r = client.post("/slots/0?action=erase", json={"filename": "x.bin"})
        assert r.status_code == 200, r.text
        assert client.get("/slots").json()[0]["hits"] == 0
        # the answer's tail parked by the second request was made whole when the slot was
        # erased (parked with the count of its time, 0): restored from RAM, it is reused once
        complete(client, "alpha conversation")
        assert client.get("/slots").json()[0]["hits"] == 1
        assert [c["hits"] for c in client.get("/v1/conversations").json()["data"]] == [1, 0]


def test_tails_kept_on_the_device_are_the_device_tier():
    """--park-device-mib: a parked state kept in device memory is reported as tier ``device``
    (listing, totals, budget, metrics, restores), one in host memory as ``ram``."""
    with echo_client(park_device_bytes=600) as client:
        complete(client, "first conversation here")    # 26 tok held: 26 * 16 bytes fit the device
        complete(client, "second conversation, longer")  # parks the first on the device
        complete(client, "third")                       # the device is full: the second to RAM
        listed = client.get("/v1/conversations").json()
        m = samples(client)
        complete(client, "first conversation here and more")  # restored from the device
        after = samples(client)
    assert [c["tier"] for c in listed["data"]] == ["live", "device", "ram"]
    device = listed["data"][1]
    assert device["tokens"] == len("first conversation here") + 3
    assert listed["tiers"]["device"] == {"conversations": 1, "tokens": device["tokens"],
                                         "bytes": device["bytes"], "budget_bytes": 600}
    assert listed["tiers"]["ram"]["conversations"] == 1
    for tier in ("live", "device", "ram"):
        assert value(m, "redlite_conversations", tier=tier) == 1
        assert value(m, "redlite_conversation_bytes", tier=tier) == listed["tiers"][tier]["bytes"]
    assert value(m, "redlite_tier_budget_bytes", tier="device") == 600
    assert moves(after, "restore") == {"device": 1, "ram": 0, "disk": 0}
