"""Replicas with conversation affinity (redlite.cluster): the pure routing planner, the
replica's ASGI bridge, the shared session tier between two servers (in process), and one
end-to-end run of a 2-replica Ray Serve application on the echo engine."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from redlite.cli import build_parser
from redlite.cluster.affinity import (AffinityTable, ReplicaLoad, conversation_key, plan_route,
                                      rendezvous)
from redlite.cluster.replica import ForwardedRequest, call_asgi
from redlite.server.run import build_server

# --- the routing key --------------------------------------------------------------------------


def chat(*contents, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"messages": messages}


def test_session_key_comes_first_from_the_one_session_rule():
    body = chat("hi") | {"prompt_cache_key": "body-key"}
    assert conversation_key({"session_id": "h"}, "/v1/chat/completions", body).value == "h"
    key = conversation_key({}, "/v1/chat/completions", body)
    assert (key.value, key.source) == ("body-key", "session")
    anthropic = chat("hi") | {"metadata": {"user_id": "u1"}}
    assert conversation_key({}, "/v1/messages", anthropic).value == "u1"
    assert conversation_key({}, "/v1/responses", {"input": "x", "prompt_cache_key": "r"}).value == "r"


def test_prefix_key_is_stable_across_turns_and_tells_conversations_apart():
    first = conversation_key({}, "/v1/chat/completions", chat("plan a trip", system="be brief"))
    later = conversation_key({}, "/v1/chat/completions",
                             chat("plan a trip", "ok", "to Rome", "sure", "in May", system="be brief"))
    other = conversation_key({}, "/v1/chat/completions", chat("plan a party", system="be brief"))
    other_system = conversation_key({}, "/v1/chat/completions", chat("plan a trip", system="x"))
    assert first.source == "prefix" and first == later
    assert len({first.value, other.value, other_system.value}) == 3
    parts = chat("q")
    parts["messages"][0]["content"] = [{"type": "text", "text": "q"}]
    assert conversation_key({}, "/v1/chat/completions", parts).source == "prefix"
    long = "x" * 1000
    assert conversation_key({}, "/v1/completions", {"prompt": long}) == \
        conversation_key({}, "/v1/completions", {"prompt": long + " more"})
    assert conversation_key({}, "/v1/models", None) is None
    assert conversation_key({}, "/v1/chat/completions", {"messages": "bad"}) is None


# --- the plan ---------------------------------------------------------------------------------

REPLICAS = [ReplicaLoad("a", 0), ReplicaLoad("b", 2), ReplicaLoad("c", 1)]


def test_plan_prefers_remembered_then_rendezvous_and_says_why():
    route = plan_route("k", REPLICAS, "b", max_waiting=4)
    assert route.ranked == ("b", "a", "c") and route.reason == "remembered"
    new = plan_route("k", REPLICAS, None, max_waiting=4)
    assert new.preferred == rendezvous("k", ["a", "b", "c"]) and new.reason.startswith("new")
    assert sorted(new.ranked) == ["a", "b", "c"]
    moved = plan_route("k", REPLICAS, "gone", max_waiting=4)
    assert moved.preferred == new.preferred and "gone" in moved.reason


def test_plan_passes_over_an_overloaded_replica_and_routes_keyless_by_load():
    route = plan_route("k", REPLICAS, "b", max_waiting=2)
    assert route.ranked == ("a", "c", "b") and "overloaded" in route.reason
    assert plan_route(None, REPLICAS, None, 4).ranked == ("a", "c", "b")
    assert plan_route("k", [], None, 4).ranked == ()


def test_removing_a_replica_moves_only_its_own_conversations():
    keys = [f"conv-{i}" for i in range(300)]
    before = {k: rendezvous(k, ["a", "b", "c"]) for k in keys}
    after = {k: rendezvous(k, ["a", "c"]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "b")
    assert 50 < sum(v == "b" for v in before.values()) < 150  # spread over the replicas


def test_affinity_table_forgets_least_recent_first():
    table = AffinityTable(capacity=2)
    table.record("x", "a")
    table.record("y", "b")
    table.get("x")
    table.record("x", "c")
    table.record("z", "a")
    assert (table.get("x"), table.get("y"), table.get("z"), len(table)) == ("c", None, "a", 2)


# --- one replica's server, in process -----------------------------------------------------------


def serve_args(*extra):
    return build_parser().parse_args(["serve", "--engine", "echo", *extra])


def forwarded(body: dict, path="/v1/chat/completions", headers=()):
    data = json.dumps(body).encode()
    return ForwardedRequest("POST", path, b"", [("host", "localhost"),
                            ("content-type", "application/json"), *headers], data)


async def collect(app, request, close_after=None):
    items = []
    stream = call_asgi(app, request, [("x-redlite-replica", "r1")])
    async for item in stream:
        items.append(item)
        if close_after is not None and len(items) >= close_after:
            await stream.aclose()
            break
    return items


def test_call_asgi_streams_the_app_response_and_names_the_replica():
    server = build_server(serve_args())
    try:
        items = asyncio.run(collect(server.app, forwarded(chat("hello") | {"stream": True})))
        status, headers = items[0]
        assert status == 200 and ("x-redlite-replica", "r1") in headers
        body = b"".join(items[1:]).decode()
        assert body.count("data: ") > 2 and body.rstrip().endswith("data: [DONE]")
        bad = asyncio.run(collect(server.app, forwarded({"messages": 3})))
        assert bad[0][0] == 400 and b'"param"' in b"".join(bad[1:])
        cut = asyncio.run(collect(server.app, forwarded(chat("x" * 200) | {"stream": True}),
                                  close_after=2))
        assert cut[0][0] == 200
        again = asyncio.run(collect(server.app, forwarded(chat("after"))))
        assert again[0][0] == 200  # the server keeps serving after a client left
    finally:
        server.worker.shutdown()


def usage_of(items):
    return json.loads(b"".join(items[1:]))["usage"]


def test_a_conversation_parked_by_one_server_is_restored_by_another(tmp_path):
    shared = ["--session-dir", str(tmp_path), "--session-min-tokens", "1", "--park-slots", "0"]
    a, b = build_server(serve_args(*shared)), build_server(serve_args(*shared))
    try:
        first = chat("the shared tier keeps this conversation")
        reply = asyncio.run(collect(a.app, forwarded(first)))
        answer = json.loads(b"".join(reply[1:]))["choices"][0]["message"]
        asyncio.run(collect(a.app, forwarded(chat("another conversation"))))  # parks the first
        assert any(tmp_path.glob("rl-*.rlsession"))
        turn = {"messages": first["messages"] + [answer, {"role": "user", "content": "next"}]}
        usage = usage_of(asyncio.run(collect(b.app, forwarded(turn))))  # b started before a wrote
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage_of(reply)["total_tokens"] - 1
    finally:
        for server in (a, b):
            server.worker.shutdown()


class FakeReplicas:
    """A replica handle whose replica dies before answering (or answers ``items``)."""

    def __init__(self, items=None):
        self.items, self.calls = items, []

    def options(self, **_):
        return self

    def remote(self, request, **kwargs):
        self.calls.append((request, kwargs))
        items = self.items

        async def stream():
            if items is None:
                raise RuntimeError("actor died")
            for item in items:
                yield item
        return stream()


def ingress_call(replicas, path, body: bytes, headers=()):
    pytest.importorskip("ray", reason="ray[serve] not installed")
    from starlette.requests import Request

    from redlite.cluster.ingress import Ingress

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers], "client": ("1.2.3.4", 5)}

    async def run():
        response = await Ingress(replicas)(Request(scope, receive))
        chunks = [c async for c in response.body_iterator] if hasattr(response, "body_iterator") \
            else [response.body]
        return response, b"".join(chunks)
    return asyncio.run(run())


def test_ingress_forwards_the_key_and_renames_the_replica_request_id():
    replicas = FakeReplicas([(200, [("x-request-id", "req_1"), ("x-redlite-replica", "r")]), b"ok"])
    response, body = ingress_call(replicas, "/v1/chat/completions",
                                  json.dumps(chat("route me")).encode(), [("session_id", "s9")])
    request, kwargs = replicas.calls[0]
    assert kwargs == {"affinity_key": "s9"} and request.client == ("1.2.3.4", 5)
    assert response.status_code == 200 and body == b"ok"
    assert (b"x-redlite-request-id", b"req_1") in response.raw_headers


def test_ingress_answers_503_in_the_surface_shape_when_no_replica_answers():
    response, body = ingress_call(FakeReplicas(), "/v1/messages", b"{}")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(body)["type"] == "error"  # Anthropic's error shape on /v1/messages


def test_serve_cluster_refuses_bad_options_before_starting_ray(tmp_path):
    from redlite.cli import main

    assert main(["serve-cluster", "--engine", "echo", "--replicas", "0"]) == 1
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["serve-cluster", "--engine", "echo", "--session-dir", str(blocked)]) == 1


# --- end to end on Ray Serve ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_until_ok(client, body, headers, deadline_s=90.0):
    """POST the chat body, retrying while Ray Serve replaces a dead replica."""
    end = time.monotonic() + deadline_s
    while True:
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        if response.status_code == 200 or time.monotonic() > end:
            return response
        time.sleep(0.5)


def test_two_replicas_on_ray_serve_keep_affinity_survive_a_dead_replica_and_save_on_removal(tmp_path):
    ray = pytest.importorskip("ray", reason="ray[serve] not installed")
    from redlite.cluster.run import start_cluster, stop_cluster

    port = free_port()
    args = build_parser().parse_args([
        "serve-cluster", "--engine", "echo", "--replicas", "2", "--replica-cpus", "0",
        "--port", str(port), "--session-dir", str(tmp_path), "--session-min-tokens", "1",
        "--park-slots", "0", "--log-level", "warning"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stopped = False
    try:
        start_cluster(args)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        conversations = [({"session_id": f"s{i}"}, chat(f"keyed conversation {i}")) for i in range(3)]
        conversations += [({}, chat(f"keyless conversation {i}")) for i in range(2)]
        # five: an odd count, so a round-robin router would move every conversation each turn
        where: list[set] = [set() for _ in conversations]
        cached: list[list[int]] = [[] for _ in conversations]
        for turn in range(3):
            for i, (headers, body) in enumerate(conversations):
                response = post_until_ok(client, body, headers)
                assert response.status_code == 200, response.text
                where[i].add(response.headers["x-redlite-replica"])
                cached[i].append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                body["messages"] += [response.json()["choices"][0]["message"],
                                     {"role": "user", "content": f"turn {turn}"}]
        assert all(len(w) == 1 for w in where), where  # every turn on the conversation's replica
        assert all(c[0] < c[1] < c[2] for c in cached), cached  # the held state is extended
        stream = client.post("/v1/chat/completions", headers=conversations[0][0],
                             json=conversations[0][1] | {"stream": True})
        assert stream.text.rstrip().endswith("data: [DONE]")
        assert stream.headers["x-redlite-replica"] in where[0]
        assert client.get("/health").status_code == 200
        surfaces = [("/v1/completions", {"prompt": "abc", "max_tokens": 4}),
                    ("/v1/messages", {"model": "m", "max_tokens": 8, "metadata": {"user_id": "u"},
                                      "messages": [{"role": "user", "content": "hi"}]}),
                    ("/v1/responses", {"input": "hi", "prompt_cache_key": "r"})]
        for path, body in surfaces:  # every API surface goes through the ingress
            response = client.post(path, json=body)
            assert response.status_code == 200 and "x-redlite-replica" in response.headers, path
        bad = client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "error" in bad.json()
        # kill the replica of conversation 0: its conversations move and restore from disk
        victim = next(iter(where[0]))
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].endswith(victim))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        moved = [i for i, w in enumerate(where) if victim in w]
        for i in moved:
            headers, body = conversations[i]
            response = post_until_ok(client, body, headers)
            assert response.status_code == 200, response.text
            assert response.headers["x-redlite-replica"] != victim
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # a removed replica saves its live conversation: the last one, never parked
        last = chat("the last conversation before the stop")
        first = post_until_ok(client, last, {}).json()
        answer = first["choices"][0]["message"]
        stop_cluster()
        stopped = True
        later = build_server(serve_args("--session-dir", str(tmp_path)))
        try:
            turn = {"messages": last["messages"] + [answer, {"role": "user", "content": "more"}]}
            usage = usage_of(asyncio.run(collect(later.app, forwarded(turn))))
            assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["total_tokens"] - 1
        finally:
            later.worker.shutdown()
    finally:
        try:
            if not stopped:
                stop_cluster()
        finally:
            ray.shutdown()
