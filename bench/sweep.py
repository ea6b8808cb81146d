"""Budget sweeps: eval results of one model on one task file, read across the budgets they ran at.

An ``eval`` run covers one budget; choosing a budget needs every mode at every budget side by side.
Results that name their model (``"model"``), ran to the end (no ``"partial"``) and share a task file
and a number of conversations form one sweep; it is a table once a mode other than ``full`` ran
beside ``full`` or at two budgets. ``full`` keeps every token whatever the budget, so it is one row,
with no budget, and the yardstick: the sweep names the smallest budget at which ``tiered`` answers
within one question of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bench.results import Result

# Modes in the order a reader compares them: the yardstick, then permanent eviction, then the two
# that keep everything (on the device, then in the tiers). Another mode is listed after these.
ORDER = ("full", "snapkv", "rocketkv-mt", "tiered")


@dataclass
class Sweep:
    model: str
    tasks: str
    conversations: int
    full: dict | None = None  # ``full``'s summary: the same at every budget
    runs: dict[tuple[str, int], dict] = field(default_factory=dict)  # (mode, budget) -> its summary
    files: list[str] = field(default_factory=list)

    @property
    def budgets(self) -> list[int]:
        return sorted({b for _, b in self.runs})

    def is_table(self) -> bool:
        """Whether there is something to compare: a compressed mode beside ``full``, or at two budgets."""
        modes = [m for m, _ in self.runs]
        return bool(modes) and (self.full is not None or any(modes.count(m) > 1 for m in modes))

    def rows(self) -> list[tuple[str, int | None, dict]]:
        """``(mode, budget, summary)`` in reading order: ``full`` first, with no budget."""
        rank = {m: i for i, m in enumerate(ORDER)}
        keys = sorted(self.runs, key=lambda k: (rank.get(k[0], len(ORDER)), k[0], k[1]))
        return ([("full", None, self.full)] if self.full else []) + [(m, b, self.runs[(m, b)]) for m, b in keys]

    def parity_budget(self, mode: str = "tiered", slack: int = 1) -> int | None:
        """The smallest budget at which ``mode`` answers at most ``slack`` fewer questions than ``full``
        over the same questions; ``None`` when no budget measured does, or ``full`` did not run."""
        for budget in self.budgets:
            run = self.runs.get((mode, budget))
            if self.full and run and run["total"] == self.full["total"] \
                    and run["correct"] >= self.full["correct"] - slack:
                return budget
        return None


def sweeps(results: list[Result]) -> list[Sweep]:
    """The sweeps among ``results`` that make a table (any benchmark's results may be given: only
    complete eval runs that name their model count). A later file, in ``results``' order, replaces an
    earlier one's run of the same mode and budget."""
    found: dict[tuple, Sweep] = {}
    for r in results:
        d = r.data
        if r.bench != "eval" or not d.get("model") or d.get("partial"):
            continue
        key = (d["model"], d["tasks"], d["conversations"])
        sweep = found.setdefault(key, Sweep(*key))
        for mode, summary in d["modes"].items():
            if mode == "full":
                sweep.full = summary
            else:
                sweep.runs[(mode, d["budget"])] = summary
        sweep.files.append(r.relative())
    return [s for s in found.values() if s.is_table()]
