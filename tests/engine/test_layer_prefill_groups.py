"""How ``LayerPrefill`` sizes its groups: whole ``rows`` groups with nobody waiting, groups sized on a
row's running cost to end near a deadline while others wait, and every layer fed in order whatever
the sizes; a model whose forward is not Llama's layout is not fed layer by layer."""
import time

import pytest
import torch

from app.engine.layer_prefill import MIN_ROWS, LayerPrefill
from app.engine.model_runner import ModelRunner
from bench.random_model import parse_shapes, random_model
from rocketkv_mt.cache import make_cache
from rocketkv_mt.config import RocketKVConfig


@pytest.fixture(scope="module")
def tiny():
    return random_model(parse_shapes("tiny,num_hidden_layers=3"), "cpu", torch.float32, 2048)


def _plan(tiny, n: int, rows: int) -> LayerPrefill:
    runner = ModelRunner(tiny)
    cache = make_cache("snapkv", runner.spec, RocketKVConfig(token_budget=32))
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    return LayerPrefill(tiny.model, cache, ids, 4, rows)


def test_alone_every_group_is_whole(tiny):
    plan = _plan(tiny, 300, 64)
    starts, fed = [], []
    while not plan.done:
        starts.append((plan.layer, plan.offset))
        fed.append(plan.advance(deadline=time.perf_counter() - 1))  # a deadline passed: one group a call
    assert starts[:6] == [(0, 0), (0, 64), (0, 128), (0, 192), (0, 256), (1, 0)]
    assert fed == [64, 64, 64, 64, 44] * 3  # every layer in whole groups, in order
    assert plan.cache.history_len == 0  # the prefill ends only with ``finish``
    plan.finish()
    assert plan.cache.history_len == 300


def test_beside_others_groups_fit_the_deadline(tiny):
    plan = _plan(tiny, 400, 256)
    first = plan.advance(deadline=time.perf_counter() - 1, fit=True)
    assert first == MIN_ROWS  # the cost of a row is not known yet
    assert plan.row_s and plan.row_s > 0
    # A deadline a few rows away: a group of about that many rows, not ``rows``.
    fed = plan.advance(deadline=time.perf_counter() + 5 * plan.row_s, fit=True)
    assert MIN_ROWS <= fed < 256
    while not plan.done:
        plan.advance(deadline=None)
    assert plan.layer == 3 and plan.finish().shape == (256,)


def test_only_llama_layout_models_are_fed_layer_by_layer(tiny):
    runner = ModelRunner(tiny)
    assert tiny.model.config.model_type == "llama" and runner.layerable
    tiny.model.config.model_type = "gemma2"  # an embedding scale and logit soft-capping: not this layout
    try:
        assert not ModelRunner(tiny).layerable
    finally:
        tiny.model.config.model_type = "llama"
