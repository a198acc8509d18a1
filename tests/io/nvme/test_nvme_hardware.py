"""Round trip on a real snvme controller. Runs only where the hardware and libnvm exist.

Needs: /dev/ssnvme* (snvme module + tutti_daemon), libnvm.so (TUTTI_LIBNVM or the loader path)
and TUTTI_NVME_TEST_DIR, a scratch directory on the daemon's ext4 mount of that namespace.
"""

import glob
import os

import pytest
import torch

from tutti.io.nvme.libnvm import find_libnvm
from tutti.io.queue import READ, WRITE, IORequest, open_queue, submit_all, wait_all


def _missing():
    why = []
    if not glob.glob("/dev/ssnvme*"):
        why.append("no /dev/ssnvme* device (snvme driver / tutti_daemon)")
    lib = find_libnvm()
    if not lib or (os.sep in lib and not os.path.exists(lib)):
        why.append("no libnvm.so (set TUTTI_LIBNVM)")
    if not os.environ.get("TUTTI_NVME_TEST_DIR"):
        why.append("TUTTI_NVME_TEST_DIR unset (a scratch dir on the snvme ext4 mount)")
    return why


pytestmark = pytest.mark.skipif(bool(_missing()), reason="nvme hardware test skipped: " + "; ".join(_missing()))


def _aligned(n):
    raw = torch.zeros(n + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096
    return raw[off:off + n]


def test_round_trip_on_hardware(tmp_path):
    d = os.environ["TUTTI_NVME_TEST_DIR"]
    path = os.path.join(d, f"tutti_nvme_rt_{os.getpid()}.bin")
    size = 1 << 20
    a = os.urandom(size)
    with open(path, "wb") as f:  # written through the filesystem: real, written extents
        f.write(a)
        f.flush()
        os.fsync(f.fileno())
    q = open_queue("nvme")
    try:
        caps = q.caps()
        fd = q.open_file(path, write=True)
        step = min(caps.max_io_bytes, 128 * 1024)
        buf = _aligned(size)
        q.register_buffers([buf])
        wait_all(submit_all(q, [IORequest(fd, o, buf, o, step, READ) for o in range(0, size, step)]), timeout=30)
        assert buf.numpy().tobytes() == a
        b = os.urandom(size)
        buf.copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
        wait_all(submit_all(q, [IORequest(fd, o, buf, o, step, WRITE) for o in range(0, size, step)]), timeout=30)
        buf.zero_()
        wait_all(submit_all(q, [IORequest(fd, o, buf, o, step, READ) for o in range(0, size, step)]), timeout=30)
        assert buf.numpy().tobytes() == b
        os.close(fd)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # the filesystem sees the raw write
        try:
            chk = _aligned(size)
            assert os.preadv(dfd, [memoryview(chk.numpy())], 0) == size
            assert chk.numpy().tobytes() == b
        finally:
            os.close(dfd)
    finally:
        q.close()
        os.unlink(path)
