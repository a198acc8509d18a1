"""ctypes binding to the few libnvm.so C functions a CPU client needs.

libnvm's functions return 0 or a positive errno (a few internal paths return -1); every call
goes through `_call`, which turns a non-zero return into LibnvmError naming the function and
the errno. The CPU client path is:

  nvm_ctrl_init(&ctrl, -1, fd_dev)         wrap an open /dev/ssnvme<N> (no control fd: a client
                                           never binds/unbinds; unlike nvm_ctrl_attach_client it
                                           does not register BAR0 with CUDA)
  nvm_create_group(ctrl, &gid, &max_q)     per-fd queue group
  nvm_dma_map_ring_host(.., gid, .., is_cq) SQ and CQ ring pages (group scoped)
  nvm_dma_map_data_host(..)                data and PRP-list pages (fd scoped)
  nvm_add_user_queue(ctrl, &req)           kernel creates I/O CQ+SQ, returns qid and doorbells
  nvm_destroy_group / nvm_dma_unmap / nvm_ctrl_free_client
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from .uapi import NvmIoctlAddUserQueue, NvmIoctlDev

ENV_LIBNVM = "TUTTI_LIBNVM"


class LibnvmError(OSError):
    """A libnvm call failed; `.errno` is the code it returned, `.call` the function name."""

    def __init__(self, call: str, err: int, detail: str = "") -> None:
        code = err if err > 0 else errno.EIO
        text = os.strerror(code) if err > 0 else f"returned {err}"
        super().__init__(code, f"libnvm {call} failed: {text}" + (f" ({detail})" if detail else ""))
        self.call = call


class NvmDmaHeader(ctypes.Structure):
    """The fixed head of libnvm's nvm_dma_t; `ioaddrs[n_ioaddrs]` (u64) follows at offset 32."""

    _fields_ = [
        ("vaddr", ctypes.c_void_p),
        ("local", ctypes.c_int8),
        ("contiguous", ctypes.c_int8),
        ("page_size", ctypes.c_size_t),
        ("n_ioaddrs", ctypes.c_size_t),
    ]


assert NvmDmaHeader.page_size.offset == 16 and NvmDmaHeader.n_ioaddrs.offset == 24
_IOADDRS_OFFSET = 32


def dma_ioaddrs(handle: int) -> tuple[int, list[int]]:
    """(controller page size, bus address of every page) of an nvm_dma_t*."""
    head = NvmDmaHeader.from_address(handle)
    n = int(head.n_ioaddrs)
    addrs = (ctypes.c_uint64 * n).from_address(handle + _IOADDRS_OFFSET)
    return int(head.page_size), [int(a) for a in addrs]


def ctrl_page_size(ctrl: int) -> int:
    """nvm_ctrl_t starts with the controller memory page size (MPS) as a size_t."""
    return int(ctypes.c_size_t.from_address(ctrl).value)


def find_libnvm(path: str | os.PathLike | None = None) -> str | None:
    """The configured libnvm.so: argument, then $TUTTI_LIBNVM, then the loader's search path."""
    if path:
        return str(path)
    env = os.environ.get(ENV_LIBNVM)
    if env:
        return env
    return ctypes.util.find_library("nvm")


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_U32P = ctypes.POINTER(ctypes.c_uint32)

# name: (restype, argtypes)
_SIGNATURES = {
    "nvm_ctrl_init": (ctypes.c_int, [_PP, ctypes.c_int, ctypes.c_int]),
    "nvm_ctrl_free_client": (None, [_P]),
    "nvm_create_group": (ctypes.c_int, [_P, _U32P, _U32P]),
    "nvm_destroy_group": (ctypes.c_int, [_P, ctypes.c_uint32]),
    "nvm_dma_map_ring_host": (ctypes.c_int, [_PP, _P, ctypes.c_uint32, _P, ctypes.c_size_t, ctypes.c_int]),
    "nvm_dma_map_data_host": (ctypes.c_int, [_PP, _P, _P, ctypes.c_size_t]),
    "nvm_dma_unmap": (None, [_P]),
    "nvm_add_user_queue": (ctypes.c_int, [_P, ctypes.POINTER(NvmIoctlAddUserQueue)]),
    "nvm_wait_dev_info": (ctypes.c_int, [_P, ctypes.POINTER(NvmIoctlDev), ctypes.c_uint32]),
}


class Libnvm:
    """libnvm.so loaded from a configured path, every used function typed."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        found = find_libnvm(path)
        if not found:
            raise OSError(errno.ENOENT, f"libnvm.so not found: pass libnvm=/path/to/libnvm.so or set {ENV_LIBNVM}")
        try:
            self.lib = ctypes.CDLL(found, use_errno=True)
        except OSError as exc:
            raise OSError(errno.ENOENT, f"cannot load libnvm from {found!r}: {exc}") from exc
        self.path = found
        missing = [name for name in _SIGNATURES if not hasattr(self.lib, name)]
        if missing:
            raise OSError(errno.ENOSYS, f"{found}: missing libnvm functions {missing}; this binding needs the "
                                        "queue-group client API (Tutti libnvm, snvme ABI v2)")
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = res, args

    def _call(self, name: str, *args, detail: str = "") -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise LibnvmError(name, rc, detail)

    # -- bring-up ------------------------------------------------------------------------
    def ctrl_init(self, fd_dev: int) -> int:
        ctrl = ctypes.c_void_p()
        self._call("nvm_ctrl_init", ctypes.byref(ctrl), -1, fd_dev, detail=f"fd {fd_dev}")
        if not ctrl.value:
            raise LibnvmError("nvm_ctrl_init", errno.EIO, "returned 0 but no controller handle")
        return ctrl.value

    def ctrl_free_client(self, ctrl: int) -> None:
        self.lib.nvm_ctrl_free_client(ctrl)

    def create_group(self, ctrl: int) -> tuple[int, int]:
        gid, max_q = ctypes.c_uint32(), ctypes.c_uint32()
        self._call("nvm_create_group", ctrl, ctypes.byref(gid), ctypes.byref(max_q))
        if gid.value == 0:
            raise LibnvmError("nvm_create_group", errno.EIO, "kernel returned group id 0")
        return gid.value, max_q.value

    def destroy_group(self, ctrl: int, group_id: int) -> None:
        self._call("nvm_destroy_group", ctrl, group_id, detail=f"group {group_id}")

    # -- mapping -------------------------------------------------------------------------
    def map_ring_host(self, ctrl: int, group_id: int, vaddr: int, size: int, is_cq: bool) -> int:
        h = ctypes.c_void_p()
        self._call("nvm_dma_map_ring_host", ctypes.byref(h), ctrl, group_id, vaddr, size, int(is_cq),
                   detail=f"{'CQ' if is_cq else 'SQ'} ring 0x{vaddr:x}+{size}")
        return h.value

    def map_data_host(self, ctrl: int, vaddr: int, size: int) -> int:
        h = ctypes.c_void_p()
        self._call("nvm_dma_map_data_host", ctypes.byref(h), ctrl, vaddr, size, detail=f"0x{vaddr:x}+{size}")
        return h.value

    def dma_unmap(self, handle: int) -> None:
        if handle:
            self.lib.nvm_dma_unmap(handle)

    def add_user_queue(self, ctrl: int, req: NvmIoctlAddUserQueue) -> None:
        self._call("nvm_add_user_queue", ctrl, ctypes.byref(req), detail=f"group {req.group_id}, {req.nr_pairs} pair(s)")
