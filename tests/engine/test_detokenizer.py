"""The detokenizer streams exactly what decoding the whole reply at every token streamed, from a
window of the last ids: the same deltas, the same held-back partial characters and stop strings."""
import random

import pytest

from app.engine.detokenizer import Detokenizer


class CountingTokenizer:
    """The bundled tokenizer, counting the ids each decode is given."""

    def __init__(self, tok):
        self.tok, self.decoded_ids = tok, 0
        self.clean_up_tokenization_spaces = getattr(tok, "clean_up_tokenization_spaces", False)

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, **kwargs)


def stream(tok, ids, stop=(), whole=False):
    """(each add's delta and the flush, the final text) as a turn streams them."""
    d = Detokenizer(tok, stop)
    d._whole = d._whole or whole  # the reference: every id decoded again at every token
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        if d.stopped:
            break
    deltas.append(d.flush())
    return deltas, d.text


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded.tokenizer


def test_text_with_split_characters_streams_as_the_whole_decode(tok):
    text = "Ünïcödé — 日本語のテキスト 🚀🔥 and code: def f(x): return x ** 2\n\n" * 30
    ids = tok.encode(text, add_special_tokens=False)
    deltas, final = stream(tok, ids)
    assert (deltas, final) == stream(tok, ids, whole=True)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_and_stop_strings_stream_as_the_whole_decode(tok, seed):
    rng = random.Random(seed)
    for trial in range(60):
        n = rng.randint(1, 60)
        # Byte-level tokens split characters (and make invalid ones); special tokens are skipped.
        high = 300 if trial % 2 else len(tok)
        ids = [rng.randrange(high) for _ in range(n)]
        stop = rng.choice([(), ("the",), ("\n\n", "ab"), ("\ufffd",)])
        assert stream(tok, ids, stop) == stream(tok, ids, stop, whole=True), (ids, stop)


def test_a_token_decodes_a_window_not_the_whole_reply(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    counting = CountingTokenizer(tok)
    deltas, _ = stream(counting, ids)
    assert "".join(deltas) == tok.decode(ids)
    # Two short decodes a token; decoding the whole reply each time would be ~len(ids)^2 / 2 ids.
    assert counting.decoded_ids < 8 * len(ids) < len(ids) ** 2 // 2


def test_a_tokenizer_that_cleans_spaces_decodes_the_whole_reply(tok):
    counting = CountingTokenizer(tok)
    counting.clean_up_tokenization_spaces = True
    ids = tok.encode("Hello , world . " * 20, add_special_tokens=False)
    stream(counting, ids)
    assert counting.decoded_ids == len(ids) * (len(ids) + 1) // 2
