"""Budget sweeps: eval results of one setup, read across the budgets they ran at.

An ``eval`` run covers one budget; choosing a budget needs every mode at every budget side by side.
Results that name their model (``"model"``), ran to the end (no ``"partial"``) and share a setup form
one sweep. The setup is the recorded command without what only says which runs to make or where to
write them (``--modes``, ``--budget``, ``--json``, ...) and without settings that do not change a
reply (threads, the cache folder): the task file, ``--max-tokens``, ``--limit`` and every other
``RKV_`` setting stay in it, so runs that could answer differently never share a row. A sweep is a
table once a mode other than ``full`` ran beside ``full`` or at two budgets. ``full`` keeps every
token whatever the budget: one row, with no budget, and the yardstick.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from bench.results import Result

# Modes in the order a reader compares them: the yardstick, then permanent eviction, then the two
# that keep everything (on the device, then in the tiers). Another mode is listed after these.
ORDER = ("full", "snapkv", "rocketkv-mt", "tiered")
# Options naming the runs to make and where their output goes, with whether each takes a value.
RUN_OPTIONS = {"--modes": True, "--budget": True, "--json": True, "--details": False, "--quiet": False}
# Settings that change how fast or where, never what a greedy reply says.
NEUTRAL_SETTINGS = ("RKV_THREADS=", "RKV_CACHE_DIR=")


def setup(command: str) -> str:
    """``command`` without its run options and neutral settings: what decides the replies."""
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        name = word.split("=", 1)[0]
        if skip:
            skip = False
        elif name in RUN_OPTIONS:
            skip = RUN_OPTIONS[name] and "=" not in word
        elif not word.startswith(NEUTRAL_SETTINGS):
            kept.append(word)
    return shlex.join(kept)


@dataclass
class Run:
    file: str
    summary: dict


@dataclass
class Sweep:
    model: str
    setup: str
    full: Run | None = None
    runs: dict[tuple[str, int], Run] = field(default_factory=dict)  # (mode, budget) -> the run
    # Runs of a (mode, budget) already taken whose answers differ: a reader must see both.
    disagreements: list[tuple[str, int | None, Run, Run]] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(r.file for r in [*([self.full] if self.full else []), *self.runs.values()]))

    def add(self, mode: str, budget: int, run: Run) -> None:
        """The first run of a mode and budget is its row; a later one that answers differently is kept
        as a disagreement (``full``'s at every budget count as one)."""
        taken = self.full if mode == "full" else self.runs.get((mode, budget))
        if taken is None:
            if mode == "full":
                self.full = run
            else:
                self.runs[(mode, budget)] = run
        elif (taken.summary["correct"], taken.summary["total"]) != (run.summary["correct"], run.summary["total"]):
            self.disagreements.append((mode, None if mode == "full" else budget, taken, run))

    def is_table(self) -> bool:
        """Whether there is something to compare: a compressed mode beside ``full``, or at two budgets."""
        modes = [m for m, _ in self.runs]
        return bool(modes) and (self.full is not None or any(modes.count(m) > 1 for m in modes))

    def rows(self) -> list[tuple[str, int | None, dict]]:
        """``(mode, budget, summary)`` in reading order: ``full`` first, with no budget."""
        rank = {m: i for i, m in enumerate(ORDER)}
        keys = sorted(self.runs, key=lambda k: (rank.get(k[0], len(ORDER)), k[0], k[1]))
        first = [("full", None, self.full.summary)] if self.full else []
        return first + [(m, b, self.runs[(m, b)].summary) for m, b in keys]

    def comparable(self, summary: dict) -> bool:
        """Whether ``summary`` answered the questions ``full`` answered (a task file changed between
        runs would not)."""
        return self.full is not None and summary["total"] == self.full.summary["total"]

    def within(self, mode: str = "tiered", slack: int = 1) -> dict[int, bool]:
        """Per budget ``mode`` ran at, comparably with ``full``: whether it answered at most ``slack``
        fewer questions."""
        return {b: s["correct"] >= self.full.summary["correct"] - slack
                for (m, b), run in sorted(self.runs.items()) if m == mode and self.comparable(s := run.summary)}


def sweeps(results: list[Result]) -> list[Sweep]:
    """The sweeps among ``results`` that make a table (results of any benchmark may be given: only
    complete eval runs that name their model count)."""
    found: dict[tuple, Sweep] = {}
    for r in results:
        d = r.data
        if r.bench != "eval" or not d.get("model") or d.get("partial"):
            continue
        key = (d["model"], setup(d["command"]))
        sweep = found.setdefault(key, Sweep(*key))
        for mode, summary in d["modes"].items():
            sweep.add(mode, d["budget"], Run(r.relative(), summary))
    return [s for s in found.values() if s.is_table()]
