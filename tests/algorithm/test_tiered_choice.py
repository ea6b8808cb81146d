"""A digest turn's Stage-1 choice runs on the page reader while the model thread goes on with the next
layer; the selection, the outputs and the cold tier come out exactly as when it runs inline."""
import threading

import torch

import rocketkv_mt.cache.prefill.tiered.choice as choice
from cache_drive import SPEC, three_turns
from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.host.tier import HostTier
from tiers.transfers import Transfers

# Never read whole: every layer takes the digest path, whose choice may be deferred.
POLICY = TierPolicy(page_tokens=8, read_whole=0)


def test_the_choice_on_the_page_reader_equals_the_choice_inline(monkeypatch):
    threads = []
    choose = choice.choose_over_parts

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return choose(*args, **kwargs)

    monkeypatch.setattr(choice, "choose_over_parts", recorded)
    rocket = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)
    transfers = Transfers(torch.device("cpu"))
    try:
        runs = []
        for reader in (None, transfers):
            tiers = TierContext(HostTier(64 << 20, None), f"choice-{reader is not None}", POLICY, transfers=reader)
            cache = make_cache("tiered", SPEC, rocket, tiers=tiers)
            threads.clear()
            runs.append((three_turns(cache, seed=3), list(threads)))
            assert cache.cold_tokens() > 0
        (inline, inline_threads), (deferred, deferred_threads) = runs
        # Inline every choice runs on the calling thread; with a reader, the digest turns' choices ran there.
        assert inline_threads and not any(name.startswith("rkv-pages") for name in inline_threads)
        assert sum(name.startswith("rkv-pages") for name in deferred_threads) >= SPEC.num_layers
        for a, b in zip(inline[0], deferred[0]):
            assert torch.equal(a, b)
        for a, b in zip(inline[1], deferred[1]):
            assert torch.equal(a, b)
    finally:
        transfers.close()
