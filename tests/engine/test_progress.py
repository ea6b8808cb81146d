"""Progress bars of long work (``app.progress``): drawn on a terminal with the running figure, silent where
stderr is not a terminal or with ``--quiet``; ``rocketkv-mt eval`` end to end with a scripted engine."""
import argparse
import io
import json
import sys
from types import SimpleNamespace

import pytest

from app.engine.events import MemoryStats
from app.progress import progress, shown
from bench import eval_mt
from bench.common import Engines


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class ScriptedEngine:
    """Every reply says the answer of the turn it is given, except the second turn of each conversation."""

    def __init__(self):
        self.turn = 0

    def create_session(self, mode, budget):
        self.turn = 0
        return SimpleNamespace(id="s")

    async def complete(self, session_id, text, params):
        self.turn += 1
        return SimpleNamespace(text="Kestrel" if self.turn != 2 else "no idea", memory=MemoryStats(device_bytes=1))

    async def delete_session(self, session_id):
        pass


TASKS = [{"id": str(i), "turns": [{"user": "q", "answer": "kestrel"}, {"user": "q", "answer": "kestrel"}]}
         for i in range(3)]


def test_a_bar_is_drawn_only_on_a_terminal_and_not_when_quiet():
    assert shown(stream=Terminal()) and not shown(stream=io.StringIO()) and not shown(quiet=True, stream=Terminal())
    for stream, quiet, drawn in ((Terminal(), False, True), (io.StringIO(), False, False), (Terminal(), True, False)):
        with progress(4, "work", quiet=quiet, stream=stream) as bar:
            for i in range(4):
                bar.set_postfix_str(f"accuracy {i / 4:.0%}")
                bar.update()
        text = stream.getvalue()
        assert ("work" in text and "4/4" in text and "accuracy 75%" in text) == drawn, (quiet, text)
        assert drawn or text == ""


@pytest.mark.parametrize("terminal, quiet", [(False, False), (True, True), (True, False)])
def test_eval_draws_its_running_accuracy_only_on_a_terminal(tmp_path, monkeypatch, capsys, terminal, quiet):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    monkeypatch.setattr(Engines, "get", lambda self, overrides: ScriptedEngine())
    monkeypatch.setenv("RKV_MODEL", "bundled:qwen2.5-coder-0.5b")
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    args = argparse.Namespace(tasks=str(tasks), modes="full,tiered", budget=64, max_tokens=4, limit=0, ids="",
                              prefill_attention=None, details=False, json_out=None, quiet=quiet)
    assert eval_mt.main(args) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is the result alone, bar or not
    assert result["modes"]["tiered"]["accuracy"] == 0.5
    assert result["model"] == "bundled:qwen2.5-coder-0.5b"  # the figures say which model gave them
    if terminal and not quiet:
        assert "eval" in err.getvalue() and "12/12" in err.getvalue()
        assert "tiered: accuracy 50% (3/6)" in err.getvalue()
    else:
        assert err.getvalue() == ""
