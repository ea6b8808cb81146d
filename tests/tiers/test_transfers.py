"""The page reader's worker: reads run off the calling thread, results and errors come back intact."""
import threading

import pytest
import torch

from tiers.host.tier import ChunkUnavailable
from tiers.transfers import Transfers


def test_a_read_runs_on_the_worker_while_the_caller_goes_on():
    transfers = Transfers(torch.device("cpu"))
    started, release = threading.Event(), threading.Event()

    def read():
        started.set()
        assert release.wait(5)  # the caller computes meanwhile; the read finishes only when let go
        return torch.arange(6).view(2, 3), threading.current_thread().name

    try:
        fut = transfers.start(read)
        assert started.wait(5) and not fut.done()
        release.set()
        t, name = transfers.wait(fut)
        assert torch.equal(t, torch.arange(6).view(2, 3)) and name.startswith("rkv-pages")
    finally:
        transfers.close()


def test_a_failed_read_raises_its_own_error_in_the_waiting_thread():
    transfers = Transfers(torch.device("cpu"))

    def read():
        raise ChunkUnavailable("page p0 is in no tier that can be read now")

    try:
        with pytest.raises(ChunkUnavailable, match="p0"):
            transfers.wait(transfers.start(read))
    finally:
        transfers.close()


def test_every_tensor_a_read_hands_back_is_found_for_the_main_stream():
    # On CUDA each is recorded as in use on the main stream: a tensor missed there could be reused by
    # the allocator while the model still reads it.
    from dataclasses import dataclass

    from tiers.transfers import _tensors

    @dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor | None

    x, y, z, w = (torch.zeros(i + 1) for i in range(4))
    found = list(_tensors(((x, [y]), Pair(z, None), Pair(w, x), 3, "name")))
    assert [id(t) for t in found] == [id(x), id(y), id(z), id(w), id(x)]


def flushes_here() -> bool:
    """Whether this thread treats subnormal floats as zero now."""
    return float(torch.tensor([1e-39]) * 1.0) == 0.0


@pytest.mark.parametrize("flush", [True, False])
def test_the_worker_flushes_subnormal_floats_only_when_asked(flush):
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode")
    transfers = Transfers(torch.device("cpu"), flush_denormal=flush)
    try:
        assert transfers.wait(transfers.start(flushes_here)) is flush
        assert not flushes_here()  # a per-thread mode: the caller's own arithmetic is untouched
    finally:
        transfers.close()


def busy_with_a_long_job(transfers, result, then=lambda: None):
    """The worker runs a job until the returned event is set (then ``then()``; it returns ``result``)."""
    busy, release = threading.Event(), threading.Event()

    def long_job():
        busy.set()
        assert release.wait(5)
        then()
        return result

    job = transfers.start(long_job)
    assert busy.wait(5)
    return job, release


def test_a_job_the_worker_has_not_begun_runs_in_the_thread_that_waits_for_it():
    # The worker is busy with another session's long job: waiting for this read does not queue behind
    # it; the read runs here, once, and the worker skips it when it gets there.
    transfers, calls = Transfers(torch.device("cpu")), []

    def read():
        calls.append(threading.current_thread().name)
        return torch.ones(2)

    try:
        first, release = busy_with_a_long_job(transfers, "long")
        second = transfers.start(read)
        assert torch.equal(transfers.wait(second), torch.ones(2)) and not first.done()
        assert calls == [threading.current_thread().name]
        release.set()
        assert transfers.wait(first) == "long"
        transfers.wait(transfers.start(lambda: None))  # the worker has passed the read by now
        assert len(calls) == 1
    finally:
        transfers.close()


def test_a_forgotten_job_never_runs_if_not_begun_and_ends_first_if_begun():
    transfers, ran = Transfers(torch.device("cpu")), []
    try:
        first, release = busy_with_a_long_job(transfers, None, then=lambda: ran.append("long"))
        queued = transfers.start(lambda: ran.append("queued"))
        transfers.forget(queued)
        transfers.forget(queued)  # again: nothing to do
        assert queued.cancelled()
        threading.Timer(0.1, release.set).start()
        transfers.forget(first)  # begun: it ends before forget returns
        assert ran == ["long"]
        transfers.wait(transfers.start(lambda: None))
        assert ran == ["long"]
    finally:
        transfers.close()
