/* rocketkv-mt chat page: the memory map of the active session (GET v1/sessions/{id}/memory-map?text=true)
 * drawn on a canvas: history positions across, one row per (layer, KV head) down, a colour per tier;
 * the last turn's re-admissions in a highlight colour, message boundaries as lines under a strip of
 * message bands. Hovering a row shows the band under the pointer (the stretch of positions in one
 * state) and the text of its tokens.
 *
 * The map's wire form is documented in docs/observability.md: `rows[i].runs` is [state, length, ...]
 * over positions 0..positions-1, `readmitted` / `demoted` are [start, length, ...] ranges.
 *
 * `window.rkvMemoryMap` is the view the page uses (and what the browser test reads pixels through).
 */
"use strict";

const MAP_COLORS = {
  device: "#3b5bdb",
  host: "#f08c00",
  redis: "#c92a2a",
  evicted: "#ced4da",
  unfed: "#f1f3f5",
  lost: "#212529",
  readmitted: "#40c057",
};
const MAP_STRIP = 16; // px of the message strip above the rows
const MAP_GUTTER = 44; // px left of the rows, for the layer labels
const ROLE_FILL = { user: "#dbe4ff", assistant: "#e9ecef", history: "#fff3bf" };

class MemoryMapView {
  constructor(canvas, tip, summaryEl) {
    this.canvas = canvas;
    this.tip = tip;
    this.summaryEl = summaryEl;
    this.map = null;
    this.rows = []; // per drawn row: {layer, head, runs: [[state, start, end]], readmitted: [[start, end]]}
    canvas.addEventListener("mousemove", (ev) => this.hover(ev));
    canvas.addEventListener("mouseleave", () => { this.tip.hidden = true; });
    window.addEventListener("resize", () => this.draw());
  }

  clear() {
    this.map = null;
    this.rows = [];
    this.canvas.dataset.state = "none";
    this.canvas.getContext("2d").clearRect(0, 0, this.canvas.width, this.canvas.height);
    this.summaryEl.textContent = "No turn yet.";
    this.tip.hidden = true;
  }

  show(map) {
    this.map = map;
    this.rows = map.rows.map((row) => {
      const runs = [];
      let at = 0;
      for (let i = 0; i < row.runs.length; i += 2) {
        runs.push([map.states[row.runs[i]], at, at + row.runs[i + 1]]);
        at += row.runs[i + 1];
      }
      const readmitted = [];
      for (let i = 0; i < row.readmitted.length; i += 2) {
        readmitted.push([row.readmitted[i], row.readmitted[i] + row.readmitted[i + 1]]);
      }
      return { layer: row.layer, head: row.head, runs, readmitted };
    });
    this.draw();
    const s = map.summary;
    const perToken = Math.max(1, s.layers * s.kv_heads);
    const parts = [`${s.positions.toLocaleString("en-US")} tokens × ${s.layers} layers × ${s.kv_heads} KV heads`];
    for (const tier of ["device", "host", "redis", "evicted", "unfed"]) {
      if (s[tier]) parts.push(`${tier} ${(s[tier] / perToken).toFixed(0)}`);
    }
    parts.push(`re-admitted ${(s.readmitted / perToken).toFixed(0)}`, `demoted ${(s.demoted / perToken).toFixed(0)}`);
    this.summaryEl.textContent = parts.join(" · ") + " (tokens per layer and KV head)";
    for (const key of ["device", "host", "redis", "readmitted"]) this.canvas.dataset[key] = String(s[key]);
    this.canvas.dataset.positions = String(s.positions);
    this.canvas.dataset.state = "drawn";
  }

  // Geometry: the strip on top, the layer labels on the left, then one row per (layer, KV head), a gap
  // between layers.
  geometry() {
    const m = this.map;
    const rows = this.rows.length;
    const heads = Math.max(1, m.summary.kv_heads);
    const rowH = Math.max(1, Math.min(6, Math.floor(220 / Math.max(1, rows))));
    const layerGap = rows / heads > 1 ? 1 : 0;
    const width = Math.max(50, this.canvas.clientWidth);
    const height = MAP_STRIP + rows * rowH + (rows / heads - 1) * layerGap + 2;
    return { rowH, heads, layerGap, width, height, left: MAP_GUTTER, n: Math.max(1, m.summary.positions) };
  }

  rowTop(g, i) {
    return MAP_STRIP + 2 + i * g.rowH + Math.floor(i / g.heads) * g.layerGap;
  }

  // Whole pixels: a cell is drawn in solid colour, not blended with its neighbours at fractional edges.
  x(g, position) {
    return g.left + Math.round((position * (g.width - g.left)) / g.n);
  }

  draw() {
    if (!this.map) return;
    const g = this.geometry();
    const ratio = window.devicePixelRatio || 1;
    this.canvas.style.height = `${g.height}px`;
    this.canvas.width = Math.round(g.width * ratio);
    this.canvas.height = Math.round(g.height * ratio);
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, g.width, g.height);
    // Message bands and their boundaries.
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    let asked = 0;
    for (const span of this.map.messages) {
      const x0 = this.x(g, span.start);
      const x1 = this.x(g, span.end);
      ctx.fillStyle = ROLE_FILL[span.role] || "#eee";
      ctx.fillRect(x0, 0, x1 - x0, MAP_STRIP);
      if (span.role === "user") asked += 1;
      const label = span.role === "user" ? `you ${asked}` : span.role === "assistant" ? `reply ${asked}` : "history";
      if (x1 - x0 > ctx.measureText(label).width + 6) {
        ctx.fillStyle = "#495057";
        ctx.fillText(label, x0 + 3, MAP_STRIP / 2);
      }
    }
    ctx.fillStyle = "#6b7489";
    ctx.fillText("layer", 2, MAP_STRIP / 2);
    const layers = this.rows.length / g.heads;
    const every = layers > 12 ? 5 : 1;
    for (let layer = 0; layer < layers; layer += 1) {
      if (layer % every && layer !== layers - 1) continue;
      ctx.fillText(String(layer), 8, this.rowTop(g, layer * g.heads) + (g.heads * g.rowH) / 2);
    }
    this.rows.forEach((row, i) => {
      const y = this.rowTop(g, i);
      for (const [state, start, end] of row.runs) {
        ctx.fillStyle = MAP_COLORS[state] || "#000";
        ctx.fillRect(this.x(g, start), y, Math.max(this.x(g, end) - this.x(g, start), 1), g.rowH);
      }
      ctx.fillStyle = MAP_COLORS.readmitted;
      for (const [start, end] of row.readmitted) {
        ctx.fillRect(this.x(g, start), y, Math.max(this.x(g, end) - this.x(g, start), 1), g.rowH);
      }
    });
    ctx.strokeStyle = "rgba(33, 37, 41, 0.55)";
    ctx.lineWidth = 1;
    for (const span of this.map.messages.slice(1)) {
      const x = this.x(g, span.start) + 0.5;
      ctx.beginPath();
      ctx.moveTo(x, 0);
      ctx.lineTo(x, g.height);
      ctx.stroke();
    }
  }

  // The columns the positions are drawn in: x = left + round(position * (width - left) / positions).
  columns() {
    const g = this.geometry();
    return { left: g.left, width: g.width, positions: g.n };
  }

  // Where (row index, position) is drawn: the middle of its first pixel column, in CSS pixels.
  cellCentre(row, position) {
    const g = this.geometry();
    return { x: this.x(g, position) + 0.5, y: this.rowTop(g, row) + Math.floor(g.rowH / 2) + 0.5 };
  }

  // The colour drawn at a cell's centre, [r, g, b] (for tests and checks).
  pixel(row, position) {
    const { x, y } = this.cellCentre(row, position);
    const ratio = this.canvas.width / Math.max(1, this.canvas.clientWidth);
    const data = this.canvas.getContext("2d").getImageData(Math.floor(x * ratio), Math.floor(y * ratio), 1, 1).data;
    return [data[0], data[1], data[2]];
  }

  hover(ev) {
    if (!this.map) return;
    const g = this.geometry();
    const rect = this.canvas.getBoundingClientRect();
    const px = ev.clientX - rect.left;
    const py = ev.clientY - rect.top;
    if (px < g.left) {
      this.tip.hidden = true;
      return;
    }
    const position = Math.min(g.n - 1, Math.max(0, Math.floor(((px - g.left) * g.n) / (g.width - g.left))));
    let index = -1;
    for (let i = 0; i < this.rows.length; i += 1) {
      if (py >= this.rowTop(g, i) && py < this.rowTop(g, i) + g.rowH + g.layerGap) index = i;
    }
    const span = this.map.messages.find((s) => s.start <= position && position < s.end);
    const lines = [];
    let from = position;
    let to = position + 1;
    if (index >= 0) {
      const row = this.rows[index];
      const run = row.runs.find(([, start, end]) => start <= position && position < end);
      const again = row.readmitted.some(([start, end]) => start <= position && position < end);
      if (run) [from, to] = [run[1], run[2]];
      lines.push(`layer ${row.layer}, KV head ${row.head}: ${run ? run[0] : "?"}${again ? ", re-admitted by the last turn" : ""}`);
    }
    const shown = [Math.max(from, position - 60), Math.min(to, position + 60)];
    lines.push(`positions ${from}–${to - 1}${span ? ` · ${span.role === "history" ? "history" : span.role} message` : ""}`);
    const tokens = this.map.tokens || [];
    const text = tokens.slice(shown[0], shown[1]).join("");
    this.tip.replaceChildren();
    const head = document.createElement("div");
    head.className = "map-tip-head";
    head.textContent = lines.join("\n");
    const body = document.createElement("div");
    body.className = "map-tip-text";
    body.textContent = (shown[0] > from ? "…" : "") + text + (shown[1] < to ? "…" : "");
    this.tip.append(head, body);
    this.tip.hidden = false;
    const box = this.canvas.parentElement.getBoundingClientRect();
    this.tip.style.left = `${Math.min(ev.clientX - box.left + 12, box.width - 320)}px`;
    this.tip.style.top = `${ev.clientY - box.top + 14}px`;
  }
}
