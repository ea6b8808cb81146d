"""The memory map and a turn's tiers as terminal text (``rocketkv-mt chat``): a one-line summary after
each reply, and ``/map``'s compact drawing of ``GET /v1/sessions/{id}/memory-map``.

The drawing has one line per layer and one column per run of positions: each cell shows the state
most of its token slots (over the layer's KV heads) are in, a slot the last turn re-admitted counting
as ``*``; a line above marks where each message starts (``U`` user, ``A`` assistant, ``H`` an
imported history).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

CELL = {"device": "#", "host": "+", "redis": ".", "evicted": "x", "unfed": "_", "lost": "!", "readmitted": "*"}
ROLE_MARK = {"user": "U", "assistant": "A", "history": "H"}
LEGEND = "# device  + host tier  . Redis  * re-admitted by the last turn  x evicted  _ not fed yet  ! lost"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def tier_line(done: dict[str, Any]) -> str:
    """One line: bytes per tier after the turn, and the tokens it re-admitted and demoted (per layer and
    KV head, from the ``done`` event's ``memory`` and ``memory_map``)."""
    m, s = done.get("memory") or {}, done.get("memory_map") or {}
    slots = (s.get("layers") or 0) * (s.get("kv_heads") or 0)
    demoted = f", {s['demoted'] / slots:.0f} demoted" if slots else ""
    return (f"  tiers: device {size(m.get('device_bytes', 0))} | host {size(m.get('host_bytes', 0))} | "
            f"Redis {size(m.get('redis_bytes', 0))}; {m.get('readmitted_tokens', 0)} tokens re-admitted{demoted}")


def _expand(flat: list[int], n: int, states: list[str]) -> list[str]:
    out: list[str] = []
    for state, length in zip(flat[::2], flat[1::2]):
        out += [states[state]] * length
    return out[:n]


def _marked(flat: list[int]) -> set[int]:
    return {p for start, length in zip(flat[::2], flat[1::2]) for p in range(start, start + length)}


def render(mm: dict[str, Any], width: int = 64) -> str:
    """The map as text, at most ``width`` columns of positions."""
    n, layers = mm["summary"]["positions"], mm["summary"]["layers"]
    if not n:
        return "memory map: no tokens yet"
    step = max(1, math.ceil(n / max(1, width)))
    cols = math.ceil(n / step)
    counts = [[Counter() for _ in range(cols)] for _ in range(layers)]
    for row in mm["rows"]:
        layer, again = row["layer"], _marked(row["readmitted"])
        for p, state in enumerate(_expand(row["runs"], n, mm["states"])):
            counts[layer][p // step]["readmitted" if p in again else state] += 1
    marks = [" "] * cols
    for span in mm.get("messages") or []:
        col = span["start"] // step
        if col < cols:
            marks[col] = ROLE_MARK.get(span["role"], "?")
    label = len(f"layer {layers - 1}")
    lines = [f"memory map: {n} tokens x {layers} layers, {mm['summary']['kv_heads']} KV heads each; "
             f"{step} token{'s' if step > 1 else ''} a column",
             " " * (label + 1) + " " + "".join(marks)]
    for layer in range(layers):
        cells = "".join(CELL.get(counts[layer][c].most_common(1)[0][0], "?") for c in range(cols))
        lines.append(f"{f'layer {layer}':>{label}} |{cells}|")
    lines.append(LEGEND)
    return "\n".join(lines)
