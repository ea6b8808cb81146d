"""Stage 1 keeps exactly the brute-force top-k per KV head (plus the window), in position order."""
import math

import pytest
import torch

from rocketkv_mt.stage1 import select_top, smooth, snapkv_keep_indices, window_scores


def brute_force_keep(q_win, keys, budget, kernel, scaling):
    hq, w, d = q_win.shape
    hkv, length, _ = keys.shape
    g = hq // hkv
    kept = []
    for h in range(hkv):
        scores = [0.0] * (length - w)
        for head in range(h * g, (h + 1) * g):
            for i in range(w):
                visible = length - w + i + 1
                logits = [float(q_win[head, i] @ keys[h, j]) * scaling for j in range(visible)]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                for j in range(length - w):
                    scores[j] += math.exp(logits[j] - m) / z
        pooled = [max(scores[max(0, j - kernel // 2): j + kernel // 2 + 1]) for j in range(length - w)]
        order = sorted(range(length - w), key=lambda j: (-pooled[j], j))[: budget - w]
        kept.append(sorted(order) + list(range(length - w, length)))
    return torch.tensor(kept)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_indices_equal_brute_force(group, seed):
    torch.manual_seed(seed)
    hkv, w, d, length, budget, kernel = 2, 8, 16, 120, 40, 7
    q = torch.randn(hkv * group, w, d, dtype=torch.float64)
    k = torch.randn(hkv, length, d, dtype=torch.float64)
    got = snapkv_keep_indices(q, k, budget, kernel, d ** -0.5)
    want = brute_force_keep(q, k, budget, kernel, d ** -0.5)
    assert got.shape == (hkv, budget)
    assert torch.equal(got, want)


def test_pool_63_and_window_32_defaults_on_longer_sequence():
    torch.manual_seed(3)
    hkv, g, w, d, length, budget = 3, 3, 32, 32, 400, 100
    q = torch.randn(hkv * g, w, d, dtype=torch.float64)
    k = torch.randn(hkv, length, d, dtype=torch.float64)
    got = snapkv_keep_indices(q, k, budget, 63, d ** -0.5)
    assert torch.equal(got, brute_force_keep(q, k, budget, 63, d ** -0.5))
    assert torch.all(got[:, 1:] > got[:, :-1])  # strictly ascending: order kept, no duplicates


def test_window_scores_are_probability_mass():
    torch.manual_seed(0)
    q = torch.randn(4, 5, 8)
    k = torch.randn(2, 30, 8)
    s = window_scores(q, k, 8 ** -0.5)
    assert s.shape == (2, 25)
    # Each of the 2 heads x 5 window queries spreads at most mass 1 over the prefix.
    assert torch.all(s.sum(-1) <= 10 + 1e-5) and torch.all(s >= 0)


def test_smooth_is_a_sliding_max():
    s = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 1.0]])
    assert smooth(s, 3).tolist() == [[5.0, 5.0, 5.0, 0.0, 1.0, 1.0]]


@pytest.mark.parametrize("seed", range(4))
def test_select_top_is_a_stable_descending_sort(seed):
    # Plateaus (as max pooling makes them), -inf for tokens that cannot be kept, and rows of mixed counts.
    torch.manual_seed(seed)
    scores = torch.randint(0, 6, (3, 200)).float()
    scores[torch.rand(3, 200) < 0.2] = float("-inf")
    if seed == 3:
        scores[1, [5, 90]] = float("nan")  # a NaN score (an overflow upstream) is ranked as a sort ranks it
    for keep in [0, 1, 37, 150]:
        want = torch.sort(torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep], dim=-1).values
        assert torch.equal(select_top(scores, keep), want), keep
