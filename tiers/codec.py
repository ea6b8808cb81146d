"""How a page's keys and values are stored in the cold tiers: as they are, or as int8 with scales.
``encode`` takes keys/values (n pages, P tokens, d head dim) and returns the page batch the tiers store;
``decode`` gives keys/values (n, P, d) back in the model's dtype.
"""
from __future__ import annotations

from typing import Protocol

import torch

from tiers.base import PageBatch, batch_nbytes


class PageCodec(Protocol):
    name: str

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> PageBatch: ...

    def decode(self, batch: PageBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


class RawCodec:
    """Bit-exact: the tiers hold the keys and values as the model made them."""

    name = "raw"

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> PageBatch:
        return {"keys": keys, "values": values}

    def decode(self, batch: PageBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["keys"].to(dtype), batch["values"].to(dtype)


class Int8Codec:
    """Symmetric int8. Keys get one scale per page and channel (their outliers sit in fixed channels),
    values one scale per token (their range varies by token): the split KIVI found to lose least."""

    name = "int8"

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> PageBatch:
        kscale = keys.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127  # (n, 1, d)
        vscale = values.float().abs().amax(dim=2, keepdim=True).clamp_min(1e-8) / 127  # (n, P, 1)
        return {
            "keys": torch.round(keys.float() / kscale).to(torch.int8),
            "values": torch.round(values.float() / vscale).to(torch.int8),
            "key_scale": kscale,
            "value_scale": vscale,
        }

    def decode(self, batch: PageBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys = batch["keys"].float() * batch["key_scale"]
        values = batch["values"].float() * batch["value_scale"]
        return keys.to(dtype), values.to(dtype)


CODECS: dict[str, type] = {"raw": RawCodec, "int8": Int8Codec}


def page_nbytes(codec: PageCodec, page_tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page (``page_tokens`` tokens of one KV head) as ``codec`` stores it."""
    zeros = torch.zeros(1, page_tokens, head_dim, dtype=dtype)
    return batch_nbytes(codec.encode(zeros, zeros))


def make_codec(name: str) -> PageCodec:
    try:
        return CODECS[name]()
    except KeyError:
        raise ValueError(f"unknown cold-tier codec {name!r}; one of {sorted(CODECS)}") from None
