"""Re-selection over a scattered history picks exactly what Stage 1 picks on the ordered history."""
import pytest
import torch

from rocketkv_mt.attention_ops import dense_attention, positional_attention
from rocketkv_mt.reselect import reselect
from rocketkv_mt.stage1 import snapkv_keep_indices


@pytest.mark.parametrize("group", [1, 3])
def test_reselect_on_shuffled_slots_equals_stage1(group):
    torch.manual_seed(group)
    hkv, w, d, length, budget = 2, 8, 16, 150, 50
    q = torch.randn(hkv * group, w, d, dtype=torch.float64)
    k = torch.randn(hkv, length, d, dtype=torch.float64)
    want = snapkv_keep_indices(q, k, budget, 7, d ** -0.5)
    # Scatter the history over slots in a per-head random order, with dead slots in between.
    t = length + 40
    keys = torch.zeros(hkv, t, d, dtype=torch.float64)
    pos = torch.full((hkv, t), 7, dtype=torch.long)  # dead slots carry a bogus, duplicate position
    alive = torch.zeros(hkv, t, dtype=torch.bool)
    for h in range(hkv):
        slots = torch.randperm(t)[:length]
        keys[h, slots] = k[h]
        pos[h, slots] = torch.arange(length)
        alive[h, slots] = True
    slots, positions, _ = reselect(q, keys, pos, alive, length, budget, 7, d ** -0.5)
    assert torch.equal(positions, want)
    assert torch.equal(torch.gather(pos, 1, slots), want)
    assert torch.all(torch.gather(alive, 1, slots))


def test_positional_attention_equals_causal_dense_on_ordered_slots():
    torch.manual_seed(0)
    hq, hkv, n, length, d = 6, 2, 5, 30, 8
    q = torch.randn(hq, n, d)
    k, v = torch.randn(hkv, length, d), torch.randn(hkv, length, d)
    ref = dense_attention(q, k, v, d ** -0.5)
    perm = torch.randperm(length)
    got = positional_attention(
        q, torch.arange(length - n, length), k[:, perm], v[:, perm], torch.arange(length)[perm].expand(hkv, -1), None, d ** -0.5
    )
    assert torch.allclose(got, ref, atol=1e-5)
