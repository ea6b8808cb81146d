"""The placement simulation behind ``bench placement``: a trace's conversations (``bench.placement_trace``)
replayed against N simulated replicas, with the server's own placement, byte model and admission.

Real code, simulated time. Every turn is routed by ``app.placement.Placer``: a held session to its
holder, others by the rooms the replicas report every ``report_s`` (``app.replica_status.replica_room``,
read off the simulated replica as off an engine), so the router works on reports as stale as Ray's. Each replica is a ``DeviceResidency`` (the engine's
admission): a turn reserves ``DeviceMemory.turn_bound`` of its session (each mode's ``device_bound``),
the longest idle sessions are parked to make room, and a turn that still does not fit waits, in arrival
order, up to ``admission_wait_s`` for turns in flight, else is refused. What is not simulated is the
model: a turn lasts its prefill at ``prefill_tps`` and its reply at ``decode_tps``, and its cache is a
stand-in holding what the mode holds after a turn (``full``: the whole history; ``tiered``: the turn's
prompt budget plus the reply, and its HSA page bounds). A parked ``tiered`` session comes back from
Redis without a re-prefill; any other mode re-prefills its history.

With ``moves``, a ``tiered`` session that its replica parks to make room is let go instead (its state
is in Redis): its next turn is placed again, by room, and restored wherever it lands. That is the
simulation of item 4's moves; the server does not release sessions yet.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from app.engine.memory import DeviceMemory
from app.engine.residency import DeviceResidency
from app.engine.session import Session, TurnStats
from app.placement import Candidate, Placer
from app.replica_status import replica_room
from bench.placement_trace import Conversation
from rocketkv_mt.cache import CacheSpec, TierPolicy, TurnSize, cache_mode
from rocketkv_mt.config import RocketKVConfig

# Llama-3.1-8B's attention in bfloat16 (bench.random_model.LLAMA_31_8B): 128 KiB of K and V a token.
LLAMA_31_8B_SPEC = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=torch.device("cpu"))


@dataclass
class SimConfig:
    replicas: int
    policy: str = "memory"
    moves: bool = False
    device_budget: int = 16 * 1024**3
    token_budget: int = 256
    prefill_chunk: int = 512
    admission_wait_s: float = 60.0
    report_s: float = 2.0
    prefill_tps: float = 8000.0
    decode_tps: float = 30.0
    max_sessions: int = 1024
    spec: CacheSpec = LLAMA_31_8B_SPEC


class StandInCache:
    """What ``DeviceMemory`` reads of a session's cache: history fed, tokens kept, cold pages, bytes."""

    def __init__(self, history: int = 0, kept: int = 0, cold_pages: int = 0, nbytes: int = 0):
        self.history_len, self.kept, self.cold, self.nbytes = history, kept, cold_pages, nbytes

    def kept_tokens(self) -> int:
        return self.kept

    def cold_pages(self) -> int:
        return self.cold

    def device_bytes(self) -> int:
        return self.nbytes


@dataclass
class Chat:
    """A conversation as it plays out: its next turn, its history so far, where it was last served."""

    conv: Conversation
    next_turn: int = 0
    history: int = 0
    kept: int = 0  # tokens its cache kept on the device after its last turn
    replica: int | None = None


@dataclass
class Counts:
    turns: int = 0
    refused: int = 0
    waited: int = 0
    parks: int = 0
    restores: int = 0
    reprefills: int = 0
    reprefill_tokens: int = 0
    releases: int = 0
    moves: int = 0
    samples: list[tuple[float, float]] = field(default_factory=list)  # (held, active) fractions per report


class SimReplica(DeviceResidency):
    def __init__(self, index: int, sim: "Simulation"):
        cfg = sim.cfg
        self.index, self.key, self.sim = index, f"replica-{index:03d}", sim
        self.settings = SimpleNamespace(prefill_chunk=cfg.prefill_chunk)
        self._sessions: dict[str, Session] = {}
        self.memory_account = DeviceMemory(cfg.device_budget, cfg.spec, sim.tiers)
        self.parking = True
        self.waiting: deque[tuple[Chat, float]] = deque()  # turns waiting for device memory, and until when

    @property
    def sessions(self) -> dict[str, Session]:
        return self._sessions

    def _park(self, session: Session) -> None:
        """As the engine parks: the cache leaves the device; a ``tiered`` one's KV stays in Redis, its
        record naming the history's length and its cold pages (``SessionCache.persist``)."""
        cold = session.cache.cold_pages()
        self.memory_account.take_cache(session)
        self.memory_account.parks += 1
        self.sim.counts.parks += 1
        tiered = session.mode == "tiered"
        session.parked_kv = {"history_len": len(session.token_ids), "cold_pages": cold} if tiered else None
        if tiered and self.sim.cfg.moves:  # let it go: its next turn is placed again, by room
            self.sim.release(self, session.id)


class Simulation:
    def __init__(self, cfg: SimConfig, trace: list[Conversation]):
        self.cfg = cfg
        self.tiers = TierPolicy()
        self.rocket = RocketKVConfig(token_budget=cfg.token_budget, window_size=32, kernel_size=15)
        self.replicas = [SimReplica(i, self) for i in range(cfg.replicas)]
        self.placer = Placer(cfg.policy)
        self.rooms = {}
        self.counts = Counts()
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        for conv in trace:
            self._at(conv.arrival, self._turn, Chat(conv))
        self._until = max((c.arrival for c in trace), default=0.0)
        self._at(0.0, self._report)

    # --- events ----------------------------------------------------------------------------------
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> Counts:
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return self.counts

    def _report(self) -> None:
        """Every replica reports its room (as ``record_routing_stats`` does); device use is sampled."""
        budget = self.cfg.device_budget
        for r in self.replicas:
            room = replica_room(r, self.cfg.max_sessions, now=self.now)
            self.rooms[r.key] = room
            held = r.memory_account.observe(r.sessions)
            self.counts.samples.append((held / budget, (budget - room.device_room) / budget))
        if self.now < self._until:
            self._at(self.now + self.cfg.report_s, self._report)

    # --- placement -------------------------------------------------------------------------------
    def _route(self, chat: Chat) -> SimReplica:
        """Every turn through the router's code: holders first, else placed by the last reports."""
        sid = chat.conv.id
        candidates = [Candidate(r.key, sid in r.sessions, self.rooms.get(r.key)) for r in self.replicas]
        key = self.placer.choose(sid, candidates, self.now)
        return self.replicas[int(key.rsplit("-", 1)[1])]

    def release(self, replica: SimReplica, sid: str) -> None:
        replica.sessions.pop(sid, None)
        replica.memory_account.forget(sid)
        self.counts.releases += 1

    # --- turns -----------------------------------------------------------------------------------
    def _turn(self, chat: Chat) -> None:
        replica = self._route(chat)
        if chat.replica is not None and replica.index != chat.replica:
            self.counts.moves += 1
        chat.replica = replica.index
        session = replica.sessions.get(chat.conv.id) or self._arrive(replica, chat)
        turn = chat.conv.turns[chat.next_turn]
        self.counts.turns += 1
        session.busy = True  # as the engine marks it: no parking while it waits for device memory
        if not replica.waiting and replica._reserve(session, turn.prompt, turn.reply) is None:
            self._start(replica, chat, session)
        elif self._may_fit_later(replica, session, turn.prompt, turn.reply):
            self.counts.waited += 1
            replica.waiting.append((chat, self.now + self.cfg.admission_wait_s))
            self._at(self.now + self.cfg.admission_wait_s, self._give_up, replica, chat)
        else:
            self._refuse(replica, session)

    def _arrive(self, replica: SimReplica, chat: Chat) -> Session:
        """The session on a replica that does not hold it: new, or restored from Redis (a ``tiered`` one
        with its KV, another mode re-prefilling its history)."""
        session = Session(id=chat.conv.id, mode=chat.conv.mode, rocket=self.rocket, cache=None)
        session.token_ids = range(chat.history)  # only its length is read
        if chat.history == 0:
            session.cache = StandInCache()
        elif chat.conv.mode == "tiered":
            session.parked_kv = {"history_len": chat.history, "cold_pages": self._cold_pages(chat.history, chat.kept)}
            session.turns.append(TurnStats(0, 0, kept_tokens=chat.kept))
        replica.sessions[session.id] = session
        return session

    def _may_fit_later(self, replica: SimReplica, session: Session, n_new: int, max_new: int) -> bool:
        mem = replica.memory_account
        return (self.cfg.admission_wait_s > 0 and any(sid != session.id for sid in mem.reserved)
                and mem.turn_bound(session, n_new, max_new) <= mem.budget)

    def _refuse(self, replica: SimReplica, session: Session) -> None:
        replica.memory_account.refusals += 1
        session.busy = False
        self.counts.refused += 1  # the person gives up on this conversation

    def _give_up(self, replica: SimReplica, chat: Chat) -> None:
        for i, (waiting, _) in enumerate(replica.waiting):
            if waiting is chat:
                del replica.waiting[i]
                self._refuse(replica, replica.sessions[chat.conv.id])
                self._admit_waiting(replica)
                return

    def _admit_waiting(self, replica: SimReplica) -> None:
        while replica.waiting:
            chat, _ = replica.waiting[0]
            session = replica.sessions[chat.conv.id]  # busy while it waits: never parked or let go
            turn = chat.conv.turns[chat.next_turn]
            if replica._reserve(session, turn.prompt, turn.reply) is not None:
                if not self._may_fit_later(replica, session, turn.prompt, turn.reply):
                    replica.waiting.popleft()
                    self._refuse(replica, session)
                    continue
                return
            replica.waiting.popleft()
            self._start(replica, chat, session)

    def _start(self, replica: SimReplica, chat: Chat, session: Session) -> None:
        turn = chat.conv.turns[chat.next_turn]
        size = replica.memory_account.turn_size(session, turn.prompt, turn.reply)
        prefill = size.new
        if session.cache is None:
            if session.parked_kv is not None:
                self.counts.restores += 1
            else:
                self.counts.reprefills += 1
                self.counts.reprefill_tokens += chat.history
            session.cache = StandInCache(size.fed, size.kept, size.cold_pages or 0)
            session.parked_kv = None
        duration = prefill / self.cfg.prefill_tps + turn.reply / self.cfg.decode_tps
        self._at(self.now + duration, self._end, replica, chat, session, size)

    def _cold_pages(self, history: int, kept: int) -> int:
        """A ``tiered`` session's cold pages once it keeps ``kept`` of ``history`` tokens on the device."""
        return math.ceil((history - kept) / self.tiers.page_tokens)

    def _end(self, replica: SimReplica, chat: Chat, session: Session, size: TurnSize) -> None:
        turn = chat.conv.turns[chat.next_turn]
        mem = replica.memory_account
        history = size.fed + size.new + turn.reply
        kept = history if session.mode == "full" else min(size.fed + size.new, size.split.prompt_budget) + turn.reply
        nbytes = size.token_bytes * kept + cache_mode(session.mode).decode.bound(size, kept)
        cold = self._cold_pages(history, kept) if session.mode == "tiered" else 0
        session.cache = StandInCache(history, kept, cold, nbytes)
        session.token_ids = range(history)
        session.turns.append(TurnStats(0, 0, kept_tokens=kept))
        session.busy, session.last_used = False, self.now
        mem.set_held(session.id, nbytes)
        mem.reserved.pop(session.id, None)
        mem.chunking.pop(session.id, None)
        chat.history, chat.kept = history, kept
        chat.next_turn += 1
        if chat.next_turn < len(chat.conv.turns):
            self._at(self.now + chat.conv.turns[chat.next_turn].think_s, self._turn, chat)
        self._admit_waiting(replica)
