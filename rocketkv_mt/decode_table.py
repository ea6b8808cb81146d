"""The row layout that describes one session's decode step of one layer to the batched kernels.

A batched decode step passes one int64 row per session: where its cache buffers are (raw pointers
and strides, so sessions whose buffers are separate allocations of different capacities are read
in one call), where the new token goes, and what to attend. The native C kernel
(``native/hsa_decode.c``, ``#define F_*``) and the Triton kernels (``kernels/decode_batch.py``) read
the same indices; ``tests/algorithm/test_decode_batch.py`` checks the C defines against this list.

Pointers are to the attended store's key/value buffers (Hkv, CAP, d), its positions (Hkv, CAP)
int64, the same for a mirror store that also receives the token (MK = 0: none), and the KT bounds
(Hkv, 2d, P) with head stride BHEAD and row stride BROW (BOUNDS = 0: none).
"""
from __future__ import annotations

FIELDS = (
    "K", "V", "POS", "CAP", "ROW", "POSITION",  # attended store; ROW = its length before the token
    "MK", "MV", "MPOS", "MCAP", "MROW",  # mirror store
    "BOUNDS", "BHEAD", "BROW", "BPAGE", "BNEW",  # KT page the key tightens (BNEW: it opens that page)
    "HSA", "PAGES", "PAGE_SIZE", "TOPR", "KPAGES", "NLOCAL", "PINNED", "NPINNED",  # HSA=0: dense over ROW + 1
)
INDEX = {name: i for i, name in enumerate(FIELDS)}
WIDTH = len(FIELDS)
