"""One layer of a group of a step's loads, as the load paths pass it around: the staging slot its
reads land in, their futures, the slab descriptors they pin. Its own module, so the load paths
(pipeline, file_chunks) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tutti.engine.plan import LoadChunk
from tutti.engine.worker.staging import StagingSlot
from tutti.io.queue import IOFuture, IORequest


@dataclass
class LoadItem:
    """One layer of a group of the step's loads (`idx`: their indices in the step's loads)."""

    layer: int
    idx: list[int]
    chunks: list[LoadChunk]
    slot: StagingSlot | None = None
    futures: list[IOFuture] = field(default_factory=list)
    pinned: list[tuple[object, int]] = field(default_factory=list)  # (store, slot) whose slab descriptors reads hold
    mapped: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk index -> its segment in a mapped slab
    more_slots: list[StagingSlot] = field(default_factory=list)  # the rest of the ring (a chunk-major load's straggler)
    unsent: list[IORequest] = field(default_factory=list)  # reads a full queue has not taken yet
