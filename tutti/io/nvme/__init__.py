"""The "nvme" IO backend: tutti submits NVMe commands itself through Tutti's libnvm/snvme.

Importing this package never touches hardware: it only registers the backend name. Opening a
queue (`open_queue("nvme", device=..., libnvm=..., nsid=..., depth=...)`) raises OSError naming
what is missing when there is no /dev/ssnvme* device or no libnvm.so.
"""

from __future__ import annotations

from ..queue import IOQueue, register_backend
from .backend import NvmeQueue
from .fiemap import Extent, ExtentError, FiemapResolver, FileExtents, Segment, fiemap
from .prp import PrpPlan, build_prps, max_prp_bytes, pages_touched
from .qpair import QueuePair, QueueProtocolError
from .uapi import ABI_VERSION, AbiMismatchError, check_handshake

__all__ = [
    "ABI_VERSION", "AbiMismatchError", "Extent", "ExtentError", "FiemapResolver", "FileExtents", "NvmeQueue",
    "PrpPlan", "QueuePair", "QueueProtocolError", "Segment", "build_prps", "check_handshake", "fiemap",
    "max_prp_bytes", "open_nvme_queue", "pages_touched",
]


@register_backend("nvme")
def open_nvme_queue(device: str | None = None, libnvm: str | None = None, nsid: int | None = None,
                    depth: int | None = None) -> IOQueue:
    """Attach to /dev/ssnvme<N> (or $TUTTI_SNVME_DEV) through libnvm.so (or $TUTTI_LIBNVM)."""
    from .device import open_device_queue

    return open_device_queue(device=device, libnvm=libnvm, nsid=nsid, depth=depth)
