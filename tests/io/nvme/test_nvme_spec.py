"""SQE/CQE byte layouts against the NVMe specification's field offsets."""

import struct

import pytest

from tutti.io.nvme import spec


def test_read_sqe_fields_sit_at_spec_offsets():
    raw = spec.encode_rw(spec.OPC_READ, cid=0xBEEF, nsid=7, prp1=0x1234_5000 + 0x10, prp2=0xABCD_E000,
                         slba=0x1_2345_6789, nblocks=8)
    assert len(raw) == 64
    assert raw[0] == 0x02  # CDW0[7:0] opcode
    assert raw[1] == 0  # FUSE=0, PSDT=0 (PRPs)
    assert struct.unpack_from("<H", raw, 2)[0] == 0xBEEF  # CDW0[31:16] CID
    assert struct.unpack_from("<I", raw, 4)[0] == 7  # CDW1 NSID
    assert raw[8:24] == bytes(16)  # CDW2-3 reserved, CDW4-5 MPTR
    assert struct.unpack_from("<Q", raw, 24)[0] == 0x1234_5010  # CDW6-7 PRP1
    assert struct.unpack_from("<Q", raw, 32)[0] == 0xABCD_E000  # CDW8-9 PRP2
    assert struct.unpack_from("<I", raw, 40)[0] == 0x2345_6789  # CDW10 SLBA low
    assert struct.unpack_from("<I", raw, 44)[0] == 0x1  # CDW11 SLBA high
    assert struct.unpack_from("<I", raw, 48)[0] == 7  # CDW12[15:0] NLB, 0's based
    assert raw[52:64] == bytes(12)  # CDW13-15


def test_write_opcode_and_decode_round_trip():
    raw = spec.encode_rw(spec.OPC_WRITE, 3, 1, 0x1000, 0, 42, 65536)
    assert raw[0] == 0x01
    assert struct.unpack_from("<I", raw, 48)[0] == 0xFFFF
    e = spec.decode_sqe(raw)
    assert (e.opcode, e.cid, e.nsid, e.prp1, e.prp2, e.slba, e.nblocks) == (1, 3, 1, 0x1000, 0, 42, 65536)


@pytest.mark.parametrize("kwargs,match", [
    (dict(opcode=0x00), "opcode"), (dict(nblocks=0), "nblocks"), (dict(nblocks=65537), "nblocks"),
    (dict(cid=1 << 16), "cid"), (dict(prp1=0x1002), "dword"),
])
def test_encode_rejects_bad_fields(kwargs, match):
    args = dict(opcode=spec.OPC_READ, cid=1, nsid=1, prp1=0x1000, prp2=0, slba=0, nblocks=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        spec.encode_rw(**args)


def test_cqe_decode_against_hand_built_dwords():
    # DW0=result, DW1=reserved, DW2 = SQHD | SQID<<16, DW3 = CID | P<<16 | SF<<17
    sf = (0x2 << 8) | 0x81  # SCT=2 (media), SC=0x81
    raw = struct.pack("<IIII", 0xCAFE, 0, 5 | (9 << 16), 0x77 | (1 << 16) | (sf << 17))
    c = spec.decode_cqe(raw)
    assert (c.dw0, c.sq_head, c.sq_id, c.cid, c.phase) == (0xCAFE, 5, 9, 0x77, 1)
    assert (c.sct, c.sc, c.ok, c.dnr) == (2, 0x81, False, False)
    assert "Unrecovered Read Error" in spec.describe_status(c.status)
    # the field offsets the queue pair reads directly
    assert struct.unpack_from("<H", raw, spec.CQE_SQHD)[0] == 5
    assert struct.unpack_from("<H", raw, spec.CQE_SQID)[0] == 9
    assert struct.unpack_from("<H", raw, spec.CQE_CID)[0] == 0x77
    assert struct.unpack_from("<H", raw, spec.CQE_STATUS)[0] & 1 == 1


def test_encode_cqe_is_what_decode_reads():
    raw = spec.encode_cqe(1, 2, 3, 4, 0, status=(1 << 14) | 0x80)
    c = spec.decode_cqe(raw)
    assert (c.dw0, c.sq_head, c.sq_id, c.cid, c.phase, c.sc, c.dnr) == (1, 2, 3, 4, 0, 0x80, True)
    assert "LBA Out of Range" in spec.describe_status(c.status) and "DNR" in spec.describe_status(c.status)


def test_doorbell_offsets_follow_cap_dstrd():
    assert spec.doorbell_offsets(0, 0) == (0x1000, 0x1004)  # admin queue
    assert spec.doorbell_offsets(33, 0) == (0x1000 + 66 * 4, 0x1000 + 67 * 4)
    assert spec.doorbell_offsets(1, 2) == (0x1000 + 2 * 16, 0x1000 + 3 * 16)
