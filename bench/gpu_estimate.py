"""How long the GPU check's parts should take on a lent machine, from arithmetic, before any lease.

``python -m bench.gpu_check --estimate`` prints it. The e2e part is counted from its own schedule
(``bench.e2e.Bench``: a warm-up, then per context a prefill per mode, the decode blocks per batch,
a second turn): prefill FLOPs over the chip's bf16 rate, decode bytes over its memory bandwidth
plus the kernel launches of a step (``bench ops`` counts ~70 a layer for the batched step of a
Llama layer, attention and MLP together). The other parts are allowances from their sizes, named
as such. Efficiencies are assumptions, stated in ``ASSUMED``; the check's ``--budget-s`` guard
stops starting parts once their estimate no longer fits, whatever the arithmetic said.
"""
from __future__ import annotations

# Measured on this workplace's lent machines (the device tool's notes): a bf16 8192^3 product and a
# device-to-device copy (read + write counted, so the read bandwidth a decode sees is about this).
CHIPS = {
    "h200": {"bf16_flops": 788e12, "bytes_per_s": 4.3e12, "memory_bytes": 139 * 2**30},
    "h100": {"bf16_flops": 798e12, "bytes_per_s": 3.0e12, "memory_bytes": 78 * 2**30},
}
ASSUMED = {
    "prefill_efficiency": 0.4,  # of the bf16 rate, linears and flash attention over a long prompt
    "decode_efficiency": 0.7,  # of the bandwidth, weights and KV read once a step
    "launch_s": 5e-6,  # one kernel launch from Python
    "launches_per_layer": 70,
    "startup_s": 20.0,  # CUDA context, random weights drawn on the device, pinned host pool
    "compile_s": 60.0,  # Triton kernels built on first use (every mode's, warm-up included)
}
# Allowances for the parts that are not arithmetic.
# The kernel tests took 25 s on an H100 (59 tests, Triton builds included); turn_profile is a model of
# the e2e shapes, two 32k prefills and four short turns.
ALLOWANCE_S = {"kernel_tests": 60.0, "tiered_redis": 40.0, "turn_profile": 40.0, "h2d": 10.0, "ops": 30.0}


def _params(shapes: dict) -> int:
    h, layers, d = shapes["hidden_size"], shapes["num_hidden_layers"], shapes["head_dim"]
    attn = h * shapes["num_attention_heads"] * d * 2 + h * shapes["num_key_value_heads"] * d * 2
    mlp = 3 * h * shapes["intermediate_size"]
    return layers * (attn + mlp) + 2 * shapes["vocab_size"] * h


def _kv_bytes_per_token(shapes: dict) -> int:
    return 2 * shapes["num_hidden_layers"] * shapes["num_key_value_heads"] * shapes["head_dim"] * 2


def prefill_s(shapes: dict, tokens: int, chip: dict) -> float:
    """One causal prefill of ``tokens``: linears 2*P*n, attention 2*n^2*heads*d*layers (QK and PV, causal half)."""
    attention = 2 * tokens**2 * shapes["num_attention_heads"] * shapes["head_dim"] * shapes["num_hidden_layers"]
    return (2 * _params(shapes) * tokens + attention) / (ASSUMED["prefill_efficiency"] * chip["bf16_flops"])


def step_s(shapes: dict, kv_tokens: int, batch: int, chip: dict) -> float:
    """One batched decode step: weights once, each session's ``kv_tokens`` of KV, the step's launches."""
    read = 2 * _params(shapes) + batch * kv_tokens * _kv_bytes_per_token(shapes)
    launches = ASSUMED["launches_per_layer"] * shapes["num_hidden_layers"] * ASSUMED["launch_s"]
    return read / (ASSUMED["decode_efficiency"] * chip["bytes_per_s"]) + launches


def e2e_s(shapes: dict, contexts: list[int], batches: list[int], modes: list[str], budget: int, steps: int,
          rounds: int, warmup: int, chip: dict) -> dict:
    """Seconds of the e2e part by piece. ``full`` reads its whole context each step; the compressed
    modes read about their budget (HSA reads less: this is the upper end). A batch whose ``full``
    copies would not fit in the chip's memory is skipped, as the bench skips it."""
    memory_bytes = chip["memory_bytes"]
    per_token = _kv_bytes_per_token(shapes)
    pieces = {"startup": ASSUMED["startup_s"], "compile": ASSUMED["compile_s"],
              "warm_up": len(modes) * prefill_s(shapes, min(2048, min(contexts)), chip)}
    steps_per_block = warmup + rounds * steps
    for n in contexts:
        pieces[f"prefill_{n}"] = len(modes) * prefill_s(shapes, n, chip)
        decode = 0.0
        for b in batches:
            for mode in modes:
                kv = n if mode.startswith("full") else budget
                if mode.startswith("full") and b * n * per_token + 2 * _params(shapes) > memory_bytes:
                    continue
                decode += steps_per_block * step_s(shapes, kv, b, chip)
        pieces[f"decode_{n}"] = decode
    pieces["total"] = sum(pieces.values())
    return pieces


def first_turns_s(shapes: dict, tokens: int, modes: int, chip: dict) -> float:
    """The prefill-peak part: one first turn of ``tokens`` per mode, a new random model first."""
    return ASSUMED["startup_s"] + modes * prefill_s(shapes, tokens, chip)


def check_s(e2e: dict, prefill_peak_s: float) -> dict:
    """Every part of the check: e2e's and prefill-peak's arithmetic, the other parts' allowances."""
    parts = {"e2e": e2e["total"], "prefill_peak": prefill_peak_s, **ALLOWANCE_S}
    return {**parts, "total": sum(parts.values())}
