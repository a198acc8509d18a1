"""Ring wrap and phase handling: the real QueuePair driven through the controller model."""

import ctypes
import random

import pytest

from tutti.io.nvme.qpair import QueuePair, QueueProtocolError
from tutti.io.nvme.spec import OPC_READ, OPC_WRITE, encode_cqe, encode_rw

from .controller_model import ModelController

PS = 4096


def _pair(depth=4, defer=False, lba=512, disk_blocks=256):
    model = ModelController(depth, qid=33, disk=bytearray(disk_blocks * lba), lba_size=lba, defer=defer)
    qp = QueuePair(memoryview(model.sq), memoryview(model.cq), depth, 33, model.ring_sq, model.ring_cq)
    return model, qp


def _page_buffer(n_pages):
    buf = (ctypes.c_char * ((n_pages + 1) * PS))()
    base = ctypes.addressof(buf)
    start = base + (-base) % PS
    return buf, start


def test_many_commands_through_a_tiny_queue_wrap_rings_and_flip_phase():
    depth, lba = 4, 512
    model, qp = _pair(depth, lba=lba)
    keep, page = _page_buffer(1)
    rng = random.Random(1)
    expect = bytearray(len(model.disk))
    phases_seen = set()
    n_cmds = 10 * depth + 3  # rings wrap 10+ times
    for i in range(n_cmds):
        blk = rng.randrange(0, 256)
        data = rng.randbytes(lba)
        ctypes.memmove(page, data, lba)
        assert qp.free_slots() > 0
        cid = qp.alloc_cid()
        qp.push(encode_rw(OPC_WRITE, cid, 1, page, 0, blk, 1))
        qp.ring()
        done = qp.reap()
        assert [c.cid for c in done] == [cid] and done[0].ok
        phases_seen.add(done[0].phase)
        expect[blk * lba:(blk + 1) * lba] = data
        # read it back through the same queue into a zeroed page
        ctypes.memset(page, 0, lba)
        cid = qp.alloc_cid()
        qp.push(encode_rw(OPC_READ, cid, 1, page, 0, blk, 1))
        qp.ring()
        (c,) = qp.reap()
        assert c.ok and ctypes.string_at(page, lba) == data
    assert bytes(model.disk) == bytes(expect)
    assert phases_seen == {0, 1}
    total = 2 * n_cmds
    assert qp.sq_tail == total % depth == model.sq_head
    assert qp.cq_head == total % depth
    assert qp.phase == (1 if (total // depth) % 2 == 0 else 0)
    assert all(0 <= v < depth for v in model.sq_doorbells + model.cq_doorbells)
    assert qp.outstanding == 0


def test_sq_fills_at_depth_minus_one_and_drains_in_batches():
    depth = 8
    model, qp = _pair(depth, defer=True)
    keep, page = _page_buffer(1)
    pushed = 0
    for rnd in range(5):
        while qp.free_slots():
            qp.push(encode_rw(OPC_READ, qp.alloc_cid(), 1, page, 0, pushed % 64, 1))
            pushed += 1
        qp.ring()
        assert qp.outstanding == depth - 1
        with pytest.raises(RuntimeError, match="no free command id"):
            qp.alloc_cid()
        assert qp.reap() == []  # nothing executed yet
        model.process(max_commands=3)  # partial progress
        got = qp.reap()
        assert len(got) == 3 and qp.free_slots() == 3
        model.process()
        got += qp.reap()
        assert len({c.cid for c in got}) == len(got)
        assert qp.outstanding == depth - 1 - len(got)
        model.process()
        qp.reap()
    assert len(model.executed) == pushed == 5 * (depth - 1)
    assert qp.outstanding == 0


def test_cq_doorbell_gates_the_controller():
    # With the host not reaping, a full CQ makes the model hold completions back.
    depth = 4
    model, qp = _pair(depth, defer=True)
    keep, page = _page_buffer(1)
    for _ in range(3):
        qp.push(encode_rw(OPC_READ, qp.alloc_cid(), 1, page, 0, 0, 1))
    qp.ring()
    model.process()
    assert model.pending == [] and model.cq_tail == 3
    assert len(qp.reap(max_entries=2)) == 2 and model.cq_doorbells[-1] == 2
    assert len(qp.reap()) == 1 and qp.cq_head == 3


def test_multi_page_commands_move_exact_bytes_via_prp_list():
    from tutti.io.nvme.prp import build_prps
    lba = 4096
    model, qp = _pair(depth=4, lba=lba, disk_blocks=16)
    keep, base = _page_buffer(6)
    lst_keep, lst = _page_buffer(1)
    data = random.Random(2).randbytes(5 * PS)
    ctypes.memmove(base, data, len(data))
    plan = build_prps([base + i * PS for i in range(5)], 0, 5 * PS, PS, list_iova=lst)
    ctypes.memmove(lst, b"".join(e.to_bytes(8, "little") for e in plan.list_entries), 8 * 4)
    qp.push(encode_rw(OPC_WRITE, qp.alloc_cid(), 1, plan.prp1, plan.prp2, 3, 5))
    qp.ring()
    (c,) = qp.reap()
    assert c.ok and bytes(model.disk[3 * lba:8 * lba]) == data


def test_completion_for_another_queue_is_a_protocol_error():
    model, qp = _pair(depth=4, defer=True)
    cid = qp.alloc_cid()
    model.cq[0:16] = encode_cqe(0, 1, 99, cid, 1)
    with pytest.raises(QueueProtocolError, match="SQ 99"):
        qp.reap()


def test_completion_for_unknown_cid_is_a_protocol_error():
    model, qp = _pair(depth=4, defer=True)
    model.cq[0:16] = encode_cqe(0, 1, 33, 2, 1)
    with pytest.raises(QueueProtocolError, match="CID 2"):
        qp.reap()


def test_queue_pair_checks_its_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        QueuePair(memoryview(bytearray(64)), memoryview(bytearray(16)), 1, 1, print, print)
    with pytest.raises(ValueError, match="too small"):
        QueuePair(memoryview(bytearray(64)), memoryview(bytearray(64)), 4, 1, print, print)
    with pytest.raises(ValueError, match="max_outstanding"):
        QueuePair(memoryview(bytearray(256)), memoryview(bytearray(64)), 4, 1, print, print, max_outstanding=4)
