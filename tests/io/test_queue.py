"""The queue contract, checked on every backend against real files in a tmp dir."""

import errno
import os
import resource
import warnings

import pytest
import torch

from tutti.io.buffers import aligned_buffer
from tutti.io.queue import (
    IOErrorWithRequest,
    IORequest,
    available_backends,
    open_queue,
    submit_all,
    wait_all,
)
from tutti.io.threads import ThreadQueue
from tutti.io.uring import UringQueue

BACKENDS = ["uring", "threads"]
KiB = 1024


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _random(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    buf = aligned_buffer(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return buf


def _segments(fd, buf, seg, op, file_base=0, buf_base=0, count=None):
    count = count if count is not None else (buf.numel() - buf_base) // seg
    return [IORequest(fd, file_base + i * seg, buf, buf_base + i * seg, seg, op, tag=i) for i in range(count)]


def test_both_backends_are_registered():
    assert {"uring", "threads"} <= set(available_backends())


@pytest.mark.parametrize("registered", [True, False], ids=["fixed", "unregistered"])
@pytest.mark.parametrize("seg", [4 * KiB, 64 * KiB, 1024 * KiB])
def test_write_then_read_round_trip_is_byte_exact(tmp_path, backend, registered, seg):
    nbytes = 2 * 1024 * KiB
    src = _random(nbytes, seed=seg)
    dst = aligned_buffer(nbytes)
    with open_queue(backend, queue_depth=16) as q:
        if registered:
            q.register_buffers([src, dst])
        fd = q.open_file(tmp_path / "data", write=True, create=True)
        try:
            futs = submit_all(q, _segments(fd, src, seg, "write"))
            assert wait_all(futs) == [seg] * (nbytes // seg)
            assert [f.request.tag for f in futs] == list(range(nbytes // seg))
            # Read back in a different order and into a shifted layout to catch offset mix-ups.
            reqs = _segments(fd, dst, seg, "read")[::-1]
            assert wait_all(submit_all(q, reqs)) == [seg] * len(reqs)
        finally:
            os.close(fd)
        if backend == "uring":
            ops = q.caps().extra["ops"]
            assert (ops["fixed"] > 0) == registered and (ops["plain"] > 0) == (not registered)
    assert torch.equal(src, dst)
    with open(tmp_path / "data", "rb") as f:
        assert f.read() == bytes(src.numpy())


def test_round_trip_at_buffer_and_file_offsets(tmp_path, backend):
    src = _random(256 * KiB, seed=1)
    dst = aligned_buffer(512 * KiB)
    with open_queue(backend) as q:
        fd = q.open_file(tmp_path / "f", write=True, create=True)
        try:
            w = IORequest(fd, 1024 * KiB, src, 64 * KiB, 128 * KiB, "write")
            wait_all(submit_all(q, [w]))
            r = IORequest(fd, 1024 * KiB, dst, 256 * KiB, 128 * KiB, "read")
            wait_all(submit_all(q, [r]))
        finally:
            os.close(fd)
    assert torch.equal(dst[256 * KiB : 384 * KiB], src[64 * KiB : 192 * KiB])
    assert int(dst[: 256 * KiB].sum()) == 0 and int(dst[384 * KiB :].sum()) == 0
    assert os.path.getsize(tmp_path / "f") == 1152 * KiB


def test_partial_acceptance_then_submit_all_finishes_everything(tmp_path, backend):
    seg, batch = 4 * KiB, 32
    src = _random(seg * batch, seed=2)
    dst = aligned_buffer(seg * batch)
    with open_queue(backend, queue_depth=4) as q:
        assert q.caps().max_in_flight == 4
        fd = q.open_file(tmp_path / "f", write=True, create=True)
        try:
            reqs = _segments(fd, src, seg, "write")
            first = q.submit(reqs)
            assert 1 <= len(first) <= 4  # a prefix, not the whole batch
            assert [f.request for f in first] == reqs[: len(first)]
            rest = submit_all(q, reqs[len(first) :])
            assert len(rest) == batch - len(first)
            wait_all(first + rest)
            wait_all(submit_all(q, _segments(fd, dst, seg, "read")))
            q.drain()
            assert q.submit([]) == []
        finally:
            os.close(fd)
    assert torch.equal(src, dst)


def test_misaligned_request_is_refused_before_any_io(tmp_path, backend):
    path = tmp_path / "f"
    path.write_bytes(b"\x11" * 8192)
    buf = _random(64 * KiB, seed=3)
    with open_queue(backend) as q:
        fd = q.open_file(path, write=True)
        try:
            good = IORequest(fd, 0, buf, 0, 4096, "write")
            for field, bad in [
                ("offset", IORequest(fd, 100, buf, 0, 4096, "write")),
                ("buf_offset", IORequest(fd, 4096, buf, 512, 4096, "write")),
                ("length", IORequest(fd, 4096, buf, 0, 1000, "write")),
                ("op", IORequest(fd, 4096, buf, 0, 4096, "append")),
                ("buf_offset", IORequest(fd, 0, buf, 60 * KiB, 8 * KiB, "write")),
                ("length", IORequest(fd, 0, buf, 0, 64 << 20, "write")),
            ]:
                with pytest.raises(ValueError, match=field):
                    q.submit([good, bad])  # the good one must not be issued either
            with pytest.raises(ValueError, match="uint8"):
                q.submit([IORequest(fd, 0, torch.zeros(4096, dtype=torch.float32), 0, 4096, "write")])
            q.drain()
        finally:
            os.close(fd)
    assert path.read_bytes() == b"\x11" * 8192  # untouched


def test_short_read_past_eof_is_an_error_naming_the_request(tmp_path, backend):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8192))
    buf = aligned_buffer(64 * KiB)
    with open_queue(backend) as q:
        fd = q.open_file(path)
        try:
            straddling = IORequest(fd, 4096, buf, 0, 16 * KiB, "read", tag="straddle")
            beyond = IORequest(fd, 1 << 20, buf, 16 * KiB, 4096, "read", tag="beyond")
            ok = IORequest(fd, 0, buf, 32 * KiB, 8192, "read", tag="ok")
            futs = submit_all(q, [straddling, beyond, ok])
            for fut, req in zip(futs[:2], [straddling, beyond]):
                err = fut.exception(timeout=10)
                assert isinstance(err, IOErrorWithRequest)
                assert err.request is req and err.errno == errno.EIO
                assert "short read" in str(err) and str(req.offset) in str(err)
            assert futs[2].result(timeout=10) == 8192
            with pytest.raises(IOErrorWithRequest):
                wait_all(futs)
        finally:
            os.close(fd)
    assert bytes(buf[32 * KiB : 40 * KiB].numpy()) == path.read_bytes()


def test_read_from_closed_fd_is_ebadf_naming_the_request(tmp_path, backend):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8192))
    buf = aligned_buffer(8192)
    with open_queue(backend) as q:
        opened = q.open_file(path)
        # moved to the top of the table before closing: the kernel hands out the lowest free number,
        # so no other thread of the test run reuses this one between the close and the read
        fd = os.dup2(opened, min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096) - 1)
        os.close(opened)
        os.close(fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # really closed, not reused
        req = IORequest(fd, 0, buf, 0, 4096, "read")
        (fut,) = q.submit([req])
        err = fut.exception(timeout=10)
        assert isinstance(err, IOErrorWithRequest) and err.errno == errno.EBADF and err.request is req
        q.drain()
        # The queue is still usable after a failed request.
        fd = q.open_file(path)
        try:
            assert wait_all(q.submit([IORequest(fd, 0, buf, 0, 8192, "read")])) == [8192]
        finally:
            os.close(fd)


def test_done_callbacks_and_poll(tmp_path, backend):
    buf = _random(64 * KiB, seed=4)
    seen = []
    with open_queue(backend) as q:
        fd = q.open_file(tmp_path / "f", write=True, create=True)
        try:
            futs = q.submit(_segments(fd, buf, 4096, "write"))
            for f in futs:
                f.add_done_callback(lambda f: seen.append(f.request.tag))
            wait_all(futs)
            q.drain()
            assert q.poll(0.0) == len(futs)  # completions since the last poll
            assert q.poll(0.0) == 0
            late = []
            futs[0].add_done_callback(late.append)  # already done: runs at once
            assert late == [futs[0]]
        finally:
            os.close(fd)
    assert sorted(seen) == list(range(16))


def test_closed_queue_refuses_work(tmp_path, backend):
    q = open_queue(backend)
    q.close()
    q.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        q.submit([IORequest(0, 0, aligned_buffer(4096), 0, 4096, "read")])


def test_auto_is_uring_on_this_machine():
    with open_queue("auto") as q:
        assert isinstance(q, UringQueue) and q.caps().backend == "uring"


def test_auto_falls_back_to_threads_with_one_warning():
    # An io_uring_setup the kernel refuses (unknown setup flag -> EINVAL) stands in for a
    # kernel without io_uring or with it disabled by seccomp/sysctl.
    with pytest.raises(OSError):
        UringQueue(uring_setup_flags=1 << 31)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = open_queue("auto", queue_depth=8, uring_setup_flags=1 << 31)
    try:
        assert isinstance(q, ThreadQueue) and q.caps().max_in_flight == 8
        msgs = [str(w.message) for w in caught]
        assert len(msgs) == 1 and "io_uring refused" in msgs[0] and "threads" in msgs[0]
    finally:
        q.close()


def test_unknown_backend_is_a_clear_value_error():
    with pytest.raises(ValueError, match="io_backend='spdk'"):
        open_queue("spdk")


def test_submit_all_validates_the_whole_list_before_the_first_window(tmp_path, backend):
    path = tmp_path / "f"
    path.write_bytes(b"\x22" * 4096)
    buf = _random(32 * 4096, seed=9)
    with open_queue(backend, queue_depth=4) as q:
        fd = q.open_file(path, write=True)
        try:
            reqs = _segments(fd, buf, 4096, "write")
            reqs[30] = IORequest(fd, 30 * 4096 + 512, buf, 30 * 4096, 4096, "write")
            with pytest.raises(ValueError, match="offset"):
                submit_all(q, reqs)  # far beyond the first window of 4
            q.drain()
        finally:
            os.close(fd)
    assert path.read_bytes() == b"\x22" * 4096


def _count_in_flight(q):
    """Wrap q.submit: [peak bytes submitted and not yet done, at any submission], and the real submit."""
    peak, submitted, real_submit = [0], [], q.submit

    def counting_submit(reqs):
        futs = real_submit(reqs)
        submitted.extend(futs)
        peak[0] = max(peak[0], sum(f.request.length for f in submitted if not f.done()))
        return futs

    q.submit = counting_submit
    return peak, real_submit


@pytest.mark.parametrize("window", [None, 256 * KiB, 64 * KiB])
def test_windowed_writes_keep_at_most_the_window_in_flight_and_write_everything(tmp_path, backend, window):
    from tutti.io.queue import submit_windowed

    nbytes, seg = 2 * 1024 * KiB, 64 * KiB
    src = _random(nbytes, seed=9)
    with open_queue(backend, queue_depth=64) as q:
        fd = q.open_file(tmp_path / "data", write=True, create=True)
        peak, real_submit = _count_in_flight(q)
        try:
            errors: dict = {}
            futs, stalled = submit_windowed(q, _segments(fd, src, seg, "write"), window, 10.0, errors)
        finally:
            q.submit = real_submit
            os.close(fd)
    assert not stalled and not errors and len(futs) == nbytes // seg and all(f.done() for f in futs)
    if window is not None:
        assert peak[0] <= window
    with open(tmp_path / "data", "rb") as f:
        assert f.read() == bytes(src.numpy())


def test_windowed_writes_after_a_stall_submit_nothing_more(tmp_path):
    from tutti.io.queue import submit_windowed

    class Stalling(ThreadQueue):
        """The second request never completes (a hung file system)."""

        def submit(self, reqs):
            futs = super().submit([r for r in reqs if r.tag != 1])
            if any(r.tag == 1 for r in reqs):
                from tutti.io.queue import IOFuture

                futs.append(IOFuture(next(r for r in reqs if r.tag == 1)))
            return futs

    src = _random(4 * 64 * KiB, seed=3)
    q = Stalling()
    fd = q.open_file(tmp_path / "data", write=True, create=True)
    try:
        errors: dict = {}
        futs, stalled = submit_windowed(q, _segments(fd, src, 64 * KiB, "write"), 128 * KiB, 0.3, errors)
    finally:
        os.close(fd)
        q.close()
    # 0 and 1 fill the window; 0 completes, so 2 goes in; waiting for 1 stalls: 3 is never submitted
    assert stalled and [f.request.tag for f in futs] == [0, 1, 2]
    assert isinstance(errors[1], TimeoutError) and isinstance(errors[3], TimeoutError)
    assert "not submitted" in str(errors[3]) and 0 not in errors


def test_writes_yield_to_tracked_reads_until_they_land(tmp_path, backend):
    """ReadsFirst: a writer's window is `yield_bytes` while a tracked read is in flight, the
    whole window once it landed; no window stays no window (RAM roots)."""
    from functools import partial

    from tutti.io.queue import IOFuture, ReadsFirst, submit_windowed

    nbytes, seg = 1024 * KiB, 64 * KiB
    src = _random(nbytes, seed=11)
    rf = ReadsFirst(seg)
    pending = IOFuture(IORequest(0, 0, src, 0, seg, "read"))
    rf.track([pending])
    assert rf.reading() and rf.window(None) is None and rf.window(8 * seg) == seg
    with open_queue(backend, queue_depth=64) as q:
        fd = q.open_file(tmp_path / "data", write=True, create=True)
        peak, real_submit = _count_in_flight(q)
        try:
            errors: dict = {}
            futs, stalled = submit_windowed(q, _segments(fd, src, seg, "write"), partial(rf.window, 8 * seg),
                                            10.0, errors)
        finally:
            q.submit = real_submit
            os.close(fd)
    assert not stalled and not errors and all(f.done() for f in futs) and peak[0] <= seg
    with open(tmp_path / "data", "rb") as f:
        assert f.read() == bytes(src.numpy())
    pending.set_result(seg)
    assert not rf.reading() and rf.window(8 * seg) == 8 * seg


def test_reads_first_counts_a_read_in_flight_whatever_order_reads_land_in():
    from tutti.io.queue import IOFuture, ReadsFirst

    buf = aligned_buffer(4 * KiB)
    a, b, c = (IOFuture(IORequest(0, 0, buf, 0, 4 * KiB, "read")) for _ in range(3))
    rf = ReadsFirst(4 * KiB)
    assert not rf.reading() and rf.window(64 * KiB) == 64 * KiB and rf.yields == 0
    rf.track([a, b])
    rf.track([c])
    b.set_result(4 * KiB)  # a later read lands first
    c.set_result(4 * KiB)
    assert rf.reading() and rf.window(64 * KiB) == 4 * KiB and rf.yields == 1
    a.set_exception(OSError(5, "EIO"))  # a failed read is done too
    assert not rf.reading() and rf.window(64 * KiB) == 64 * KiB
    with pytest.raises(ValueError, match="yield_bytes=0"):
        ReadsFirst(0)


def test_reads_first_keeps_only_reads_in_flight_while_no_writer_asks():
    from tutti.io.queue import IOFuture, ReadsFirst

    buf = aligned_buffer(4 * KiB)
    rf = ReadsFirst(4 * KiB)
    for _ in range(1000):  # a server that loads and never stores
        fut = IOFuture(IORequest(0, 0, buf, 0, 4 * KiB, "read"))
        rf.track([fut])
        fut.set_result(4 * KiB)
    assert len(rf._reads) <= 1


def test_a_writer_waits_for_reads_asleep_not_polling():
    """ReadsFirst.wait_idle: a writer yielding to the hits' reads sleeps until the reads land
    (or its cap passes), whatever order they land in, and wakes about once per read it waits on
    rather than polling beside the step: counted in calls to done(), not timed."""
    import threading
    import time

    from tutti.io.queue import IOFuture, ReadsFirst

    calls = [0]

    class Counted(IOFuture):
        __slots__ = ()

        def done(self) -> bool:
            calls[0] += 1
            return super().done()

    buf = aligned_buffer(4 * KiB)
    a, b, c = (Counted(IORequest(0, 0, buf, 0, 4 * KiB, "read")) for _ in range(3))
    rf = ReadsFirst(4 * KiB)
    assert rf.wait_idle(0.0)  # nothing tracked: at once
    rf.track([a, b, c])
    c.set_result(4 * KiB)  # the newest lands first: the writer waits on b, then a
    assert not rf.wait_idle(0.05)  # the cap passes with reads in flight
    calls[0] = 0

    def land() -> None:
        time.sleep(0.2)
        b.set_result(4 * KiB)
        time.sleep(0.2)
        a.set_exception(OSError(5, "EIO"))  # a failed read has landed too

    t = threading.Thread(target=land)
    t.start()
    assert rf.wait_idle(30.0) and not rf.reading()
    t.join()
    assert a.done() and b.done()
    assert calls[0] < 40  # polling at 0.5 ms would have asked some 800 times in 0.4 s


def test_a_wrapped_queue_hands_every_call_to_the_real_one(tmp_path):
    """WrappedQueue: a subclass sees each request and the bytes still land through the real backend."""
    from tutti.io.queue import READ, WRITE, IORequest, WrappedQueue, open_queue

    class Counting(WrappedQueue):
        def __init__(self, inner):
            super().__init__(inner)
            self.seen = []

        def submit(self, requests):
            self.seen += [(r.op, r.length) for r in requests]
            return super().submit(requests)

    from tutti.io.buffers import aligned_buffer

    q = Counting(open_queue("threads"))
    assert q.name == "threads" and q.caps().backend == "threads"
    buf = aligned_buffer(8192)
    buf.zero_()
    q.register_buffers([buf])
    fd = q.open_file(tmp_path / "f", write=True, create=True)
    buf[:4096] = 7
    q.submit([IORequest(fd, 0, buf, 0, 4096, WRITE)])[0].result(timeout=10)
    q.submit([IORequest(fd, 0, buf, 4096, 4096, READ)])[0].result(timeout=10)
    assert q.seen == [(WRITE, 4096), (READ, 4096)] and bool((buf[4096:] == 7).all())
    q.drain()
    q.close()
