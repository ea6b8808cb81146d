"""The page reader's worker: reads run off the calling thread, results and errors come back intact."""
import threading

import pytest
import torch

from tiers.host import ChunkUnavailable
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
