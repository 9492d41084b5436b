"""Schemathesis against the echo engine's ASGI app, in process: positive and negative data from
/openapi.json, every check (no 5xx, statuses / content types / bodies as documented, valid data
accepted, invalid data rejected, 405s with Allow...), deterministic. Every operation runs every
phase (examples, coverage: each field's boundary and invalid values, fuzzing); the fuzzing
phase's example count is derived from the schema (:func:`example_budget`)."""

import atexit
import shutil
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import settings
from schemathesis.config import SchemathesisConfig
from schemathesis.python import asgi

from echo_app import echo_state
from redlite.server.app import create_app

MAX_EXAMPLES = 40  # an operation with a request body of its own
SHARED_BODY_EXAMPLES = 10  # a body whose every field an earlier operation's body has
PER_PARAMETER = 10  # an operation without a body, per path/query parameter


def example_budget(spec: dict) -> list[dict]:
    """Per-operation ``max-examples`` overrides from the OpenAPI document, where the space is
    small: an operation without a body gets PER_PARAMETER examples per parameter (one when it
    has none: there is one request to make); one whose body's fields all appear, with the same
    schemas, in an earlier operation's body (``/apply-template`` takes the chat-completions
    body, ``count_tokens`` a part of the Messages one) gets SHARED_BODY_EXAMPLES: random bodies
    of that space already go through the same parser at full strength, and its own coverage
    phase still tries every field's boundaries. Others keep MAX_EXAMPLES."""
    overrides, seen = [], []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            content = (operation.get("requestBody") or {}).get("content") or {}
            body = (content.get("application/json") or {}).get("schema")
            if body is None:
                examples = max(1, PER_PARAMETER * len(operation.get("parameters") or []))
            elif any(all(earlier.get(k) == v for k, v in body.get("properties", {}).items())
                     for earlier in seen):
                examples = SHARED_BODY_EXAMPLES
            else:
                seen.append(body.get("properties", {}))
                continue
            overrides.append({"include-name": f"{method.upper()} {path}",
                              "generation": {"max-examples": examples}})
    return overrides


# The schema is loaded at collection time (schemathesis parametrizes from it), so the app and
# its slot folder are made on import; teardown_module removes them (atexit as a fallback for a
# run that collects this module without running it).
_slot_root = Path(tempfile.mkdtemp(prefix="redlite-fuzz-"))
atexit.register(shutil.rmtree, _slot_root, ignore_errors=True)
# a cap as `redlite serve --max-tokens` sets one: a biased echo answer never ends by itself
_state = echo_state(slot_dir=_slot_root / "slots", max_tokens=8)
_app = create_app(_state)
_BUDGET = example_budget(_app.openapi())
CONFIG = SchemathesisConfig.from_dict({
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True,
                   "database": "none"},
    "checks": {"enabled": True},
    "operations": _BUDGET,
})
schema = schemathesis.openapi.from_asgi("/openapi.json", _app, config=CONFIG)
# one in-process client for every call (not one per call), without the per-request proxy lookup
_client = asgi.get_client(_app).__enter__()
_client.trust_env = False


def teardown_module(module):
    _state.worker.shutdown(wait_s=2.0)
    shutil.rmtree(_slot_root, ignore_errors=True)


def test_the_budget_keeps_full_strength_where_the_space_is_large():
    budget = {entry["include-name"]: entry["generation"]["max-examples"] for entry in _BUDGET}
    for full in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
                 "POST /v1/responses", "POST /tokenize", "POST /slots/{id_slot}"):
        assert full not in budget
    assert budget["POST /apply-template"] == budget["POST /v1/messages/count_tokens"] == SHARED_BODY_EXAMPLES
    assert budget["GET /health"] == 1 and budget["GET /v1/models/{model_id}"] == PER_PARAMETER


@schema.parametrize()
@settings(deadline=None)
def test_openapi_conformance(case):
    case.call_and_validate(session=_client, headers={"host": "127.0.0.1"})
