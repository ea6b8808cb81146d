"""Every Triton kernel compiles for an H200 (sm_90) on this machine, GPU or not, without spilling.

The interpreter runs the kernels' arithmetic but not their compilation: a kernel can pass every
interpreted test and still fail to build, or build with registers spilled to local memory. Here
each kernel is compiled ahead of time with the launch parameters its host function picks (block
sizes, warps; unit strides and 16-aligned pointers specialised as Triton specialises them at run
time), through ptxas, and its register report is read: no bf16 build may spill. The builds run in
a subprocess with TRITON_INTERPRET=0 (an interpreted run patches Triton's language in place).
Skipped where this Triton has no NVIDIA backend or another ahead-of-time API.
"""
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
except ImportError as exc:  # pragma: no cover - another Triton layout
    pytest.skip(f"no ahead-of-time NVIDIA build in this Triton: {exc}", allow_module_level=True)

pytestmark = pytest.mark.kernel
SKIP = "SKIP: "

UNIT_STRIDES = {"sqd", "skd", "svd", "sod", "spt", "sat", "sxd"}
ALIGNED = re.compile(r"^(s[a-z]{2,3}|D)$")


def kernel(module: str, name: str):
    return getattr(importlib.import_module(f"rocketkv_mt.kernels.{module}"), name)


def build(fn, pointers: dict, constexprs: dict, warps: int, stages: int = 3) -> str:
    """Compile for sm_90 and return ptxas's resource report."""
    consts = {**{a: 1 for a in fn.arg_names if a in UNIT_STRIDES}, **constexprs}
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
            if pointers[arg].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
            if ALIGNED.match(arg):  # strides and the head dim: multiples of 16 in every real launch
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except (TypeError, AttributeError) as exc:  # the AOT API, not the kernel
        return f"{SKIP}this Triton's ahead-of-time API differs: {exc}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    return out.stderr


def ptrs(dtype: str, **others) -> dict:
    return {k: (dtype if v == "T" else v) for k, v in others.items()}


BF16 = "*bf16"
CASES = {
    "attend_rows causal": ("prefill_attention", "_attend_rows", ptrs(
        BF16, q_ptr="T", k_ptr="T", v_ptr="T", kpos_ptr="*i64", qpos_ptr="*i64", alive_ptr="*u8", out_ptr="T",
        lse_ptr="*fp32", qk_scale="fp32"), dict(POSITIONAL=False, HAS_ALIVE=False, BLOCK_M=128, BLOCK_N=64,
                                              BLOCK_D=128, UPCAST=False, PRECISION="ieee"), 8, 2),
    "attend_rows positions": ("prefill_attention", "_attend_rows", ptrs(
        BF16, q_ptr="T", k_ptr="T", v_ptr="T", kpos_ptr="*i64", qpos_ptr="*i64", alive_ptr="*u8", out_ptr="*fp32",
        lse_ptr="*fp32", qk_scale="fp32"), dict(POSITIONAL=True, HAS_ALIVE=True, BLOCK_M=128, BLOCK_N=64,
                                              BLOCK_D=128, UPCAST=False, PRECISION="ieee"), 8, 2),
    "decode_batch append": ("decode_batch", "_append", ptrs(BF16, tab_ptr="*i64", k_ptr="T", v_ptr="T"),
                            dict(BLOCK_D=128), 4, 3),
    "decode_batch page scores": ("decode_batch", "_page_scores", ptrs(
        BF16, tab_ptr="*i64", q_ptr="T", ch_ptr="*i64", logit_ptr="*fp32", score_ptr="*fp32"),
        dict(BLOCK_G=4, BLOCK_P=32, BLOCK_C=32, BLOCK_D=128, BLOCK_A=16), 4, 3),
    "decode_batch attend": ("decode_batch", "_attend", ptrs(
        BF16, tab_ptr="*i64", q_ptr="T", pages_ptr="*i64", out_ptr="T", po_ptr="*fp32", pm_ptr="*fp32",
        pl_ptr="*fp32", qk_scale="fp32"), dict(BLOCK_G=16, BLOCK_T=64, BLOCK_D=128, SPLIT=True, UPCAST=False,
                                             PRECISION="ieee"), 8, 3),
    "sparse_decode": ("sparse_decode", "_sparse_decode", ptrs(
        BF16, q_ptr="T", k_ptr="T", v_ptr="T", tok_ptr="*i64", ok_ptr="*u8", out_ptr="T", po_ptr="*fp32",
        pm_ptr="*fp32", pl_ptr="*fp32", qk_scale="fp32"), dict(BLOCK_G=16, BLOCK_T=64, BLOCK_D=128, SPLIT=True,
                                                             UPCAST=False, PRECISION="ieee"), 8, 3),
    "sparse_decode merge": ("sparse_decode", "_merge_splits", ptrs(
        BF16, po_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", out_ptr="T"), dict(BLOCK_G=16, BLOCK_D=128), 4, 3),
    "page_scores logits": ("page_scores", "_page_logits", ptrs(
        BF16, q_ptr="T", kmin_ptr="T", kmax_ptr="T", ch_ptr="*i64", logit_ptr="*fp32", bmax_ptr="*fp32",
        bsum_ptr="*fp32"), dict(BLOCK_G=4, BLOCK_P=32, BLOCK_C=32, BLOCK_D=128), 4, 3),
    "window_scores row stats": ("window_scores", "_row_stats", ptrs(
        BF16, q_ptr="T", k_ptr="T", m_ptr="*fp32", l_ptr="*fp32", qk_scale="fp32"),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, UPCAST=False, PRECISION="ieee"), 8, 3),
    "window_scores prefix mass": ("window_scores", "_prefix_mass", ptrs(
        BF16, q_ptr="T", k_ptr="T", lse_ptr="*fp32", out_ptr="*fp32", qk_scale="fp32"),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, UPCAST=False, PRECISION="ieee"), 8, 3),
}


@pytest.fixture(scope="module")
def reports() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_builds_for_sm90_without_spilling(name, reports):
    report = reports[name]
    if report.startswith(SKIP):
        pytest.skip(report[len(SKIP):])
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report


def _build_all() -> dict:
    out = {}
    for name, (module, fn_name, pointers, constexprs, warps, stages) in CASES.items():
        try:
            out[name] = build(kernel(module, fn_name), pointers, constexprs, warps, stages)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            out[name] = f"ERROR {type(exc).__name__}: {exc}"[:4000]
    return out


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    print(json.dumps(_build_all()))
