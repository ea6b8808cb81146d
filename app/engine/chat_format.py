"""Turns chat messages into token ids incrementally, so each turn only adds its own tokens."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_PROBE = "\x00rkv-probe\x00"


class ChatFormat:
    """The tokenizer's chat template, applied one turn at a time.

    A session's token ids are: the first turn rendered by the template, then for each reply the
    generated ids, then the template's end-of-turn text (less what generation already produced)
    together with the next user block.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, extra_eos: list[int] | None = None):
        self.tok = tokenizer
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        eos = {tokenizer.eos_token_id, *(extra_eos or [])}
        self.eos_ids = {i for i in eos if i is not None}
        rendered = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}])
        self.turn_end_text = rendered.split(_PROBE, 1)[1]

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def first_turn(self, messages: list[dict]) -> list[int]:
        """Ids of a conversation's opening (system prompt if any, first user message, reply prompt)."""
        return self.encode(self.render(messages, generation_prompt=True))

    def next_turn(self, history: list[dict], user: dict, closing: str) -> list[int]:
        """Ids that follow a finished reply: ``closing`` (rest of the end-of-turn text) + the new user block."""
        before = self.render(history)
        after = self.render([*history, user], generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render conversations incrementally")
        return self.encode(closing + after[len(before) :])

    def closing_after(self, last_token: int | None) -> str:
        """End-of-turn text still owed after a reply whose last generated token is ``last_token``."""
        if last_token is not None and last_token in self.eos_ids:
            eos_text = self.tok.decode([last_token])
            if self.turn_end_text.startswith(eos_text):
                return self.turn_end_text[len(eos_text) :]
        return self.turn_end_text
