"""take_rows: the same rows as torch.gather along the token axis, for the strided views caches hand it."""
import pytest
import torch

from rocketkv_mt.take_rows import take_rows


def gathered(x, index):
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


@pytest.mark.parametrize("layout", ["contiguous", "store_view", "offset_view", "heads_last"])
def test_rows_equal_gather(layout):
    g = torch.Generator().manual_seed(3)
    h, t, d = 3, 37, 8
    if layout == "contiguous":
        x = torch.randn(h, t, d, generator=g)
    elif layout == "store_view":  # a layer store's kept tokens: a prefix of a larger buffer
        x = torch.randn(h, t + 20, d, generator=g)[:, :t]
    elif layout == "offset_view":  # starts inside the buffer and ends at its last row
        x = torch.randn(h, t + 5, d, generator=g)[:, 5:]
    else:  # (T, H, d) storage seen as (H, T, d): a head stride smaller than a row's
        x = torch.randn(t, h, d, generator=g).transpose(0, 1)
    index = torch.randint(0, t, (h, 50), generator=g)
    index[1, :3] = torch.tensor([0, t - 1, 0])
    out = take_rows(x, index)
    assert torch.equal(out, gathered(x, index))
    out[0, 0, 0] = 1e9  # a copy, never a view of x
    assert not (x == 1e9).any()


def test_out_of_range_rows_raise_instead_of_reading_another_head():
    x = torch.randn(2, 10, 4)
    for bad in (10, -1):
        index = torch.zeros(2, 3, dtype=torch.long)
        index[0, 1] = bad
        with pytest.raises(IndexError):
            take_rows(x, index)
    with pytest.raises(ValueError):
        take_rows(x, torch.zeros(3, 1, dtype=torch.long))


def test_empty_index_and_integer_rows():
    x = torch.arange(2 * 6 * 3, dtype=torch.int32).view(2, 6, 3)
    assert take_rows(x, torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, 3)
    index = torch.tensor([[5, 0], [2, 2]])
    assert torch.equal(take_rows(x, index), gathered(x, index))
