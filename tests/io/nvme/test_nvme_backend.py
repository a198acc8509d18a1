"""The "nvme" IOQueue contract end to end against the controller model (no hardware)."""

import errno
import os
import random

import pytest
import torch

from tutti.io.nvme.backend import NvmeQueue
from tutti.io.nvme.fiemap import Extent, ExtentError, FIEMAP_EXTENT_UNWRITTEN, FileExtents
from tutti.io.nvme.qpair import QueuePair
from tutti.io.queue import READ, WRITE, IOErrorWithRequest, IORequest, submit_all, wait_all

from .controller_model import DictResolver, IdentityDma, ModelController, SC_LBA_OUT_OF_RANGE

PS = 4096


def aligned(n, align=PS):
    raw = torch.zeros(n + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off:off + n]


class Rig:
    def __init__(self, tmp_path, depth=4, lba=512, disk_bytes=1 << 20, mdts=8192, defer=False):
        self.model = ModelController(depth, 40, bytearray(disk_bytes), lba, PS, nsid=1, defer=defer)
        m = self.model
        self.qp = QueuePair(memoryview(m.sq), memoryview(m.cq), depth, 40, m.ring_sq, m.ring_cq)
        self.dma = IdentityDma(PS, depth)
        self.resolver = DictResolver()
        self.q = NvmeQueue(self.qp, self.dma, self.resolver, lba_size=lba, max_transfer=mdts, nsid=1)
        self.tmp = tmp_path

    def file(self, name, extents, write=True):
        p = self.tmp / name
        p.write_bytes(b"")
        fd = os.open(p, os.O_RDWR if write else os.O_RDONLY)
        self.resolver.files[fd] = FileExtents(extents, name)
        return fd


def fragmented(file_len, disk_len, piece, rng):
    """A file scattered over the disk in `piece`-byte extents, in a shuffled physical order."""
    slots = list(range(disk_len // piece))
    rng.shuffle(slots)
    return [Extent(i * piece, slots[i] * piece, piece) for i in range(file_len // piece)]


def test_caps_report_the_device_limits(tmp_path):
    r = Rig(tmp_path, depth=8, lba=512, mdts=128 * 1024)
    c = r.q.caps()
    assert (c.backend, c.alignment, c.max_io_bytes, c.queue_depth, c.max_in_flight, c.direct_io) == \
        ("nvme", 512, 128 * 1024, 7, 7, True)
    # no MDTS reported: limited by one PRP list page, never assumed bigger
    r2 = NvmeQueue(r.qp, r.dma, r.resolver, lba_size=4096, max_transfer=0, nsid=1)
    assert r2.caps().max_io_bytes == 512 * PS and r2.caps().alignment == 4096


def test_byte_exact_round_trip_through_a_small_queue(tmp_path):
    rng = random.Random(7)
    r = Rig(tmp_path, depth=4, lba=512, mdts=32768)
    file_len = 256 * 1024
    ext = fragmented(file_len, len(r.model.disk), 16 * 1024, rng)
    fd = r.file("slab", ext)
    src = aligned(file_len)
    src.copy_(torch.frombuffer(bytearray(rng.randbytes(file_len)), dtype=torch.uint8))
    # writes of mixed sizes up to MDTS (32 KiB) crossing the 16 KiB extents -> several commands each
    reqs, off = [], 0
    while off < file_len:
        n = min(rng.choice([4096, 12288, 20480, 32768]), file_len - off)
        reqs.append(IORequest(fd, off, src, off, n, WRITE))
        off += n
    futs = submit_all(r.q, reqs)
    assert wait_all(futs, timeout=10) == [q.length for q in reqs]
    # the bytes landed where the extents say
    for e in ext:
        assert bytes(r.model.disk[e.physical:e.physical + e.length]) == src[e.logical:e.end].numpy().tobytes()
    dst = aligned(file_len)
    reqs = [IORequest(fd, o, dst, o, 32768, READ) for o in range(0, file_len, 32768)]
    assert wait_all(submit_all(r.q, reqs), timeout=10) == [32768] * len(reqs)
    assert torch.equal(src, dst)
    assert r.qp.phase in (0, 1) and len(r.model.executed) > 4 * 8  # rings wrapped many times
    assert max(e.nblocks for e in r.model.executed) * 512 <= 16384  # split at extent boundaries
    r.q.close()


def test_partial_acceptance_when_the_queue_is_full(tmp_path):
    r = Rig(tmp_path, depth=4, lba=512, defer=True)
    fd = r.file("slab", [Extent(0, 0, 64 * 1024)])
    buf = aligned(64 * 1024)
    reqs = [IORequest(fd, i * 4096, buf, i * 4096, 4096, READ) for i in range(6)]
    futs = r.q.submit(reqs)
    assert len(futs) == 3  # depth 4 -> 3 in flight
    assert not any(f.done() for f in futs)
    assert r.q.submit(reqs[3:]) == []
    r.model.process()
    assert r.q.poll(1.0) == 3 and all(f.done() for f in futs)
    futs2 = r.q.submit(reqs[3:])
    assert len(futs2) == 3
    r.model.process()
    assert [f.result(1.0) for f in futs2] == [4096] * 3


def test_a_request_is_accepted_whole_or_not_at_all(tmp_path):
    r = Rig(tmp_path, depth=4, lba=512, defer=True)
    fd = r.file("slab", [Extent(0, 0, 8192), Extent(8192, 65536, 8192)])
    buf = aligned(64 * 1024)
    small = IORequest(fd, 0, buf, 0, 4096, READ)  # 1 command
    big = IORequest(fd, 4096, buf, 4096, 8192, READ)  # crosses the extents: 2 commands
    futs = r.q.submit([small, small, big])
    assert len(futs) == 2 and len(r.model.executed) == 0 and r.qp.outstanding == 2
    r.model.process()
    r.q.drain()
    f = r.q.submit([big])
    assert len(f) == 1 and r.qp.outstanding == 2


def test_device_error_fails_the_future_with_the_nvme_status(tmp_path):
    r = Rig(tmp_path, depth=4, lba=512, disk_bytes=64 * 1024)
    fd = r.file("slab", [Extent(0, 60 * 1024, 16 * 1024)])  # runs past the model's disk
    buf = aligned(16 * 1024)
    (ok,) = r.q.submit([IORequest(fd, 0, buf, 0, 4096, READ)])
    assert ok.result(1.0) == 4096
    (bad,) = r.q.submit([IORequest(fd, 0, buf, 0, 8192, READ)])
    with pytest.raises(IOErrorWithRequest, match="LBA Out of Range") as ei:
        bad.result(1.0)
    assert ei.value.errno == errno.EIO
    assert SC_LBA_OUT_OF_RANGE == 0x80


def test_bad_requests_raise_before_any_io(tmp_path):
    r = Rig(tmp_path, depth=4, lba=4096)
    fd = r.file("slab", [Extent(0, 0, 64 * 1024)])
    ro = r.file("ro", [Extent(0, 0, 64 * 1024)], write=False)
    buf = aligned(64 * 1024)
    good = IORequest(fd, 0, buf, 0, 4096, READ)
    for bad, match in [
        (IORequest(fd, 512, buf, 0, 4096, READ), "offset=512"),
        (IORequest(fd, 0, buf, 0, 1 << 20, READ), "length"),
        (IORequest(ro, 0, buf, 0, 4096, WRITE), "read-only"),
    ]:
        with pytest.raises(ValueError, match=match):
            r.q.submit([good, bad])
    assert r.model.executed == [] and r.qp.outstanding == 0


def test_holes_and_unwritten_extents_are_refused_before_io(tmp_path):
    r = Rig(tmp_path, depth=4, lba=512)
    fd = r.file("slab", [Extent(0, 0, 8192), Extent(16384, 8192, 8192, FIEMAP_EXTENT_UNWRITTEN)])
    buf = aligned(32768)
    with pytest.raises(ExtentError, match="no extent") as ei:
        r.q.submit([IORequest(fd, 4096, buf, 0, 8192, READ)])
    assert ei.value.errno == errno.ENXIO
    with pytest.raises(ExtentError, match="unwritten"):
        r.q.submit([IORequest(fd, 16384, buf, 0, 4096, READ)])
    assert r.model.executed == []


def test_too_fragmented_request_is_refused(tmp_path):
    r = Rig(tmp_path, depth=4, lba=512, mdts=65536)
    rng = random.Random(3)
    fd = r.file("slab", fragmented(64 * 1024, 1 << 20, 4096, rng))
    buf = aligned(64 * 1024)
    with pytest.raises(ValueError, match="fragmentation"):
        r.q.submit([IORequest(fd, 0, buf, 0, 16384, READ)])


def test_close_then_submit_is_refused(tmp_path):
    r = Rig(tmp_path)
    r.q.close()
    with pytest.raises(ValueError, match="closed"):
        r.q.submit([])


def test_backend_is_registered_and_fails_clearly_without_hardware(monkeypatch):
    import glob

    from tutti.io.queue import available_backends, open_queue

    assert "nvme" in available_backends()
    if glob.glob("/dev/ssnvme*"):
        pytest.skip("this machine has /dev/ssnvme*; the missing-hardware message cannot be checked")
    monkeypatch.setenv("TUTTI_LIBNVM", "/nonexistent/libnvm.so")
    with pytest.raises(OSError) as ei:
        open_queue("nvme")
    msg = str(ei.value)
    assert "/dev/ssnvme*" in msg and "libnvm.so" in msg and "/nonexistent/libnvm.so" in msg
    with pytest.raises(OSError, match="/dev/ssnvme9 does not exist"):
        open_queue("nvme", device="/dev/ssnvme9")
