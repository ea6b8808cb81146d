"""``rocketkv-mt bench plot``: a result file as a PNG (matplotlib, no display needed).

One figure per file, drawn from the file alone: ``eval`` (accuracy per turn per mode, peak device
bytes), ``bench decode`` (ms per token and device bytes per mode), ``bench scaling`` (time to first
token, bytes read from the cold tiers and device bytes against the history), ``bench capacity``
(sessions resident and bytes per session) and ``bench serve`` (tokens/s and first-token latency per
phase; with ``--stall``, the gaps between streamed tokens before and during a long prefill).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from bench.results import Result, load

MB = 1e6  # decimal megabytes, as the report and the README write them


def _axes(n: int, width: float = 5.0, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, whatever the environment says
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def _bars(ax, labels: list[str], values: list[float], title: str, fmt: str = "{:.0f}") -> None:
    bars = ax.bar(range(len(labels)), values, color=[f"C{i}" for i in range(len(labels))])
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def _eval(data: dict):
    fig, (acc, mem) = _axes(2)
    modes = data["modes"]
    for mode, row in modes.items():
        turns = range(1, len(row["per_turn_accuracy"]) + 1)
        acc.plot(turns, row["per_turn_accuracy"], marker="o", label=f"{mode} ({row['correct']}/{row['total']})")
    acc.set_xticks(list(turns))
    acc.set_ylim(-0.05, 1.05)
    acc.set_xlabel("turn")
    acc.set_title("accuracy per turn", fontsize=10)
    acc.grid(alpha=0.3)
    acc.legend(fontsize=7)
    _bars(mem, list(modes), [m["peak_device_kv_bytes"] / MB for m in modes.values()], "peak device KV (MB)")
    fig.suptitle(f"{data['tasks']}: {data['conversations']} conversations, budget {data['budget']}", fontsize=10)
    return fig


def _decode(data: dict):
    fig, (ms, mem) = _axes(2)
    modes = data["modes"]
    names = list(modes)
    width = 0.38
    xs = range(len(names))
    for shift, field, label in ((-width / 2, "decode_ms_per_token", "decode"),
                                (width / 2, "attention_ms_per_token", "attention")):
        bars = ms.bar([x + shift for x in xs], [modes[m][field] for m in names], width, label=label)
        ms.bar_label(bars, [f"{modes[m][field]:.1f}" for m in names], fontsize=7)
    ms.set_xticks(list(xs), names)
    ms.set_title("ms per token", fontsize=10)
    ms.legend(fontsize=8)
    ms.grid(axis="y", alpha=0.3)
    _bars(mem, names, [modes[m]["device_kv_bytes"] / MB for m in names], "device KV bytes (MB)")
    fig.suptitle(f"context {data['context']} tokens, budget {data['budget']}", fontsize=10)
    return fig


def _scaling(data: dict):
    fig, (ttft, read, device) = _axes(3)
    rows = data["lengths"]
    history = [row["history_tokens"] for row in rows]
    for mode in data["modes"]:
        turn3 = [row["modes"][mode]["turn3"] for row in rows]
        ttft.plot(history, [t["ttft_ms"] for t in turn3], marker="o", label=mode)
        read.plot(history, [t["bytes_read"] / MB for t in turn3], marker="o", label=mode)
        device.plot(history, [t["device_bytes"] / MB for t in turn3], marker="o", label=mode)
    read.plot(history, [row["history_kv_bytes"] / MB for row in rows], "k--", label="the history's KV")
    titles = ("turn 3: time to first token (ms)", "turn 3: bytes read from cold tiers (MB)",
              "turn 3: device bytes (MB)")
    for ax, title in zip((ttft, read, device), titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("history tokens at turn 3")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['model']}, budget {data['token_budget']}, {data['device']}", fontsize=10)
    return fig


def _capacity(data: dict):
    fig, (count, size) = _axes(2)
    modes = data["modes"]
    names = list(modes)
    _bars(count, names, [modes[m]["sessions"] for m in names], "sessions resident")
    _bars(size, names, [modes[m]["device_bytes_per_session"] / MB for m in names], "device bytes per session (MB)")
    fig.suptitle(f"{data['context']}-token histories, device budget {data['device_budget'] / MB:.0f} MB, "
                 f"token budget {data['token_budget']}", fontsize=10)
    return fig


def _serve(data: dict):
    fig, (rate, first) = _axes(2)
    phases = ["concurrent", "one at a time"]
    _bars(rate, phases, [data["aggregate_tokens_per_s"], data["sequential_tokens_per_s"]],
          f"short turns: tokens/s ({data['speedup']}x)", "{:.1f}")
    _bars(first, phases, [data["concurrent"]["ttft_ms"]["p50"], data["sequential"]["ttft_ms"]["p50"]],
          "short turns: first token, p50 (ms)")
    fig.suptitle(f"{data['sessions']} sessions x {data['turns']} turns of {data['max_tokens']} tokens after "
                 f"~{data['context']}-token contexts; {data['errors']} errors", fontsize=10)
    return fig


def long_message(long: dict) -> str:
    """A stall run's long message in words: a first message, or a later turn's (its history aside)."""
    turn = long.get("turn", 1)
    if turn == 1:
        return f"a {long['prompt_tokens']:,}-token first message"
    return f"a {long.get('prefilled_tokens', long['prompt_tokens']):,}-token message as turn {turn}"


def _stall(data: dict):
    fig, (gaps,) = _axes(1, width=6.0)
    labels = ["p95 gap before", "longest pause", "p95 gap during"]
    _bars(gaps, labels, [data["gap_before_p95_ms"], data["max_pause_ms"], data["gaps_during_p95_ms"]],
          f"gaps between streamed tokens (ms); ratio {data['ratio']}x")
    fig.suptitle(f"{data['sessions']} streaming sessions, {long_message(data['long_message'])} arrives "
                 f"({data['mode']})", fontsize=10)
    return fig


FIGURES = {"eval": _eval, "decode": _decode, "scaling": _scaling, "capacity": _capacity, "serve": _serve,
           "stall": _stall}


def plottable(result: Result) -> bool:
    return result.bench in FIGURES


def render(result: Result, path: Path) -> Path:
    """Draw ``result`` into the PNG ``path``. No version or date is written into the file, so the
    same result drawn twice by the same matplotlib gives the same bytes."""
    import matplotlib.pyplot as plt

    if not plottable(result):
        raise ValueError(f"{result.path}: no figure for a {result.bench} result (figures: {', '.join(FIGURES)})")
    fig = FIGURES[result.bench](result.data)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_files(paths: list[str | Path], out: Path) -> list[Path]:
    """One ``<folder>-<stem>.png`` per result file in ``out``; nothing is drawn unless every file can be."""
    results = [load(p) for p in paths]
    for r in results:
        if not plottable(r):
            raise ValueError(f"{r.path}: no figure for a {r.bench} result (figures: {', '.join(FIGURES)})")
    names = [r.name for r in results]
    clash = {n for n in names if names.count(n) > 1}
    if clash:
        raise ValueError(f"two result files would draw the same figure: {', '.join(sorted(clash))}")
    return [render(r, out / f"{r.name}.png") for r in results]


def run_command(name: str, work: Callable[[], str]) -> int:
    """Run a command's ``work`` and print what it says; a failure is one line on stderr and exit 2."""
    try:
        said = work()
    except ImportError as exc:  # matplotlib comes with the dev extras (`make setup` installs them)
        print(f"{name}: {exc}: install the dev extras (pip install -e '.[dev]')", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    print(said)
    return 0


def main(args) -> int:
    return run_command("bench plot", lambda: "\n".join(map(str, plot_files(args.results, Path(args.out)))))
