"""Named tensors as one byte string a store keeps: a JSON header (each tensor's dtype, shape and byte
range), then the raw bytes. Never pickle: what a store hands back is data, not code.

Layout: 4 bytes, the header's length (big-endian), the header, the tensors' bytes one after another.
"""
from __future__ import annotations

import json

import torch

_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.int32, torch.uint8, torch.int8)
}


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset,
                        "nbytes": len(raw)}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + b"".join(blobs)


def unpack(value: bytes) -> dict[str, torch.Tensor]:
    """Inverse of ``pack``; ``ValueError`` for an unknown dtype or a value shorter than its header says."""
    size = int.from_bytes(value[:4], "big")
    if len(value) < 4 + size:
        raise ValueError("a stored value shorter than its header")
    data = memoryview(value)[4 + size :]
    out = {}
    for name, spec in json.loads(value[4 : 4 + size]).items():
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"unsupported dtype {spec['dtype']!r} in tensor header")
        start, n = int(spec["offset"]), int(spec["nbytes"])
        raw = bytearray(data[start : start + n])
        if len(raw) != n:
            raise ValueError("tensor data shorter than its header says")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(spec["shape"]).clone()
    return out
