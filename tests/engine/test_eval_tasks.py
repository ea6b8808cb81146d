"""The multi-turn recall benchmark: the shipped task files and ``rocketkv-mt eval``'s scoring and JSON."""
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.engine.events import MemoryStats

from bench import make_tasks
from bench.eval_mt import answered, load_tasks, pick, run_mode

TASKS = Path(make_tasks.__file__).parent / "tasks"


def test_shipped_task_files_are_what_the_generator_writes(tmp_path):
    make_tasks.main(["--out", str(tmp_path)])
    for name in ("mt_2k.jsonl", "mt_5k.jsonl", "mt_8k.jsonl"):
        assert (tmp_path / name).read_text() == (TASKS / name).read_text(), name


@pytest.mark.parametrize("name,approx_tokens", [("mt_2k.jsonl", 2000), ("mt_5k.jsonl", 5700), ("mt_8k.jsonl", 8000)])
def test_every_turn_asks_a_different_fact_hidden_in_the_first_message(name, approx_tokens):
    rows = load_tasks(str(TASKS / name))
    assert len(rows) >= 8 and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        turns = row["turns"]
        assert len(turns) == 4
        first = turns[0]["user"]
        answers = [t["answer"] for t in turns]
        questions = [t["user"].rsplit("\n\n", 1)[-1] for t in turns]
        assert len(set(answers)) == 4 and len(set(questions)) == 4
        for answer in answers:  # each answer occurs once, in the first message only
            assert first.count(answer) == 1
            assert all(answer not in t["user"] for t in turns[1:])
        words = len(first.split())
        assert 0.7 * approx_tokens * make_tasks.WORDS_PER_TOKEN < words < 1.3 * approx_tokens * make_tasks.WORDS_PER_TOKEN


def test_task_rows_without_user_or_answer_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "turns": [{"user": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="'user' and 'answer'"):
        load_tasks(str(bad))


def test_conversations_are_picked_by_id_in_file_order_then_limited():
    tasks = [{"id": i, "turns": []} for i in ("a", "b", "c", "d")]
    assert [t["id"] for t in pick(tasks, "d,b")] == ["b", "d"]
    assert [t["id"] for t in pick(tasks, "d,b,c", limit=2)] == ["b", "c"]
    assert [t["id"] for t in pick(tasks, limit=3)] == ["a", "b", "c"] and pick(tasks) == tasks
    with pytest.raises(ValueError, match="'x'"):
        pick(tasks, "a,x")


class _ScriptedEngine:
    """Replies from a script, so the scoring itself is what is checked."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.deleted = []

    def create_session(self, mode, budget):
        return SimpleNamespace(id=f"s{len(self.deleted)}")

    async def complete(self, session_id, text, params):
        reply, nbytes = self.replies.pop(0)
        return SimpleNamespace(text=reply, memory=MemoryStats(device_bytes=nbytes, cold_bytes_read=2 * nbytes))

    async def delete_session(self, session_id):
        self.deleted.append(session_id)


def test_a_turn_counts_when_its_answer_occurs_case_insensitively():
    tasks = [
        {"id": "a", "turns": [{"user": "q1", "answer": "Halvik"}, {"user": "q2", "answer": "41081"}]},
        {"id": "b", "turns": [{"user": "q1", "answer": "purple"}, {"user": "q2", "answer": "497"}]},
    ]
    engine = _ScriptedEngine([("It is HALVIK.", 10), ("The key is 4108.", 30), ("purple!", 20), ("Room 497", 5)])
    out = asyncio.run(run_mode(engine, "tiered", tasks, 256, 16))
    assert (out["correct"], out["total"]) == (3, 4)
    assert out["accuracy"] == 0.75 and out["per_turn_accuracy"] == [1.0, 0.5]
    assert out["peak_device_kv_bytes"] == 30 and engine.deleted == ["s0", "s1"]
    assert [t["correct"] for t in out["replies"][0]["turns"]] == [True, False]
    assert out["mean_bytes_per_turn"]["cold_bytes_read"] == round(2 * (10 + 30 + 20 + 5) / 4)


def test_any_of_several_gold_answers_counts_and_kinds_are_counted_apart():
    tasks = [
        {"id": "q", "kind": "squad", "turns": [
            {"user": "q1", "answer": "Magdalen Tower", "answers": ["Magdalen Tower", "Oxford's Magdalen Tower"]},
            {"user": "q2", "answer": "1934", "answers": ["1934", "in 1934"]}]},
        {"id": "n", "kind": "needles", "turns": [{"user": "q1", "answer": "4367190"}]},
    ]
    engine = _ScriptedEngine([("It copies oxford's magdalen tower.", 1), ("In 1935.", 1), ("4367190", 1)])
    out = asyncio.run(run_mode(engine, "full", tasks, 256, 16))
    assert [t["correct"] for t in out["replies"][0]["turns"]] == [True, False]
    assert out["per_kind"] == {"squad": {"correct": 1, "total": 2}, "needles": {"correct": 1, "total": 1}}
    assert answered({"answer": "x", "answers": ["Paris", "France"]}, "it is in FRANCE")
    assert not answered({"answer": "Paris"}, "it is in France")


def test_files_without_kinds_have_no_per_kind_counts():
    engine = _ScriptedEngine([("purple", 1)])
    out = asyncio.run(run_mode(engine, "full", [{"id": "a", "turns": [{"user": "q", "answer": "purple"}]}], 256, 16))
    assert "per_kind" not in out and out["correct"] == 1


def test_a_turn_whose_answers_are_empty_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "turns": [{"user": "hi", "answer": "a", "answers": ["a", ""]}]}) + "\n")
    with pytest.raises(ValueError, match="non-empty strings"):
        load_tasks(str(bad))


@pytest.mark.slow
async def test_fidelity_is_exact_for_full_and_for_a_budget_above_the_history(make_engine):
    from bench.common import Engines
    from bench.fidelity import measure
    from bench.haystack import hide

    first = hide(["The pass key is 41735.", "Omar keeps a pet ferret."], 300, [0.3, 0.7], seed=3)
    tasks = [{"id": "t", "turns": [{"user": first + "\n\nWhat is the pass key?", "answer": "41735"},
                                   {"user": "What pet does Omar keep?", "answer": "ferret"}]}]
    variants = {"full": {"mode": "full"}, "roomy": {"mode": "tiered", "rocket": {"token_budget": 4096}},
                "tight": {"mode": "tiered", "rocket": {"token_budget": 32}}}
    out = await measure(Engines.around(make_engine()), tasks, variants, budget=64, max_tokens=6)
    for name in ("full", "roomy"):  # nothing compressed: the same distribution at every position
        assert out[name]["top1_agreement"] == 1.0 and out[name]["mean_kl"] < 1e-4, (name, out[name])
    assert out["tight"]["positions"] == out["full"]["positions"] >= 2
    assert out["tight"]["mean_kl"] > out["roomy"]["mean_kl"]
