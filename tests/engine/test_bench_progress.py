"""The progress bars of ``bench needle``, ``bench capacity``, ``bench fidelity`` and ``bench serve``, each
run from its command line on a tiny workload: on a terminal the bar is drawn with its running figure
(accuracy, sessions admitted, agreement, throughput); where stderr is not a terminal it writes nothing.
(``eval``, ``bench scaling`` and a model's first conversion are checked in test_progress.py,
test_bench_scaling.py and test_model_cache.py.)"""
import io
import json
import sys

import pytest
from serving_helpers import local_server

from cli.main import build_parser

pytestmark = pytest.mark.slow


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


TASK = {"id": "p0", "turns": [{"user": "Remember this: the locker code is 5521. Say ok.", "answer": "ok"},
                              {"user": "What is the locker code?", "answer": "5521"}]}
# bench -> (its arguments after `rocketkv-mt bench`, the bar's name, a word of its running figure)
BENCHES = {
    "needle": (["needle", "--lengths", "300", "--cases", "1", "--modes", "snapkv", "--budget", "64"],
               "bench needle", "snapkv "),
    "capacity": (["capacity", "--context", "200", "--modes", "tiered", "--budget", "32", "--max-tokens", "2",
                  "--max-sessions", "2", "--device-budget", str(1 << 30)],
                 "capacity tiered", "admitted"),
    "fidelity": (["fidelity", "--tasks", "{tasks}", "--budget", "32", "--max-tokens", "3"],
                 "bench fidelity", "top-1 agreement"),
    "serve": (["serve", "--url", "{url}", "--sessions", "2", "--turns", "1", "--context", "100", "--max-tokens", "3",
               "--no-sequential"], "bench serve", "tokens/s"),
}


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
@pytest.mark.parametrize("bench", list(BENCHES))
def test_a_bench_draws_its_bar_on_a_terminal_and_nothing_elsewhere(bench, terminal, loaded, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr("app.model_loader.load_model", lambda settings, quiet=False: loaded)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    argv, name, figure = BENCHES[bench]

    def run(url: str = "") -> int:
        args = build_parser().parse_args(["bench", *(a.format(tasks=tasks, url=url) for a in argv)])
        err, before = Terminal() if terminal else io.StringIO(), sys.stderr
        monkeypatch.setattr(sys, "stderr", err)
        try:
            return args.func(args)
        finally:
            monkeypatch.setattr(sys, "stderr", before)
            run.err = err.getvalue()

    if bench == "serve":
        with local_server(loaded) as server:
            assert run(server.url) == 0
    else:
        assert run() == 0
    json.loads(capsys.readouterr().out)  # the result on stdout, bar or not
    if terminal:
        assert name in run.err and figure in run.err, run.err
    else:
        assert name not in run.err and figure not in run.err and "\r" not in run.err, run.err
