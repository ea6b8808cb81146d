"""Torch ops and kernel launches per decode step per layer do not grow with the number of sessions.

Measured with the torch profiler on a random-weight model (``bench ops``): 1, 4 and 16 sessions of
every mode decode together; inside each layer's attention, the batched path makes the same number
of torch ops and one kernel call whatever the sessions, where the per-session path grows with them.
"""
import pytest
import torch

from app.engine.model_runner import ModelRunner
from bench.decode_ops import measure
from bench.random_model import TINY, random_model
from rocketkv_mt.native import hsa as native_hsa

SESSIONS = (1, 4, 16)


@pytest.fixture(scope="module")
def loaded():
    return random_model({**TINY, "num_hidden_layers": 3}, "cpu", torch.float32, max_positions=1024)


@pytest.mark.skipif(not native_hsa.supports(torch.zeros(1)), reason="no C compiler: no batched kernel on this CPU")
def test_ops_per_decode_step_do_not_grow_with_sessions(loaded):
    rows = [measure(ModelRunner(loaded, kernels="auto"), n, prompt=96, budget=32) for n in SESSIONS]
    alone = [measure(ModelRunner(loaded, kernels="torch"), n, prompt=96, budget=32) for n in SESSIONS[:2]]
    for row in rows + alone:
        print(f"sessions={row['sessions']:2d}: {row['ops_per_layer']:.0f} ops, {row['launches_per_layer']:.0f} kernel "
              f"calls per layer; {row['step_ops']} ops per step")
    ops = [row["ops_per_layer"] for row in rows]
    assert max(ops) == min(ops) and ops[0] <= 16
    assert all(row["launches_per_layer"] == 1 for row in rows)  # one native call per layer, all sessions
    steps = [row["step_ops"] for row in rows]
    assert max(steps) - min(steps) <= 2  # the model and the sampling around it: no per-session ops either
    # The per-session path, for contrast: its ops do grow with the sessions.
    assert alone[1]["ops_per_layer"] > 3 * alone[0]["ops_per_layer"]
