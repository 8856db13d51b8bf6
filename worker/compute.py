"""Where a worker's torch computation runs: on one thread for all its waves, where a CPU device
gives each of them more than one core.

libgomp, the OpenMP runtime of PyTorch's CPU builds, gives every thread that opens a parallel
region a pool of helper threads of its own. Once a process holds more of them than it has cores,
libgomp no longer lets idle helpers spin between regions (a "throttled" spin of 100 turns): they
sleep, and every operation of a forward pays to wake them. Two waves computing on all cores in
threads of their own hit that, and so does one wave beside a main thread that computed first:
the narrow ResNet's forward and backward took 1.3-1.4x longer than the same on the main thread
(``benchmarks/bench_compute.py``). So where the waves share more than one core, their forwards,
backwards and tests run one at a time on the daemon's own thread, on every core, while each
wave's thread keeps one torch thread for the rest (its batches, its copies to and from the
shards), which then overlaps the other wave's computation. With one core per wave (the narrow
layout) each wave computes on its own thread, side by side, and on a GPU each wave launches its
own kernels.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class ComputeStopped(RuntimeError):
    """The thread that ran the waves' computation stopped serving it."""


class InlineCompute:
    """Each wave computes on its own thread."""

    shared = False

    def __call__(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return fn(*args, **kwargs)

    def enter_wave_thread(self) -> None:
        pass

    def serve(self, done: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Wait until ``done()`` (the waves compute by themselves)."""
        while not done():
            time.sleep(poll_s)


class SharedCompute:
    """Runs the waves' calls one at a time on the thread that made it, while that thread is in
    ``serve``; that thread keeps its ``threads`` torch threads, and each wave's thread one."""

    shared = True

    def __init__(self, threads: int):
        import torch

        self.threads = threads
        self._owner = threading.get_ident()
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._stopped = False
        # torch sets a thread's count from the process-wide one on its first parallel operation:
        # read it once here, so that the waves' setting theirs later does not change this one's
        torch.get_num_threads()
        torch.set_num_threads(threads)

    def __call__(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` on the serving thread; its result, or its exception raised
        here. Called from the serving thread itself, it runs at once."""
        if threading.get_ident() == self._owner:
            return fn(*args, **kwargs)
        call = _Call(fn, args, kwargs)
        self._calls.put(call)
        while not call.done.wait(1.0):
            if self._stopped and not call.started:
                raise ComputeStopped("the worker stopped before this wave's computation ran")
        if call.error is not None:
            raise call.error
        return call.result

    def enter_wave_thread(self) -> None:
        """Keep the calling thread to one torch thread (no pool of its own), for good (read
        first, then set, as in ``__init__``)."""
        import torch

        if threading.get_ident() == self._owner:
            return  # the computing thread keeps its threads
        torch.get_num_threads()
        torch.set_num_threads(1)

    def serve(self, done: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Run the waves' calls until ``done()``; a call queued after that fails with
        ``ComputeStopped``."""
        try:
            while not done():
                try:
                    call = self._calls.get(timeout=poll_s)
                except queue.Empty:
                    continue
                call.run()
        finally:
            self._stopped = True
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                call.fail(ComputeStopped("the worker stopped before this computation ran"))


class _Call:
    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.started = False
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started = True
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except Exception as e:  # the caller's to handle, as if it had run there
            self.error = e
        except BaseException as e:  # the serving thread is being stopped: the caller too
            self.error = e
            raise
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()
