"""Schemathesis against the server's own OpenAPI schema, on loopback: no request gets a 5xx.

Every operation is fuzzed with data that fits the schema and with data that does not (schemathesis'
positive and negative generation), with a valid API key so that requests reach the handlers, and
once without a key. The server's limits are small (short replies, a small context) so that the
turns the fuzzer starts stay cheap. Hypothesis runs derandomized: a failure repeats.
"""
from __future__ import annotations

import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from serving_helpers import local_server

KEY = "fuzz-" + uuid.uuid4().hex
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 15}


@pytest.fixture(scope="module")
def fuzz_server(loaded):
    with local_server(loaded, api_key=KEY, max_new_tokens=2, max_tokens_limit=4, max_context=512,
                      max_message_bytes=2048, max_request_bytes=64 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", headers=AUTH, timeout=30)


def operations(schema) -> list:
    ops = [result.ok() for result in schema.get_all_operations()]
    assert len(ops) >= 10, [op.label for op in ops]  # sessions (6), openai (2), healthz, metrics
    return ops


def into_a_turn(case) -> None:
    """Steer a generated completion past the checks that would stop nearly every random one (the
    model name, n, a last user message, a new session), so that its sampling values, stop strings
    and content reach a real turn."""
    body = case.body
    if case.path != "/v1/chat/completions" or not isinstance(body, dict):
        return
    body.update(model=MODEL, n=1, mode=None, budget=None, max_tokens=2, max_completion_tokens=None)
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    last = messages[-1] if messages else {}
    text = last.get("content") if isinstance(last.get("content"), str) and last["content"].strip() else "hi"
    body["messages"] = [*messages[:-1], {**last, "role": "user", "content": text}]
    for name in ("x-session-id", "x-session-token"):
        (case.headers or {}).pop(name, None)


def fuzz(operation, mode: GenerationMode, headers: dict | None, check) -> list[int]:
    """Run one operation's generated cases through ``check``; returns the status of each case."""
    seen: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if mode is GenerationMode.POSITIVE and len(seen) % 2:
            into_a_turn(case)
        response = case.call(headers=headers, timeout=60)
        seen.append(response.status_code)
        check(case, response)

    run()
    return seen


def no_server_error(case, response) -> None:
    detail = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}\n"
    detail += case.as_curl_command()
    assert response.status_code < 500, detail
    if response.status_code >= 400:  # every refusal is the documented error envelope
        error = response.json()["error"]
        assert error["code"] and error["message"], detail


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_generated_request_gets_a_server_error(api_schema, fuzz_server, mode):
    statuses = {}
    for operation in operations(api_schema):
        try:
            statuses[operation.label] = fuzz(operation, mode, AUTH, no_server_error)
        except Exception as exc:  # schemathesis says when a schema admits no negative data
            if "Unsatisfiable" not in type(exc).__name__ and "unsatisfiable" not in str(exc).lower():
                raise
    print(mode.value, {label: sorted(set(codes)) for label, codes in statuses.items()})
    assert sum(len(codes) for codes in statuses.values()) >= 30
    if mode is GenerationMode.POSITIVE:  # the fuzzer got past validation, into the handlers and turns
        assert 200 in statuses["POST /v1/chat/completions"]
        assert any(201 in codes for codes in statuses.values())
    assert fuzz_server.service.engine.sessions is not None  # the server is still up, with its state
    import httpx

    assert httpx.get(f"{fuzz_server.url}/healthz").json()["status"] == "ok"


def test_without_a_key_everything_but_health_is_unauthorized(api_schema):
    def unauthorized(case, response):
        if case.path == "/healthz":
            assert response.status_code == 200
        else:
            assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized", case.path

    for operation in operations(api_schema):
        fuzz(operation, GenerationMode.POSITIVE, {}, unauthorized)
