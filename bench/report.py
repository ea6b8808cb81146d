"""``rocketkv-mt bench report``: ``docs/benchmarks.md`` and its figures, from the result files.

One section per benchmark folder of ``results/``; under it, one part per result file with the command
that produced it, the machine it ran on, the commit of the code, a table of its figures and, where
``bench plot`` draws one, its figure (``docs/benchmarks/<folder>-<stem>.png``). The page holds
nothing the files do not, so regenerating it from the same files gives the same text; what changed
and when lives in git.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from bench.plot import long_message, plottable, render, run_command
from bench.report_gpu import GPU_TABLES
from bench.report_soak import SOAK_TABLES
from bench.results import RESULTS, ROOT, Result, folder, shipped
from bench.sweep import Sweep, sweeps
from bench.tables import mb as _mb
from bench.tables import ms as _ms
from bench.tables import table as _table

DOC = ROOT / "docs" / "benchmarks.md"

# What each benchmark measures, in a sentence or two, by folder.
ABOUT = {
    "chat": "How well each model chats with the sampling a served turn gets (`rocketkv-mt bench chat`): four "
            "conversations of our own whose first message gives a name and two facts, then five turns that ask "
            "for them and give one small instruction, once per seed, cache `full`. A recall is correct when the "
            "reply holds the fact; a reply loops when it repeats a four-word phrase three times (twice when cut "
            "at `max_tokens`); tokens/s is decode speed on this machine.",
    "eval": "Multi-turn recall (`rocketkv-mt eval`): conversations whose first message hides four facts in "
            "filler, then one question per turn about another fact; greedy replies, correct when they hold "
            "the fact. Accuracy per turn shows what each mode forgets as the conversation goes on. The "
            "RULER-based files (`bench/tasks/ruler_*.jsonl`, docs/ruler.md) add correct answers per task kind.",
    "needle": "Single-turn pass-key retrieval (`rocketkv-mt bench needle`): a 5-digit key hidden at several "
              "depths of a long prompt; correct when the reply holds it.",
    "fidelity": "Teacher-forced agreement with full attention (`rocketkv-mt bench fidelity`): every variant "
                "reads `full`'s own greedy transcript and is scored at each reply position by top-1 agreement "
                "with `full`'s token and by mean KL(full || variant). Smaller differences show here than in "
                "`eval`'s counts.",
    "history-swap": "One turn answered in each mode on top of each mode's own earlier replies "
                    "(`rocketkv-mt bench history-swap`): recall lost at that turn against recall inherited "
                    "from earlier, differently worded replies.",
    "scaling": "What a turn costs as the history grows (`rocketkv-mt bench scaling`): three turns per "
               "conversation; turn 3's time to first token, the bytes it read back from the cold tiers and "
               "the device bytes, per mode. Times are medians over the repeated conversations.",
    "decode": "Decode speed and device memory on one long context (`rocketkv-mt bench decode`): ms per "
              "generated token for the whole model and for attention alone, modes alternating.",
    "capacity": "Sessions one replica keeps on its device (`rocketkv-mt bench capacity`): sessions with a "
                "long first message are admitted by the engine's own admission control, one by one, until "
                "it refuses one; parking is off.",
    "prefill-peak": "What a long first turn holds on the device while it is prefilled (`rocketkv-mt bench "
                    "prefill-peak`), fed layer by layer as the engine feeds it: the session's peak (KV, KT and "
                    "what its policies hold, read after every group of rows) beside the admission bound the "
                    "engine reserves for the turn, and with the prefill's scratch (hidden states, rotary "
                    "tables, one group's MLP and attention workspace: measured on CUDA, computed from the "
                    "shapes on a CPU).",
    "ttft": "Time to first token of a later turn (`rocketkv-mt bench ttft`): a stateful session against "
            "the same conversation re-prefilled from scratch, as a stateless server would.",
    "serve": "A running server under load (`rocketkv-mt bench serve`). Load runs: concurrent WebSocket "
             "sessions send a context message, then short turns, then the same conversations run one at a "
             "time; the speed-up is the short turns' tokens/s concurrent over one at a time. Stall runs "
             "(`--stall`): sessions stream long replies, then a long message arrives in one more session "
             "(its first turn, or with `--stall-turn K` its K-th, after shorter ones); the ratio is the longest pause a stream saw while it was prefilled over the 95th "
             "percentile gap between tokens before it. Cluster runs (`python -m bench.cluster_serve`): two chat "
             "replicas on two Ray worker nodes on loopback, each replica's device budget measured to fit N of the "
             "sessions and not N+1; each round 2N new sessions arrive at once and stay resident together; "
             "sessions per replica and refusals (`device_memory_exhausted`) per placement policy "
             "(`RKV_PLACEMENT`).",
    "soak": "Sessions kept through faults (`rocketkv-mt bench soak`): a Redis topology (one `redis-server`, a "
            "primary and a replica behind three Sentinels, or a Cluster of three masters with a replica each; AOF "
            "with `appendfsync everysec`) and replica processes; clients take short REST turns, delete their "
            "sessions after a random number of turns and open new ones, and move between replicas, while faults "
            "strike one at a time: replicas killed (SIGKILL) and started again, Redis primaries crashed (their "
            "last writes lost), Sentinel and Cluster failovers, a replica cut off from Redis, one made slow (a "
            "proxy in its network namespace) and one paused (SIGSTOP). Then: every turn acknowledged durable is in "
            "its session's final history, bit for bit (one acknowledged as not durable may be missing, and its "
            "client was told), no deleted session answers on any replica, every surviving conversation replayed "
            "on a fresh replica without faults gives the same greedy replies, or, where a reply differs, the soak's "
            "own transcript teacher-forced puts each of its tokens within a tie (0.05 logit) of the top one: float "
            "noise of batched steps, not wrong KV, which would put them far below (no wrong KV was served); no record "
            "names missing KV unless a restore said so, once the pending TTL has passed every Redis key of the "
            "session namespace is named by its record, and each replica's used host-tier bytes are its live "
            "sessions' sum. Older files: a single Redis restarted on its AOF. Failed attempts (retried) are "
            "counted by kind; a violation fails the run.",
    "placement": "Where new sessions go, by simulation (`rocketkv-mt bench placement`): a synthetic chat trace "
                 "(sized from LMSYS-Chat-1M and ShareGPT statistics; `bench/placement_trace.py`) replayed against "
                 "2, 8 and 64 simulated replicas with the server's own placement (`app/placement.py`), per-session "
                 "byte bounds and admission (parking, waits, refusals); only the model is simulated. `hash` places "
                 "new sessions by rendezvous hashing, `memory` on the replica that last reported the most room, "
                 "`memory+moves` also places a parked `tiered` session again at its next turn (simulated only). "
                 "Device use: held bytes over the budget (fleet mean), and bytes of active sessions and turns in "
                 "flight over the budget (mean replica, busiest replica), sampled at each report.",
    "rounds": "The load bench's conversations in one process with every model step recorded "
              "(`rocketkv-mt bench rounds`): each round of concurrent short turns as its prefill and decode "
              "steps, beside a turn alone.",
    "hsa": "One layer's Hybrid Sparse Attention decode step on synthetic tensors (`rocketkv-mt bench hsa`): "
           "the native C kernel, the torch path and dense attention, in microseconds per call; with "
           "`--sessions`, the batched step of that many sessions, each layer with cold buffers of its own.",
    "linear": "A float32 linear layer on CPU (`rocketkv-mt bench linear`): `nn.Linear` (the BLAS torch was "
              "built with) against oneDNN's product over weights packed once, as `RKV_CPU_LINEAR=onednn` "
              "serves them.",
    "ops": "Torch ops, kernel launches and native calls per decode step and layer (`rocketkv-mt bench ops`, "
           "torch profiler): the batched step (`auto`) against one call per session (`torch`).",
    "gpu": "The GPU check (`bench/gpu_check.py`, see docs/gpu-check.md).",
}


def _eval(d: dict) -> list[str]:
    kinds = list(dict.fromkeys(k for m in d["modes"].values() for k in m.get("per_kind", {})))
    rows = [[f"`{mode}`", f"{m['correct']} / {m['total']}", " / ".join(f"{a:.3g}" for a in m["per_turn_accuracy"]),
             *(_count(m.get("per_kind", {}).get(k)) for k in kinds),
             _mb(m["peak_device_kv_bytes"]), f"{m['mean_turn_latency_ms'] / 1000:.1f} s"]
            for mode, m in d["modes"].items()]
    lines = [f"`{d['tasks']}`, {d['conversations']} conversations, budget {d['budget']}.", ""]
    head = ["mode", "correct", "accuracy per turn", *kinds, "peak device KV", "mean turn latency"]
    return lines + _table(head, rows)


def _sweep(s: Sweep) -> list[str]:
    """One budget sweep: every mode at every budget it ran at, ``full`` as the yardstick."""
    rows = s.rows()
    kinds = list(dict.fromkeys(k for _, _, m in rows for k in m.get("per_kind", {})))
    full_bytes = s.full.summary.get("peak_device_kv_bytes") if s.full else None
    table = []
    for mode, budget, m in rows:
        peak = m.get("peak_device_kv_bytes")
        other = "" if mode == "full" or s.comparable(m) else " (not `full`'s questions)"
        table.append([f"`{mode}`", "-" if budget is None else budget, f"{m['correct']} / {m['total']}{other}",
                      *(_count(m.get("per_kind", {}).get(k)) for k in kinds), "-" if peak is None else _mb(peak),
                      f"{peak / full_bytes:.0%}" if peak is not None and full_bytes else "-"])
    lines = [f"### Budget sweep: `{s.setup}`", "", "Model `" + s.model + "`; from "
             + ", ".join(f"`{f}`" for f in s.files) + ".", ""]
    head = ["mode", "budget", "correct", *kinds, "peak device KV", "of `full`'s"]
    lines += _table(head, table) + [""]
    for mode, budget, taken, other in s.disagreements:
        at = "" if budget is None else f" at {budget}"
        lines.append(f"`{mode}`{at} answered {other.summary['correct']} / {other.summary['total']} in "
                     f"`{other.file}`: the row is `{taken.file}`'s.")
    return lines + [_verdict(s), ""]


def _verdict(s: Sweep) -> str:
    """Where ``tiered`` answers within one question of ``full``: every budget, since a smaller budget
    that holds does not promise that every larger one does."""
    within = s.within()
    held = [b for b, ok in within.items() if ok]
    if s.full is None:
        return "`full` did not run: no yardstick."
    if not within:
        return "`tiered` did not run on `full`'s questions."
    if not held:
        return "At no budget measured does `tiered` answer within one question of `full`."
    missed = [b for b, ok in within.items() if not ok]
    return (f"`tiered` answers within one question of `full` at budget {', '.join(map(str, held))}"
            + (f" (not at {', '.join(map(str, missed))})" if missed else "")
            + f"; the smallest: **{held[0]}**.")


def _count(c: dict | None) -> str:
    return "-" if c is None else f"{c['correct']} / {c['total']}"


def _needle(d: dict) -> list[str]:
    lengths = list(d["per_length"])
    rows = [[f"`{mode}`", f"{m['correct']} / {m['total']}", " / ".join(str(d["per_length"][n][mode]) for n in lengths)]
            for mode, m in d["modes"].items()]
    lines = [f"{d['cases']} cases, budget {d['budget']}, Stage-1 kernel {d['kernel_size']}.", ""]
    return lines + _table(["mode", "correct", f"per length ({' / '.join(lengths)} tokens)"], rows)


def _fidelity(d: dict) -> list[str]:
    rows = []
    for name, v in d["variants"].items():
        changed = {**v.get("rocket", {}), **v.get("settings", {})}
        rows.append([name, f"`{v['mode']}`", ", ".join(f"`{k}={x}`" for k, x in changed.items()) or "defaults",
                     v["positions"], f"{v['top1_agreement']:.4f}", f"{v['mean_kl']:.4f}"])
    lines = [f"`{d['tasks']}`, first {d['conversations']} conversations, budget {d['budget']}.", ""]
    return lines + _table(["variant", "mode", "changed", "positions", "top-1 agreement", "mean KL"], rows)


def _history_swap(d: dict) -> list[str]:
    n = len(d["conversations"])
    rows = [[pair.replace("/", ", "), f"{c} / {n}"] for pair, c in d["correct"].items()]
    lines = [f"`{d['tasks']}`, turn {d['turn']} answered, budget {d['budget']}.", ""]
    return lines + _table(["history, answer", "correct"], rows)


def _scaling(d: dict) -> list[str]:
    rows = []
    for length in d["lengths"]:
        history = length["history_kv_bytes"]
        for mode, m in length["modes"].items():
            t1, t3 = m["turn1"], m["turn3"]
            read = t3["bytes_read"]
            rows.append([f"{length['history_tokens']:,}", f"`{mode}`", _ms(t3["ttft_ms"]), t3.get("ttft_vs_full", "–"),
                         _mb(read) if read else "0", f"{read / history:.1%}" if read else "–",
                         t1.get("ttft_vs_full", "–"), _mb(t3["device_bytes"])])
    lines = [f"`{d['model']}` on {d['device']}, budget {d['token_budget']}, {d['max_tokens']} tokens a reply, "
             f"medians of {d['repeats']} conversation(s).", ""]
    return lines + _table(["history at turn 3", "mode", "turn 3 first token", "vs full", "turn 3 bytes read",
                           "of the history's KV", "turn 1 first token vs full", "device bytes"], rows)


def _decode(d: dict) -> list[str]:
    s = d["split"]
    rows = [[f"`{mode}`", m["decode_ms_per_token"], m["attention_ms_per_token"], _mb(m["device_kv_bytes"]),
             m["device_tokens_per_head"]] for mode, m in d["modes"].items()]
    lines = [f"Context {d['context']:,} tokens, budget {d['budget']}, {d['decode_tokens_per_mode']} decode tokens a "
             f"mode; split: prompt budget {s['prompt_budget']}, page {s['page_size']}, top-r {s['topr']}, "
             f"top-k {s['topk']}.", ""]
    return lines + _table(["mode", "decode ms/token", "attention ms/token", "device KV", "tokens per KV head"], rows)


def _capacity(d: dict) -> list[str]:
    rows = [[f"`{mode}`", m["sessions"], _mb(m["device_bytes_per_session"]), f"{m['device_tokens_per_session']:,}",
             _mb(m["admission_bound_bytes"])] for mode, m in d["modes"].items()]
    host = f", host tier {_mb(d['host_tier_bytes'])}" if d.get("host_tier_bytes") else ""
    stopped = [f"`{mode}`" for mode, m in d["modes"].items() if m.get("refused_by") == "host"]
    note = f" The host tier, not the device, stopped {', '.join(stopped)}." if stopped else ""
    lines = [f"{d['context']:,}-token histories, device budget {_mb(d['device_budget'])}, token budget "
             f"{d['token_budget']}{host}.{note}", ""]
    return lines + _table(["mode", "sessions resident", "device bytes a session", "tokens per KV head on device",
                           "admission bound a turn"], rows)


def _prefill_peak(d: dict) -> list[str]:
    rows = [[f"`{mode}`", _mb(m["peak_session_bytes"]), f"{d.get('peak_over_full', {}).get(mode, '–')}",
             _mb(m["admission_bound_bytes"]), _mb(m["peak_with_scratch_bytes"]), _mb(m["held_after_bytes"]),
             f"{m['prefill_s']:.0f} s"] for mode, m in d["modes"].items()]
    lines = [f"A {d['context']:,}-token first turn, model {d['model']}, {d['device']}, token budget "
             f"{d['token_budget']}, groups of {d['rows_per_group']} rows; scratch "
             f"{next(iter(d['modes'].values()))['scratch']}.", ""]
    return lines + _table(["mode", "session peak", "of full's", "admission bound", "peak with scratch",
                           "held after", "prefill"], rows)


def _chat(d: dict) -> list[str]:
    rows = []
    for name, m in d["chat_models"].items():
        s = m["sampling"]
        shown = "greedy" if s["temperature"] == 0 else ", ".join(
            f"{k} {v}" for k, v in s.items() if v not in (0, 0.0) and not (k.endswith("penalty") and v == 1.0))
        rows.append([f"`{name}` ({m['title']})", f"{m['recalls']}/{m['recall_questions']}",
                     f"{m['instructions']}/{m['instruction_questions']}", f"{m['loops']}/{m['replies']}",
                     f"{m['decode_tokens_per_s']}", shown])
    lines = [f"{d['conversations']} conversations of {d['turns']} turns, seeds {d['seeds']}, replies of up to "
             f"{d['max_tokens']} tokens.", ""]
    return lines + _table(["model", "recalls correct", "instructions followed", "replies that loop",
                           "decode tokens/s", "sampling"], rows)


def _ttft(d: dict) -> list[str]:
    st = d["stateful"]
    rows = [[f"stateful `{d['mode']}`", _ms(st["ttft_ms"]), st["prefilled_tokens"], "1"]]
    rows += [[f"stateless `{mode}`", _ms(m["ttft_ms"]), m["prefilled_tokens"], f"{d['speedup'][mode]}x"]
             for mode, m in d["stateless"].items()]
    lines = [f"Turn {d['turn']} over a {d['history_tokens']:,}-token history, budget {d['token_budget']}.", ""]
    return lines + _table(["session", "first token", "tokens prefilled", "stateful is faster by"], rows)


def _serve(d: dict) -> list[str]:
    if "stall_tokens" in d:
        return _stall(d)
    rows = []
    for label, key, rate in (("concurrent", "concurrent", d["aggregate_tokens_per_s"]),
                             ("one at a time", "sequential", d["sequential_tokens_per_s"])):
        p = d[key]
        rows.append([label, p["turns"], f"{rate:.2f}", f"{_ms(p['latency_ms']['p50'])} / {_ms(p['latency_ms']['p95'])}",
                     f"{_ms(p['ttft_ms']['p50'])} / {_ms(p['ttft_ms']['p95'])}", f"{p['wall_s']:.1f} s"])
    ctx = d.get("with_context", {})
    lines = [f"{d['sessions']} sessions, ~{d['context']}-token context messages, then {d['turns']} turns of "
             f"{d['max_tokens']} tokens; mode: {d['mode']}. Speed-up **{d['speedup']}x**"
             + (f" ({ctx['speedup']}x counting the context messages)" if ctx else "")
             + f"; {d['errors']} errors; peak device bytes {_mb(d['peak_device_bytes'])} of a "
             f"{_mb(d['device_budget_bytes'])} budget.", ""]
    return lines + _table(["short turns", "turns", "tokens/s", "turn latency p50 / p95", "first token p50 / p95",
                           "wall"], rows)


def _stall(d: dict) -> list[str]:
    long = d["long_message"]
    rows = [[_ms(d["gap_before_p95_ms"]), _ms(d["max_pause_ms"]), f"**{d['ratio']}x**", _ms(d["gaps_during_p95_ms"]),
             f"{long_message(long)}, first token at {long['ttft_s']:.1f} s"]]
    lines = [f"Stall: {d['sessions']} sessions stream replies of up to {d['reply_tokens']} tokens; mode: {d['mode']}.",
             ""]
    return lines + _table(["p95 gap before", "longest pause", "ratio", "p95 gap during", "the long message"], rows)


def _cluster(d: dict) -> list[str]:
    c, t, p = d["cluster"], d["totals"], d["probe"]
    n, hashed = d["sessions_per_replica"], c["policy"] == "hash"
    lines = [f"Placement `{c['policy']}`: {c['replicas']} replicas on {c['workers']} Ray worker nodes (the head offers "
             f"no CPU; each worker `{{\"chat\": 1}}`), mode `{d['mode']}`, {d['sessions']} sessions a round with a "
             f"~{d['context']}-token context message, then {d['turns']} short turn"
             f"{'s' if d['turns'] != 1 else ''}, {d['max_tokens']} tokens a reply. Device budget {_mb(d['device_budget_bytes'])} a replica: {n} sessions commit at most "
             f"{_mb(p['fits_bytes'])}, {n + 1} at least {_mb(p['overflow_bytes'])}; turns are refused at once "
             f"rather than queued. **{t['refused_sessions']} of {t['sessions_opened']} sessions refused; "
             f"{t['even_rounds']} of {len(d['rounds'])} rounds split {n} / {n}**; {t['parked']} sessions parked, "
             f"{t['other_errors']} other errors."
             + (f" Session ids are random, so rounds sample the hash: {2 * n} ids hashed over two replicas split "
                f"{n} / {n} with probability {math.comb(2 * n, n) / 4 ** n:.0%}." if hashed else ""), ""]
    rows = [[i, " / ".join(map(str, r["split"])), r["refused_sessions"], r["turns_done"],
             *([("yes" if r["as_hashed"] else "no")] if hashed else [])] for i, r in enumerate(d["rounds"], 1)]
    lines += _table(["round", "sessions per replica", "refused", "turns served",
                     *(["where the rendezvous hash puts them"] if hashed else [])], rows) + [""]
    stats = d.get("replica_stats", {})
    rows = [[f"`{k}`", "head" if node == d.get("head_node") else f"worker `{node[:8]}`",
             sum(r["split"][i] for r in d["rounds"]), _mb(stats.get(k, {}).get("peak_device_bytes") or 0),
             stats.get(k, {}).get("turns_refused_device_memory", "–"), stats.get(k, {}).get("sessions_parked_total", "–")]
            for i, (k, node) in enumerate((k, d["replica_nodes"][k]) for k in d["replicas"])]
    return lines + _table(["replica", "node", "sessions over the rounds", "peak device bytes", "turns refused",
                           "sessions parked"], rows)


def _placement(d: dict) -> list[str]:
    p = d["placement"]
    sim = p["sim"]
    lines = [f"{p['model']}, device budget {sim['device_budget'] / 1024**3:g} GiB a replica, token budget "
             f"{sim['token_budget']}, admission wait {sim['admission_wait_s']:g} s, reports every {sim['report_s']:g} s, "
             f"prefill {sim['prefill_tps']:g} and decode {sim['decode_tps']:g} tokens/s a session, seed {p['seed']}.", ""]
    for name, runs in d["scenarios"].items():
        shape = p["scenarios"][name]
        lines.append(f"`{name}`: {shape['rate']:g} conversations/s a replica for {shape['duration_s']:g} s; per "
                     "replica count, the trace drawn: " + "; ".join(
                         f"{n}: {r['trace']['conversations']:,} conversations, {r['trace']['mean_turns']} turns, "
                         f"{r['trace']['mean_prompt_tokens']:g} / {r['trace']['mean_reply_tokens']:g} tokens a "
                         f"message / reply, gaps {r['trace']['mean_gap_s']:g} s" for n, r in runs.items()) + ".")
        lines.append("")
        rows = [[n, f"`{policy}`", f"{x['turns']:,}", x["refused"], x["waited"], f"{x['parks']:,}",
                 f"{x['reprefill_tokens']:,}", x["restores"], x["moves"], f"{x['device_held_mean']:.0%}",
                 f"{x['device_active_mean']:.0%} / {x['device_active_busiest']:.0%}"]
                for n, r in runs.items() for policy, x in r["policies"].items()]
        lines += _table(["replicas", "policy", "turns", "refused", "waited", "parks", "re-prefilled tokens",
                         "restores", "moves", "device held", "active: mean / busiest replica"], rows) + [""]
    return lines[:-1]


def _rounds(d: dict) -> list[str]:
    phases = [("context messages", d["context_phase"])]
    phases += [(f"round {i}", r) for i, r in enumerate(d["rounds"], 1)]
    phases += [(f"a turn alone ({i})", r) for i, r in enumerate(d["alone"], 1)]
    rows = [[label, p["turns"], f"{p['wall_s']:.2f} s", f"{p['prefill_steps']} / {p['prefill_s']:.2f} s",
             p["decode_steps"], _ms(p["decode_step_ms_median"]), p["mean_decode_batch"]] for label, p in phases]
    lines = [f"{d['sessions']} sessions, ~{d['context']}-token contexts, {d['max_tokens']} tokens a turn, mode "
             f"`{d['mode']}`; ratio **{d['ratio']}x** (16 turns alone over a round).", ""]
    return lines + _table(["phase", "turns", "wall", "prefill steps / time", "decode steps", "decode step median",
                           "mean decode batch"], rows)


def _hsa(d: dict) -> list[str]:
    s = d["shapes"]
    rows = [[f"`{name}`", us, "1" if name == "native" else f"{d['ratios'].get(f'{name}/native', '–')}x"]
            for name, us in d["us_per_call"].items()]
    lines = [f"{s['kv_heads']} KV heads x {s['group']} query heads, head dim {s['head_dim']}, {s['kept']} kept tokens "
             f"(dense context {s['context']}), page {s['page_size']}, top-r {s['topr']}, top-k {s['topk']}.", ""]
    lines += _table(["backend", "µs per call", "over native"], rows)
    if "batched" in d:
        b = d["batched"]
        lines += ["", f"Batched native step, {b['sessions']} sessions x {b['layers']} layers: {_ms(b['step_ms'])} a "
                  f"step, **{b['us_per_session_layer']} µs** a session and layer."]
    return lines


def _linear(d: dict) -> list[str]:
    rows = [[f"{r['out']} x {r['in']}", r["rows"], r["us"]["torch"], r["us"]["onednn"], f"{r['torch_over_onednn']}x"]
            for r in d["results"]]
    lines = [f"{d['threads']} thread(s), {d['rounds']} rounds.", ""]
    return lines + _table(["out x in", "rows", "`nn.Linear` µs", "oneDNN µs", "nn.Linear / oneDNN"], rows)


def _ops(d: dict) -> list[str]:
    rows = [[f"`{kernels}`", c["sessions"], c["ops_per_layer"], c["launches_per_layer"], c["native_calls_per_layer"],
             c["step_ops"]] for kernels, counts in d["counts"].items() for c in counts]
    lines = [f"Random model ({', '.join(f'{k} {v}' for k, v in d['shapes'].items())}) on {d['device']}, "
             f"{d['dtype']}; modes {', '.join(d['modes'])} in turn.", ""]
    return lines + _table(["kernels", "sessions", "ops a layer", "kernel launches a layer", "native calls a layer",
                           "ops a step"], rows)


def _fields(d: dict) -> list[str]:
    """Any other result: its scalar fields, one level of nesting flattened."""
    rows = []
    for key, value in d.items():
        if key in ("command", "server_command", "machine", "commit"):
            continue
        if isinstance(value, dict):
            rows += [[f"{key}.{k}", v] for k, v in value.items() if not isinstance(v, (dict, list))]
        elif not isinstance(value, list):
            rows.append([key, value])
    return _table(["field", "value"], rows)


TABLES: dict[str, Callable[[dict], list[str]]] = {
    "chat": _chat, "eval": _eval, "needle": _needle, "fidelity": _fidelity, "history-swap": _history_swap, "scaling": _scaling,
    "decode": _decode, "capacity": _capacity, "prefill-peak": _prefill_peak, "ttft": _ttft, "serve": _serve,
    "stall": _stall, "cluster": _cluster, "placement": _placement, "rounds": _rounds, "hsa": _hsa,
    "linear": _linear, "ops": _ops, **SOAK_TABLES, **GPU_TABLES,
}


def machine_text(machine: dict | None) -> str:
    if not machine:
        return "not recorded"
    return f"{machine.get('cpu') or 'CPU not recorded'}, {machine.get('cores') or '?'} cores, " \
           f"{'GPU ' + machine['gpu'] if machine.get('gpu') else 'no GPU'}"


def part(result: Result, figures: str) -> list[str]:
    """One result file: where it is, how it was made, its table and figure."""
    d = result.data
    lines = [f"### `{result.relative()}`", ""]
    lines.append(f"- command: `{d.get('command', 'not recorded')}`")
    if d.get("server_command"):
        lines.append(f"- server: `{d['server_command']}`")
    lines.append(f"- machine: {machine_text(d.get('machine'))}")
    lines.append(f"- commit: {d.get('commit') or 'not recorded'}")
    lines.append("")
    lines += TABLES.get(result.bench, _fields)(d)
    if plottable(result):
        lines += ["", f"![{result.name}]({figures}/{result.name}.png)"]
    return lines + [""]


def build(results: list[Result], figures: str = "benchmarks", results_dir: Path = RESULTS) -> str:
    """The text of docs/benchmarks.md; figures are linked as ``<figures>/<name>.png``."""
    sections: dict[str, list[Result]] = {}
    for r in results:
        sections.setdefault(folder(r, results_dir), []).append(r)
    lines = ["# Benchmarks", "",
             "Generated by `rocketkv-mt bench report` from the result files under `results/`, one folder per "
             "benchmark; change those files (by running the command shown) and regenerate, rather than editing "
             "this page. Each run names its command, the machine it ran on and the commit of its code: compare "
             "times only between runs of one machine. Earlier runs are in the history of `results/`.", ""]
    lines += [f"- [{name}](#{name})" for name in sections] + [""]
    for name, found in sections.items():
        lines += [f"## {name}", "", ABOUT.get(name, ""), ""]
        for r in found:
            lines += part(r, figures)
        for sweep in sweeps(found):
            lines += _sweep(sweep)
    return "\n".join(lines).rstrip() + "\n"


def write(results_dir: Path = RESULTS, doc: Path = DOC) -> list[Path]:
    """Write ``doc`` and its figures (in ``<doc's folder>/<doc's stem>/``), removing figures no result
    draws any more. Returns the files written."""
    results = shipped(results_dir)
    figures = doc.parent / doc.stem
    drawn = [render(r, figures / f"{r.name}.png") for r in results if plottable(r)]
    for stale in set(figures.glob("*.png")) - set(drawn):
        stale.unlink()
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(build(results, doc.stem, results_dir))
    return [doc, *drawn]


def main(args) -> int:
    def work() -> str:
        written = write(Path(args.results), Path(args.out))
        return f"{written[0]} and {len(written) - 1} figures"

    return run_command("bench report", work)
