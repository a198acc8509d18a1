"""IO backends open like kernel variants: 'package.module:attr' or a registered name, with the
backend's own options (`io_options`), through the real worker pipeline."""

from __future__ import annotations

import pytest
import torch

from tutti.engine.config.settings import EngineConfig
from tutti.engine.plan import LoadChunk, StepPlan

from worker_helpers import make_caches, run_step, store_chunks, worker


@pytest.mark.parametrize("backend,options,label", [
    ("iobackend_example:CountingQueue", {"label": "cls", "workers": 3}, "cls"),
    ("iobackend_example:make", {"label": "fn"}, "fn"),
])
def test_a_backend_by_module_path_with_its_options_moves_the_bytes(tmp_path, backend, options, label):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(3, [0, 1])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, io_backend=backend, io_options=options)
    assert type(w.queue).__name__ == "CountingQueue" and w.queue.label == label
    run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 3, (20, 21))]))
    assert w.take_failed_blocks() == set() and w.queue.submitted > 0
    for s, d in zip(src, dst):
        assert torch.equal(d[[20, 21]], s[[0, 1]])
    w.close()


def test_bad_backends_and_options_are_refused_naming_the_key(tmp_path):
    base = {"root": str(tmp_path), "capacity_bytes": "1GiB"}
    with pytest.raises(ValueError, match=r"io_backend='nope': unknown backend.*package.module:attr"):
        EngineConfig.from_dict({**base, "io_backend": "nope"})
    with pytest.raises(ValueError, match=r"io_backend='no_such_module:X': cannot import module"):
        EngineConfig.from_dict({**base, "io_backend": "no_such_module:X"})
    with pytest.raises(ValueError, match=r"io_backend='iobackend_example:nothing': module .* has no attribute"):
        EngineConfig.from_dict({**base, "io_backend": "iobackend_example:nothing"})
    with pytest.raises(ValueError, match=r"io_options=\['x'\]: expected a mapping"):
        EngineConfig.from_dict({**base, "io_options": ["x"]})
    with pytest.raises(ValueError, match=r"io_options=.*refused them"):
        worker(tmp_path, make_caches(0), io_backend="threads", io_options={"colour": "red"})
    import iobackend_example  # noqa: F401 - registers "counting-example" in this process

    assert EngineConfig.from_dict({**base, "io_backend": "counting-example"}).io_backend == "counting-example"


@pytest.mark.parametrize("backend", ["threads", "uring"])
def test_buffered_reads_on_request(tmp_path, backend):
    """io_options {"direct": false}: the page cache on purpose (a disk whose data it may hold)."""
    from tutti.io.queue import available_backends

    if backend not in available_backends():
        pytest.skip(f"{backend} not available here")
    src = make_caches(0)
    store_chunks(tmp_path, src, [(3, [0, 1])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, io_backend=backend, io_options={"direct": False})
    run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 3, (20, 21))]))
    assert w.take_failed_blocks() == set()
    fd = w.store.location(3, 0)[0]
    assert w.queue.is_direct(fd) is False and w.queue.caps().direct_io is False
    for s, d in zip(src, dst):
        assert torch.equal(d[[20, 21]], s[[0, 1]])
    w.close()
    with pytest.raises(ValueError, match="direct='no'"):
        worker(tmp_path, make_caches(0), io_backend=backend, io_options={"direct": "no"})
