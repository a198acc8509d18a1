"""One NVMe I/O queue pair driven from Python: SQ tail, CQ head, phase tag, doorbells.

The rings are plain writable buffers (an mmap of pinned pages on hardware, a bytearray in the
tests' controller model); doorbells are callables that store one 32-bit value. Nothing here
knows about files or futures, so the exact ring arithmetic is tested without hardware.
"""

from __future__ import annotations

from typing import Callable

from .spec import CQE_SIZE, SQE_SIZE, Completion, decode_cqe

Doorbell = Callable[[int], None]


class QueueProtocolError(OSError):
    """The controller posted something no correct controller posts; the queue is unusable."""


class QueuePair:
    """Producer side of an SQ and consumer side of its CQ (both `depth` entries).

    At most depth-1 commands are outstanding: a full SQ has tail+1 == head, and command ids
    are drawn from 0..depth-2 so a CQE's CID always names exactly one outstanding command.
    """

    def __init__(self, sq: memoryview, cq: memoryview, depth: int, qid: int,
                 sq_doorbell: Doorbell, cq_doorbell: Doorbell, max_outstanding: int | None = None) -> None:
        if depth < 2:
            raise ValueError(f"depth={depth}: an NVMe queue needs at least 2 entries")
        if len(sq) < depth * SQE_SIZE or len(cq) < depth * CQE_SIZE:
            raise ValueError(f"rings too small for depth={depth}: sq {len(sq)} B, cq {len(cq)} B")
        self.sq = sq.cast("B") if sq.format != "B" else sq
        self.cq = cq.cast("B") if cq.format != "B" else cq
        self._cq_status = self.cq[: depth * CQE_SIZE].cast("H")  # for the phase-tag peek
        self.depth = depth
        self.qid = qid
        self._sq_db = sq_doorbell
        self._cq_db = cq_doorbell
        self.sq_tail = 0
        self.sq_head = 0  # as last reported by the controller in a CQE
        self.cq_head = 0
        self.phase = 1  # rings start zeroed; the controller's first pass writes phase 1
        cap = depth - 1 if max_outstanding is None else max_outstanding
        if not 1 <= cap <= depth - 1:
            raise ValueError(f"max_outstanding={max_outstanding}: must be 1..{depth - 1} for depth {depth}")
        self.max_outstanding = cap
        self._free_cids = list(range(cap - 1, -1, -1))
        self._outstanding: set[int] = set()
        self._pending_doorbell = False

    # -- submission ----------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def free_slots(self) -> int:
        """SQ entries that can be written now without overrunning the controller's head."""
        ring_free = (self.sq_head - self.sq_tail - 1) % self.depth
        return min(ring_free, len(self._free_cids))

    def alloc_cid(self) -> int:
        if not self._free_cids:
            raise RuntimeError("queue pair: no free command id (caller must check free_slots())")
        cid = self._free_cids.pop()
        self._outstanding.add(cid)
        return cid

    def push(self, sqe: bytes) -> None:
        """Write one SQE at the tail; the doorbell is rung by `ring()` once per batch."""
        if len(sqe) != SQE_SIZE:
            raise ValueError(f"sqe: expected {SQE_SIZE} bytes, got {len(sqe)}")
        if (self.sq_tail + 1) % self.depth == self.sq_head:
            raise RuntimeError("queue pair: SQ full (caller must check free_slots())")
        off = self.sq_tail * SQE_SIZE
        self.sq[off : off + SQE_SIZE] = sqe
        self.sq_tail = (self.sq_tail + 1) % self.depth
        self._pending_doorbell = True

    def ring(self) -> None:
        """Tell the controller the new SQ tail (one MMIO store for the whole batch)."""
        if self._pending_doorbell:
            self._pending_doorbell = False
            self._sq_db(self.sq_tail)

    # -- completion ----------------------------------------------------------------------
    def reap(self, max_entries: int | None = None) -> list[Completion]:
        """Consume every new CQE (phase tag == expected phase), then ring the CQ head doorbell."""
        out: list[Completion] = []
        limit = self.depth if max_entries is None else max_entries
        while len(out) < limit:
            # Read the status half-word first: the phase tag says whether the slot is new.
            if (self._cq_status[(self.cq_head * CQE_SIZE + 14) // 2] & 1) != self.phase:
                break
            off = self.cq_head * CQE_SIZE
            cqe = decode_cqe(self.cq[off : off + CQE_SIZE])
            self._check(cqe)
            self._outstanding.discard(cqe.cid)
            self._free_cids.append(cqe.cid)
            self.sq_head = cqe.sq_head
            self.cq_head += 1
            if self.cq_head == self.depth:
                self.cq_head = 0
                self.phase ^= 1
            out.append(cqe)
        if out:
            self._cq_db(self.cq_head)
        return out

    def _check(self, cqe: Completion) -> None:
        if cqe.sq_id != self.qid:
            raise QueueProtocolError(5, f"CQE for SQ {cqe.sq_id} on queue {self.qid}'s CQ")
        if cqe.cid not in self._outstanding:
            raise QueueProtocolError(5, f"queue {self.qid}: CQE for CID {cqe.cid}, which is not outstanding")
        if cqe.sq_head >= self.depth:
            raise QueueProtocolError(5, f"queue {self.qid}: CQE reports SQ head {cqe.sq_head} >= depth {self.depth}")
