"""The shipped result files: where they live (``results/<bench>/``), how one is read, and which
benchmark wrote it, told from its fields so that a file copied elsewhere is still recognised."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"

# Benchmarks in the order the report lists them: what a user weighs first (recall, then speed and
# memory) before the lower-level timings. A folder not named here is listed after them.
ORDER = ("chat", "eval", "needle", "fidelity", "history-swap", "scaling", "decode", "capacity", "prefill-peak", "ttft",
         "serve", "soak", "placement", "rounds", "hsa", "linear", "ops", "gpu")


@dataclass(frozen=True)
class Result:
    path: Path
    data: dict

    @property
    def bench(self) -> str:
        return kind(self.data, self.path)

    @property
    def name(self) -> str:
        """``<folder>-<stem>`` (``serve-stall_8``): unique among the files of results/, whose folders
        are the benchmarks, and the name of its figure."""
        return f"{self.path.parent.name}-{self.path.stem}"

    def relative(self, root: Path = ROOT) -> str:
        try:
            return self.path.resolve().relative_to(root).as_posix()
        except ValueError:
            return self.path.as_posix()


def kind(data: dict, path: Path | None = None) -> str:
    """Which benchmark wrote ``data``: ``eval``, ``decode``, ``scaling``, ``capacity``, ``serve``
    (load), ``stall`` (``bench serve --stall``), ``cluster`` (``bench.cluster_serve``), ``soak``, ... or, failing those fields, the file's folder."""
    modes = data.get("modes")
    if "chat_models" in data:
        return "chat"
    if "cluster" in data and isinstance(data.get("rounds"), list):
        return "cluster"
    if "turns_failed" in data and "violations" in data:
        return "soak"
    if "replica_counts" in data and "scenarios" in data:
        return "placement"
    if "stall_tokens" in data:
        return "stall"
    if "aggregate_tokens_per_s" in data:
        return "serve"
    if "decode_tokens_per_mode" in data:
        return "decode"
    if isinstance(data.get("lengths"), list) and data["lengths"] and "history_tokens" in data["lengths"][0]:
        return "scaling"
    if "device_budget" in data and isinstance(modes, dict):
        return "capacity"
    if "rows_per_group" in data and isinstance(modes, dict):
        return "prefill-peak"
    if isinstance(modes, dict) and any("per_turn_accuracy" in m for m in modes.values()):
        return "eval"
    if "per_length" in data:
        return "needle"
    if "variants" in data and "tasks" in data:
        return "fidelity"
    if "stateful" in data and "stateless" in data:
        return "ttft"
    if "us_per_call" in data:
        return "hsa"
    if "rounds" in data and "alone" in data:
        return "rounds"
    if "conversations" in data and "correct" in data and "turn" in data:
        return "history-swap"
    if "counts" in data and "shapes" in data:
        return "ops"
    if isinstance(data.get("results"), list) and data["results"] and "torch_over_onednn" in data["results"][0]:
        return "linear"
    if "speedups" in data and isinstance(data.get("results"), list):
        return "e2e"
    if "parts" in data and "estimates_s" in data:
        return "gpu-check"
    if "tests" in data and isinstance(data.get("failed"), list):
        return "kernel-tests"
    if "redis_session_bytes_after_turn_3" in data:
        return "tiered-redis"
    if isinstance(modes, dict) and any("python_calls" in m for m in modes.values()):
        return "turn-profile"
    return path.parent.name if path is not None else "result"


def load(path: str | Path) -> Result:
    path = Path(path)
    return Result(path, json.loads(path.read_text()))


def shipped(results: Path = RESULTS) -> list[Result]:
    """Every JSON file under ``results/``, ordered by benchmark (``ORDER``), then by file name."""
    found = [load(p) for p in sorted(results.rglob("*.json"))]
    rank = {b: i for i, b in enumerate(ORDER)}
    return sorted(found, key=lambda r: (rank.get(folder(r, results), len(ORDER)), folder(r, results), r.path.name))


def folder(result: Result, results: Path = RESULTS) -> str:
    """The benchmark folder a shipped file sits in (``serve`` for both load and stall runs)."""
    try:
        return result.path.resolve().relative_to(results.resolve()).parts[0]
    except ValueError:
        return result.bench
