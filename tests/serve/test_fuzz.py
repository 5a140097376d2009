"""Property-based fuzzing of the HTTP API from its own OpenAPI document (schemathesis + hypothesis).

Every operation of `/openapi.json` gets bodies that fit the schema (positive) and bodies that do not
(negative), sent to a live server on localhost; no answer may be a 5xx, none may take longer than
CALL_TIMEOUT (a hang fails the test), and afterwards the scheduler must hold no sequence. The short run is in
the default suite; `pytest -m slow tests/serve/test_fuzz.py` runs the long one (docs/SERVING.md, Fuzzing).
"""

from __future__ import annotations

import os

import httpx
import pytest

from .conftest import MODEL, LiveServer, make_app

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

CALL_TIMEOUT = 30.0
"""Seconds one request may take (a tiny model with a 128-position context answers in well under one)."""
SHORT_EXAMPLES = 25
"""Examples per operation and mode in the default suite."""
LONG_EXAMPLES = int(os.environ.get("REFUSION_FUZZ_EXAMPLES", "400"))
"""Examples per operation and mode of the slow run."""


@pytest.fixture(scope="module")
def fuzz_server():
    """A tiny model with a short context (128 positions), so that every valid request decodes quickly."""
    from refusion.config import DecodeConfig
    from refusion.model.tiny import tiny_model, tiny_tokenizer

    app = make_app((tiny_model(max_positions=128), tiny_tokenizer()), max_batch_size=2, max_queue=16,
                   config=DecodeConfig(max_new_tokens=16, slot_size=4, block_size=8))
    with LiveServer(app) as live:
        yield live


def operations(live: LiveServer):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{live.url}/openapi.json", timeout=10).json())
    found = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in found}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= paths, paths
    return found


def fuzz(live: LiveServer, examples: int) -> dict[int, int]:
    """Send `examples` generated requests per operation and mode; return the count of each status seen."""
    statuses: dict[int, int] = {}
    for operation in operations(live):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            cases = operation.as_strategy(generation_mode=mode)

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=cases, served=st.booleans())
            def check(case, served):
                if served and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = MODEL  # else nearly every body names an unknown model (a 404)
                response = case.call(base_url=live.url, timeout=CALL_TIMEOUT, headers={"Connection": "close"})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert response.status_code < 500 or response.status_code == 503 and \
                    response.json()["error"]["code"] == "queue_full", (case.as_curl_command(), response.text)

            try:
                check()
            except Unsatisfiable:  # no invalid input exists for an operation that takes none (GET /health)
                assert mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET", operation.path
    return statuses


def assert_no_sequence_left(live: LiveServer) -> None:
    status = live.wait_idle()
    decoder = live.scheduler.decoder
    assert decoder.live == {} and decoder.cache.row_of == {}, status
    assert status["failed"] == 0 and httpx.get(f"{live.url}/health").json()["status"] == "ok"


@pytest.mark.timeout(300)  # a hang fails, it does not stall the suite
def test_fuzz_api_short(fuzz_server):
    statuses = fuzz(fuzz_server, SHORT_EXAMPLES)
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both valid and invalid bodies
    assert_no_sequence_left(fuzz_server)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_api_long(fuzz_server):
    statuses = fuzz(fuzz_server, LONG_EXAMPLES)
    print(f"fuzz: {LONG_EXAMPLES} examples per operation and mode; statuses {dict(sorted(statuses.items()))}")
    assert_no_sequence_left(fuzz_server)
