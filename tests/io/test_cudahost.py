"""A refused cudaHostRegister leaves no CUDA error behind for the next torch kernel (CUDA only)."""

import mmap

import pytest
import torch

from tutti.io.cudahost import host_register, host_unregister

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cudaHostRegister exists only with CUDA")


@cuda
def test_a_refused_registration_does_not_fail_the_next_kernel():
    buf = mmap.mmap(-1, 1 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    assert host_register(t.data_ptr(), 1 << 20) == 0
    try:
        assert host_register(t.data_ptr(), 1 << 20) != 0  # already registered: refused
        x = torch.ones(1024, device="cuda")
        assert float((x * 2).sum().item()) == 2048.0  # PyTorch's launch check finds no stale error
    finally:
        host_unregister(t.data_ptr())
    del t


def test_without_cuda_nothing_is_loaded():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    from tutti.store import rammap

    assert rammap.register_host(0, 4096) is None
