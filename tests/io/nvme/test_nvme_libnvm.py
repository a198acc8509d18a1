"""The libnvm binding's loading and error conversion (no libnvm.so on this machine)."""

import ctypes
import ctypes.util
import errno

import pytest

from tutti.io.nvme.libnvm import Libnvm, LibnvmError, NvmDmaHeader, dma_ioaddrs


def test_missing_library_names_the_env_var(monkeypatch):
    monkeypatch.setenv("TUTTI_LIBNVM", "/nonexistent/libnvm.so")
    with pytest.raises(OSError, match="/nonexistent/libnvm.so") as ei:
        Libnvm()
    assert ei.value.errno == errno.ENOENT


def test_a_library_without_the_client_api_is_refused():
    libc = ctypes.util.find_library("c")
    with pytest.raises(OSError, match="nvm_create_group") as ei:
        Libnvm(libc)
    assert ei.value.errno == errno.ENOSYS


def test_error_names_call_and_errno():
    e = LibnvmError("nvm_add_user_queue", errno.EBUSY, "group 3, 1 pair(s)")
    assert e.errno == errno.EBUSY and e.call == "nvm_add_user_queue"
    assert "nvm_add_user_queue" in str(e) and "busy" in str(e).lower() and "group 3" in str(e)
    assert LibnvmError("nvm_create_group", -1).errno == errno.EIO


def test_dma_descriptor_layout_is_read_from_memory():
    # an nvm_dma_t laid out by hand: header then ioaddrs[]
    class Dma(ctypes.Structure):
        _fields_ = [("head", NvmDmaHeader), ("ioaddrs", ctypes.c_uint64 * 3)]

    d = Dma()
    d.head.page_size, d.head.n_ioaddrs = 4096, 3
    d.ioaddrs[:] = [0x1000, 0x5000, 0x3000]
    assert Dma.ioaddrs.offset == 32
    assert dma_ioaddrs(ctypes.addressof(d)) == (4096, [0x1000, 0x5000, 0x3000])
