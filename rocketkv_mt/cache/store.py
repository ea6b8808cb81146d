"""Per-layer KV storage: preallocated buffers of kept keys, values and their positions."""
from __future__ import annotations

import torch

from rocketkv_mt.take_rows import take_rows


class LayerKV:
    """Kept tokens of one layer, the same count for every KV head.

    keys/values: (Hkv, L, d); positions: (Hkv, L) int64, the tokens' positions in the whole history.
    Buffers grow by chunks so decode appends are in place (gpt-fast style static slices).
    """

    # Spare slots past the kept tokens, so a partial last page can be read as a whole page in place.
    SLACK = 32

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, chunk: int = 256):
        self.chunk = chunk
        self.length = 0
        self._k = torch.empty(num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._v = torch.empty_like(self._k)
        self._pos = torch.empty(num_kv_heads, 0, dtype=torch.long, device=device)
        self._clean = 0  # slots below this hold written tokens or zeros (``_zero_ahead``)

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self._pos[:, : self.length]

    def reserve(self, total: int, lead: int = 0) -> None:
        """Make the buffers hold ``total`` tokens (plus the slack) without moving them again; the next
        token may be written in place (``appended``). ``lead`` (< ``chunk``): grow and zero that many
        tokens early. A decode step appends to every layer of every decoding session at once, so equal
        layers would all move, or zero, in the same step; leads that differ by layer spread that work
        over many steps (one step paying for all of a session's layers was a pause of 70 ms per session
        on a 2-core machine, where fresh pages fault)."""
        self._reserve(total + lead)
        self._zero_ahead(min(total, self.length + 1) + self.SLACK + lead)

    def _reserve(self, total: int) -> None:
        cap = self._k.shape[1]
        if total + self.SLACK > cap:
            new_cap = max(total + self.SLACK, cap + cap // 2, cap + self.chunk)
            self._move(-(-new_cap // self.chunk) * self.chunk)

    def _move(self, new_cap: int) -> None:
        """Into buffers of ``new_cap`` tokens, the kept ones copied. Their other slots are left
        unwritten (``_zero_ahead``): zeroing a long prefill's whole reservation at once took most of a
        second on a VM where every fresh page faults, and the chunk that reserves it waits for that."""
        for name in ("_k", "_v", "_pos"):
            old = getattr(self, name)
            buf = old.new_empty(old.shape[0], new_cap, *old.shape[2:])
            buf[:, : self.length] = old[:, : self.length]
            setattr(self, name, buf)
        self._clean = self.length

    def _zero_ahead(self, need: int) -> None:
        """Make slots up to ``need`` hold written tokens or zeros, not garbage: HSA reads a partial last
        page whole (masked), and NaN * 0 would leak. Zeroed a chunk of slots at a time, so that the
        appends of a decode or of a chunked prefill rarely zero anything."""
        if need <= self._clean:
            return
        stop = min(self._k.shape[1], max(need, self._clean + self.chunk))
        for buf in (self._k, self._v, self._pos):
            buf[:, self._clean : stop] = 0
        self._clean = stop

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers (Hkv, capacity, d); capacity >= length + SLACK."""
        return self._k, self._v

    @property
    def position_buffer(self) -> torch.Tensor:
        """The whole positions buffer (Hkv, capacity) int64."""
        return self._pos

    def appended(self, n: int = 1) -> None:
        """Count ``n`` tokens that a kernel wrote in place after the kept ones (room made by ``reserve``)."""
        if self.length + n > self._k.shape[1]:
            raise ValueError(f"{n} tokens written past the {self._k.shape[1]}-token buffers")
        self.length += n

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: (Hkv, n, d); positions: (n,) shared by all heads, or (Hkv, n)."""
        n = k.shape[1]
        self._reserve(self.length + n)
        end = self.length + n
        self._k[:, self.length : end] = k
        self._v[:, self.length : end] = v
        self._pos[:, self.length : end] = positions
        self.length = end
        self._clean = max(self._clean, end)
        self._zero_ahead(end + self.SLACK)

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only tokens idx (Hkv, m) (indices into the current kept tokens, ascending), compacted."""
        k = take_rows(self.keys, idx)
        v = take_rows(self.values, idx)
        pos = torch.gather(self.positions, 1, idx)
        m = idx.shape[1]
        self._k[:, :m] = k
        self._v[:, :m] = v
        self._pos[:, :m] = pos
        self.length = m
        self._shrink()

    def replace(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Set the kept tokens to exactly k, v (Hkv, m, d) with positions (Hkv, m)."""
        self.length = 0
        self.append(k, v, positions)
        self._shrink()

    def truncate(self, length: int) -> None:
        """Drop the tokens appended after the first ``length`` (zeroed: see ``_zero_ahead``)."""
        for buf in (self._k, self._v, self._pos):
            buf[:, length : self.length] = 0
        self.length = length
        self._shrink()

    def _shrink(self) -> None:
        """Give back buffer space far beyond the kept tokens (after an eviction or a re-selection),
        so that what a compressed cache allocates follows what it keeps."""
        cap, need = self._k.shape[1], self.length + self.SLACK
        if cap <= 2 * need or cap - need < self.chunk:
            return
        self._move(-(-(need + self.chunk // 2) // self.chunk) * self.chunk)
        self._zero_ahead(need)

    def nbytes(self) -> int:
        """Bytes of the kept keys and values (what the session needs, not the spare capacity); from the
        shapes, without slicing a view (the replica measures every cache it stepped, after each step)."""
        heads, _, dim = self._k.shape
        return 2 * heads * self.length * dim * self._k.element_size()
