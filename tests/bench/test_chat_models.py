"""``bench chat``: the loop detector, a slice of the chat set on the bundled model, and its table in the
report; and the greedy values the benchmarks send to servers."""
import asyncio

from app.engine.sampling import SamplingParams
from bench.chat_models import CONVERSATIONS, loops, run_model
from bench.common import GREEDY
from bench.report import TABLES
from bench.results import kind


def test_the_benchmarks_greedy_requests_are_the_engines_greedy_decoding():
    assert GREEDY == SamplingParams().shaping()
    assert SamplingParams(**GREEDY).plain


def test_loops_are_a_phrase_three_times_or_twice_in_a_cut_reply():
    assert loops("I can help. I can help you. I can help you now. I can help you now.", "stop")
    once = "Lisbon is where you keep your bees, Ada."
    assert not loops(once, "stop") and not loops(once, "length")
    twice = "you keep your bees there and you keep your bees"
    assert not loops(twice, "stop") and loops(twice, "length")


def test_a_conversation_of_the_chat_set_scores_recalls_instructions_and_speed(make_engine):
    engine = make_engine()
    result = asyncio.run(run_model(engine, {"temperature": 0}, [0], max_tokens=6, conversations=CONVERSATIONS[:1]))
    assert result["recall_questions"] == 4 and result["instruction_questions"] == 1 and result["replies"] == 6
    assert 0 <= result["recalls"] <= 4 and 0 <= result["loops"] <= 6
    assert result["decode_tokens_per_s"] > 0
    assert [e["user"] for e in result["example"]][:2] == [CONVERSATIONS[0][0], CONVERSATIONS[0][1][0].text]
    assert not engine.sessions  # each conversation deleted after its turns

    data = {"chat_models": {"bundled:smollm2-135m": {**result, "title": "SmolLM2-135M-Instruct",
                                                      "sampling": SamplingParams().shaping()}},
            "seeds": [0], "max_tokens": 6, "conversations": 1, "turns": 6}
    assert kind(data) == "chat"
    table = "\n".join(TABLES["chat"](data))
    assert f"{result['recalls']}/4" in table and "greedy" in table
