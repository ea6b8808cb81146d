"""Prefill attention without a mask or a score matrix on CUDA, against the masked SDPA it replaces.

The reference is the path every turn took before: SDPA with an explicit boolean mask and GQA, in
blocks of rows. Each CUDA path is checked on CPU tensors: the bottom-right causal SDPA call (on a CPU
SDPA builds the mask itself, so only its semantics are checked here) and the Triton kernel, under
the interpreter here and compiled under ``make gpu-check``.
"""
import pytest
import torch
import torch.nn.functional as F

from kernel_helpers import kernel_device, load_kernels
from rocketkv_mt import attention_ops
from rocketkv_mt.attention_ops import causal_sdpa, dense_attention, positional_attention, prefill_scratch_bytes
from rocketkv_mt.split_attention import attend_part, join_rows, merge, window_probs

K = load_kernels()
DEVICE = kernel_device(K) if K is not None else "cpu"
needs_kernels = pytest.mark.skipif(K is None, reason="Triton kernels built for a GPU but no CUDA here")


def reference_dense(q, keys, values, scaling, rows=1024):
    hq, n, _ = q.shape
    length = keys.shape[1]
    k, v = keys.unsqueeze(0), values.unsqueeze(0)
    if n == 1:
        return F.scaled_dot_product_attention(q.unsqueeze(0), k, v, scale=scaling, enable_gqa=True)[0]
    out = torch.empty_like(q)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        visible = length - n + stop
        q_pos = torch.arange(length - n + start, length - n + stop).view(-1, 1)
        mask = torch.arange(visible).view(1, -1) <= q_pos
        out[:, start:stop] = F.scaled_dot_product_attention(
            q[:, start:stop].unsqueeze(0), k[:, :, :visible], v[:, :, :visible], attn_mask=mask, scale=scaling,
            enable_gqa=True,
        )[0]
    return out


def reference_positional(q, q_pos, keys, values, key_pos, alive, scaling):
    g = q.shape[0] // keys.shape[0]
    mask = key_pos.unsqueeze(1) <= q_pos.view(1, -1, 1)
    if alive is not None:
        mask &= alive.unsqueeze(1)
    return F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask.repeat_interleave(g, dim=0).unsqueeze(0), scale=scaling, enable_gqa=True,
    )[0]


def reference_lse(q, keys, scaling, seen):
    """log-sum-exp (Hq, n) of the logits a row sees; ``seen`` (Hkv, n, T)."""
    hq, n, d = q.shape
    hkv = keys.shape[0]
    g = hq // hkv
    logits = torch.matmul(q.view(hkv, g, n, d), keys.unsqueeze(1).transpose(-1, -2)) * scaling
    return torch.logsumexp(logits.masked_fill(~seen.unsqueeze(1), float("-inf")), dim=-1).reshape(hq, n)


def case(hkv, g, n, length, d, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * g, n, d, generator=gen)
    keys, values = torch.randn(hkv, length, d, generator=gen), torch.randn(hkv, length, d, generator=gen)
    return q.to(device), keys.to(device), values.to(device)


SHAPES = [(2, 3, 17, 40, 16), (1, 4, 40, 40, 32), (3, 1, 9, 70, 16), (2, 4, 1, 33, 16)]


@pytest.mark.parametrize("hkv,g,n,length,d", SHAPES)
def test_cpu_path_equals_the_masked_reference(hkv, g, n, length, d):
    q, keys, values = case(hkv, g, n, length, d)
    torch.testing.assert_close(dense_attention(q, keys, values, 0.3), reference_dense(q, keys, values, 0.3),
                               atol=1e-5, rtol=0)


def test_cpu_path_blocks_of_rows_equal_one_pass(monkeypatch):
    q, keys, values = case(2, 2, 50, 80, 16, seed=3)
    monkeypatch.setattr(attention_ops, "PREFILL_ROWS", 16)
    torch.testing.assert_close(dense_attention(q, keys, values, 0.25), reference_dense(q, keys, values, 0.25, rows=10**6),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("hkv,g,n,length,d", SHAPES[:3])
def test_bottom_right_causal_sdpa_equals_the_masked_reference(hkv, g, n, length, d):
    q, keys, values = case(hkv, g, n, length, d, seed=1)
    torch.testing.assert_close(causal_sdpa(q, keys, values, 0.3), reference_dense(q, keys, values, 0.3),
                               atol=1e-5, rtol=0)


def test_flash_is_never_taken_for_cpu_tensors():
    q, keys, values = case(2, 2, 8, 20, 16)
    assert not attention_ops.flash_takes(q, keys, values)


@needs_kernels
@pytest.mark.kernel
@pytest.mark.parametrize("hkv,g,n,length,d", SHAPES[:3] + [(1, 8, 70, 300, 64)])
def test_kernel_causal_offset_equals_the_masked_reference(hkv, g, n, length, d):
    q, keys, values = case(hkv, g, n, length, d, seed=2, device=DEVICE)
    out, lse = K.attend_rows(q, keys, values, 0.3, q_offset=length - n)
    torch.testing.assert_close(out, reference_dense(q.cpu(), keys.cpu(), values.cpu(), 0.3).to(DEVICE),
                               atol=1e-5, rtol=0)
    seen = (torch.arange(length).view(1, -1) <= torch.arange(length - n, length).view(-1, 1)).expand(hkv, n, length)
    torch.testing.assert_close(lse, reference_lse(q.cpu(), keys.cpu(), 0.3, seen).to(DEVICE), atol=1e-5, rtol=0)
    routed = dense_attention(q, keys, values, 0.3, backend="triton")
    torch.testing.assert_close(routed, out, atol=0, rtol=0)


@needs_kernels
@pytest.mark.kernel
def test_kernel_bf16_tiles_equal_the_fp32_reference():
    q, keys, values = case(2, 4, 150, 400, 64, seed=10)
    want = reference_dense(q, keys, values, 0.125)
    qb, kb, vb = (x.to(DEVICE, torch.bfloat16) for x in (q, keys, values))
    out, _ = K.attend_rows(qb, kb, vb, 0.125, q_offset=400 - 150)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), want, atol=3e-2, rtol=3e-2)


@needs_kernels
@pytest.mark.kernel
@pytest.mark.parametrize("with_alive", [False, True])
def test_kernel_positions_in_any_order_equal_the_masked_reference(with_alive):
    hkv, g, n, t, d, history = 2, 3, 21, 60, 16, 100
    gen = torch.Generator().manual_seed(4)
    q, keys, values = case(hkv, g, n, t, d, seed=4)
    key_pos = torch.stack([torch.randperm(history, generator=gen)[:t] for _ in range(hkv)])
    q_pos = torch.arange(history - n, history)
    alive = (torch.rand(hkv, t, generator=gen) > 0.3) if with_alive else None
    if alive is not None:
        alive[:, key_pos.argmin(dim=1)] = True  # every query sees at least one slot, as in a real turn
    want = reference_positional(q, q_pos, keys, values, key_pos, alive, 0.2)
    dev = [x.to(DEVICE) for x in (q, q_pos, keys, values, key_pos)]
    got = positional_attention(*dev, None if alive is None else alive.to(DEVICE), 0.2, backend="triton")
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(positional_attention(q, q_pos, keys, values, key_pos, alive, 0.2), want, atol=1e-5, rtol=0)


@needs_kernels
@pytest.mark.kernel
def test_kernel_rows_that_see_nothing_get_zero_and_minus_infinity():
    q, keys, values = case(2, 2, 6, 10, 16, seed=5, device=DEVICE)
    alive = torch.zeros(2, 10, dtype=torch.bool, device=DEVICE)
    alive[0, 3] = True
    out, lse = K.attend_rows(q, keys, values, 0.5, q_offset=10, alive=alive)
    assert torch.all(out[2:] == 0) and torch.all(lse[2:] == float("-inf"))
    torch.testing.assert_close(out[:2], values[0, 3].expand(2, 6, -1), atol=1e-6, rtol=0)


@needs_kernels
@pytest.mark.kernel
def test_kernel_parts_merge_like_the_cpu_parts():
    """A tiered turn's two parts (device part with the turn's own causal tail, read-back part with
    dead slots): the kernel branch of attend_part gives the CPU branch's output, lse and window scores."""
    hkv, g, n, d, w = 2, 3, 20, 16, 6
    q, k, v = case(hkv, g, n, 30 + n, d, seed=6)
    _, ck, cv = case(hkv, g, 1, 24, d, seed=7)
    visible = torch.rand(hkv, 24, generator=torch.Generator().manual_seed(8)) > 0.4
    visible[1] = False  # a head with nothing read back
    cpu = [attend_part(q, k, v, 0.3, w, own_tail=n, backend="torch"),
           attend_part(q, ck, cv, 0.3, w, visible=visible, backend="torch")]
    dev = [attend_part(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), 0.3, w, own_tail=n, backend="triton"),
           attend_part(q.to(DEVICE), ck.to(DEVICE), cv.to(DEVICE), 0.3, w, visible=visible.to(DEVICE), backend="triton")]
    out_c, lse_c = merge(cpu, q.dtype)
    out_d, lse_d = merge(dev, q.dtype)
    torch.testing.assert_close(out_d.cpu(), out_c, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse_d.cpu(), lse_c, atol=1e-5, rtol=0)
    for a, b in zip(cpu, dev):
        torch.testing.assert_close(window_probs(b, lse_d).cpu(), window_probs(a, lse_c), atol=1e-5, rtol=0)


@needs_kernels
@pytest.mark.kernel
def test_kernel_window_rows_first_then_the_rest_equal_the_cpu_one_pass():
    """A tiered turn's device part in two calls (the window rows first, at their offset in the turn,
    then the other rows with no window): on the kernel branch it equals the CPU branch in one pass."""
    hkv, g, n, d, w = 2, 3, 20, 16, 6
    q, k, v = case(hkv, g, n, 30 + n, d, seed=9)
    whole = attend_part(q, k, v, 0.3, w, own_tail=n, backend="torch")
    qd, kd, vd = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    window = attend_part(qd[:, n - w :], kd, vd, 0.3, w, own_tail=n, first_row=n - w, backend="triton")
    rest = attend_part(qd[:, : n - w], kd, vd, 0.3, 0, own_tail=n, backend="triton")
    assert rest.window_probs is None and rest.window_top is None
    joined = join_rows(rest, window)
    torch.testing.assert_close(joined.out.cpu(), whole.out, atol=1e-5, rtol=0)
    torch.testing.assert_close(joined.lse.cpu(), whole.lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(window_probs(joined, joined.lse).cpu(), window_probs(whole, whole.lse), atol=1e-5, rtol=0)


def test_scratch_bytes_on_cuda_hold_no_rows_by_keys_term():
    args = dict(q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    cuda = [prefill_scratch_bytes(1024, t, device="cuda", **args) for t in (32_768, 131_072)]
    assert cuda[0] == cuda[1] == 32 * 1024 * (4 + 128 * 4)  # lse and one fp32 output, whatever the keys
    cpu = prefill_scratch_bytes(1024, 131_072, device="cpu", **args)
    assert cpu >= 2 * 32 * 1024 * 131_072 * 4  # the (Hq, rows, keys) scores and their softmax
    # Stage 1's window rows are the one part that grows with the keys on CUDA: w rows, not n.
    windowed = [prefill_scratch_bytes(n, 131_072, device="cuda", window=32, **args) for n in (1024, 4096)]
    assert windowed[0] - cuda[1] == (2 * 32 * 32 + 8 * 128) * 131_072 * 4
    assert windowed[1] - windowed[0] == 32 * 3072 * (4 + 128 * 4)  # more rows: only their lse and output


@pytest.mark.kernel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention and the compiled kernel run on CUDA only")
def test_cuda_prefill_allocates_no_rows_by_keys_scores():
    hkv, g, n, length, d = 8, 4, 512, 4096, 128
    q, keys, values = case(hkv, g, n, length, d, seed=9)
    want = reference_dense(q, keys, values, d**-0.5)
    scores = hkv * g * n * length * 4  # what the masked path allocates for its fp32 scores
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4)):
        qc, kc, vc = (x.to("cuda", dtype) for x in (q, keys, values))
        assert attention_ops.flash_takes(qc, kc, vc) == (dtype == torch.bfloat16)  # fp32: the Triton kernel
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = dense_attention(qc, kc, vc, d**-0.5)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < scores / 8
        torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    args = (q.cuda(), torch.arange(length - n, length).cuda(), keys.cuda(), values.cuda(),
            torch.arange(length).expand(hkv, length).cuda())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = positional_attention(*args, None, d**-0.5)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < scores / 8
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
