"""The staging ring: aligned host buffers between storage and the KV cache.

One aligned allocation (registered with the IO queue once) cut into equal slots. A slot is
handed out to a load or a store and comes back only when both its IO and the kernel or copy
that consumes it have finished: on CUDA the owner attaches an event to the release and the
next acquirer waits on it.

With a codec (tutti.codec), reads and writes move encoded bytes, which are decoded into (or encoded
from) the raw staging on the host: each ring and arena then has an encoded twin, a second
registered buffer cut the same way (slot i's twin at i x encoded_slot_bytes, region i's at
i x encoded_region_bytes). Without one there is no twin.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from tutti.engine.hostcost import gil_free_wait


@dataclass
class StagingSlot:
    index: int
    offset: int  # byte offset in the ring's buffer
    host: torch.Tensor  # uint8 view of slot_bytes
    device: torch.Tensor | None  # device twin on CUDA, else None
    busy_until: object = None  # CUDA event that must complete before reuse
    encoded_offset: int = 0  # with a codec: where its encoded twin starts in the ring's `encoded`


class StagingRing:
    encoded: torch.Tensor | None = None  # with a codec: the encoded twin (reads land there), else None
    encoded_slot_bytes = 0

    def __init__(self, buffer: torch.Tensor, slot_bytes: int, device: torch.device | None = None, *,
                 encoded: torch.Tensor | None = None, encoded_slot_bytes: int = 0) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("staging buffer: expected a 1-D uint8 tensor")
        n = buffer.numel() // slot_bytes
        if n < 1:
            raise ValueError(f"staging: {buffer.numel()} B holds no slot of {slot_bytes} B")
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        if encoded is not None:
            if encoded.numel() < n * encoded_slot_bytes or encoded_slot_bytes <= 0:
                raise ValueError(f"staging: an encoded twin of {encoded.numel()} B holds no {n} slots of "
                                 f"{encoded_slot_bytes} B")
            self.encoded, self.encoded_slot_bytes = encoded, encoded_slot_bytes
        dev_buf = None
        if device is not None and device.type == "cuda":
            dev_buf = torch.empty(n * slot_bytes, dtype=torch.uint8, device=device)
        self.device_buffer = dev_buf  # every slot's device twin, in slot order
        self._set_slots([
            StagingSlot(i, i * slot_bytes, buffer[i * slot_bytes:(i + 1) * slot_bytes],
                        None if dev_buf is None else dev_buf[i * slot_bytes:(i + 1) * slot_bytes],
                        encoded_offset=i * encoded_slot_bytes)
            for i in range(n)
        ])

    def _set_slots(self, slots: list[StagingSlot]) -> None:
        """The ring's slots, every one free."""
        self.slots = slots
        # first in, first out: the slot released longest ago is handed out first, so its consumer's
        # kernels (the event try_acquire waits on) have had the most time to finish and the host
        # rarely waits in the forward's hooks (last in, first out handed back the one just released)
        self._free: deque[int] = deque(range(len(slots)))
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def try_acquire(self, wait_host: bool = True) -> StagingSlot | None:
        """A free slot, or None. `wait_host`: return only once the consumer of its last contents
        has finished (the host may then write the host buffer); False for a user that touches
        only the device buffer on the consumer's own stream (it calls `wait_host` if it changes
        its mind)."""
        with self._lock:
            if not self._free:
                return None
            slot = self.slots[self._free.popleft()]
        if wait_host:
            self.wait_host(slot)
        return slot

    @staticmethod
    def wait_host(slot: StagingSlot) -> None:
        if slot.busy_until is not None:
            with gil_free_wait():
                slot.busy_until.synchronize()  # the consumer of its last contents (already enqueued) finishes
            slot.busy_until = None

    def acquire_all(self) -> list[StagingSlot] | None:
        """Every slot at once (one contiguous span, for a user that needs more than a slot), or
        None if any is held. No host wait (see try_acquire's `wait_host`)."""
        with self._lock:
            if len(self._free) != len(self.slots):
                return None
            self._free = deque()
        return list(self.slots)

    def release(self, slot: StagingSlot, busy_until: object = None) -> None:
        slot.busy_until = busy_until
        with self._cv:
            self._free.append(slot.index)
            self._cv.notify()


class DeviceRing(StagingRing):
    """Slots on the device only: for loads that copy from mapped slabs straight to the device
    (no host staging, no reads). On the CPU, host memory stands in for the device."""

    def __init__(self, nbytes: int, slot_bytes: int, device: torch.device | None = None) -> None:
        cuda = device is not None and device.type == "cuda"
        n = max(1, nbytes // slot_bytes)
        buf = torch.empty(n * slot_bytes, dtype=torch.uint8, device=device if cuda else "cpu")
        self.buffer = None if cuda else buf
        self.slot_bytes = slot_bytes
        self.device_buffer = buf if cuda else None
        views = [buf[i * slot_bytes:(i + 1) * slot_bytes] for i in range(n)]
        self._set_slots([StagingSlot(i, i * slot_bytes, None if cuda else v, v if cuda else None)
                         for i, v in enumerate(views)])


class RegionArena:
    """Equal regions of one buffer, handed out as runs of consecutive regions.

    A store holds a whole chunk (every layer, in the slab's slot order) in one region, so the
    chunk goes to disk in one write; the chunks of a step take consecutive regions where they
    can, so one gather launch fills them all. Regions come back when their write is done.
    """

    def __init__(self, buffer: torch.Tensor, offset: int, nbytes: int, region_bytes: int,
                 device: torch.device | None = None, sums_per_region: int = 0, *,
                 encoded: torch.Tensor | None = None, encoded_region_bytes: int = 0) -> None:
        """The arena is `buffer[offset:offset + nbytes]`; `buffer` is what the IO queue registered.
        `sums_per_region`: int64 checksums each region's chunk carries, kept in host memory
        allocated here (pinned on CUDA), so no store allocates pinned memory while serving.
        `encoded` (a codec): the regions' encoded twins, `encoded_region_bytes` each, registered too."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("staging arena: expected a 1-D uint8 tensor")
        self.buffer = buffer
        self.offset = offset
        self.region_bytes = region_bytes
        self.num_regions = nbytes // region_bytes if region_bytes > 0 else 0
        self.host = buffer[offset:offset + self.num_regions * region_bytes]
        self.device = None
        if device is not None and device.type == "cuda" and self.num_regions:
            self.device = torch.empty(self.num_regions * region_bytes, dtype=torch.uint8, device=device)
        cuda = device is not None and device.type == "cuda"
        self.sums = torch.zeros(self.num_regions * sums_per_region, dtype=torch.int64, pin_memory=cuda)
        self.sums_per_region = sums_per_region
        self._free = [True] * self.num_regions
        self._nfree = self.num_regions
        self._lock = threading.Lock()
        self.encoded, self.encoded_region_bytes = encoded, encoded_region_bytes
        if encoded is not None and (encoded_region_bytes <= 0
                                    or encoded.numel() < self.num_regions * encoded_region_bytes):
            raise ValueError(f"staging arena: an encoded twin of {encoded.numel()} B holds no {self.num_regions} "
                             f"regions of {encoded_region_bytes} B")

    @property
    def free_count(self) -> int:
        with self._lock:
            return self._nfree

    def take(self, n: int) -> list[tuple[int, int]]:
        """Up to `n` regions as (first, count) runs, longest runs first; fewer when full."""
        with self._lock:
            runs, start = [], None
            for i, free in enumerate(self._free + [False]):
                if free and start is None:
                    start = i
                elif not free and start is not None:
                    runs.append((start, i - start))
                    start = None
            out, left = [], n
            for first, count in sorted(runs, key=lambda r: -r[1]):
                if left <= 0:
                    break
                take = min(count, left)
                out.append((first, take))
                left -= take
                for i in range(first, first + take):
                    self._free[i] = False
                self._nfree -= take
            return sorted(out)

    def release(self, first: int, count: int) -> None:
        with self._lock:
            for i in range(first, first + count):
                assert not self._free[i], "staging arena: region released twice"
                self._free[i] = True
            self._nfree += count

    def buffer_offset(self, region: int) -> int:
        """Byte offset of `region` in the buffer registered with the IO queue."""
        return self.offset + region * self.region_bytes

    def host_view(self, first: int, count: int) -> torch.Tensor:
        return self.host[first * self.region_bytes:(first + count) * self.region_bytes]

    def encoded_offset(self, region: int) -> int:
        """Byte offset of `region`'s encoded twin in `encoded` (a codec only)."""
        return region * self.encoded_region_bytes

    def sums_view(self, first: int, count: int) -> torch.Tensor:
        """The checksums of regions [first, first + count): held with the regions."""
        k = self.sums_per_region
        return self.sums[first * k:(first + count) * k]

    def device_view(self, first: int, count: int) -> torch.Tensor | None:
        if self.device is None:
            return None
        return self.device[first * self.region_bytes:(first + count) * self.region_bytes]
