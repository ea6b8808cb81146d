"""Moving cold pages towards the device off the model's critical path.

One worker thread per engine does a read's host work (the gather from the pool, Redis round trips) while
the model thread computes; on CUDA it also issues the host-to-device copies (pinned source,
``non_blocking``) on a side stream, so they overlap the main stream's kernels. ``wait`` hands the result
over: the main stream waits for the side stream's copies, and the tensors are recorded as in use there so
the allocator does not reuse them early. A job the worker has not begun when it is waited for (queued
behind other work, maybe another session's) runs in the waiting thread: a wait never queues behind work
it did not ask for. The host tier lets the worker and the model thread use it at once (``tiers.host.tier``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
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
        """Whether a read should go to the worker: on CUDA always (its copies run beside the queued kernels);
        on a CPU only if the model thread has work meanwhile, else the hand-over costs more than it saves: a
        4k-token history's 21-token turn (all window rows): 211 ms with it, 149 ms inline (bundled model, 2 threads)."""
        return self._stream is not None or overlapped_work

    def on_device_stream(self) -> bool:
        """Whether handed-over work runs on a CUDA side stream (else on a CPU core of its own)."""
        return self._stream is not None

    def start(self, fn: Callable[[], T], reads_device: bool = False) -> "_Job":
        """Run ``fn`` (a read returning tensors, alone or in tuples, lists and dataclasses) on the worker,
        unless ``wait`` asks for it first. ``reads_device``: ``fn`` reads tensors the model thread
        computed, so on CUDA the side stream first waits for what the current stream has queued."""
        ready = None
        if reads_device and self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        job = _Job(fn, self._stream is not None)
        self._worker.submit(self._on_side_stream, job, ready)
        return job

    def _on_side_stream(self, job: "_Job", ready: "torch.cuda.Event | None" = None) -> None:
        try:
            if self._stream is None:
                with torch.inference_mode():
                    return job.run()
            with torch.inference_mode(), torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                return job.run()
        except BaseException as exc:  # noqa: BLE001 - failed before the job ran: its waiters get the error
            job.fail(exc)

    def wait(self, fut: "_Job") -> T:
        """A job's result, safe on the current stream (re-raises its error); run here if the worker has not begun it."""
        with torch.inference_mode():
            fut.run()
        out = fut.result()
        if self._stream is not None:
            # The job's stream (the side stream, or another thread's current one) may still be writing its result.
            here = torch.cuda.current_stream(self.device)
            here.wait_event(fut.finished)
            for t in _tensors(out):
                if t.is_cuda:
                    t.record_stream(here)
        return out

    def forget(self, fut: "_Job") -> None:
        """A job whose result is no longer wanted (a turn that stopped, a cache let go): one not begun
        never runs; one begun ends first (its error dropped)."""
        if fut.cancelled() or fut.discard():
            return
        if fut.exception() is None:
            self.wait(fut)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class _Job(concurrent.futures.Future):
    """The future of one call of ``fn``, made by whichever thread claims it first: the worker when it
    gets to it, or a thread that waits for it before then (``run``); or never (``discard``)."""

    def __init__(self, fn: Callable[[], T], cuda: bool = False):
        super().__init__()
        self._fn = fn
        self._cuda = cuda  # once ``fn`` returns, record where the current CUDA stream is (``finished``)
        self.finished: "torch.cuda.Event | None" = None
        self._claim = threading.Lock()

    def run(self) -> None:
        """Call ``fn`` into this future, unless another thread claimed it first (a no-op then)."""
        if not self._claim.acquire(blocking=False):
            return
        fn, self._fn = self._fn, None  # what it read is the result's now, not held by the job
        self.set_running_or_notify_cancel()
        try:
            out = fn()
            if self._cuda:
                self.finished = torch.cuda.Event()
                self.finished.record()
            self.set_result(out)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.set_exception(exc)

    def fail(self, exc: BaseException) -> None:
        """End it with ``exc`` if no thread has claimed it."""
        if self._claim.acquire(blocking=False):
            self._fn = None
            self.set_running_or_notify_cancel()
            self.set_exception(exc)

    def discard(self) -> bool:
        """Cancel it if no thread has claimed it (True: it never runs)."""
        if not self._claim.acquire(blocking=False):
            return False
        self._fn = None
        return self.cancel()


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
