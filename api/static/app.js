/* rocketkv-mt browser chat: sessions over the WebSocket protocol of /v1/chat/ws, the session REST
 * API for details, and a live view of where each session's KV cache lives (device / host / Redis):
 * bytes per tier, and the memory map of every token (drawn by memory_map.js, loaded before this file).
 *
 * Plain ES2020, no build step, nothing loaded from other origins. All URLs are relative to the page,
 * so the UI also works when the server is mounted under a path prefix.
 *
 * State kept in localStorage (this browser only):
 *   rkv-mt.sessions  [{session_id, token, mode, budget, created, sampling}]  the sessions made here
 *                    (``sampling``: the values this session sends with each message); the token
 *                    is the session's secret, needed to resume it and for REST calls
 *                    (`x-session-token`), so it never leaves this browser except to this server.
 *   rkv-mt.active    the selected session id
 *   rkv-mt.apiKey    the API key, when one is saved.
 *
 * API key (for a server started with RKV_API_KEY; a server without one ignores it):
 *   - HTTP: `Authorization: Bearer <key>` on every fetch.
 *   - WebSocket: browsers cannot set headers on a WebSocket handshake, and the protocol's events are
 *     strict (an unknown `api_key` field in session.create/resume would be answered `invalid_event`),
 *     so the key travels as a query parameter: `/v1/chat/ws?api_key=<key>`. It is only added when a
 *     key is saved, so servers without the feature see the same URL as before.
 */
"use strict";

const $ = (sel) => document.querySelector(sel);
const LS = { sessions: "rkv-mt.sessions", active: "rkv-mt.active", apiKey: "rkv-mt.apiKey" };

const state = {
  sessions: [],        // [{session_id, token, mode, budget, created, detail?, missing?}]
  activeId: null,
  apiKey: "",
  ws: null,
  wsOpen: null,        // Promise<WebSocket> of the current socket
  bound: null,         // session id the current socket is bound to
  pending: null,       // {resolve, reject} waiting for the next `session` (or `error`) event
  turn: null,          // {sessionId, el, textEl, metaEl, text} while a reply streams
  defaults: {},        // the server's sampling defaults (the last `session` event's `sampling`)
};
const SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
  "presence_penalty", "seed"];

let mapView = null; // the MemoryMapView of the page (memory_map.js), made in init()

class ApiErr extends Error {
  constructor(code, message, status) {
    super(message);
    this.code = code;
    this.status = status;
  }
}

// ---------------------------------------------------------------------------------- storage
function loadStored() {
  try {
    const list = JSON.parse(localStorage.getItem(LS.sessions) || "[]");
    state.sessions = Array.isArray(list) ? list.filter((s) => s && s.session_id && s.token) : [];
  } catch (_) {
    state.sessions = [];
  }
  state.activeId = localStorage.getItem(LS.active);
  state.apiKey = localStorage.getItem(LS.apiKey) || "";
}

function saveStored() {
  const plain = state.sessions.map(({ session_id, token, mode, budget, created, sampling }) =>
    ({ session_id, token, mode, budget, created, sampling }));
  localStorage.setItem(LS.sessions, JSON.stringify(plain));
  if (state.activeId) localStorage.setItem(LS.active, state.activeId);
  else localStorage.removeItem(LS.active);
}

const findSession = (id) => state.sessions.find((s) => s.session_id === id) || null;
const activeSession = () => findSession(state.activeId);

// ---------------------------------------------------------------------------------- errors
function showError(code, message) {
  const box = $("#errors");
  const item = document.createElement("div");
  item.className = "error";
  item.dataset.testid = "error";
  item.dataset.code = code || "error";
  const text = document.createElement("span");
  const strong = document.createElement("b");
  strong.textContent = code || "error";
  text.append(strong, ": " + (message || "something went wrong"));
  const close = document.createElement("button");
  close.type = "button";
  close.className = "close";
  close.setAttribute("aria-label", "dismiss");
  close.textContent = "×";
  close.addEventListener("click", () => item.remove());
  item.append(text, close);
  box.prepend(item);
  while (box.children.length > 4) box.lastElementChild.remove();
  if (code === "unauthorized") {
    $("#api-key").classList.add("needs-key");
    $("#api-key").focus();
  }
}

function reportError(err) {
  if (err instanceof ApiErr) showError(err.code, err.message);
  else showError("client_error", String((err && err.message) || err));
}

// ---------------------------------------------------------------------------------- HTTP
async function api(method, path, { token, body } = {}) {
  const headers = {};
  if (state.apiKey) headers.Authorization = "Bearer " + state.apiKey;
  if (token) headers["x-session-token"] = token;
  if (body !== undefined) headers["content-type"] = "application/json";
  let response;
  try {
    response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    throw new ApiErr("network_error", `${method} ${path} failed: ${err.message || err}`);
  }
  if (response.status === 204) return null;
  let data = null;
  try {
    data = await response.json();
  } catch (_) { /* not JSON */ }
  if (!response.ok) {
    const e = (data && data.error) || {};
    if (response.status === 401) {
      throw new ApiErr("unauthorized", e.message || "the server needs an API key: enter it above and save", 401);
    }
    throw new ApiErr(e.code || `http_${response.status}`, e.message || response.statusText || "request failed",
      response.status);
  }
  return data;
}

// ---------------------------------------------------------------------------------- WebSocket
function wsUrl() {
  const url = new URL("v1/chat/ws", window.location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.search = "";
  url.hash = "";
  if (state.apiKey) url.searchParams.set("api_key", state.apiKey);
  return url.toString();
}

function setConn(kind, text) {
  const el = $("#conn-status");
  el.dataset.state = kind;
  el.textContent = "socket: " + (text || kind);
}

function openSocket() {
  if (state.ws && (state.ws.readyState === WebSocket.OPEN || state.ws.readyState === WebSocket.CONNECTING)) {
    return state.wsOpen;
  }
  const ws = new WebSocket(wsUrl());
  let opened = false;
  state.ws = ws;
  state.bound = null;
  setConn("connecting");
  state.wsOpen = new Promise((resolve, reject) => {
    ws.addEventListener("open", () => {
      opened = true;
      setConn("open");
      resolve(ws);
    });
    ws.addEventListener("close", (ev) => {
      if (!opened) reject(new ApiErr("connection_failed", `could not open the WebSocket (code ${ev.code})`));
    });
  });
  state.wsOpen.catch(() => {}); // reported by whoever awaits it
  ws.addEventListener("message", (ev) => {
    let event;
    try {
      event = JSON.parse(ev.data);
    } catch (_) {
      showError("invalid_json", "the server sent a frame that is not JSON");
      return;
    }
    onServerEvent(event);
  });
  ws.addEventListener("close", (ev) => {
    if (state.ws !== ws) return;
    state.ws = null;
    state.bound = null;
    setConn("closed", `closed (${ev.code})`);
    const reason = ev.reason ? `: ${ev.reason}` : "";
    if (ev.code === 1008 || ev.code === 4001 || ev.code === 4401 || ev.code === 4003) {
      showError("unauthorized", `the server refused the WebSocket${reason}; check the API key`);
    } else if (!opened) {
      probeAuth();
    }
    if (state.pending) {
      state.pending.reject(new ApiErr("connection_closed", `the WebSocket closed (code ${ev.code})${reason}`));
      state.pending = null;
    }
    if (state.turn) {
      finishTurnWithError("connection_closed", `the WebSocket closed mid-reply (code ${ev.code})${reason}`);
    }
  });
  return state.wsOpen;
}

async function probeAuth() {
  // A refused handshake looks the same as a dead server from JS; ask over HTTP which one it is.
  try {
    await api("GET", "v1/sessions");
    showError("connection_failed", "the WebSocket could not be opened");
  } catch (err) {
    reportError(err);
  }
}

function sendEvent(event) {
  state.ws.send(JSON.stringify(event));
}

// Send a session.create / session.resume and wait for the `session` (or `error`) event.
async function sessionRequest(event) {
  await openSocket();
  if (state.pending) throw new ApiErr("client_busy", "another session request is in flight");
  const reply = new Promise((resolve, reject) => { state.pending = { resolve, reject }; });
  sendEvent(event);
  const info = await reply;
  state.bound = info.session_id;
  if (info.sampling) {
    state.defaults = info.sampling;
    renderSampling();
  }
  return info;
}

// ---------------------------------------------------------------------------------- sampling
// Each session keeps the values its user set (sent with every message); a field left empty takes the
// server's default, which the field shows as its placeholder.
function renderSampling() {
  const s = activeSession();
  const own = (s && s.sampling) || {};
  for (const field of SAMPLING_FIELDS) {
    const input = $(`#s-${field}`);
    input.value = own[field] ?? "";
    const d = state.defaults[field];
    input.placeholder = d === undefined || d === null ? "" : String(d);
  }
}

function readSampling() {
  const values = {};
  for (const field of SAMPLING_FIELDS) {
    const input = $(`#s-${field}`);
    const text = input.value.trim();
    if (!text) continue;
    const n = Number(text);
    if (!Number.isFinite(n) || (input.dataset.int && !Number.isInteger(n))) {
      throw new ApiErr("invalid_sampling_params", `${field} must be a ${input.dataset.int ? "whole " : ""}number`);
    }
    values[field] = n;
  }
  return values;
}

function storeSampling() {
  const s = activeSession();
  if (!s) return;
  try {
    s.sampling = readSampling();
    saveStored();
  } catch (_) { /* reported when a message is sent */ }
}

function fmtSampling(v) {
  if (!v) return "–";
  if (v.temperature === 0) return "greedy" + (v.repetition_penalty !== 1 ? `, repetition ${v.repetition_penalty}` : "");
  const parts = [`t ${v.temperature}`, `top_p ${v.top_p}`];
  if (v.top_k > 0) parts.push(`top_k ${v.top_k}`);
  if (v.min_p > 0) parts.push(`min_p ${v.min_p}`);
  if (v.repetition_penalty !== 1) parts.push(`repetition ${v.repetition_penalty}`);
  if (v.frequency_penalty) parts.push(`frequency ${v.frequency_penalty}`);
  if (v.presence_penalty) parts.push(`presence ${v.presence_penalty}`);
  if (v.seed !== null && v.seed !== undefined) parts.push(`seed ${v.seed}`);
  return parts.join(", ");
}

async function bindActive() {
  const s = activeSession();
  if (!s) throw new ApiErr("no_session", "create a session first");
  await openSocket();
  if (state.bound === s.session_id) return s;
  await sessionRequest({ type: "session.resume", session_id: s.session_id, token: s.token });
  s.missing = false;
  return s;
}

function onServerEvent(event) {
  switch (event.type) {
    case "session":
      if (state.pending) {
        state.pending.resolve(event);
        state.pending = null;
      }
      break;
    case "delta":
      if (state.turn) appendDelta(event.text || "");
      break;
    case "done":
      if (state.turn) finishTurn(event);
      break;
    case "error":
      // A cancel that crossed its turn's `done` on the wire: the turn is over, nothing to show.
      if (event.code === "no_active_turn") break;
      if (state.pending) {
        state.pending.reject(new ApiErr(event.code, event.message));
        state.pending = null;
      } else if (state.turn && event.code !== "session_busy") {
        finishTurnWithError(event.code, event.message); // the turn ended without a `done`
      } else {
        showError(event.code, event.message);
      }
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------------- formatting
function fmtBytes(n) {
  n = Number(n) || 0;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${n} B` : `${v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2)} ${units[i]}`;
}
const fmtInt = (n) => (Number(n) || 0).toLocaleString("en-US");
const fmtMs = (ms) => (ms === undefined || ms === null ? "–" : `${Math.round(ms)} ms`);
const shortId = (id) => (id.length > 12 ? id.slice(0, 10) + "…" : id);
const pct = (part, whole) => (whole > 0 && part > 0 ? Math.max(1.5, (100 * part) / whole) : 0);

// ---------------------------------------------------------------------------------- memory panel
function renderMemory(memory, tokens) {
  memory = memory || {};
  const tiers = {
    device: Number(memory.device_bytes) || 0,
    host: Number(memory.host_bytes) || 0,
    redis: Number(memory.redis_bytes) || 0,
  };
  const total = tiers.device + tiers.host + tiers.redis;
  for (const [name, bytes] of Object.entries(tiers)) {
    const label = $(`#${name}-bytes`);
    label.textContent = fmtBytes(bytes);
    label.dataset.bytes = String(bytes);
    label.title = `${fmtInt(bytes)} bytes`;
    const bar = $(`#bar-${name}`);
    bar.style.width = `${Math.min(100, pct(bytes, total)).toFixed(2)}%`;
    bar.title = `${name}: ${fmtInt(bytes)} bytes (${total ? ((100 * bytes) / total).toFixed(1) : 0}% of this session)`;
  }
  const totalEl = $("#total-bytes");
  totalEl.textContent = fmtBytes(total);
  totalEl.dataset.bytes = String(total);
  totalEl.title = `${fmtInt(total)} bytes`;
  const history = Number((tokens && tokens.history) ?? memory.history_tokens) || 0;
  const device = Number((tokens && tokens.device) ?? memory.device_tokens) || 0;
  $("#history-tokens").textContent = fmtInt(history);
  $("#device-tokens").textContent = fmtInt(device);
  $("#bar-tokens").style.width = `${Math.min(100, pct(device, history)).toFixed(2)}%`;
  $("#bar-tokens").title = history ? `${((100 * device) / history).toFixed(1)}% of the history is on the device` : "";
  if (tokens && tokens.cached !== undefined) $("#cached-tokens").textContent = fmtInt(tokens.cached);
  $("#readmitted-tokens").textContent = fmtInt(memory.readmitted_tokens);
  $("#memory-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function renderUsage(turn) {
  const usage = $("#usage");
  if (!turn) {
    usage.dataset.state = "none";
    for (const id of ["finish", "prompt", "prefilled", "generated", "ttft", "latency", "replica", "sampling"]) {
      $(`#usage-${id}`).textContent = "–";
    }
    return;
  }
  usage.dataset.state = "done";
  $("#usage-finish").textContent = turn.finish_reason || "–";
  $("#usage-prompt").textContent = fmtInt(turn.prompt_tokens);
  $("#usage-prefilled").textContent = fmtInt(turn.prefilled_tokens);
  $("#usage-generated").textContent = fmtInt(turn.generated_tokens);
  $("#usage-ttft").textContent = fmtMs(turn.ttft_ms);
  $("#usage-latency").textContent = fmtMs(turn.latency_ms);
  $("#usage-replica").textContent = turn.replica || "–";
  $("#usage-sampling").textContent = fmtSampling(turn.sampling);
}

function clearMemory() {
  renderMemory({}, { history: 0, device: 0 });
  mapView.clear();
  $("#cached-tokens").textContent = "–";
  $("#memory-updated").textContent = "";
  renderUsage(null);
}

// ---------------------------------------------------------------------------------- sessions
function renderSessionList() {
  const list = $("#session-list");
  list.replaceChildren();
  $("#no-sessions").hidden = state.sessions.length > 0;
  for (const s of state.sessions) {
    const li = document.createElement("li");
    li.className = "session-item" + (s.session_id === state.activeId ? " active" : "") + (s.missing ? " missing" : "");
    li.dataset.testid = "session-item";
    li.dataset.sessionId = s.session_id;
    li.tabIndex = 0;
    const title = document.createElement("div");
    title.className = "session-id";
    title.textContent = shortId(s.session_id);
    title.title = s.session_id;
    const meta = document.createElement("div");
    meta.className = "session-meta";
    const d = s.detail;
    const parts = [s.mode, s.budget ? `budget ${s.budget}` : "default budget"];
    if (d) parts.push(`${d.turns} turn${d.turns === 1 ? "" : "s"}`, `${fmtInt(d.history_tokens)} tok`);
    if (s.missing) parts.push("not found on the server");
    meta.textContent = parts.join(" · ");
    li.append(title, meta);
    li.addEventListener("click", () => switchSession(s.session_id));
    li.addEventListener("keydown", (ev) => { if (ev.key === "Enter") switchSession(s.session_id); });
    list.append(li);
  }
}

function renderHeader() {
  const s = activeSession();
  $("#session-title").textContent = s ? s.session_id : "No session";
  $("#session-mode").textContent = s ? s.mode : "–";
  $("#session-budget").textContent = s ? (s.budget ?? "server default") : "–";
  $("#session-turns").textContent = s && s.detail ? String(s.detail.turns) : "0";
  updateControls();
}

function updateControls() {
  const s = activeSession();
  const busy = !!state.turn;
  $("#message").disabled = !s;
  $("#send").disabled = !s || busy;
  $("#cancel").disabled = !busy;
  $("#delete-session").disabled = !s || busy;
  $("#new-session").disabled = busy;
  document.body.classList.toggle("generating", busy);
}

async function refreshDetail(s, { renderTranscriptToo = false } = {}) {
  try {
    const detail = await api("GET", `v1/sessions/${encodeURIComponent(s.session_id)}`, { token: s.token });
    s.detail = detail;
    s.missing = false;
    s.mode = detail.mode || s.mode;
    s.budget = detail.budget ?? s.budget;
    if (s.session_id === state.activeId) {
      renderMemory(detail.memory, detail.tokens);
      refreshMap(s).catch(reportError);
      if (renderTranscriptToo) {
        renderTranscript(detail);
        const last = detail.turn_stats && detail.turn_stats[detail.turn_stats.length - 1];
        renderUsage(last ? { ...last, replica: detail.replica } : null);
      }
    }
    saveStored();
    return detail;
  } catch (err) {
    if (err.code === "session_not_found") s.missing = true;
    throw err;
  } finally {
    renderSessionList();
    if (s.session_id === state.activeId) renderHeader();
  }
}

// The memory map of a session, with each position's token text for the hover.
async function refreshMap(s) {
  const path = `v1/sessions/${encodeURIComponent(s.session_id)}/memory-map?text=true`;
  const map = await api("GET", path, { token: s.token });
  if (s.session_id === state.activeId) mapView.show(map);
}

async function createSession(ev) {
  ev.preventDefault();
  if (state.turn) return;
  const event = { type: "session.create", mode: $("#mode").value };
  const budget = $("#budget").value.trim();
  if (budget) {
    const n = Number(budget);
    if (!Number.isInteger(n) || n <= 0) {
      showError("invalid_budget", "the budget must be a positive whole number of tokens");
      return;
    }
    event.budget = n;
  }
  const system = $("#system").value.trim();
  if (system) event.system = system;
  $("#new-session").disabled = true;
  try {
    const info = await sessionRequest(event);
    const s = { session_id: info.session_id, token: info.token, mode: info.mode, budget: info.budget ?? null,
      created: Date.now(), sampling: {} };
    state.sessions.unshift(s);
    state.activeId = s.session_id;
    saveStored();
    renderSampling();
    renderSessionList();
    renderHeader();
    renderTranscript({ messages: system ? [{ role: "system", content: system }] : [] });
    clearMemory();
    refreshDetail(s).catch(reportError);
    $("#message").focus();
  } catch (err) {
    reportError(err);
  } finally {
    updateControls();
  }
}

async function switchSession(id) {
  if (id === state.activeId && state.bound === id) return;
  if (state.turn) {
    showError("session_busy", "a reply is streaming: wait for it or cancel it before switching sessions");
    return;
  }
  state.activeId = id;
  saveStored();
  renderSampling();
  renderSessionList();
  renderHeader();
  renderTranscript({ messages: [] });
  clearMemory();
  const s = activeSession();
  try {
    await refreshDetail(s, { renderTranscriptToo: true });
    await bindActive(); // resume on the socket now, so a stale session shows its error at once
  } catch (err) {
    if (err.code === "session_not_found") {
      s.missing = true;
      const hint = $("#empty-hint");
      if (hint) hint.textContent = "This session is gone from the server (expired or deleted). Delete it from the list.";
    }
    renderSessionList();
    reportError(err);
  }
}

async function deleteSession() {
  const s = activeSession();
  if (!s || state.turn) return;
  if (!window.confirm(`Delete session ${s.session_id}? Its history and KV cache are freed.`)) return;
  try {
    await api("DELETE", `v1/sessions/${encodeURIComponent(s.session_id)}`, { token: s.token });
  } catch (err) {
    if (err.code !== "session_not_found") {
      reportError(err);
      return;
    }
    // Already gone on the server (expired or restarted): just forget it here.
  }
  state.sessions = state.sessions.filter((x) => x !== s);
  if (state.bound === s.session_id) state.bound = null;
  state.activeId = state.sessions.length ? state.sessions[0].session_id : null;
  saveStored();
  renderSessionList();
  renderHeader();
  clearMemory();
  renderTranscript({ messages: [] });
  if (state.activeId) switchSession(state.activeId);
}

// ---------------------------------------------------------------------------------- transcript
function messageEl(role, text, extraClass) {
  const wrap = document.createElement("div");
  wrap.className = `msg ${role}` + (extraClass ? ` ${extraClass}` : "");
  wrap.dataset.role = role;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = role === "assistant" ? "text assistant-message" : role === "user" ? "text user-message" : "text";
  body.dataset.testid = role === "assistant" ? "assistant-message" : role === "user" ? "user-message" : role;
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "msg-meta";
  wrap.append(who, body, meta);
  return { wrap, body, meta };
}

function turnMeta(t) {
  const parts = [];
  if (t.finish_reason) parts.push(t.finish_reason);
  if (t.generated_tokens !== undefined) parts.push(`${t.generated_tokens} generated`);
  if (t.prompt_tokens !== undefined) parts.push(`prefilled ${t.prefilled_tokens}/${t.prompt_tokens}`);
  if (t.ttft_ms) parts.push(`ttft ${fmtMs(t.ttft_ms)}`);
  if (t.latency_ms) parts.push(fmtMs(t.latency_ms));
  return parts.join(" · ");
}

function renderTranscript(detail) {
  const box = $("#transcript");
  box.replaceChildren();
  const messages = (detail && detail.messages) || [];
  const stats = (detail && detail.turn_stats) || [];
  let turn = 0;
  for (const m of messages) {
    const role = ["user", "assistant", "system"].includes(m.role) ? m.role : "system";
    const text = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
    const { wrap, meta } = messageEl(role, text);
    if (role === "assistant") {
      wrap.dataset.state = m.error ? "error" : m.cancelled ? "cancelled" : "done";
      if (stats[turn]) meta.textContent = turnMeta(stats[turn]);
      turn += 1;
    }
    box.append(wrap);
  }
  if (!messages.length) {
    const hint = document.createElement("p");
    hint.className = "empty-hint";
    hint.id = "empty-hint";
    hint.textContent = activeSession() ? "Say something." : "Create a session, then say something.";
    box.append(hint);
  }
  box.scrollTop = box.scrollHeight;
}

function scrollToEnd(force) {
  const box = $("#transcript");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

async function sendMessage(ev) {
  if (ev) ev.preventDefault();
  if (state.turn) return;
  const input = $("#message");
  const content = input.value;
  if (!content.trim()) {
    showError("empty_message", "type a message first");
    return;
  }
  let event;
  try {
    event = { type: "message", content, ...readSampling() };
  } catch (err) {
    reportError(err);
    return;
  }
  const maxTokens = $("#max-tokens").value.trim();
  if (maxTokens) {
    const n = Number(maxTokens);
    if (!Number.isInteger(n) || n <= 0) {
      showError("invalid_sampling_params", "max tokens must be a positive whole number");
      return;
    }
    event.max_tokens = n;
  }
  let s;
  $("#send").disabled = true;
  try {
    s = await bindActive();
  } catch (err) {
    if (err.code === "session_not_found") {
      const stale = activeSession();
      if (stale) stale.missing = true;
      renderSessionList();
    }
    reportError(err);
    updateControls();
    return;
  }
  const hint = $("#empty-hint");
  if (hint) hint.remove();
  const box = $("#transcript");
  box.append(messageEl("user", content).wrap);
  const reply = messageEl("assistant", "");
  reply.wrap.dataset.state = "streaming";
  reply.wrap.classList.add("streaming");
  box.append(reply.wrap);
  state.turn = { sessionId: s.session_id, el: reply.wrap, textEl: reply.body, metaEl: reply.meta, text: "" };
  $("#usage").dataset.state = "streaming";
  input.value = "";
  updateControls();
  scrollToEnd(true);
  try {
    sendEvent(event);
  } catch (err) {
    finishTurnWithError("send_failed", String(err.message || err));
  }
}

function appendDelta(text) {
  state.turn.text += text;
  state.turn.textEl.textContent = state.turn.text;
  scrollToEnd(false);
}

function finishTurn(done) {
  const turn = state.turn;
  state.turn = null;
  turn.el.classList.remove("streaming");
  turn.el.dataset.state = done.finish_reason === "cancelled" ? "cancelled" : "done";
  turn.el.dataset.finishReason = done.finish_reason;
  turn.metaEl.textContent = turnMeta({ ...done.usage, finish_reason: done.finish_reason,
    ttft_ms: done.ttft_ms, latency_ms: done.latency_ms });
  const s = findSession(turn.sessionId);
  if (turn.sessionId === state.activeId) {
    renderMemory(done.memory, null);
    renderUsage({ ...done.usage, finish_reason: done.finish_reason, ttft_ms: done.ttft_ms,
      latency_ms: done.latency_ms, replica: done.replica, sampling: done.sampling });
  }
  updateControls();
  if (s) refreshDetail(s).catch(reportError);
}

function finishTurnWithError(code, message) {
  const turn = state.turn;
  state.turn = null;
  turn.el.classList.remove("streaming");
  turn.el.dataset.state = "error";
  turn.metaEl.textContent = `error: ${code}`;
  const note = document.createElement("div");
  note.className = "error-message";
  note.dataset.testid = "turn-error";
  note.textContent = `${code}: ${message}`;
  turn.el.append(note);
  $("#usage").dataset.state = "error";
  showError(code, message);
  updateControls();
  const s = findSession(turn.sessionId);
  if (s) refreshDetail(s).catch(() => {});
}

function cancelTurn() {
  if (!state.turn || !state.ws || state.ws.readyState !== WebSocket.OPEN) return;
  sendEvent({ type: "cancel" });
  $("#cancel").disabled = true;
}

// ---------------------------------------------------------------------------------- start
async function loadHealth() {
  try {
    const h = await api("GET", "healthz");
    $("#server-info").textContent = `${h.model} · ${h.backend} · ${h.replica}`;
  } catch (err) {
    $("#server-info").textContent = "server unreachable";
    reportError(err);
  }
}

function init() {
  mapView = new MemoryMapView($("#map-canvas"), $("#map-tip"), $("#map-summary"));
  window.rkvMemoryMap = mapView;
  loadStored();
  $("#api-key").value = state.apiKey;
  $("#api-key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.apiKey = $("#api-key").value.trim();
    if (state.apiKey) localStorage.setItem(LS.apiKey, state.apiKey);
    else localStorage.removeItem(LS.apiKey);
    $("#api-key").classList.remove("needs-key");
    // Reconnect so the WebSocket carries the new key.
    if (state.ws && !state.turn) state.ws.close(1000, "api key changed");
    loadHealth();
  });
  $("#new-session-form").addEventListener("submit", createSession);
  $("#composer").addEventListener("submit", sendMessage);
  $("#message").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) sendMessage(ev);
  });
  $("#cancel").addEventListener("click", cancelTurn);
  $("#delete-session").addEventListener("click", deleteSession);
  for (const field of SAMPLING_FIELDS) $(`#s-${field}`).addEventListener("change", storeSampling);

  renderSessionList();
  renderHeader();
  clearMemory();
  loadHealth();
  if (state.activeId && !findSession(state.activeId)) state.activeId = null;
  if (!state.activeId && state.sessions.length) state.activeId = state.sessions[0].session_id;
  if (state.activeId) {
    const id = state.activeId;
    state.activeId = null;
    switchSession(id);
  }
}

document.addEventListener("DOMContentLoaded", init);
