"""One queue over several (tutti.io.routed.RoutedQueue), on real queues and files: each request
goes to the queue that opened its file, a full queue ends the accepted prefix as any queue's
does, poll waits on the queue with requests in flight, and caps is what every queue takes."""

import os

import pytest
import torch

from tutti.io.buffers import aligned_buffer
from tutti.io.queue import READ, WRITE, IORequest, WrappedQueue, open_queue, submit_all, wait_all
from tutti.io.routed import RoutedQueue

SEG = 4096


class Counted(WrappedQueue):
    """A real queue that counts what it is handed, and takes at most `take` requests a submit."""

    def __init__(self, inner, take=None):
        super().__init__(inner)
        self.seen, self.take = [], take

    def submit(self, requests):
        got = self.inner.submit(requests if self.take is None else requests[:self.take])
        self.seen.extend(r.fd for r in requests[:len(got)])
        return got


@pytest.fixture
def pair(tmp_path):
    qs = [Counted(open_queue("uring")), Counted(open_queue("threads"))]
    routed = RoutedQueue(qs)
    fds = [routed.opener(i)(tmp_path / f"f{i}", write=True, create=True) for i in range(2)]
    yield routed, qs, fds, tmp_path
    for fd in fds:
        os.close(fd)
    routed.close()


def _data(n, seed):
    buf = aligned_buffer(n * SEG)
    buf.copy_(torch.randint(0, 256, (n * SEG,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def test_each_request_goes_to_the_queue_that_opened_its_file(pair):
    routed, qs, fds, tmp_path = pair
    data = _data(8, 1)
    reqs = [IORequest(fds[i % 2], (i // 2) * SEG, data, i * SEG, SEG, WRITE) for i in range(8)]
    wait_all(submit_all(routed, reqs), timeout=10)
    assert qs[0].seen == [fds[0]] * 4 and qs[1].seen == [fds[1]] * 4
    for i in range(2):
        on_disk = (tmp_path / f"f{i}").read_bytes()
        assert on_disk == b"".join(bytes(data[j * SEG:(j + 1) * SEG].numpy()) for j in range(i, 8, 2))
    back = aligned_buffer(8 * SEG)
    wait_all(submit_all(routed, [IORequest(r.fd, r.offset, back, r.buf_offset, SEG, READ) for r in reqs]), timeout=10)
    assert torch.equal(back, data)
    assert routed.caps().backend == "uring+threads" and routed.caps().extra["queues"] == ["uring", "threads"]


def test_a_full_queue_ends_the_accepted_prefix_and_submit_all_sends_the_rest_in_order(tmp_path):
    qs = [Counted(open_queue("threads")), Counted(open_queue("threads"), take=1)]
    routed = RoutedQueue(qs)
    fds = [routed.opener(i)(tmp_path / f"f{i}", write=True, create=True) for i in range(2)]
    try:
        data = _data(6, 2)
        reqs = [IORequest(fds[0], 0, data, 0, SEG, WRITE), IORequest(fds[1], 0, data, SEG, SEG, WRITE),
                IORequest(fds[1], SEG, data, 2 * SEG, SEG, WRITE), IORequest(fds[0], SEG, data, 3 * SEG, SEG, WRITE)]
        taken = routed.submit(reqs)
        assert [f.request for f in taken] == reqs[:2]  # the second queue took one of its two: a prefix
        wait_all(taken + submit_all(routed, reqs[2:]), timeout=10)
        assert qs[0].seen == [fds[0]] * 2 and qs[1].seen == [fds[1]] * 2
        assert (tmp_path / "f1").read_bytes() == bytes(data[SEG:3 * SEG].numpy())
    finally:
        for fd in fds:
            os.close(fd)
        routed.close()


def test_poll_waits_on_the_queue_with_requests_in_flight(pair):
    routed, qs, fds, _ = pair
    data = _data(1, 3)
    fut = routed.submit([IORequest(fds[1], 0, data, 0, SEG, WRITE)])[0]
    n = 0
    for _ in range(200):
        n += routed.poll(0.05)
        if fut.done():
            break
    assert fut.done() and fut.result() == SEG and n >= 1
    assert routed.poll(0.0) == 0 and routed.poll(0.01) == 0  # nothing in flight: returns at once


def test_a_reused_fd_number_is_routed_by_its_newest_open(pair):
    routed, qs, fds, tmp_path = pair
    os.close(fds[1])
    again = routed.opener(0)(tmp_path / "g", write=True, create=True)
    fds[1] = again
    assert routed.queue_of(again) == 0 and routed.queue_of(fds[0]) == 0
    wait_all(submit_all(routed, [IORequest(again, 0, _data(1, 4), 0, SEG, WRITE)]), timeout=10)
    assert qs[1].seen == [] and qs[0].seen == [again]
