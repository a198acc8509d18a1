"""tutti.engine.worker.staging: the load ring hands slots out oldest-released first."""

from __future__ import annotations

import torch

from tutti.engine.worker.staging import StagingRing


class Event:
    """A stand-in for a CUDA event: counts the host's waits on it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_the_slot_released_longest_ago_is_handed_out_first():
    """A released slot carries the event of its last consumer's kernels; the next acquirer waits
    on it in the forward's hooks. Handing out the slot released longest ago (or never used) gives
    those kernels the most time, so the host rarely waits: with a ring of three, two in use and
    released in turn, the never-used one comes first, then the two in the order they came back."""
    ring = StagingRing(torch.zeros(3 * 4096, dtype=torch.uint8), 4096)
    a, b = ring.try_acquire(), ring.try_acquire()
    ea, eb = Event(), Event()
    ring.release(a, ea)
    ring.release(b, eb)
    c = ring.try_acquire()
    assert c.index not in (a.index, b.index) and ea.waits == eb.waits == 0
    assert ring.try_acquire().index == a.index and ea.waits == 1 and eb.waits == 0
    assert ring.try_acquire(wait_host=False).index == b.index and eb.waits == 0  # its user waits if it must
    assert ring.try_acquire() is None
