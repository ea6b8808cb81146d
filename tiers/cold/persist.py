"""A cold layer's page table (``tiers.cold.layer``, the ``layer`` argument) as tensors a store keeps with
the session's KV generation (``tiers.session_kv``), and the table rebuilt from them: page ids, positions,
alive flags, key bounds, and the key and value sketches. A table written with other sketch settings is
read as far as it goes (a missing sketch reads as the middle of its range).
"""
from __future__ import annotations

import torch

from tiers.cold.ids import packed_id, unpacked_id
from tiers.cold.table import DIGEST_DTYPE, outward


def _restored_codes(layer, tensors: dict[str, torch.Tensor], head: int, pages: int) -> torch.Tensor:
    """A head's sketch codes from a persisted page table; one written without them (another ``sketch_bits``)
    gets the step just above the middle of every range: its tokens rank as their pages' centres do."""
    width = layer._codes.buf.shape[-1]
    codes = tensors.get(f"codes{head}")
    if codes is not None and tuple(codes.shape) == (pages, layer.page_tokens, width):
        return codes
    middle = sum(((1 << layer.sketch_bits) // 2) << s for s in range(0, 8, layer.sketch_bits or 8)) if width else 0
    return torch.full((pages, layer.page_tokens, width), middle, dtype=torch.uint8)


def _restored_values(layer, tensors: dict[str, torch.Tensor], head: int, pages: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A head's value sketch from a persisted page table; for a table written without one, zeros,
    and no value sketch for this layer from then on (``values_sketched``)."""
    width, d = layer._vcodes.buf.shape[-1], layer._vmin.buf.shape[-1]
    got = tuple(tensors.get(f"{name}{head}") for name in ("vcodes", "vmin", "vmax"))
    shapes = ((pages, layer.page_tokens, width), (pages, d), (pages, d))
    if all(t is not None and tuple(t.shape) == shape for t, shape in zip(got, shapes)):
        return got
    if width:
        layer.values_sketched = False
    return (torch.zeros(*shapes[0], dtype=torch.uint8), torch.zeros(*shapes[1], dtype=DIGEST_DTYPE),
            torch.zeros(*shapes[2], dtype=DIGEST_DTYPE))


def index_tensors(layer) -> dict[str, torch.Tensor]:
    """The page table as tensors (written to Redis with the session's record)."""
    out = {}
    for i, ids in enumerate(layer.ids):
        n = len(ids)
        out[f"pos{i}"] = layer._pos.buf[i, :n].to(torch.int32)
        out[f"alive{i}"] = layer._alive.buf[i, :n].clone()
        out[f"kmin{i}"] = layer._kmin.buf[i, :n].clone()
        out[f"kmax{i}"] = layer._kmax.buf[i, :n].clone()
        out[f"ids{i}"] = torch.tensor([packed_id(pid) for pid in ids], dtype=torch.int64)
        if layer.sketch_bits:
            out[f"codes{i}"] = layer._codes.buf[i, :n].clone()
            if layer.values_sketched:
                out[f"vcodes{i}"] = layer._vcodes.buf[i, :n].clone()
                out[f"vmin{i}"] = layer._vmin.buf[i, :n].clone()
                out[f"vmax{i}"] = layer._vmax.buf[i, :n].clone()
    return out


def snapshot(layer) -> dict:
    """The JSON-able rest of the page table: its pages per head, which a restore checks the tensors against."""
    return {"pages": [len(ids) for ids in layer.ids]}


def restore(layer, state: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Rebuild the page table from ``index_tensors`` and ``snapshot``: the page ids it names (the caller
    checks the store holds them); ``ValueError``, leaving it empty, where they do not match each other."""
    layer._reset(len(layer.ids))
    try:
        _restore(layer, state, tensors)
    except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as exc:
        layer._reset(len(layer.ids))
        raise ValueError(f"layer {layer.layer}: page table does not match its record ({exc})") from None
    return layer.page_ids()


def _restore(layer, state: dict, tensors: dict[str, torch.Tensor]) -> None:
    pages, p = state["pages"], layer.page_tokens
    if len(pages) != len(layer.ids):
        raise ValueError(f"{len(pages)} heads recorded, {len(layer.ids)} in the cache")
    for i, n in enumerate(pages):
        packed = tensors[f"ids{i}"].tolist()
        pos, alive = tensors[f"pos{i}"].long(), tensors[f"alive{i}"].bool()
        if len(packed) != n or tuple(pos.shape) != (n, p) or tuple(alive.shape) != (n, p):
            raise ValueError(f"head {i}: {n} pages recorded, tables of {len(packed)} and {tuple(pos.shape)}")
        if bool((alive & (pos < 0)).any()):
            raise ValueError(f"head {i}: a cold token without a position")
        ids = [unpacked_id(layer.layer, e) for e in packed]
        if ids:
            layer._append(torch.full((len(ids),), i), ids, pos, alive,
                         outward(tensors[f"kmin{i}"], up=False), outward(tensors[f"kmax{i}"], up=True),
                         _restored_codes(layer, tensors, i, len(ids)), _restored_values(layer, tensors, i, len(ids)))
