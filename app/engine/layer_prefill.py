"""A long prefill fed layer by layer, so a session's device memory never holds its whole prompt in
every layer at once: a first turn's, or a later one's where the cache feeds later turns so.

The model runs one decoder layer over the whole prompt, in groups of ``rows`` query rows, before the
next layer; the prompt's hidden states (1, n, hidden) are carried from layer to layer, each group's
output written over its input (a later group of the same layer needs only the keys and values the
cache holds). The cache (``ComposedCache.begin_layered``) appends each group's keys and values to
the layer's store, attends the group densely over it and, after the layer's last group, runs the
mode's selection (Stage 1 with the layer's real observation window; evicted or demoted tokens leave
the device), here or on the page reader, which the next layer then waits for (``ready`` tells). The result is the whole prefill's, up to float rounding (a group's size
changes how the kernels block their sums): every row attends to what it would have, and each layer
selects from the same inputs. While it runs, a layer holds at most its
own whole prompt, the layers before it their selections, and the layers after it nothing new.

A later turn (``SessionCache.layers_later``: ``tiered``, whose rows also attend over the cold pages the
layer's window rows pick) runs each layer in two passes: first the keys and values of the whole turn,
in groups, computed from the layer's input (its norm and key/value projections, rotated), and the
window rows' queries, which pick the pages and Stage 1's choice; then the rows in groups, as above.

``advance`` does groups until a deadline, so the model thread can run other sessions' decode steps
between two calls (``app.engine.batcher``); while they wait (``fit``), a group is sized on what the
rows before it cost (a row's cost grows along a layer, with the keys it attends to), between
``MIN_ROWS`` and ``rows``, so that it ends near the deadline; otherwise groups are ``rows`` long
(small groups cost more a row). ``finish`` gives the first token's logits. Between two calls the prefill can be taken
back (``SessionCache.undo_layered``).

The model is a transformers decoder with Llama's layout (``model.embed_tokens``, ``rotary_emb``,
``layers``, ``norm``, ``lm_head``, no embedding or logit scaling): the model types in
``LAYERED_MODEL_TYPES`` (the bundled models among them). Others feed a first prompt in chunks.
"""
from __future__ import annotations

import time

import torch

from rocketkv_mt.cache import SessionCache

MIN_ROWS = 4  # fewest rows a group sized on a deadline carries
ROW_EMA = 0.5  # weight of the newest group in the running cost of a row
# transformers model types whose forward is exactly embed -> decoder layers (with rotary tables) -> norm
# -> lm_head, as ``LayerPrefill`` runs it.
LAYERED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


def heads(proj: torch.nn.Module, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A projection of x (1, r, hidden) split into heads: (1, H, r, head_dim), as the attention module does."""
    return proj(x).view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (1, H, r, d) at the rows' ``cos``/``sin`` (1, r, d), as Llama's layout applies it."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LayerPrefill:
    """One prompt fed layer by layer into ``cache`` (which must be empty) by ``model``."""

    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, cache: SessionCache, ids: list[int], max_new: int, rows: int):
        if rows < 1:
            raise ValueError("a group has at least one row")
        self.model, self.cache, self.rows = model, cache, rows
        self.n = len(ids)
        self.layer, self.offset = 0, 0  # the next group: its layer and first row
        self.keys_first = cache.history_len > 0  # a later turn: each layer takes the turn's keys first
        self.keyed = False  # the running layer holds the whole turn's keys (its rows come next)
        self.row_s: float | None = None  # running cost of a row (seconds), to size groups on a deadline
        inner = model.model
        device = inner.embed_tokens.weight.device
        cache.begin_layered(self.n, max_new)
        self.position_ids = cache.positions(self.n).unsqueeze(0)
        self.hidden = inner.embed_tokens(torch.tensor([ids], dtype=torch.long, device=device))
        self.cos, self.sin = inner.rotary_emb(self.hidden, position_ids=self.position_ids)

    @property
    def done(self) -> bool:
        return self.layer == len(self.model.model.layers)

    @torch.inference_mode()
    def advance(self, deadline: float | None = None, fit: bool = False) -> int:
        """Feed groups, at least one, until every layer has had the prompt or ``time.perf_counter()``
        passes ``deadline`` (None: to the end), sizing them to end near it when ``fit`` (and then ending
        with a layer whose next one is not ``ready``); returns the rows fed."""
        fed = 0
        while not self.done:
            layer = self.layer
            fed += self.feed_group(self._group(deadline, time.perf_counter()) if fit else self.rows, wait=fit)
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if fit and self.layer != layer and not self.ready():
                # A layer ended and is selecting, or applying its choice, on the page reader (``tiered`` on
                # a CPU), which the next layer would wait for here: other sessions' steps go first.
                break
        self._wait()  # the slice's time is the device's, not what queueing its work took
        return fed

    @torch.inference_mode()
    def feed_group(self, rows: int | None = None, wait: bool = False) -> int:
        """One group: the running layer over its next ``rows`` rows (default ``rows``); returns the rows
        fed. ``wait``: the group has run on the device before this returns (so its time is the group's)."""
        t0 = time.perf_counter()
        a = self.offset
        if self.keys_first and not self.keyed:
            return self._feed_keys(a, min(a + self.rows, self.n), wait)
        b = min(a + (rows or self.rows), self.n)
        self.hidden[:, a:b] = self.model.model.layers[self.layer](
            self.hidden[:, a:b], attention_mask=None, position_ids=self.position_ids[:, a:b],
            position_embeddings=(self.cos[:, a:b], self.sin[:, a:b]), rkv_cache=self.cache,
        )
        self.layer, self.offset = (self.layer + 1, 0) if b == self.n else (self.layer, b)
        self.keyed = self.keyed and b < self.n
        if wait:
            self._wait()
        row_s = (time.perf_counter() - t0) / (b - a)
        self.row_s = row_s if self.row_s is None else (1 - ROW_EMA) * self.row_s + ROW_EMA * row_s
        return b - a

    def _feed_keys(self, a: int, b: int, wait: bool) -> int:
        """A later turn's running layer: the keys and values of rows ``a:b`` into the cache; after the
        last rows, the window rows' queries. Projections only (no attention): groups of ``rows``."""
        layer = self.model.model.layers[self.layer]
        attn = layer.self_attn
        x = layer.input_layernorm(self.hidden[:, a:b])
        k = rotated(heads(attn.k_proj, x, attn.head_dim), self.cos[:, a:b], self.sin[:, a:b])
        v = heads(attn.v_proj, x, attn.head_dim)
        self.cache.layered_keys(self.layer, k[0], v[0])
        if b == self.n:
            w = self.cache.layered_window_rows()
            q = rotated(heads(attn.q_proj, layer.input_layernorm(self.hidden[:, -w:]), attn.head_dim),
                        self.cos[:, -w:], self.sin[:, -w:])
            self.cache.layered_window(self.layer, q[0], attn.scaling)
            self.keyed, self.offset = True, 0
        else:
            self.offset = b
        if wait:
            self._wait()
        return 0  # no row has been through the layer yet

    def ready(self) -> bool:
        """Whether the next group runs without waiting: a layer's first group waits for the layer before
        it to have selected, or applied its choice (``tiered`` on a CPU runs those on the page reader)."""
        return self.done or self.offset != 0 or self.keyed or self.cache.layered_ready(self.layer)

    def _group(self, deadline: float | None, now: float) -> int:
        """Rows of the next group: ``rows``, or with a deadline as many as fit before it at the running
        cost of a row (``MIN_ROWS`` while that is not known yet)."""
        if deadline is None:
            return self.rows
        if not self.row_s:
            return min(self.rows, MIN_ROWS)
        return max(MIN_ROWS, min(self.rows, int((deadline - now) / self.row_s)))

    def _wait(self) -> None:
        if self.hidden is not None and self.hidden.is_cuda:
            torch.cuda.synchronize(self.hidden.device)

    @torch.inference_mode()
    def finish(self) -> torch.Tensor:
        """After the last layer: the cache's prefill ends; the last position's logits (V,) in float32."""
        if not self.done:
            raise RuntimeError("the prompt has not been through every layer")
        self.cache.end_layered()
        last = self.model.model.norm(self.hidden[:, -1:])
        logits = self.model.lm_head(last)[0, -1].float()
        self.hidden = self.cos = self.sin = None  # the prompt's activations are not held past the prefill
        return logits

    def scratch_bytes(self) -> int:
        """Bytes this prefill holds besides the cache: the prompt's hidden states and rotary tables."""
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.cos, self.sin) if t is not None)
