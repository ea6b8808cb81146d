"""One layer's decode step of many sessions in one kernel call equals each session's step alone.

Sessions of every mode (dense, SnapKV, HSA over the kept set, HSA over rocketkv-mt's selection with
the history mirrored, tiered) are prefilled identically twice; one copy decodes alone through
``attend`` (the torch path: the reference), the other in batched steps (``BatchCache``) on the native
C kernel or the Triton kernels. Outputs, stores, positions and KT bounds must agree at every step,
including steps that open a new KT page, grow the buffers and cross from dense into HSA.
"""
import re
from pathlib import Path

import pytest
import torch

from kernel_helpers import load_kernels
from rocketkv_mt import decode_table
from rocketkv_mt.cache import CacheSpec, TierContext, TierPolicy, make_cache
from rocketkv_mt.cache.batch import BatchCache
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.config import RocketKVConfig
from rocketkv_mt.kt_cache import KTCache
from rocketkv_mt.native import hsa as native_hsa
from tiers.host.tier import HostTier

K = load_kernels()
HKV, G, D, LAYERS = 2, 3, 16, 2
MODES = ["full", "snapkv", "rocketkv", "rocketkv-mt", "tiered", "rocketkv"]
# Prompt lengths: the second rocketkv session stays under its budget (dense) for the first steps.
PROMPTS = [37, 45, 60, 52, 70, 14]


def spec(kernels: str, dtype=torch.float32, device="cpu") -> CacheSpec:
    return CacheSpec(LAYERS, HKV, D, dtype, torch.device(device), kernels=kernels)


def new_cache(mode: str, kernels: str, i: int, host: HostTier, dtype=torch.float32, every_page=False, device="cpu"):
    # every_page: topk covers every page, so the chosen set cannot hang on 16-bit rounding of the scores.
    rocket = RocketKVConfig(token_budget=16, window_size=4, kernel_size=3, anchor_tokens=4 if i == 2 else 0,
                            topk=1000 if every_page else None)
    tiers = TierContext(host=host, session_id=f"s{i}-{kernels}", policy=TierPolicy(page_tokens=4))
    return make_cache(mode, spec(kernels, dtype, device), rocket, tiers=tiers if mode == "tiered" else None)


def qkv(gen, n, dtype=torch.float32, device="cpu"):
    return tuple(torch.randn(1, h, n, D, generator=gen).to(device, dtype) for h in (HKV * G, HKV, HKV))


def prefill(cache, n, seed):
    gen = torch.Generator().manual_seed(seed)
    cache.begin_forward(n, prefill=True, max_new=12)
    for layer in range(LAYERS):
        cache.attend(layer, *qkv(gen, n, cache.spec.dtype, cache.spec.device), D**-0.5)
    cache.end_forward()


def state(cache):
    """What a decode step changes: kept keys/values/positions per layer, KT bounds, history."""
    out = [cache.history_len]
    for layer in range(LAYERS):
        selection = getattr(cache.prefill, "selection", None)
        for store in [cache.layers[layer], *([selection[layer]] if selection is not None else [])]:
            out += [store.keys.clone(), store.values.clone(), store.positions.clone()]
        kt = getattr(cache.decode, "kt", [None] * LAYERS)[layer]
        if kt is not None:
            out += [kt.bounds.clone(), kt.length]
    return out


def assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        else:
            assert x == y


native = pytest.mark.skipif(not native_hsa.supports(torch.zeros(1)), reason="no C compiler")
triton = [pytest.mark.kernel, pytest.mark.skipif(K is None, reason="Triton kernels built for a GPU but no CUDA here")]
DEVICE = "cpu" if K is None or K.INTERPRETED else "cuda"


@pytest.mark.parametrize("kind,dtype,steps", [
    pytest.param("native", torch.float32, 14, marks=native),
    pytest.param("triton", torch.float32, 8, marks=triton),
    pytest.param("triton", torch.bfloat16, 6, marks=triton),
])
def test_batched_steps_equal_each_session_alone(kind, dtype, steps):
    host = HostTier(1 << 24)
    bf16 = dtype == torch.bfloat16
    device = DEVICE if kind == "triton" else "cpu"
    alone = [new_cache(m, "torch", i, host, dtype, bf16, device) for i, m in enumerate(MODES)]
    batched = [new_cache(m, kind, i, host, dtype, bf16, device) for i, m in enumerate(MODES)]
    for i, (a, b) in enumerate(zip(alone, batched)):
        prefill(a, PROMPTS[i], seed=i)
        prefill(b, PROMPTS[i], seed=i)
    gen = torch.Generator().manual_seed(99)
    tol = dict(atol=2e-2, rtol=2e-2) if bf16 else dict(atol=1e-5, rtol=0)
    for step in range(steps):
        if step == steps // 2 + 1:  # a second turn: tiered settles its new selection at its first decode step, alone
            for i, (a, b) in enumerate(zip(alone, batched)):
                prefill(a, 9, seed=100 + i)
                prefill(b, 9, seed=100 + i)
        ids = range(len(MODES)) if step != 2 else [0, 2, 4]  # a step some sessions sit out
        inputs = {i: [qkv(gen, 1, dtype, device) for _ in range(LAYERS)] for i in ids}
        want = {}
        for i in ids:
            alone[i].begin_forward(1, prefill=False)
            want[i] = [alone[i].attend(layer, *inputs[i][layer], D**-0.5) for layer in range(LAYERS)]
            alone[i].end_forward()
        caches = [batched[i] for i in ids]
        for c in caches:
            c.begin_forward(1, prefill=False)
        batch = BatchCache(caches, [1] * len(caches))
        for layer in range(LAYERS):
            packed = [torch.cat([inputs[i][layer][j] for i in ids], dim=2) for j in range(3)]
            got = batch.attend(layer, *packed, D**-0.5)
            for pos, i in enumerate(ids):
                torch.testing.assert_close(got[:, pos : pos + 1].float(), want[i][layer].float(), **tol)
        assert not batch.errors
        for c in caches:
            c.end_forward()
        for i in ids:
            assert_same_state(state(batched[i]), state(alone[i]))
    hsa_sessions = [c for c in batched if hasattr(c.decode, "kt") and c.layers[0].length > c.split.token_budget]
    assert len(hsa_sessions) >= 3  # the batched steps really ran HSA, not only dense attention


def test_a_failing_cache_fails_only_its_segment():
    if not native_hsa.supports(torch.zeros(1)):
        pytest.skip("no C compiler")
    host = HostTier(1 << 24)
    caches = [new_cache(m, "auto", i, host) for i, m in enumerate(["full", "rocketkv", "snapkv"])]
    for i, c in enumerate(caches):
        prefill(c, PROMPTS[i], seed=i)
        c.begin_forward(1, prefill=False)

    def broken(layer):
        raise RuntimeError("no target")

    def mismatched(layer):  # KT bounds of fewer tokens than the store: its row cannot be made
        return DecodeTarget(caches[2].layers[layer], kt=KTCache(caches[2].layers[layer].keys[:, :-3], 4))

    caches[1].decode_target = broken
    caches[2].decode_target = mismatched
    caches.append(new_cache("full", "auto", 3, host))
    prefill(caches[3], 20, seed=3)
    caches[3].begin_forward(1, prefill=False)
    lengths = [c.layers[0].length for c in caches]
    batch = BatchCache(caches, [1, 1, 1, 1])
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.cat(x, dim=2) for x in zip(*[qkv(gen, 1) for _ in caches]))
    out = batch.attend(0, q, k, v, D**-0.5)
    assert set(batch.errors) == {1, 2}
    assert torch.all(out[:, [1, 2]] == 0) and torch.all(out[:, [0, 3]] != 0)
    assert [c.layers[0].length for c in caches] == [lengths[0] + 1, lengths[1], lengths[2], lengths[3] + 1]


def test_the_c_kernel_reads_the_table_columns_of_decode_table():
    source = Path(native_hsa.__file__).with_name("hsa_decode.c").read_text()
    defines = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define F_(\w+) (\d+)", source)}
    assert defines.pop("WIDTH") == decode_table.WIDTH
    assert defines == decode_table.INDEX
