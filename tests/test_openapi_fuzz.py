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
_state = echo_state(slot_dir=_slot_root / "slots", max_tokens=32)
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(_state), config=CONFIG)


def teardown_module(module):
    _state.worker.shutdown(wait_s=2.0)
    shutil.rmtree(_slot_root, ignore_errors=True)


@schema.parametrize()
@settings(deadline=None)
def test_openapi_conformance(case):
    case.call_and_validate(headers={"host": "127.0.0.1"})
