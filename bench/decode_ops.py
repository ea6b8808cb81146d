"""``rocketkv-mt bench ops``: torch ops and kernel launches per decode step per layer, by sessions.

Sessions of every mode (full, snapkv, rocketkv, rocketkv-mt, tiered, in turn) are prefilled on a
random-weight model (``bench.random_model``) with budgets below their prompts, so the compressed
ones decode with HSA; after two warm-up steps one batched decode step (``ModelRunner.step`` and the
sampling of its tokens) runs under the torch profiler. Counted per layer, inside the attention
(``rkv::attention`` ranges): top-level torch ops (``aten::`` calls made from Python, not the ones
they call in turn) and kernel launches (CUDA: kernel launches; CPU: calls of the native kernel,
``rkv::decode_batch``). ``--kernels torch`` counts the per-session path for comparison.
"""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from app.engine.model_runner import ModelRunner, Segment
from app.engine.sampling import plain_sampler, sample_batch
from bench.common import write_json
from bench.random_model import parse_shapes, random_model
from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.host.tier import HostTier

MODES = ("full", "snapkv", "rocketkv", "rocketkv-mt", "tiered")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _within(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def count_events(events, layers: int) -> dict:
    """Ops and launches of one profiled step: per layer inside attention, and in the whole step."""
    top = [e for e in events if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]
    in_attention = [e for e in top if _within(e, "rkv::attention")]
    native = [e for e in events if e.name == "rkv::decode_batch" and _within(e, "rkv::attention")]
    cuda = [e for e in events if e.name in LAUNCHES and _within(e, "rkv::attention")]
    launches = len(cuda) if cuda else len(native)
    return {
        "ops_per_layer": len(in_attention) / layers,
        "launches_per_layer": launches / layers,
        "native_calls_per_layer": len(native) / layers,
        "step_ops": len(top),
    }


def measure(runner: ModelRunner, sessions: int, prompt: int, budget: int, seed: int = 0) -> dict:
    """One profiled decode step of ``sessions`` sessions (modes in turn) after their prefill."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model.config.vocab_size
    host = HostTier(1 << 30)
    rocket = RocketKVConfig(token_budget=budget, window_size=8, kernel_size=5)
    caches = [
        make_cache(MODES[i % len(MODES)], runner.spec, rocket,
                   tiers=TierContext(host, f"ops-{sessions}-{i}", TierPolicy(page_tokens=8)))
        for i in range(sessions)
    ]
    tokens = []
    for i, cache in enumerate(caches):
        ids = torch.randint(0, vocab, (prompt + 3 * (i % 5),), generator=gen).tolist()
        tokens.append(int(runner.forward(ids, cache, prefill=True, max_new=64).argmax()))
    greedy = [plain_sampler()] * sessions

    def step():
        logits, errors = runner.step([Segment(c, [t]) for c, t in zip(caches, tokens)])
        if errors:
            raise RuntimeError(f"decode step failed: {errors}")
        return sample_batch(logits, greedy)

    for _ in range(2):  # tiered settles its selection at its first step, alone; buffers are in place after
        tokens = step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        tokens = step()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
    for cache in caches:
        cache.release()
    return {"sessions": sessions, **count_events(prof.events(), runner.spec.num_layers)}


def run(shapes: dict, device: str, kernels: list[str], sessions: list[int], prompt: int, budget: int) -> dict:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    loaded = random_model(shapes, dev, dtype, max_positions=prompt + 512)
    result = {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), "shapes": shapes, "prompt": prompt,
              "budget": budget, "modes": list(MODES), "counts": {}}
    for backend in kernels:
        runner = ModelRunner(loaded, kernels=backend)
        result["counts"][backend] = [measure(runner, n, prompt, budget) for n in sessions]
    return result


def main(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = run(parse_shapes(args.shapes), device, args.kernels.split(","), [int(n) for n in args.sessions.split(",")],
                 args.prompt, args.budget)
    for backend, rows in result["counts"].items():
        for row in rows:
            print(f"kernels={backend:5s} sessions={row['sessions']:3d}: {row['ops_per_layer']:6.1f} torch ops and "
                  f"{row['launches_per_layer']:5.1f} launches per layer per decode step ({row['step_ops']} ops per step)")
    write_json(result, args.json_out, quiet=True)
    return 0
