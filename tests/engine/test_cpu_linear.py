"""A float32 model's linear layers on CPU through oneDNN's packed product (``app.cpu_linear``): the
same products as ``nn.Linear`` to rounding, a row's result independent of the rows beside it, and the
loaded model packed unless told not to."""
import json

import pytest
import torch
from torch import nn

from app import cpu_linear
from app.cpu_linear import PackedLinear, pack_linears
from app.model_loader import load_model
from app.settings import Settings
from cli.main import build_parser

pytestmark = pytest.mark.skipif(not cpu_linear.available(torch.device("cpu"), torch.float32),
                                reason="no oneDNN packed product in this torch build")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_nn_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(2, 7, 576)
    with torch.inference_mode():
        want, got = linear(x), packed(x)
    assert got.shape == want.shape == (2, 7, 1536)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    # A session's logits in a batched step are then exactly the ones it gets alone.
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False))
    x = torch.randn(16, 576)
    with torch.inference_mode():
        batched = packed(x)
        for i in (0, 5, 15):
            assert torch.equal(packed(x[i : i + 1]), batched[i : i + 1])


def test_pack_linears_replaces_every_linear_and_keeps_the_outputs():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Sequential(nn.Linear(128, 64, bias=False)), nn.Linear(64, 10))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 3
        got = model(x)
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_loaded_model_is_packed_unless_told_not_to(loaded):
    assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
    assert type(loaded.model.lm_head) is PackedLinear
    assert not any(type(m) is nn.Linear for m in loaded.model.modules())
    plain = load_model(Settings(cpu_linear="torch"))
    assert type(plain.model.lm_head) is nn.Linear
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        a = loaded.model.model.embed_tokens(ids)
        torch.testing.assert_close(loaded.model.lm_head(a), plain.model.lm_head(a), rtol=1e-5, atol=1e-4)


def test_bench_linear_reports_both_products_per_shape_and_rows(tmp_path):
    out = tmp_path / "linear.json"
    args = build_parser().parse_args(["bench", "linear", "--shapes", "96x64,8x64", "--rows", "1,3", "--rounds", "1",
                                      "--calls", "5", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["out"], r["in"], r["rows"]) for r in rows] == [(96, 64, 1), (96, 64, 3), (8, 64, 1), (8, 64, 3)]
    assert all(r["us"]["torch"] > 0 and r["us"]["onednn"] > 0 and r["max_abs_diff"] < 1e-4 for r in rows)


def test_a_build_that_cannot_pack_keeps_nn_linear(monkeypatch):
    def fail(weight, rows):
        raise RuntimeError("no packing here")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fail)
    plain = load_model(Settings())
    assert not any(type(m) is PackedLinear for m in plain.model.modules())
    assert type(plain.model.lm_head) is nn.Linear
