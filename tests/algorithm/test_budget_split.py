import pytest

from rocketkv_mt.config import RocketKVConfig


def test_paper_split_128k_budget_256():
    s = RocketKVConfig(token_budget=256).split(seq_len=131072, max_new=30, head_dim=128)
    assert (s.prompt_budget, s.page_size, s.topr, s.topk) == (1266, 3, 76, 128)
    assert s.window_size == 32 and s.kernel_size == 63
    assert s.topk_pages == 43


def test_explicit_values_override_the_split():
    cfg = RocketKVConfig(token_budget=256, prompt_budget=2048, page_size=4, topr=128, topk=256)
    s = cfg.split(seq_len=131072, max_new=30, head_dim=128)
    assert (s.prompt_budget, s.page_size, s.topr, s.topk) == (2048, 4, 128, 256)


@pytest.mark.parametrize("seq_len", [600, 2_000, 8_040, 32_000, 131_072])
@pytest.mark.parametrize("budget", [256, 512, 1024])
def test_split_is_consistent(seq_len, budget):
    s = RocketKVConfig(token_budget=budget).split(seq_len=seq_len, max_new=40, head_dim=64)
    assert s.window_size < s.prompt_budget <= seq_len - 40
    assert 1 <= s.page_size and 1 <= s.topr <= 64
    assert abs(s.topk - min(budget, seq_len) / 2) <= 1
    # A longer context never gets a smaller compression ratio.
    longer = RocketKVConfig(token_budget=budget).split(seq_len=seq_len * 2, max_new=40, head_dim=64)
    assert longer.prompt_budget / (seq_len * 2) <= s.prompt_budget / seq_len + 1e-9


def test_unknown_fields_are_rejected():
    with pytest.raises(ValueError):
        RocketKVConfig(token_budget=256, pages=3)
