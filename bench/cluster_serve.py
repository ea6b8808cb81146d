"""``python -m bench.cluster_serve``: where ``bench serve``'s sessions land on two chat replicas on two Ray
nodes, and how many are refused, when each replica's device budget fits N of them and 2N arrive at once.

The cluster is real Ray nodes on loopback (``ray.cluster_utils.Cluster``, the processes ``ray start
--head`` / ``ray start --address`` run): a head offering no CPU (the HTTP proxy and the ingress live
there) and two workers, each offering ``{"chat": 1}``, the resource every chat replica asks for
(``RKV_REPLICA_RESOURCES``), so one replica lands on each worker. The application joins the cluster
through ``RKV_RAY_ADDRESS`` with ``RKV_PLACEMENT`` set to the policy under test.

The device budget is measured, not guessed: the driver first runs every conversation of the run in an
engine of its own (the replicas' settings, no budget) and records, turn by turn, the admission bound
the engine reserves (``DeviceMemory.turn_bound``) and the bytes the session holds after it. ``fits``,
the N largest per-session maxima added up, is what any N of these sessions can commit at once;
``overflow``, the N+1 smallest first-turn holdings added up, the least that N+1 of them commit once
their first turns are admitted. The budget is halfway between: N sessions always fit, an (N+1)-th
never does.

Each round opens 2N WebSocket sessions (``bench serve``'s conversations: a context message of about
``--context`` tokens, then ``--turns`` short turns) and runs them in lockstep: every session is
created before any sends its context message, and every context message has been answered (or
refused) before any short turn is sent, so the sessions are resident together. A refused session
(``device_memory_exhausted``) sends nothing more. Admission does not wait (``admission_wait_s`` 0):
a turn that does not fit beside the turns in flight is refused at once rather than queued until an
idle session can be parked, which would hide the refusal; the replicas' park counters are recorded
to show that none was parked. Between rounds the sessions are deleted and the replicas report their
room again. Session ids (and Ray's replica ids) are random, so which replica hashing picks changes
from round to round: rounds sample it, and each hashed placement is checked against the rendezvous
hash of the ids (``app.placement``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from collections import Counter
from types import SimpleNamespace

import httpx
import ray
import ray._private.ray_constants as ray_constants
import redis
from ray import serve
from ray.cluster_utils import Cluster

from api.deployment import deploy as deploy_app
from app.engine.engine import Engine
from app.engine.sampling import SamplingParams
from app.model_loader import load_model
from app.placement import POLICIES, Candidate, place
from app.settings import ServerSettings, Settings
from bench.common import write_json
from bench.serve_load import Barrier, Conversation, Session, conversations, open_session

LOOPBACK = "127.0.0.1"
CHAT = "chat"  # the custom resource the workers offer and the chat replicas ask for
NODE = {"node_ip_address": LOOPBACK, "object_store_memory": 80 * 1024**2}
REFUSED = "device_memory_exhausted"
ROUND_TIMEOUT_S = 900.0
SETTLE_S = 6.0  # > two routing-stats periods (api.deployment.ROUTING_STATS_S) and a Redis stats push wait


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# --- the budget ---------------------------------------------------------------------------------------
def budget_for(worst: list[int], first: list[int], n: int) -> dict[str, int]:
    """The device budget that fits any ``n`` of these sessions and no ``n + 1``: ``worst`` holds each
    session's largest commitment over its turns (reserved bound or bytes held), ``first`` the least it
    commits once its first turn is admitted (that turn's bound, or what it holds after it)."""
    if len(worst) < n or len(first) < n + 1:
        raise ValueError(f"need at least {n + 1} sessions' figures")
    fits = sum(sorted(worst, reverse=True)[:n])
    overflow = sum(sorted(first)[: n + 1])
    if fits >= overflow:
        raise ValueError(f"{n} sessions may commit {fits} bytes, {n + 1} only {overflow}: no budget tells them "
                         "apart (a longer --context or fewer --turns)")
    return {"budget": (fits + overflow) // 2, "fits": fits, "overflow": overflow}


async def probe(settings, convs: list[Conversation], max_tokens: int) -> dict:
    """Run every conversation in an engine of this process with the replicas' settings and no budget:
    each turn's admission bound and the bytes the session holds after it."""
    fields = settings.model_dump(include=set(Settings.model_fields))
    local = Settings(**{**fields, "device_budget_bytes": 0, "redis_url": None})
    engine = Engine(local, loaded=load_model(local, quiet=True))
    mem = engine.memory_account
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sessions = []
    try:
        for conv in convs:
            session = engine.create_session(mode=settings.mode, budget=settings.token_budget)
            bounds, held = [], []
            for text in [conv.context_text, *conv.short_texts]:
                n_new = len(engine._turn_ids(session, text))
                bounds.append(max(mem.turn_bound(session, n_new, max_tokens),
                                  mem.turn_bound(session, n_new, max_tokens, prefill_chunk=local.prefill_chunk)))
                await engine.complete(session.id, text, params)
                held.append(session.cache.device_bytes())
            await engine.delete_session(session.id)
            sessions.append({"turn_bounds": bounds, "held_after": held, "tokens": len(session.token_ids)})
        return {"bytes_per_token": mem.per_token, "sessions": sessions}
    finally:
        engine.close()
        del engine
        gc.collect()


# --- the cluster -------------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster(temp_dir: str):
    """A head (no CPU) and two workers offering ``{"chat": 1}``, on loopback; every process is ended by
    its id on the way out."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep the nodes' own processes on loopback
    # Ray maps a loopback address to the host's own, for nodes on other machines; these all run here.
    ray_constants.ENABLE_RAY_CLUSTER = False
    nodes = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0, "include_dashboard": False,
                                                          "temp_dir": temp_dir})
    try:
        workers = [nodes.add_node(**NODE, num_cpus=1, resources={CHAT: 1}) for _ in range(2)]
        nodes.wait_for_nodes()
        yield SimpleNamespace(nodes=nodes, workers=workers)
    finally:
        nodes.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def replica_nodes() -> dict[str, str]:
    """Each chat replica's Ray node id, as the replica's own process reports it."""
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if "#ChatReplica#" in actor["name"]:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            node = handle.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
            found[actor["name"].rsplit("#", 1)[1]] = ray.get(node, timeout=60)
    return found


def deploy(settings):
    """``api.deployment.deploy``, on a fresh port while the proxy loses its port to another process."""
    for attempt in range(4):
        try:
            deploy_app(settings)
            return settings
        except Exception as exc:  # the proxy's bind failure arrives wrapped in a RayTaskError
            if "Failed to bind" not in str(exc) or attempt == 3:
                raise
            serve.shutdown()
            settings = settings.model_copy(update={"port": free_port()})
    raise AssertionError("unreachable")


# --- a round -----------------------------------------------------------------------------------------
async def run_round(url: str, args, convs: list[Conversation]) -> list[dict]:
    """The 2N conversations in lockstep (all created, then all context messages, then the short turns
    of those not refused); one record per session."""
    created, loaded = Barrier(len(convs)), Barrier(len(convs))

    async def one(conv: Conversation) -> dict:
        record: dict = {"index": conv.index, "turns": []}
        barriers = [created, loaded]
        try:
            async with open_session(url, args) as ws:
                session = Session(ws, args)
                await session.create()
                record.update({k: session.info.get(k) for k in ("session_id", "token", "replica")})
                await barriers.pop(0).wait()  # every session exists before any turn is sent
                for text, kind in [(conv.context_text, "context"), *((t, "short") for t in conv.short_texts)]:
                    turn = await session.turn(text, kind)
                    conv.turns.append(turn)
                    record["turns"].append({"kind": kind, "replica": turn.replica, "code": turn.code,
                                            "generated": turn.generated})
                    if kind == "context":
                        await barriers.pop(0).wait()  # every session holds its context (or was refused)
                    if turn.error is not None:
                        break  # a refused session sends nothing more
        except Exception as exc:  # noqa: BLE001 - recorded, and the others are not left waiting
            record["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for barrier in barriers:
                await barrier.wait()
        return record

    return list(await asyncio.gather(*(one(c) for c in convs)))


async def delete_sessions(url: str, records: list[dict]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for r in records:
            if r.get("session_id"):
                await http.delete(f"/v1/sessions/{r['session_id']}", headers={"x-session-token": r["token"]})


def round_summary(records: list[dict], replicas: list[str], policy: str) -> dict:
    """Sessions per replica, refusals and turns served; with ``hash``, whether every session sits where
    the rendezvous hash of its id and the replicas' ids puts it."""
    split = Counter(r.get("replica") for r in records)
    refused = [r for r in records if any(t["code"] == REFUSED for t in r["turns"])]
    other = [t["code"] for r in records for t in r["turns"] if t["code"] not in (None, REFUSED)]
    moved = sum(1 for r in records for t in r["turns"] if t["replica"] not in (None, r.get("replica")))
    summary = {
        "split": [split.get(k, 0) for k in replicas],
        "refused_sessions": len(refused),
        "refused_per_replica": [sum(1 for r in refused if r.get("replica") == k) for k in replicas],
        "turns_done": sum(1 for r in records for t in r["turns"] if t["code"] is None),
        "other_errors": other + [r["error"] for r in records if "error" in r],
        "turns_on_another_replica": moved,
    }
    if policy == "hash":
        summary["as_hashed"] = all(
            place(r["session_id"], [Candidate(k) for k in replicas], "hash").key == r.get("replica")
            for r in records if r.get("session_id"))
    return summary


def replica_stats(redis_url: str, namespace: str) -> dict[str, dict]:
    """Each replica's last pushed totals (``{ns}:replicas``: "<expiry> <JSON>" per replica)."""
    client = redis.Redis.from_url(redis_url)
    try:
        found = {}
        for value in client.hgetall(f"{namespace}:replicas").values():
            stats = json.loads(value.decode().split(" ", 1)[1])
            found[stats["replica"]] = stats
        return found
    finally:
        client.close()


def drop_keys(redis_url: str, namespace: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*"))
        for key in keys:
            client.delete(key)
        return len(keys)
    finally:
        client.close()


# --- the run -----------------------------------------------------------------------------------------
async def measure(args, settings, convs: list[Conversation]) -> dict:
    url = f"http://{LOOPBACK}:{settings.port}"
    await asyncio.sleep(SETTLE_S)  # both replicas have reported their room
    placed = replica_nodes()
    replicas = sorted(placed)
    rounds = []
    for i in range(args.rounds):
        for conv in convs:
            conv.turns.clear()
        records = await asyncio.wait_for(run_round(url, args, convs), ROUND_TIMEOUT_S)
        rounds.append({**round_summary(records, replicas, args.policy),
                       "sessions": [{k: v for k, v in r.items() if k != "token"} for r in records]})
        if not args.quiet:
            print(f"round {i + 1}: split {rounds[-1]['split']}, refused {rounds[-1]['refused_sessions']}",
                  file=sys.stderr, flush=True)
        await delete_sessions(url, records)
        await asyncio.sleep(SETTLE_S)  # the replicas report their room (and push their totals) again
    return {"replica_nodes": placed, "replicas": replicas, "rounds": rounds}


def settings_of(args, port: int, namespace: str, address: str | None, budget: int):

    return ServerSettings(
        host=LOOPBACK, port=port, ray_address=address, num_replicas=2, replica_num_cpus=1,
        replica_resources={CHAT: 1}, placement=args.policy, mode=args.mode, max_new_tokens=args.max_tokens,
        device_budget_bytes=budget, admission_wait_s=0, redis_url=args.redis_url, redis_namespace=namespace,
        request_retry_s=90,
    )


def run(args) -> dict:
    n = args.sessions_per_replica
    args.sessions = 2 * n
    convs = conversations(args)
    namespace = f"rkv-cluster-{uuid.uuid4().hex[:8]}"
    base = settings_of(args, 0, namespace, None, 0)
    t0 = time.perf_counter()
    measured = asyncio.run(probe(base, convs, args.max_tokens))
    worst = [max(*s["turn_bounds"], *s["held_after"]) for s in measured["sessions"]]
    first = [min(s["turn_bounds"][0], s["held_after"][0]) for s in measured["sessions"]]
    budget = budget_for(worst, first, n)
    result: dict = {
        "cluster": {"policy": args.policy, "nodes": 3, "head_cpus": 0, "workers": 2,
                    "worker_resources": {CHAT: 1}, "replicas": 2},
        "sessions_per_replica": n,
        "sessions": 2 * n,
        "context": args.context,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "mode": args.mode,
        "model": base.model,
        "device_budget_bytes": budget["budget"],
        "budget_rule": "measured in the driver: each session's turns run alone with no budget; halfway between "
                       "the N largest per-session commitments added up (fits) and the N+1 smallest first-turn "
                       "commitments added up (overflow)",
        "probe": {"bytes_per_token": measured["bytes_per_token"], "fits_bytes": budget["fits"],
                  "overflow_bytes": budget["overflow"], "session_worst_bytes": worst,
                  "session_first_bytes": first},
    }
    temp_dir = f"/tmp/rkv-cluster-{os.getpid()}"
    try:
        with cluster(temp_dir) as nodes:
            settings = settings_of(args, free_port(), namespace, nodes.nodes.address, budget["budget"])
            try:
                settings = deploy(settings)
                result.update(asyncio.run(measure(args, settings, convs)))
                result["replica_stats"] = {
                    k: {f: v.get(f) for f in ("sessions", "device_budget_bytes", "peak_device_bytes",
                                              "turns_refused_device_memory", "sessions_parked_total")}
                    for k, v in replica_stats(args.redis_url, namespace).items()}
                result["head_node"] = nodes.nodes.head_node.node_id
            finally:
                with contextlib.suppress(Exception):
                    serve.shutdown()
                ray.shutdown()
    finally:
        drop_keys(args.redis_url, namespace)
    result["totals"] = totals(result)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def totals(result: dict) -> dict:
    rounds = result.get("rounds", [])
    return {
        "splits": [r["split"] for r in rounds],
        "even_rounds": sum(1 for r in rounds if len(set(r["split"])) == 1),
        "refused_sessions": sum(r["refused_sessions"] for r in rounds),
        "sessions_opened": len(rounds) * result["sessions"],
        "turns_done": sum(r["turns_done"] for r in rounds),
        "other_errors": sum(len(r["other_errors"]) for r in rounds),
        "parked": sum((s.get("sessions_parked_total") or 0) for s in result.get("replica_stats", {}).values()),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=POLICIES, required=True, help="RKV_PLACEMENT of the application")
    p.add_argument("--sessions-per-replica", type=int, default=2, help="N: the budget fits N; 2N sessions arrive")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 2N new sessions (ids, so hashing, change)")
    p.add_argument("--context", type=int, default=600, help="tokens of filler in each session's first message")
    p.add_argument("--turns", type=int, default=1, help="short turns per session after its context message")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn (greedy)")
    p.add_argument("--mode", default="full", help="cache mode of the sessions")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no line per round on stderr")
    args = p.parse_args(argv)
    args.api_key, args.budget = None, None  # what bench serve's client reads
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # tear the cluster down on a kill too
    result = run(args)
    write_json(result, args.json_out)
    t = result["totals"]
    return 0 if t["other_errors"] == 0 and len(t["splits"]) == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
