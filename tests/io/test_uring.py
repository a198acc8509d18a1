"""io_uring specifics: ring setup, fixed buffers, op selection, completion thread, close."""

import errno
import os
import platform
import threading

import pytest
import torch

from tutti.io import uring
from tutti.io.buffers import aligned_buffer
from tutti.io.queue import IOErrorWithRequest, IORequest, submit_all, wait_all
from tutti.io.uring import UringQueue

KiB = 1024


def _random(nbytes, seed=0):
    buf = aligned_buffer(nbytes)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return buf


def test_syscall_numbers_match_the_unified_table():
    if platform.machine() in ("x86_64", "aarch64", "riscv64", "armv7l", "ppc64le", "s390x"):
        assert (uring.NR_SETUP, uring.NR_ENTER, uring.NR_REGISTER) == (425, 426, 427)


def test_ring_geometry_and_caps():
    with UringQueue(queue_depth=6, max_in_flight=1000) as q:
        caps = q.caps()
        assert caps.backend == "uring" and caps.alignment == 4096
        assert caps.queue_depth == 8  # the kernel rounds entries up to a power of two
        assert caps.extra["cq_entries"] == 16
        assert caps.max_in_flight == 16  # capped at the CQ size: completions cannot overflow
        assert caps.max_io_bytes == uring.DEFAULT_MAX_IO
        assert caps.extra["op_read_write"] is True  # this kernel has IORING_OP_READ/WRITE


def test_refused_setup_raises_oserror_with_the_kernels_errno():
    with pytest.raises(OSError) as info:
        UringQueue(uring_setup_flags=1 << 31)
    assert info.value.errno == errno.EINVAL and "io_uring_setup" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"queue_depth": 0}, "queue_depth"), ({"queue_depth": 1 << 16}, "queue_depth"),
     ({"max_io_bytes": 1000}, "max_io_bytes"), ({"max_in_flight": 0}, "max_in_flight"),
     ({"uring_reap_divisor": 0}, "uring_reap_divisor")],
)
def test_bad_constructor_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        UringQueue(**kwargs)


def test_fixed_buffer_table_picks_the_containing_buffer(tmp_path):
    a, b, other = _random(64 * KiB, 1), _random(128 * KiB, 2), _random(64 * KiB, 3)
    with UringQueue() as q:
        q.register_buffers([a, b])
        assert q._fixed_index(b.data_ptr() + 64 * KiB, 64 * KiB) is not None
        assert q._fixed_index(b.data_ptr() + 64 * KiB, 128 * KiB) is None  # runs past b
        assert q._fixed_index(other.data_ptr(), 4096) is None
        fd = q.open_file(tmp_path / "f", write=True, create=True)
        try:
            wait_all(submit_all(q, [
                IORequest(fd, 0, a, 0, 64 * KiB, "write"),
                IORequest(fd, 64 * KiB, b, 0, 128 * KiB, "write"),
                IORequest(fd, 192 * KiB, other, 0, 64 * KiB, "write"),
            ]))
            assert q.caps().extra["ops"] == {"fixed": 2, "plain": 1, "vectored": 0}
            expected = torch.cat([a, b, other])
            # Re-registering replaces the table: now only `other` is fixed.
            q.register_buffers([other])
            dst = aligned_buffer(256 * KiB)
            wait_all(submit_all(q, [IORequest(fd, 0, other, 0, 64 * KiB, "read")]))
            wait_all(submit_all(q, [IORequest(fd, 0, dst, 0, 256 * KiB, "read")]))
            assert q.caps().extra["ops"] == {"fixed": 3, "plain": 2, "vectored": 0}
            assert torch.equal(dst, expected) and torch.equal(other, a)
        finally:
            os.close(fd)


def test_register_buffers_rejects_bad_tensors():
    with UringQueue() as q:
        with pytest.raises(ValueError, match=r"buffers\[1\]"):
            q.register_buffers([aligned_buffer(4096), torch.zeros(8, 8)[:, 0]])


def test_vectored_ops_for_kernels_without_op_read(tmp_path):
    # Kernels before 5.6 lack IORING_OP_READ/WRITE; the READV/WRITEV path must be byte-exact too.
    src, dst = _random(256 * KiB, 5), aligned_buffer(256 * KiB)
    with UringQueue(queue_depth=4) as q:
        q._use_rw = False
        fd = q.open_file(tmp_path / "f", write=True, create=True)
        try:
            wait_all(submit_all(q, [IORequest(fd, i * 16 * KiB, src, i * 16 * KiB, 16 * KiB, "write") for i in range(16)]))
            wait_all(submit_all(q, [IORequest(fd, i * 16 * KiB, dst, i * 16 * KiB, 16 * KiB, "read") for i in range(16)]))
        finally:
            os.close(fd)
        assert q.caps().extra["ops"]["vectored"] == 32
    assert torch.equal(src, dst)


def test_callbacks_run_on_the_completion_thread_and_may_resubmit(tmp_path):
    # A chain of dependent IOs driven entirely from done-callbacks: no deadlock on the queue lock.
    src = _random(64 * KiB, 6)
    done = threading.Event()
    threads = set()
    with UringQueue(queue_depth=2) as q:
        fd = q.open_file(tmp_path / "f", write=True, create=True)

        def next_write(fut=None):
            if fut is not None:
                threads.add(threading.current_thread().name)
                fut.result()
            i = 0 if fut is None else fut.request.tag + 1
            if i == 16:
                done.set()
                return
            (f,) = q.submit([IORequest(fd, i * 4096, src, i * 4096, 4096, "write", tag=i)])
            f.add_done_callback(next_write)

        try:
            next_write()
            assert done.wait(10)
            q.drain()
        finally:
            os.close(fd)
    assert threads and all(n.startswith("tutti-uring-reaper") for n in threads)
    assert (tmp_path / "f").read_bytes() == bytes(src.numpy())


def test_close_waits_for_in_flight_io(tmp_path):
    src = _random(1024 * KiB, 7)
    q = UringQueue(queue_depth=64)
    fd = q.open_file(tmp_path / "f", write=True, create=True)
    try:
        futs = q.submit([IORequest(fd, i * 16 * KiB, src, i * 16 * KiB, 16 * KiB, "write") for i in range(64)])
        q.close()
        assert all(f.done() for f in futs) and wait_all(futs) == [16 * KiB] * 64
    finally:
        os.close(fd)
    assert not q._reaper.is_alive()


def test_buffered_fallback_is_recorded(tmp_path):
    with UringQueue() as q:
        direct = q.open_file(tmp_path / "f", write=True, create=True)
        proc = q.open_file("/proc/self/status")  # procfs refuses O_DIRECT
        try:
            assert q.is_direct(direct) is True and q.is_direct(proc) is False
            caps = q.caps()
            assert caps.direct_io is False and caps.extra["buffered_fds"] == [proc]
            # A buffered read still works; the file is shorter than 4 KiB so it is short.
            buf = aligned_buffer(4096)
            (fut,) = q.submit([IORequest(proc, 0, buf, 0, 4096, "read")])
            err = fut.exception(timeout=10)
            assert isinstance(err, IOErrorWithRequest) and "short read" in str(err)
            assert bytes(buf[:5].numpy()) == b"Name:"
        finally:
            os.close(direct)
            os.close(proc)
