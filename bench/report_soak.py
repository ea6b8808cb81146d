"""``bench soak``'s result files as tables of ``docs/benchmarks.md``: what the run did (turns by what their
save gave, faults by kind, what the replicas restored, replayed and found lost, keys per session and
round trips per turn), then each check with what it looked at and its violations. Files written before
faults had kinds (``restarts``: replica and Redis restarts) render too.
"""
from __future__ import annotations

from collections.abc import Callable

from bench.tables import mb, table

# (violation name, what it counts, the check that looked) in the order a reader weighs them.
CHECKS = (
    ("history", "surviving sessions whose history differs from what was acknowledged", "history"),
    ("lost_turns", "acknowledged turns lost", None),
    ("duplicated_turns", "acknowledged turns duplicated", None),
    ("deleted_answering", "deleted sessions answering on a replica", "deleted"),
    ("replies_differ", "sessions whose replies differ from a reference run without faults", "replies"),
    ("missing_kv", "sessions whose record names missing KV that no restore reported", "missing_kv"),
    ("orphan_keys", "Redis keys of the session namespace without a live record", "orphan_keys"),
    ("host_slots", "replicas whose used host-tier bytes are not their live sessions' sum", "host_slots"),
)
SERVER = (  # the replicas' counters (``/v1/stats``, summed over replicas and their lives)
    ("caches_kv_restored", "session caches restored from Redis KV"),
    ("caches_kv_restore_failed", "restores whose KV could not be read, Redis down or KV gone (rebuilt)"),
    ("caches_replayed", "caches rebuilt by replaying their feeds"),
    ("caches_reprefilled", "caches rebuilt by prefilling the history"),
    ("store_losses", "copies the store was found behind (saved back)"),
    ("divergences", "copies that diverged from the store (stopped serving)"),
)


def _checked(d: dict, check: str | None) -> str:
    """What a check looked at: sessions, turns, keys or replicas."""
    c = d["checks"]
    if check in ("history", "deleted"):
        return f"{c[check]['sessions']} sessions"
    if check == "replies":
        r = c.get("replies")
        ties = f"; {r['ties']} differing at a tie of the top logits (teacher-forced, float noise)" if r and r.get("ties") else ""
        return "not run" if not r else f"{r['sessions']} sessions, {r['turns']} turns{ties}"
    if check == "missing_kv":
        return "every record"
    if check == "orphan_keys":
        return "every key" + (", after the pending TTL" if "pending_ttl_s" in d["soak"] else "")
    if check == "host_slots":
        return f"{len(c['host_slots'])} replicas"
    return f"{c['history']['turns'].get('acknowledged', 0)} turns"


def _faults(d: dict) -> str:
    if "faults" not in d:  # written before faults had kinds
        r = d["restarts"]
        return (f"{r['replica']} replica restarts (kill -9), {r['redis']} Redis restart(s)"
                + (f", {r['failed']} failed" if r.get("failed") else ""))
    f = d["faults"]
    done = ", ".join(f"{n} {kind}" for kind, n in f["done"].items()) or "no fault"
    failed = ", ".join(f"{n} {kind}" for kind, n in f["failed"].items())
    skipped = "; ".join(f"{kind} skipped: {why}" for kind, why in f["skipped"].items())
    return done + (f" ({failed} failed)" if failed else "") + (f"; {skipped}" if skipped else "")


def _rows(d: dict) -> list[list]:
    rows = [["turns acknowledged", d["turns_done"]]]
    if "acknowledged" in d:
        a = d["acknowledged"]
        rows += [["acknowledged durable (fsynced or replicated)", a["durable"]],
                 ["acknowledged not durable (in Redis memory only)", a["not_durable"]],
                 ["acknowledged not saved (kept in replica memory)", a["not_saved"]],
                 ["acknowledged not durable, then lost (the client was told)", d["turns_lost_not_durable"]],
                 ["histories read back (Redis lost writes, or a failed turn stayed)", d["reconciles"]],
                 ["failed turns found kept in the history, reply cut short", d.get("turns_unfinished", 0)],
                 ["turns let go of (not saved, in doubt), found saved back later", d.get("turns_returned", 0)],
                 ["`session_diverged` answers", d["diverged_told"]]]
    rows.append(["acknowledged on a retry", d["turns_replayed"]])
    rows += [[f"fault: {kind}", n] for kind, n in d.get("faults", {}).get("done", {}).items()]
    rows += [[what, d["server"].get(name, 0)] for name, what in SERVER if "server" in d]
    if "replica_logs" in d:  # counted from the replicas' output, where no counter tells
        logs = d["replica_logs"].values()
        rows += [["restores of a record without KV (cache prefilled from the whole history)",
                  sum(r["restored_history_only"] for r in logs)], ["`ERROR` lines", sum(r["errors"] for r in logs)]]
    if "keys_per_session" in d:
        k = d["keys_per_session"]
        rows += [["Redis keys per live session: mean / max", f"{k['mean']} / {k['max']} ({k['sessions']} sessions)"],
                 ["Redis round trips per acknowledged turn (housekeeping included)", d["round_trips_per_turn"]]]
    rows += [[f"turn attempts failed: `{kind}`", n] for kind, n in d["turns_failed"].items()]
    rows += [[f"other requests failed: `{kind}`", n] for kind, n in d["requests_failed"].items()]
    rows += [["sessions opened", d["sessions_created"]], ["sessions deleted", d["deletes"]],
             ["sessions surviving", d["sessions_surviving"]], ["turns left in doubt", d["turns_in_doubt"]]]
    return rows + [[f"sessions given up: {why}", n] for why, n in d["sessions_given_up"].items()]


def soak(d: dict) -> list[str]:
    s = d["soak"]
    where = f"{s['topology']} Redis" if "topology" in s else "one Redis"
    net = "" if "netns" not in s else (", each replica in a network namespace" if s["netns"] else ", no namespaces")
    lines = [f"{s['sessions']} clients on {s['replicas']} replicas ({where}{net}) for {s['duration_s']:.0f} s (wall "
             f"{d['wall_s']:.0f} s), mode `{s['mode']}`, budget {s['budget']}, {s['max_tokens']} tokens a reply, "
             f"host tier {mb(s['host_tier_bytes'])}; sessions of {s['session_turns'][0]}-{s['session_turns'][1]} "
             f"turns. Faults: {_faults(d)}" + (", not waiting for unsaved sessions" if s.get("kill_unsaved") else "")
             + ". " + ("**No violation.**" if d["ok"] else "**Violations found.**"), ""]
    lines += table(["what", "count"], _rows(d)) + [""]
    durable = "acknowledged" in d  # since turns say what their save gave, only durable ones must survive
    rows = [["acknowledged durable turns lost" if durable and name == "lost_turns" else what, _checked(d, check),
             d["violations"][name]] for name, what, check in CHECKS if name in d["violations"]]
    return lines + table(["check", "checked", "violations"], rows)


SOAK_TABLES: dict[str, Callable[[dict], list[str]]] = {"soak": soak}
