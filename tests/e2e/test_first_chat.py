"""A first chat as a new user has it: the server as ``make serve`` starts it (its default model and
sampling, nothing set), then the two messages of a newcomer. The second reply names what the first
message said and does not loop, in every cache mode; and the small bundled model, served with its
defaults, stops looping on the prompt that made it loop greedily.

Seeded, so that a run is reproducible; the served default model is fetched by ``make test`` (as by
``make serve``) before the suite runs.
"""
from __future__ import annotations

import contextlib

import pytest
from serving_helpers import WsChat, local_server

from bench.chat_models import loops
from bench.common import GREEDY
from rocketkv_mt.cache import CACHE_MODES

FIRST = "Hi! My name is Ada and I keep bees in Lisbon."
SECOND = "Where do I keep my bees?"
SEED = 0

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def served_as_shipped(**env: str):
    """A local server whose settings are the shipped ones: the suite's model and greedy setting
    (tests/conftest.py) are taken away, and ``env`` set."""
    import transformers

    from app.model_loader import load_model
    from app.settings import ServerSettings

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RKV_MODEL", raising=False)
        mp.delenv("RKV_DEFAULT_TEMPERATURE", raising=False)
        mp.delenv("RKV_DEFAULT_REPETITION_PENALTY", raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        transformers.utils.logging.disable_progress_bar()
        loaded = load_model(ServerSettings())
        with local_server(loaded, max_new_tokens=ServerSettings().max_new_tokens) as server:
            yield server


@pytest.fixture(scope="module")
def first_run():
    with served_as_shipped() as server:
        yield server


async def two_messages(server, mode: str | None = None) -> tuple[str, dict]:
    async with WsChat.open(server.ws_url) as chat:
        await chat.create(**({"mode": mode} if mode else {}))
        for text in (FIRST, SECOND):
            deltas, done = await chat.turn(text, max_tokens=None, seed=SEED)
            assert done["type"] == "done", done
    return "".join(deltas), done


@pytest.mark.parametrize("mode", list(CACHE_MODES))
async def test_the_second_reply_names_lisbon_without_a_loop(first_run, mode):
    reply, done = await two_messages(first_run, mode)
    assert done["sampling"]["temperature"] > 0, "a chat samples by default"
    assert "lisbon" in reply.lower(), reply
    assert not loops(reply, done["finish_reason"]) and done["finish_reason"] == "stop", reply


async def test_the_bundled_model_stops_looping_with_its_default_settings():
    with served_as_shipped(RKV_MODEL="bundled:smollm2-135m") as server:
        async with WsChat.open(server.ws_url) as chat:
            await chat.create(mode="full")
            # What a newcomer had before sampling controls: plain greedy decoding, no penalty.
            greedy = [await chat.turn(text, max_tokens=None, **GREEDY) for text in (FIRST, SECOND)]
        reply, done = await two_messages(server, "full")
    looped_text, looped_done = "".join(greedy[-1][0]), greedy[-1][1]
    assert loops(looped_text, looped_done["finish_reason"]), "greedy decoding loops on this prompt"
    assert not loops(reply, done["finish_reason"]) and done["finish_reason"] == "stop", reply
