"""Memory of a wave: bytes of activations saved for backward, and on a GPU the device's memory.

``SavedActivationMeter`` works on any device: a ``saved_tensors_hooks`` pack hook counts each
tensor autograd keeps for backward, and the handle it returns uncounts it when autograd lets go of
it (during backward). Storage shared by several saved tensors counts once; parameters saved for
backward (a Linear's weight) are not activations and do not count.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import torch


class _Saved:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivationMeter, key: int | None):
        self.tensor = tensor
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        # May run inside a garbage collection on any thread, even one holding the meter's lock:
        # _release never blocks.
        if self.key is not None:
            self.meter._release(self.key)


class SavedActivationMeter:
    """Live and peak saved-activation bytes of one wave, with an optional (time, bytes) trace.

    The trace uses wall-clock time so traces of waves in different processes share one clock."""

    def __init__(self, parameters: Iterable[torch.Tensor] = (), clock=time.time):
        self._parameters = list(parameters)
        self._exclude: set[int] = set()
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._lock = threading.Lock()
        self._freed: deque[int] = deque()  # releases not yet counted (deque appends are atomic)
        self.clock = clock
        self.current = 0
        self.peak = 0
        self.tracing = False
        self.trace: list[tuple[float, int]] = []
        self._watch: tuple[int, object] | None = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        # the parameters' memory, found anew each pass: a wave's parameters move into memory
        # the shards write (worker/wave_memory.py) after the meter is made
        self._exclude = {p.untyped_storage().data_ptr() for p in self._parameters}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return _Saved(tensor, self, None)
        with self._lock:
            self._count_freed()
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [1, storage.nbytes()]
                self._change(storage.nbytes())
            else:
                entry[0] += 1
        self._drain()
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        """Count a saved tensor autograd let go of. Never waits for the lock: a garbage
        collection inside ``_pack`` (which holds it) would otherwise deadlock the wave. The
        release is queued and counted by whoever holds the lock next, at the latest when the
        holder lets go (every holder drains the queue after releasing)."""
        self._freed.append(key)
        self._drain()

    def _drain(self) -> None:
        # Anyone who queued a release while another thread held the lock did so before that
        # thread's release, so the holder's drain after it finds the entry.
        while self._freed and self._lock.acquire(blocking=False):
            try:
                self._count_freed()
            finally:
                self._lock.release()

    def _count_freed(self) -> None:
        """Under the lock: count every queued release."""
        while self._freed:
            key = self._freed.popleft()
            entry = self._live.get(key)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self._change(-entry[1])

    def when_below(self, threshold: int, callback) -> None:
        """Call ``callback`` once, as soon as live bytes drop to ``threshold`` or below (from
        whichever thread frees them: the backward pass frees saved tensors as it goes)."""
        with self._lock:
            self._count_freed()
            if self.current <= threshold:
                fire = True
            else:
                self._watch = (threshold, callback)
                fire = False
        self._drain()
        if fire:
            callback()

    def cancel_watch(self) -> None:
        with self._lock:
            self._count_freed()
            self._watch = None
        self._drain()

    def _change(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)
        if self.tracing:
            self.trace.append((self.clock(), self.current))
        if self._watch is not None and self.current <= self._watch[0]:
            callback, self._watch = self._watch[1], None
            callback()  # under the meter's lock: the callback must not use the meter


def cap_cuda_memory(device: torch.device, gib: float) -> None:
    """Cap this process's CUDA caching allocator at ``gib`` GiB (0: no cap), so that a large card
    behaves like a smaller one: allocations beyond it raise out-of-memory as on that card."""
    if gib <= 0 or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * (1 << 30) / total), index)


def device_memory(device: torch.device) -> dict[str, int]:
    """On a GPU: what the caching allocator holds, what NVML says the device uses, and its
    utilisation (percent of the last sample period a kernel ran)."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    out = {
        "cuda_allocated": torch.cuda.memory_allocated(index),
        "cuda_peak_allocated": torch.cuda.max_memory_allocated(index),
        "cuda_reserved": torch.cuda.memory_reserved(index),
    }
    nvml = _nvml(index)
    if nvml is not None:
        out.update(nvml)
    return out


_nvml_ready: bool | None = None


def _nvml(index: int) -> dict[str, int] | None:
    global _nvml_ready
    try:
        import pynvml
    except ImportError:
        return None
    if _nvml_ready is None:
        try:
            pynvml.nvmlInit()
            _nvml_ready = True
        except pynvml.NVMLError:
            _nvml_ready = False
    if not _nvml_ready:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {
            "nvml_used": int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
            "gpu_util": int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        }
    except pynvml.NVMLError:
        return None
