"""Page-locking host memory for DMA (cudaHostRegister), without leaving an error behind.

Why: a refused cudaHostRegister (a file-backed mapping on a disk file system, a read-only flag
the driver does not take) returns its error *and* records it as the thread's last CUDA error.
PyTorch checks that record after its next kernel launch on the same thread and raises there: a
refusal that tutti handles (it copies through CUDA's staging instead) would fail a later,
unrelated torch operation. So a refusal is cleared at once with cudaGetLastError, on the thread
that made it.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("tutti.io")

_cudart_lib: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime this process already loaded (PyTorch's), found in /proc/self/maps."""
    global _cudart_lib
    if _cudart_lib is not False:
        return _cudart_lib  # type: ignore[return-value]
    _cudart_lib = None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for p in sorted(paths):
            try:
                _cudart_lib = ctypes.CDLL(p)  # already loaded: the same handle, no second runtime
                break
            except OSError:
                continue
    except OSError:
        pass
    return _cudart_lib  # type: ignore[return-value]


def clear_last_error() -> None:
    """Reset this thread's last CUDA runtime error (after a call whose failure was handled)."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()
        return
    # no shared runtime to call (a statically linked build): let PyTorch's own launch check
    # read the record and clear it
    try:
        torch.empty(1, device="cuda").zero_()
        torch.cuda.current_stream().synchronize()
    except RuntimeError:
        pass


def host_register(addr: int, nbytes: int, flags: int = 0) -> int:
    """cudaHostRegister; returns its error code (0 = registered). A refusal leaves no error behind."""
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, flags))
    if err != 0:
        clear_last_error()
    return err


def host_unregister(addr: int) -> None:
    """cudaHostUnregister; a refusal leaves no error behind. Also runs from finalizers (an owner
    dropped at interpreter exit): it never raises."""
    try:
        err = int(torch.cuda.cudart().cudaHostUnregister(addr))
        if err != 0:
            clear_last_error()
    except Exception:  # noqa: BLE001 - CUDA already torn down: the process's pages go with it
        pass
