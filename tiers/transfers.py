"""Moving cold pages towards the device off the model's critical path.

One worker thread per engine does a read's host work (the gather from the pool, Redis round trips)
while the model thread goes on computing; on CUDA the worker also issues the host-to-device copies
(pinned source, ``non_blocking``) on a side stream, so they overlap the kernels of the main stream.
``wait`` hands the result over: the main stream waits for the side stream's copies, and the tensors
are recorded as in use there so the allocator does not reuse them early.

The host tier guards its index with a lock it never holds across a Redis call (``tiers.host``): the
worker may write one session's demoted pages while the model thread reads another session's.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


class Transfers:
    def __init__(self, device: torch.device, flush_denormal: bool = False):
        """``flush_denormal``: the worker treats subnormal floats as zero, as the model thread may
        (a per-thread CPU mode: the sketches it scores hold softmax weights)."""
        self.device = device
        init = (lambda: torch.set_flush_denormal(True)) if flush_denormal else None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rkv-pages", initializer=init)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def pays(self, overlapped_work: bool) -> bool:
        """Whether a read should go to the worker: on CUDA always (its copies run beside the kernels
        already queued); on a CPU only when the model thread has work to do meanwhile. With none (a
        short turn, whose rows are all window rows), handing the read over and back costs more than
        it saves: a 4k-token history's 21-token turn took 211 ms with the worker against 149 ms inline
        (bundled model, 2 threads)."""
        return self._stream is not None or overlapped_work

    def on_device_stream(self) -> bool:
        """Whether handed-over work runs on a CUDA side stream (else on a CPU core of its own)."""
        return self._stream is not None

    def start(self, fn: Callable[[], T], reads_device: bool = False) -> concurrent.futures.Future:
        """Run ``fn`` (a read that returns tensors, alone or in tuples, lists and dataclasses) on the worker
        thread. ``reads_device``: ``fn`` reads tensors the model thread computed, so on CUDA the side
        stream first waits for what the current stream has queued."""
        ready = None
        if reads_device and self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self._worker.submit(self._on_side_stream, fn, ready)

    def _on_side_stream(self, fn: Callable[[], T], ready: "torch.cuda.Event | None" = None) -> T:
        if self._stream is None:
            with torch.inference_mode():
                return fn()
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            return fn()

    def wait(self, fut: concurrent.futures.Future) -> T:
        """The read's result, safe to use on the current stream (re-raises the read's error)."""
        out = fut.result()
        if self._stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self._stream)
            for t in _tensors(out):
                if t.is_cuda:
                    t.record_stream(main)
        return out

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _tensors(out) -> Iterator[torch.Tensor]:
    """Every tensor a read handed back: itself, or inside its tuples, lists and dataclasses."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            yield from _tensors(getattr(out, f.name))
