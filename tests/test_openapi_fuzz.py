"""Schemathesis against the echo engine's ASGI app, in process: positive and negative data from
/openapi.json, every check (no 5xx, statuses / content types / bodies as documented, valid data
accepted, invalid data rejected, 405s with Allow...), bounded examples (MAX_EXAMPLES per
operation, deterministic)."""

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

MAX_EXAMPLES = 40

CONFIG = SchemathesisConfig.from_dict({
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True,
                   "database": "none"},
    "checks": {"enabled": True},
})

# The schema is loaded at collection time (schemathesis parametrizes from it), so the app and
# its slot folder are made on import; teardown_module removes them (atexit as a fallback for a
# run that collects this module without running it).
_slot_root = Path(tempfile.mkdtemp(prefix="redlite-fuzz-"))
atexit.register(shutil.rmtree, _slot_root, ignore_errors=True)
# a cap as `redlite serve --max-tokens` sets one: a biased echo answer never ends by itself
_state = echo_state(slot_dir=_slot_root / "slots", max_tokens=8)
_app = create_app(_state)
schema = schemathesis.openapi.from_asgi("/openapi.json", _app, config=CONFIG)
# one in-process client for every call (not one per call), without the per-request proxy lookup
_client = asgi.get_client(_app).__enter__()
_client.trust_env = False


def teardown_module(module):
    _state.worker.shutdown(wait_s=2.0)
    shutil.rmtree(_slot_root, ignore_errors=True)


@schema.parametrize()
@settings(deadline=None)
def test_openapi_conformance(case):
    case.call_and_validate(session=_client, headers={"host": "127.0.0.1"})
