"""Thread-pool specifics: pool sizing, partial transfers, buffered fallback."""

import os

import pytest
import torch

from tutti.io.buffers import aligned_buffer
from tutti.io.queue import IOErrorWithRequest, IORequest, submit_all, wait_all
from tutti.io.threads import ThreadQueue

KiB = 1024


def test_pool_never_has_more_workers_than_requests_in_flight():
    with ThreadQueue(queue_depth=4, workers=16) as q:
        caps = q.caps()
        assert caps.extra["workers"] == 4 and caps.max_in_flight == 4 and caps.queue_depth == 4
    with ThreadQueue(queue_depth=64, max_in_flight=32, workers=3) as q:
        assert q.caps().extra["workers"] == 3 and q.caps().max_in_flight == 32


@pytest.mark.parametrize(
    "kwargs, field",
    [({"queue_depth": 0}, "queue_depth"), ({"workers": 0}, "workers"),
     ({"max_io_bytes": 4097}, "max_io_bytes"), ({"max_in_flight": -1}, "max_in_flight")],
)
def test_bad_constructor_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ThreadQueue(**kwargs)


def test_partial_read_at_eof_of_a_direct_file_is_reported_short(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(6000))  # not a multiple of 4 KiB: the direct read stops unaligned
    buf = aligned_buffer(8192)
    with ThreadQueue() as q:
        fd = q.open_file(path)
        try:
            assert q.is_direct(fd) is True
            (fut,) = q.submit([IORequest(fd, 0, buf, 0, 8192, "read")])
            err = fut.exception(timeout=10)
        finally:
            os.close(fd)
    assert isinstance(err, IOErrorWithRequest) and "short read: 6000 of 8192" in str(err)
    assert bytes(buf[:6000].numpy()) == path.read_bytes()


def test_buffered_fallback_file_loops_until_eof():
    # procfs refuses O_DIRECT, so this is the buffered path: the first preadv returns the whole
    # (small) file, the loop reads again, gets 0 (EOF) and reports the short count.
    with ThreadQueue() as q:
        fd = q.open_file("/proc/self/status")
        buf = aligned_buffer(4096)
        try:
            assert q.is_direct(fd) is False and q.caps().extra["buffered_fds"] == [fd]
            (fut,) = q.submit([IORequest(fd, 0, buf, 0, 4096, "read")])
            err = fut.exception(timeout=10)
        finally:
            os.close(fd)
    assert isinstance(err, IOErrorWithRequest) and "short read" in str(err)
    assert bytes(buf[:5].numpy()) == b"Name:"


def test_many_small_requests_across_the_pool(tmp_path):
    n, seg = 256, 4 * KiB
    src = aligned_buffer(n * seg)
    src.copy_(torch.randint(0, 256, (n * seg,), dtype=torch.uint8))
    dst = aligned_buffer(n * seg)
    with ThreadQueue(queue_depth=8, workers=4) as q:
        fd = q.open_file(tmp_path / "f", write=True, create=True)
        try:
            wait_all(submit_all(q, [IORequest(fd, i * seg, src, i * seg, seg, "write") for i in range(n)]))
            wait_all(submit_all(q, [IORequest(fd, i * seg, dst, i * seg, seg, "read") for i in range(n)]))
        finally:
            os.close(fd)
    assert torch.equal(src, dst)


def test_non_contiguous_or_wrong_dtype_buffers_are_refused(tmp_path):
    with ThreadQueue() as q:
        with pytest.raises(ValueError, match="contiguous"):
            q.submit([IORequest(0, 0, aligned_buffer(16384).view(2, 8192)[:, :4096], 0, 4096, "read")])


def test_buffered_fallback_is_said_once_per_queue(tmp_path, caplog):
    """A RAM root refuses O_DIRECT for every slab: one line says so, not one per file."""
    import logging

    from tutti.io.threads import ThreadQueue

    q = ThreadQueue(workers=1)
    try:
        with caplog.at_level(logging.INFO, logger="tutti"):
            for _ in range(3):
                os.close(q.open_file("/proc/self/status"))  # procfs refuses O_DIRECT
        said = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
        assert len(said) == 1 and "said once" in said[0].getMessage()
    finally:
        q.close()
