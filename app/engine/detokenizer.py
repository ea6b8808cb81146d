"""Incremental detokenization with stop strings: emits only text that is final."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add a generated token; returns the newly final text (may be empty)."""
        self.ids.append(token_id)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                break
        if self.stopped:
            return self.flush()
        # Hold back a partial UTF-8 character and any tail that could still grow into a stop string.
        end = len(self.text)
        if self.text.endswith("\ufffd"):
            end -= 1
        if self.stop:
            end = min(end, max(self.emitted, len(self.text) - max(len(s) for s in self.stop) + 1))
        return self._emit(end)

    def flush(self) -> str:
        return self._emit(len(self.text.rstrip("\ufffd")))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
