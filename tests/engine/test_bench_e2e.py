"""``bench e2e`` on tiny shapes on the CPU: every mode prefills, decodes in batches and takes a
second turn; the figures it reports are the caches' own."""
import argparse
import json
import weakref

import torch

from app.engine.layer_prefill import LayerPrefill

from bench import e2e


def args(tmp_path, **over):
    base = dict(contexts="300", batches="1,3", modes="full,rocketkv,tiered", shapes="tiny,num_hidden_layers=3",
                device="cpu", budget=32, max_new=32, steps=2, rounds=2, warmup=1, second_turn=8, rows=4096,
                json_out=str(tmp_path / "e2e.json"))
    return argparse.Namespace(**{**base, **over})


def test_e2e_reports_every_mode_and_batch(tmp_path):
    assert e2e.main(args(tmp_path)) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    (res,) = result["results"]
    assert res["context"] == 300 and result["shapes"]["num_hidden_layers"] == 3
    for batch in ("1", "3"):
        rows = res["decode"][batch]
        assert set(rows) == {"full", "rocketkv", "tiered"}
        for row in rows.values():
            assert row["ms_per_step"] > 0 and row["steps_timed"] == 4  # 2 steps x 2 rounds
        # Compressed modes hold less on the device than the whole context; copies hold as much as the original.
        assert rows["rocketkv"]["device_bytes"] < rows["full"]["device_bytes"]
        assert rows["tiered"]["device_bytes"] < rows["full"]["device_bytes"]
    assert res["decode"]["3"]["full"]["device_bytes"] > 2.9 * res["decode"]["1"]["full"]["device_bytes"]
    modes = res["modes"]
    assert modes["tiered"]["host_bytes"] > 0 and modes["full"]["host_bytes"] == 0
    assert all(m["ttft_second_turn_ms"] > 0 and m["prefill_s"] > 0 for m in modes.values())
    assert set(result["speedups"]) == {"rocketkv_over_full", "tiered_over_full"}


def test_contexts_read_k_as_1024():
    assert e2e.parse_tokens("32k, 128K,100") == [32768, 131072, 100]



def test_a_context_longer_than_rows_is_prefilled_layer_by_layer_like_a_whole_one(tmp_path, monkeypatch):
    """Longer than ``rows``, a context is fed layer by layer (as the engine feeds a long first prompt),
    every mode; its first token and the bytes a mode keeps equal a whole prefill's."""
    layered = []
    monkeypatch.setattr(e2e, "LayerPrefill", lambda *a, **k: layered.append(a[1]) or LayerPrefill(*a, **k))
    bench = e2e.Bench(args(tmp_path, modes=",".join(e2e.MODES)))
    for mode in e2e.MODES:
        fed = {}
        for rows in (64, 4096):
            bench.gen = torch.Generator().manual_seed(0)  # the same prompt each way
            before = len(layered)
            state = bench.prefill(mode, 300, rows)
            assert len(layered) - before == (rows < 300), (mode, rows)
            fed[rows] = (state["token"], state["cache"].device_bytes())
            state["cache"].release()
        assert fed[64] == fed[4096], mode


def test_a_context_fed_layer_by_layer_is_settled_before_it_is_copied(tmp_path):
    """A ``tiered`` context fed layer by layer leaves its last layer's selection to the page reader on a
    CPU; the bench settles it before it copies the cache for a decode batch, so the copy is whole."""
    bench = e2e.Bench(args(tmp_path, modes="tiered"))
    state = bench.prefill("tiered", 300, 64)
    cache = state["cache"]
    assert cache.decode_ready()
    copy = e2e._clone(cache)
    assert copy.device_bytes() == cache.device_bytes() and copy.kept_tokens() == cache.kept_tokens()
    for a, b in zip(cache.layers, copy.layers):
        assert torch.equal(a.positions, b.positions)
    cache.release()


def test_a_context_starts_with_nothing_the_one_before_held(tmp_path, monkeypatch):
    """A decode batch's copies point at themselves through their policies: they are collected before
    the next context prefills, not left to crowd it."""
    copies = []
    clone = e2e._clone
    monkeypatch.setattr(e2e, "_clone", lambda cache: copies.append(weakref.ref(c := clone(cache))) or c)
    bench = e2e.Bench(args(tmp_path, contexts="200,300", batches="3"))
    alive = []
    prefill = bench.prefill

    def counted(mode, context, rows=None):
        if context == 300 and not alive:
            alive.append(sum(ref() is not None for ref in copies))
        return prefill(mode, context, rows)

    monkeypatch.setattr(bench, "prefill", counted)
    bench.run()
    assert len(copies) >= 2 * 3 * 2 and alive == [0]
