"""The staging ring: aligned host buffers between storage and the KV cache.

One aligned allocation (registered with the IO queue once) cut into equal slots. A slot is
handed out to a load or a store and comes back only when both its IO and the kernel or copy
that consumes it have finished: on CUDA the owner attaches an event to the release and the
next acquirer waits on it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class StagingSlot:
    index: int
    offset: int  # byte offset in the ring's buffer
    host: torch.Tensor  # uint8 view of slot_bytes
    device: torch.Tensor | None  # device twin on CUDA, else None
    busy_until: object = None  # CUDA event that must complete before reuse


class StagingRing:
    def __init__(self, buffer: torch.Tensor, slot_bytes: int, device: torch.device | None = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("staging buffer: expected a 1-D uint8 tensor")
        n = buffer.numel() // slot_bytes
        if n < 2:
            raise ValueError(f"staging: {buffer.numel()} B holds fewer than 2 slots of {slot_bytes} B")
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        dev_buf = None
        if device is not None and device.type == "cuda":
            dev_buf = torch.empty(n * slot_bytes, dtype=torch.uint8, device=device)
        self.slots = [
            StagingSlot(i, i * slot_bytes, buffer[i * slot_bytes:(i + 1) * slot_bytes],
                        None if dev_buf is None else dev_buf[i * slot_bytes:(i + 1) * slot_bytes])
            for i in range(n)
        ]
        self._free = list(range(n - 1, -1, -1))
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def try_acquire(self) -> StagingSlot | None:
        with self._lock:
            if not self._free:
                return None
            slot = self.slots[self._free.pop()]
        if slot.busy_until is not None:
            slot.busy_until.synchronize()  # the consumer of its last contents (already enqueued) finishes
            slot.busy_until = None
        return slot

    def acquire(self, timeout: float | None = None) -> StagingSlot:
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._free), timeout):
                raise TimeoutError("staging ring: no free slot")
        slot = self.try_acquire()
        assert slot is not None
        return slot

    def release(self, slot: StagingSlot, busy_until: object = None) -> None:
        slot.busy_until = busy_until
        with self._cv:
            self._free.append(slot.index)
            self._cv.notify()
