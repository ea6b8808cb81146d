"""Key sketches (``tiers.cold.key_sketch``): a few bits per channel within the page's bounds."""
import pytest
import torch

from tiers.cold import key_sketch


@pytest.mark.parametrize("bits", [2, 4])
def test_a_sketched_key_is_within_half_a_step_of_the_key(bits):
    gen = torch.Generator().manual_seed(bits)
    m, p, d = 5, 8, 16
    keys = torch.randn(m, p, d, generator=gen) * 3
    keys[1, :, 3] = 0.25  # a channel whose page range is a single value
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    codes = key_sketch.encode(keys, kmin, kmax, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (m, p, d * bits // 8)
    assert key_sketch.nbytes_per_token(d, bits) == codes.shape[-1]
    est = key_sketch.decode(codes, kmin, kmax, bits)
    step = (kmax - kmin).unsqueeze(1) / (1 << bits)
    assert est.shape == keys.shape
    assert ((est - keys).abs() <= step / 2 + 1e-5).all()
    assert torch.equal(est[1, :, 3], torch.full((p,), 0.25))
    # Every code is used as a level of its own: the extremes land in the first and the last step.
    lo = key_sketch.decode(key_sketch.encode(kmin.unsqueeze(1), kmin, kmax, bits), kmin, kmax, bits)
    hi = key_sketch.decode(key_sketch.encode(kmax.unsqueeze(1), kmin, kmax, bits), kmin, kmax, bits)
    assert torch.allclose(lo[:, 0], kmin + step[:, 0] / 2) and torch.allclose(hi[:, 0], kmax - step[:, 0] / 2)


def test_decoding_takes_any_leading_shape():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 4, 8, generator=gen)  # (heads, pages, P, d)
    kmin, kmax = keys.amin(dim=2), keys.amax(dim=2)
    codes = key_sketch.encode(keys.view(6, 4, 8), kmin.view(6, 8), kmax.view(6, 8), 2).view(2, 3, 4, 2)
    flat = key_sketch.decode(codes.view(6, 4, 2), kmin.view(6, 8), kmax.view(6, 8), 2)
    assert torch.equal(key_sketch.decode(codes, kmin, kmax, 2), flat.view(2, 3, 4, 8))
    # Decoded to a narrower dtype: the float32 estimate, rounded once (not computed in bfloat16).
    half = key_sketch.decode(codes, kmin, kmax, 2, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, flat.view(2, 3, 4, 8).bfloat16())


@pytest.mark.parametrize("bits, d", [(3, 16), (1, 16), (4, 7), (2, 6)])
def test_a_sketch_it_cannot_pack_is_refused(bits, d):
    with pytest.raises(ValueError):
        key_sketch.codes_per_byte(bits, d)
