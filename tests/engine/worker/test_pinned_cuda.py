"""PinnedInts (CUDA only): uploads land intact, sections are reused only once their copies are
done, oversize requests fall back. Runs on the GPU machine (`python3 tests/engine/worker/test_pinned_cuda.py`)."""
from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_uploads_are_intact_across_many_wraps():
    from tutti.engine.worker.context import PinnedInts

    p = PinnedInts(entries=1024, sections=4)
    dev = torch.device("cuda", 0)
    outs, wants = [], []
    for i in range(2000):  # 2000 x ~100 entries: the ring wraps about 200 times
        vals = torch.arange(i, i + 37 + i % 97, dtype=torch.int64)
        outs.append(p.upload(vals, dev))
        wants.append(vals)
    torch.cuda.synchronize()
    for o, w in zip(outs, wants):
        assert torch.equal(o.cpu(), w)
    big = torch.arange(5000, dtype=torch.int64)
    assert torch.equal(p.upload(big, dev).cpu(), big) and p.fallbacks >= 1


@cuda
def test_a_section_still_being_copied_is_not_overwritten():
    from tutti.engine.worker.context import PinnedInts

    p = PinnedInts(entries=64, sections=2)
    dev = torch.device("cuda", 0)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # the stream is busy: its copies are not done
        first = p.upload(torch.full((32,), 7, dtype=torch.int64), dev)
        second = p.upload(torch.full((32,), 8, dtype=torch.int64), dev)  # section 1
        third = p.upload(torch.full((32,), 9, dtype=torch.int64), dev)  # section 0 is busy: fallback
    assert p.fallbacks == 1
    torch.cuda.synchronize()
    assert first.cpu().eq(7).all() and second.cpu().eq(8).all() and third.cpu().eq(9).all()


if __name__ == "__main__":
    test_uploads_are_intact_across_many_wraps()
    test_a_section_still_being_copied_is_not_overwritten()
    print("PINNED_OK")
