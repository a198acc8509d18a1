"""ctypes mirrors of the snvme driver's UAPI (ABI version 2) and its ioctl numbers.

Written from the layout the driver's UAPI header documents (sizes and offsets are asserted
at import time, so a drift shows up as an ImportError, not as a kernel writing past a
buffer). Only the structs a libnvm *client* needs are mirrored: the map request, the device
info (with the ABI handshake), the queue group and the add-user-queue payload.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

# -- ioctl number encoding (asm-generic/ioctl.h): dir:2 | size:14 | type:8 | nr:8 ---------
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_NONE, _IOC_WRITE, _IOC_READ = 0, 1, 2


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:
    if not 0 <= size < (1 << _IOC_SIZEBITS):
        raise ValueError(f"ioctl payload size {size} does not fit the 14-bit size field")
    return (direction << _IOC_DIRSHIFT) | (size << _IOC_SIZESHIFT) | (type_ << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT)


def _IOW(type_: int, nr: int, size: int) -> int:
    return _IOC(_IOC_WRITE, type_, nr, size)


def _IOR(type_: int, nr: int, size: int) -> int:
    return _IOC(_IOC_READ, type_, nr, size)


def _IOWR(type_: int, nr: int, size: int) -> int:
    return _IOC(_IOC_READ | _IOC_WRITE, type_, nr, size)


# -- ABI version and capabilities ---------------------------------------------------------
#: The UAPI revision this binding was written against. Version 2 raised the per-group queue
#: cap to 32, which changed the size (hence the ioctl number) of NVM_ADD_USER_QUEUE.
ABI_VERSION = 2
CAP_QUEUE_GROUPS = 1 << 0
CAP_USER_QUEUES = 1 << 1
CAP_RAW_ADMIN = 1 << 2
CAP_KERNEL_IOQ_CAP = 1 << 3
CAP_MAP_KIND_TAG = 1 << 4
#: What the client path uses: groups, user queues and ring/data map tagging.
REQUIRED_CAPS = CAP_QUEUE_GROUPS | CAP_USER_QUEUES | CAP_MAP_KIND_TAG

NVM_IOCTL_TYPE = 0x80
DISK_NAME_LEN = 32
MAX_QUEUES_PER_GROUP = 32

MAP_KIND_UNSPECIFIED = 0
MAP_KIND_RING_SQ = 1
MAP_KIND_RING_CQ = 2
MAP_KIND_DATA = 3


class NvmIoctlMap(ctypes.Structure):
    """Memory map request (map host/device memory for the controller's DMA)."""

    _fields_ = [
        ("vaddr_start", ctypes.c_uint64),
        ("n_pages", ctypes.c_uint64),
        ("ioaddrs", ctypes.c_uint64),  # user address of a u64 array the kernel fills
        ("ioq_idx", ctypes.c_int32),  # -1 in queue-group mode
        ("is_cq", ctypes.c_int32),  # -1 in queue-group mode
        ("group_id", ctypes.c_uint32),
        ("map_kind", ctypes.c_uint8),
        ("reserved0", ctypes.c_uint8 * 3),
    ]


class NvmIoctlDev(ctypes.Structure):
    """Per-controller facts returned by NVM_GET_DEV_INFO; carries the ABI handshake."""

    _fields_ = [
        ("nr_user_q", ctypes.c_uint32),
        ("start_cq_idx", ctypes.c_uint32),
        ("dstrd", ctypes.c_uint8),  # CAP.DSTRD, doorbell stride exponent
        ("max_data_size", ctypes.c_uint64),  # MDTS in bytes (0: no limit reported)
        ("block_size", ctypes.c_uint64),  # namespace LBA size in bytes
        ("disk_name", ctypes.c_char * DISK_NAME_LEN),
        ("q_depth", ctypes.c_uint16),  # entries of every user queue
        ("reserved0", ctypes.c_uint16),
        ("bar0_size", ctypes.c_uint32),
        ("max_user_qid", ctypes.c_uint32),
        ("max_queues_per_group", ctypes.c_uint32),
        ("sgl_supported", ctypes.c_uint32),
        ("abi_version", ctypes.c_uint32),
        ("capabilities", ctypes.c_uint32),
        ("reserved1", ctypes.c_uint32 * 3),
    ]


class NvmIoctlQueueGroup(ctypes.Structure):
    _fields_ = [
        ("group_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("max_queues", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32 * 5),
    ]


class NvmUserQueuePairIn(ctypes.Structure):
    _fields_ = [("sq_vaddr", ctypes.c_uint64), ("cq_vaddr", ctypes.c_uint64)]


class NvmUserQueuePairOut(ctypes.Structure):
    _fields_ = [
        ("sq_doorbell_offset", ctypes.c_uint32),
        ("cq_doorbell_offset", ctypes.c_uint32),
        ("qid", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class NvmIoctlAddUserQueue(ctypes.Structure):
    _fields_ = [
        ("group_id", ctypes.c_uint32),
        ("nr_pairs", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32 * 5),
        ("pairs", NvmUserQueuePairIn * MAX_QUEUES_PER_GROUP),
        ("out_pairs", NvmUserQueuePairOut * MAX_QUEUES_PER_GROUP),
    ]


#: (struct, size, {field: offset}) as the UAPI header locks them on LP64.
LAYOUT = {
    NvmIoctlMap: (40, {"vaddr_start": 0, "n_pages": 8, "ioaddrs": 16, "ioq_idx": 24, "is_cq": 28,
                       "group_id": 32, "map_kind": 36}),
    NvmIoctlDev: (104, {"nr_user_q": 0, "start_cq_idx": 4, "dstrd": 8, "max_data_size": 16,
                        "block_size": 24, "disk_name": 32, "q_depth": 64, "bar0_size": 68,
                        "max_user_qid": 72, "max_queues_per_group": 76, "sgl_supported": 80,
                        "abi_version": 84, "capabilities": 88}),
    NvmIoctlQueueGroup: (32, {"group_id": 0, "flags": 4, "max_queues": 8}),
    NvmUserQueuePairIn: (16, {"sq_vaddr": 0, "cq_vaddr": 8}),
    NvmUserQueuePairOut: (16, {"sq_doorbell_offset": 0, "cq_doorbell_offset": 4, "qid": 8}),
    NvmIoctlAddUserQueue: (1056, {"group_id": 0, "nr_pairs": 4, "pairs": 32, "out_pairs": 544}),
}


def _check_layout() -> None:
    for struct, (size, offsets) in LAYOUT.items():
        if ctypes.sizeof(struct) != size:
            raise ImportError(f"{struct.__name__}: sizeof is {ctypes.sizeof(struct)}, the snvme UAPI says {size}")
        for name, off in offsets.items():
            got = getattr(struct, name).offset
            if got != off:
                raise ImportError(f"{struct.__name__}.{name}: offset {got}, the snvme UAPI says {off}")


_check_layout()

# -- ioctl numbers issued on /dev/ssnvme<N> -------------------------------------------------
_U64, _U32 = 8, 4
NVM_MAP_HOST_MEMORY = _IOW(NVM_IOCTL_TYPE, 1, ctypes.sizeof(NvmIoctlMap))
NVM_MAP_DEVICE_MEMORY = _IOW(NVM_IOCTL_TYPE, 2, ctypes.sizeof(NvmIoctlMap))
NVM_UNMAP_HOST_MEMORY = _IOW(NVM_IOCTL_TYPE, 4, _U64)
NVM_UNMAP_DEVICE_MEMORY = _IOW(NVM_IOCTL_TYPE, 5, _U64)
NVM_GET_DEV_INFO = _IOR(NVM_IOCTL_TYPE, 9, ctypes.sizeof(NvmIoctlDev))
NVM_CREATE_QUEUE_GROUP = _IOWR(NVM_IOCTL_TYPE, 12, ctypes.sizeof(NvmIoctlQueueGroup))
NVM_DESTROY_QUEUE_GROUP = _IOW(NVM_IOCTL_TYPE, 13, _U32)
NVM_ADD_USER_QUEUE = _IOWR(NVM_IOCTL_TYPE, 14, ctypes.sizeof(NvmIoctlAddUserQueue))


class AbiMismatchError(OSError):
    """The running snvme driver speaks another UAPI revision: refuse to touch it."""


def check_handshake(info: NvmIoctlDev, device: str = "snvme device") -> None:
    """Fail closed unless the driver reports exactly our ABI and the capabilities we use.

    abi_version 0 is an old driver that zeroed the (then reserved) field: its structs may be
    laid out differently, so it is refused like any other mismatch.
    """
    if info.abi_version != ABI_VERSION:
        what = "a pre-handshake driver (abi_version 0)" if info.abi_version == 0 else f"ABI v{info.abi_version}"
        raise AbiMismatchError(
            errno.ENODEV,
            f"{device}: the snvme driver reports {what}, this binding speaks ABI v{ABI_VERSION}; "
            "rebuild/reload the snvme module and libnvm from the same Tutti release",
        )
    missing = REQUIRED_CAPS & ~info.capabilities
    if missing:
        names = [n for n, bit in (("QUEUE_GROUPS", CAP_QUEUE_GROUPS), ("USER_QUEUES", CAP_USER_QUEUES),
                                  ("MAP_KIND_TAG", CAP_MAP_KIND_TAG)) if missing & bit]
        raise AbiMismatchError(
            errno.ENODEV,
            f"{device}: the snvme driver lacks capabilities {names} (capabilities=0x{info.capabilities:x})",
        )


def get_dev_info(fd: int, device: str = "snvme device") -> NvmIoctlDev:
    """NVM_GET_DEV_INFO on an open /dev/ssnvme<N>, with the handshake checked."""
    info = NvmIoctlDev()
    try:
        fcntl.ioctl(fd, NVM_GET_DEV_INFO, info, True)
    except OSError as exc:
        raise OSError(exc.errno, f"{device}: ioctl NVM_GET_DEV_INFO failed: {os.strerror(exc.errno or 0)}") from exc
    check_handshake(info, device)
    return info
