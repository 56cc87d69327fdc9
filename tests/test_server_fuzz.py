"""Fuzz the server's OpenAPI schema with schemathesis: every operation, schema-valid and schema-breaking bodies,
headers and query strings, in process (ASGI). The check: never a server error (5xx) — a bad request gets a 4xx in
its API's error shape, a good one an answer. The model is the tiny Qwen 3.5 checkpoint with its generation
replaced by a scripted reply of a few tokens, so the fuzz exercises the API layer, not the random weights.
Schema-valid bodies that name a model name the served one (any other is a 404 before the rest is looked at).

What it tried and found is printed at the end (run with ``-s``) and kept in ``FUZZ_REPORT`` for the session note.
"""

from __future__ import annotations

from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from server_util import load_tiny  # noqa: E402

from lumen_core.engine import Stats  # noqa: E402

REPLY = "Sure.\n</think>\n\nHello!"
FUZZ_REPORT: Counter = Counter()


@pytest.fixture(scope="module")
def app(tiny_checkpoint):
    from lumen_core.server.app import create_app

    engine = load_tiny(tiny_checkpoint("qwen3_5"), context=2048)
    ids = engine.tokenizer.backend.encode(REPLY, add_special_tokens=False).ids

    def scripted(prompt_ids, max_tokens=256, params=None):
        engine.check_length(len(prompt_ids))
        engine.stats = st = Stats(prompt_tokens=len(prompt_ids), finish_reason="stop")
        for tok in ids[:max_tokens]:
            st.generated_tokens += 1
            yield tok

    engine.generate_tokens = scripted
    application = create_app(engine, None, "tiny")
    yield application
    application.state.service.close()


def test_no_request_makes_a_server_error(app):
    """Every operation of /openapi.json, 40 schema-valid and 40 schema-breaking cases each (schemathesis' pytest
    plugin does not load under this pytest, so its strategies run through hypothesis directly)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                              "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics"}
    for op, mode in [(op, mode) for op in operations for mode in schemathesis.GenerationMode]:
        try:
            _fuzz(op, mode)
        except Unsatisfiable:  # nothing to break in an operation without a body or parameters
            assert mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET", (op.path, mode)


def _fuzz(op, mode) -> None:
    from hypothesis import given

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        if mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # a made-up name is a 404 before anything else: fuzz what lies behind it
        response = case.call()
        FUZZ_REPORT[(case.method, case.path, mode.value, response.status_code)] += 1
        case.validate_response(response, checks=[not_a_server_error])

    run()


def test_report_what_the_fuzz_tried():
    if not FUZZ_REPORT:
        pytest.skip("the fuzz did not run (this test selected alone)")
    print("\nschemathesis requests per (method, path, generation mode, status):")
    for (method, path, mode, status), n in sorted(FUZZ_REPORT.items()):
        print(f"  {method} {path} [{mode}] -> {status}: {n}")
    assert all(status < 500 for (*_, status) in FUZZ_REPORT)
