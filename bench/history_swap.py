"""``rocketkv-mt bench history-swap``: does a mode lose a later turn by its own recall, or by its earlier replies?

For each conversation, every mode in ``--modes`` answers the turns before ``--turn`` on its own
(greedy); then every mode answers turn ``--turn`` on top of every such history (the history is
given to a fresh session as messages and token ids, so it is prefilled whole). A cell is correct
when the turn's answer occurs in the reply, as in ``rocketkv-mt eval``.
"""
from __future__ import annotations

from app.engine.sampling import SamplingParams
from bench.common import load_engine, run_async
from bench.eval_mt import answered, load_tasks


async def _history(engine, mode: str, budget: int, turns: list[dict], params):
    session = engine.create_session(mode=mode, budget=budget)
    for turn in turns:
        await engine.complete(session.id, turn["user"], params)
    history = (list(session.messages), list(session.token_ids))
    await engine.delete_session(session.id)
    return history


async def _answer(engine, mode: str, budget: int, history, turn: dict, params) -> dict:
    session = engine.create_session(mode=mode, budget=budget)
    session.messages, session.token_ids = list(history[0]), list(history[1])
    done = await engine.complete(session.id, turn["user"], params)
    await engine.delete_session(session.id)
    return {"correct": answered(turn, done.text), "reply": done.text}


async def run(args) -> dict:
    tasks = load_tasks(args.tasks)
    if args.convs:
        wanted = set(args.convs.split(","))
        tasks = [t for t in tasks if t["id"] in wanted]
    modes = [m for m in args.modes.split(",") if m]
    params = SamplingParams(max_tokens=args.max_tokens)
    engine = load_engine()
    result = {"tasks": args.tasks, "turn": args.turn, "budget": args.budget, "conversations": {}, "correct": {}}
    try:
        for task in tasks:
            cells = {}
            for hist_mode in modes:
                history = await _history(engine, hist_mode, args.budget, task["turns"][: args.turn], params)
                for ans_mode in modes:
                    key = f"{hist_mode}-history/{ans_mode}-answer"
                    cells[key] = await _answer(engine, ans_mode, args.budget, history, task["turns"][args.turn], params)
                    result["correct"][key] = result["correct"].get(key, 0) + cells[key]["correct"]
            result["conversations"][task["id"]] = cells
    finally:
        engine.close()
    return result


def main(args) -> int:
    return run_async(run, args)
