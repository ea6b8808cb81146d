"""The OpenAI-compatible endpoint, driven by the official ``openai`` SDK against a real server."""
from __future__ import annotations

import httpx
import openai
import pytest
from serving_helpers import local_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(loaded):
    with local_server(loaded) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=120)


def engine_turns(server, sid: str, token: str) -> list[dict]:
    r = httpx.get(f"{server.url}/v1/sessions/{sid}", headers={"x-session-token": token})
    assert r.status_code == 200, r.text
    return r.json()["turn_stats"]


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_non_streamed_completion(client, server):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.model_extra["prefilled_tokens"] == usage.prompt_tokens  # a new session prefills everything
    assert raw.headers["x-session-id"].startswith("s_") and raw.headers["x-session-token"]
    assert raw.headers["x-replica"] == "test-replica"


def test_streamed_completion(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens >= 1
    assert usage.model_extra["prefilled_tokens"] == usage.prompt_tokens


def test_session_header_prefills_only_the_new_suffix(client, server):
    history = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "My favourite number is 42. Remember it."},
    ]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=12)
    first = raw.parse()
    sid, token = raw.headers["x-session-id"], raw.headers["x-session-token"]
    bind = {"x-session-id": sid, "x-session-token": token}

    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "What is my favourite number?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, max_tokens=12, extra_headers=bind
    )
    second = raw.parse()
    assert raw.headers["x-session-id"] == sid
    u1, u2 = first.usage, second.usage
    assert u2.prompt_tokens > u1.prompt_tokens + u1.completion_tokens
    assert u2.model_extra["prefilled_tokens"] < u2.prompt_tokens // 2
    turns = engine_turns(server, sid, token)
    assert [t["prefilled_tokens"] for t in turns] == [u1.model_extra["prefilled_tokens"],
                                                      u2.model_extra["prefilled_tokens"]]

    # Streamed, still bound: again only the suffix is prefilled.
    history += [{"role": "assistant", "content": second.choices[0].message.content},
                {"role": "user", "content": "Thanks!"}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=6, stream=True, stream_options={"include_usage": True},
        extra_headers=bind,
    ))
    u3 = chunks[-1].usage
    assert u3.prompt_tokens > u2.prompt_tokens and u3.model_extra["prefilled_tokens"] < u3.prompt_tokens // 2
    assert engine_turns(server, sid, token)[-1]["prefilled_tokens"] == u3.model_extra["prefilled_tokens"]

    # A history that does not continue the session is refused and leaves it alone.
    with pytest.raises(openai.ConflictError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[history[0], {"role": "user", "content": "Different start"}],
            max_tokens=4, extra_headers=bind,
        )
    assert err.value.body["code"] == "history_mismatch"
    assert len(engine_turns(server, sid, token)) == 3


def test_stateless_history_is_seeded(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Hi, I am Bo."},
            {"role": "assistant", "content": "Hello Bo!"},
            {"role": "user", "content": "Who am I?"},
        ],
        max_tokens=6,
    )
    usage = completion.usage
    assert usage.prompt_tokens > 20 and usage.model_extra["prefilled_tokens"] == usage.prompt_tokens


def test_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-session-id": "s_missing", "x-session-token": "x"},
        )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-2)
    assert err.value.body["code"] == "invalid_sampling_params"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "no user turn"}])
