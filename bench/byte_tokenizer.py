"""A byte-level tokenizer with a chat template, built in memory: one token per UTF-8 byte plus the
chat markers. It needs no file and no hub, so a random-weight model can hold a real conversation
through the engine (``bench.random_model.random_chat_model``) where no model package is installed,
as on a lent GPU machine.

Ids: 0..255 are the bytes (in the byte-level alphabet's sorted order), then ``<|im_end|>`` (the end
of a turn and of a reply: the eos), ``<|pad|>`` and ``<|im_start|>``.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

START, END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
# ChatML, as the bundled models use: a conversation renders turn by turn, each turn appended.
CHAT_TEMPLATE = (
    "{% for m in messages %}" + START + "{{ m['role'] }}\n{{ m['content'] }}" + END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + START + "assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer of 259 ids: 256 bytes, then the end marker, padding and the start marker."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=END, pad_token=PAD,
                                  additional_special_tokens=[START], chat_template=CHAT_TEMPLATE,
                                  clean_up_tokenization_spaces=False)
    return tok
