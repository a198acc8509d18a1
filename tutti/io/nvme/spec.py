"""NVMe I/O command and completion layouts (NVM Command Set, Read/Write), from the spec.

A submission queue entry is 64 bytes of little-endian dwords:
  CDW0  [7:0] opcode, [9:8] FUSE, [15:14] PSDT (0 = PRPs), [31:16] CID
  CDW1  NSID
  CDW2-3 reserved, CDW4-5 MPTR (metadata pointer)
  CDW6-7 PRP1 (DPTR bytes 24..31), CDW8-9 PRP2 (DPTR bytes 32..39)
  CDW10-11 SLBA, CDW12 [15:0] NLB (0's based), CDW13 DSM, CDW14-15 protection info
A completion queue entry is 16 bytes:
  DW0 command specific, DW1 reserved, DW2 [15:0] SQ head, [31:16] SQ id,
  DW3 [15:0] CID, [16] phase tag, [31:17] status field (SC [24:17], SCT [27:25], CRD, M, DNR)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SQE_SIZE = 64
CQE_SIZE = 16

OPC_FLUSH = 0x00
OPC_WRITE = 0x01
OPC_READ = 0x02

#: Byte offsets inside a 64-byte SQE (used by tests and the controller model).
SQE_OPCODE, SQE_FLAGS, SQE_CID, SQE_NSID = 0, 1, 2, 4
SQE_MPTR, SQE_PRP1, SQE_PRP2 = 16, 24, 32
SQE_CDW10, SQE_CDW11, SQE_CDW12 = 40, 44, 48
#: Byte offsets inside a 16-byte CQE.
CQE_DW0, CQE_SQHD, CQE_SQID, CQE_CID, CQE_STATUS = 0, 8, 10, 12, 14

MAX_NLB = 1 << 16  # NLB is a 16-bit 0's based count

_SQE = struct.Struct("<BBHIQQQQIIIIII")
_CQE = struct.Struct("<IIHHHH")
assert _SQE.size == SQE_SIZE and _CQE.size == CQE_SIZE


def encode_rw(opcode: int, cid: int, nsid: int, prp1: int, prp2: int, slba: int, nblocks: int) -> bytes:
    """One Read/Write SQE using PRPs (PSDT=0). `nblocks` is the real count, not 0's based."""
    if opcode not in (OPC_READ, OPC_WRITE):
        raise ValueError(f"opcode=0x{opcode:02x}: only Read (0x02) and Write (0x01) are built here")
    if not 0 <= cid <= 0xFFFF:
        raise ValueError(f"cid={cid}: a command identifier is 16 bits")
    if not 1 <= nblocks <= MAX_NLB:
        raise ValueError(f"nblocks={nblocks}: one command moves 1..{MAX_NLB} logical blocks")
    if not 0 <= slba < (1 << 64):
        raise ValueError(f"slba={slba}: not a 64-bit LBA")
    if prp1 & 0x3:
        raise ValueError(f"prp1=0x{prp1:x}: PRP1 must be dword aligned")
    return _SQE.pack(opcode, 0, cid, nsid, 0, 0, prp1, prp2,
                     slba & 0xFFFFFFFF, slba >> 32, (nblocks - 1) & 0xFFFF, 0, 0, 0)


@dataclass(frozen=True)
class SubmissionEntry:
    opcode: int
    flags: int
    cid: int
    nsid: int
    prp1: int
    prp2: int
    slba: int
    nblocks: int


def decode_sqe(raw: bytes | memoryview) -> SubmissionEntry:
    f = _SQE.unpack(bytes(raw))
    return SubmissionEntry(opcode=f[0], flags=f[1], cid=f[2], nsid=f[3], prp1=f[6], prp2=f[7],
                           slba=f[8] | (f[9] << 32), nblocks=(f[10] & 0xFFFF) + 1)


@dataclass(frozen=True)
class Completion:
    dw0: int
    sq_head: int
    sq_id: int
    cid: int
    phase: int
    status: int  # the 15-bit status field, DW3[31:17]; 0 = success

    @property
    def sc(self) -> int:
        return self.status & 0xFF

    @property
    def sct(self) -> int:
        return (self.status >> 8) & 0x7

    @property
    def dnr(self) -> bool:
        return bool(self.status >> 14 & 1)

    @property
    def ok(self) -> bool:
        return self.status == 0


def encode_cqe(dw0: int, sq_head: int, sq_id: int, cid: int, phase: int, status: int = 0) -> bytes:
    """Used by the controller model: a CQE exactly as a controller posts it."""
    return _CQE.pack(dw0, 0, sq_head, sq_id, cid, ((status & 0x7FFF) << 1) | (phase & 1))


def decode_cqe(raw: bytes | memoryview) -> Completion:
    dw0, _, sqhd, sqid, cid, sf = _CQE.unpack(bytes(raw))
    return Completion(dw0=dw0, sq_head=sqhd, sq_id=sqid, cid=cid, phase=sf & 1, status=sf >> 1)


_GENERIC = {
    0x01: "Invalid Command Opcode", 0x02: "Invalid Field in Command", 0x04: "Data Transfer Error",
    0x06: "Internal Error", 0x07: "Command Abort Requested", 0x0B: "Invalid Namespace or Format",
    0x13: "PRP Offset Invalid", 0x80: "LBA Out of Range", 0x81: "Capacity Exceeded",
    0x82: "Namespace Not Ready",
}
_MEDIA = {0x80: "Write Fault", 0x81: "Unrecovered Read Error", 0x86: "Access Denied"}


def describe_status(status: int) -> str:
    sc, sct = status & 0xFF, (status >> 8) & 0x7
    names = {0: _GENERIC, 2: _MEDIA}.get(sct, {})
    name = names.get(sc, "see the NVMe status code tables")
    dnr = " DNR" if status >> 14 & 1 else ""
    return f"NVMe status SCT=0x{sct:x} SC=0x{sc:02x} ({name}){dnr}"


def doorbell_offsets(qid: int, dstrd: int) -> tuple[int, int]:
    """BAR0 byte offsets of SQ y tail and CQ y head doorbells: 0x1000 + (2y[+1]) * (4 << DSTRD)."""
    stride = 4 << dstrd
    return 0x1000 + (2 * qid) * stride, 0x1000 + (2 * qid + 1) * stride
