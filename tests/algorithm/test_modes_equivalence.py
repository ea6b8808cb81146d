"""Compressed modes are exact when nothing needs compressing, and bounded when something does."""
import pytest
import torch

from bench.haystack import filler_text
from rocketkv_mt.cache import make_cache
from rocketkv_mt.config import RocketKVConfig

pytestmark = pytest.mark.slow


@pytest.fixture
def runner(make_engine):
    return make_engine().runner


def prompt_ids(tokenizer, n_words: int) -> list[int]:
    text = filler_text(n_words, seed=1) + " What is the grass like?"
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def run_mode(runner, mode, budget, ids, decode_ids):
    cache = make_cache(mode, runner.spec, RocketKVConfig(token_budget=budget))
    logits = [runner.forward(ids, cache, prefill=True, max_new=len(decode_ids) + 1)]
    for tok in decode_ids:
        logits.append(runner.forward([tok], cache, prefill=False))
    return torch.stack(logits), cache


def test_budget_above_context_gives_full_logits(runner, loaded):
    ids = prompt_ids(loaded.tokenizer, 250)
    assert 250 < len(ids) < 1000
    full, _ = run_mode(runner, "full", 4096, ids, [])
    greedy = []
    cache = make_cache("full", runner.spec)
    logit = runner.forward(ids, cache, prefill=True, max_new=12)
    for _ in range(12):
        greedy.append(int(logit.argmax()))
        logit = runner.forward([greedy[-1]], cache, prefill=False)
    ref, _ = run_mode(runner, "full", 4096, ids, greedy)
    for mode in ("snapkv", "rocketkv"):
        got, c = run_mode(runner, mode, 4096, ids, greedy)
        assert c.kept_tokens() == len(ids) + len(greedy)  # nothing evicted
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), mode


def test_small_budget_keeps_prompt_budget_per_head_and_true_positions(runner, loaded):
    ids = prompt_ids(loaded.tokenizer, 900)
    max_new = 8
    split = RocketKVConfig(token_budget=128).split(len(ids) + max_new + 1, max_new + 1, runner.spec.head_dim)
    assert split.prompt_budget < len(ids)
    full, full_cache = run_mode(runner, "full", 128, ids, list(range(100, 100 + max_new)))
    for mode in ("snapkv", "rocketkv"):
        got, cache = run_mode(runner, mode, 128, ids, list(range(100, 100 + max_new)))
        assert cache.kept_tokens() == split.prompt_budget + max_new
        assert cache.history_len == full_cache.history_len == len(ids) + max_new
        for layer in cache.layers:
            pos = layer.positions
            assert torch.all(pos[:, 1:] > pos[:, :-1])  # position order kept per head
            # The observation window and every decode token are kept, at their true positions.
            tail = torch.arange(len(ids) - split.window_size, len(ids) + max_new)
            assert torch.equal(pos[0, -len(tail):], tail)
        kv_bytes = sum(layer.nbytes() for layer in cache.layers)
        assert kv_bytes * cache.history_len == full_cache.device_bytes() * cache.kept_tokens()
        assert kv_bytes <= cache.device_bytes() < full_cache.device_bytes()
        # Compression changes the numbers but the prediction at the end of the prompt survives.
        assert int(got[0].argmax()) == int(full[0].argmax())
