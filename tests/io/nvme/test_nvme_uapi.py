"""snvme UAPI mirrors: sizes, offsets, ioctl numbers and the fail-closed ABI handshake."""

import ctypes
import errno
import os

import pytest

from tutti.io.nvme import uapi
from tutti.io.nvme.fiemap import FS_IOC_FIEMAP


@pytest.mark.parametrize(
    "struct,size",
    [(uapi.NvmIoctlMap, 40), (uapi.NvmIoctlDev, 104), (uapi.NvmIoctlQueueGroup, 32),
     (uapi.NvmIoctlAddUserQueue, 1056), (uapi.NvmUserQueuePairIn, 16), (uapi.NvmUserQueuePairOut, 16)],
)
def test_struct_sizes_match_the_uapi_header(struct, size):
    assert ctypes.sizeof(struct) == size


def test_field_offsets_match_the_uapi_header():
    assert uapi.NvmIoctlMap.ioaddrs.offset == 16
    assert uapi.NvmIoctlMap.is_cq.offset == 28
    assert uapi.NvmIoctlMap.map_kind.offset == 36
    assert uapi.NvmIoctlDev.dstrd.offset == 8
    assert uapi.NvmIoctlDev.max_data_size.offset == 16  # 7 bytes of padding after dstrd
    assert uapi.NvmIoctlDev.disk_name.offset == 32
    assert uapi.NvmIoctlDev.q_depth.offset == 64
    assert uapi.NvmIoctlDev.abi_version.offset == 84
    assert uapi.NvmIoctlDev.capabilities.offset == 88
    assert uapi.NvmIoctlQueueGroup.max_queues.offset == 8
    assert uapi.NvmIoctlAddUserQueue.pairs.offset == 32
    assert uapi.NvmIoctlAddUserQueue.out_pairs.offset == 544
    for struct, (size, offsets) in uapi.LAYOUT.items():
        for name, off in offsets.items():
            assert getattr(struct, name).offset == off, (struct.__name__, name)


def test_ioctl_numbers_encode_dir_size_type_nr():
    # dir<<30 | size<<16 | type<<8 | nr, computed by hand from the header's definitions.
    assert uapi.NVM_MAP_HOST_MEMORY == (1 << 30) | (40 << 16) | (0x80 << 8) | 1 == 0x40288001
    assert uapi.NVM_GET_DEV_INFO == (2 << 30) | (104 << 16) | (0x80 << 8) | 9 == 0x80688009
    assert uapi.NVM_CREATE_QUEUE_GROUP == 0xC020800C
    assert uapi.NVM_DESTROY_QUEUE_GROUP == 0x4004800D
    assert uapi.NVM_ADD_USER_QUEUE == 0xC420800E  # ABI v2: 1056-byte payload
    assert uapi.NVM_UNMAP_HOST_MEMORY == 0x40088004
    # The same macros give the kernel's well-known FS_IOC_FIEMAP value.
    assert FS_IOC_FIEMAP == 0xC020660B


def test_ioc_rejects_a_payload_too_large_for_the_size_field():
    with pytest.raises(ValueError, match="14-bit"):
        uapi._IOW(0x80, 1, 1 << 14)


def _info(abi=uapi.ABI_VERSION, caps=uapi.REQUIRED_CAPS):
    info = uapi.NvmIoctlDev()
    info.abi_version, info.capabilities = abi, caps
    return info


def test_handshake_accepts_our_abi_with_required_caps():
    uapi.check_handshake(_info())
    uapi.check_handshake(_info(caps=0x1F))


@pytest.mark.parametrize("abi", [0, 1, 3, 0xFFFFFFFF])
def test_handshake_fails_closed_on_any_other_abi(abi):
    with pytest.raises(uapi.AbiMismatchError) as ei:
        uapi.check_handshake(_info(abi=abi), "/dev/ssnvme7")
    assert ei.value.errno == errno.ENODEV
    assert "/dev/ssnvme7" in str(ei.value) and "ABI v2" in str(ei.value)
    if abi == 0:
        assert "pre-handshake" in str(ei.value)


def test_handshake_fails_closed_on_missing_capabilities():
    with pytest.raises(uapi.AbiMismatchError, match="USER_QUEUES"):
        uapi.check_handshake(_info(caps=uapi.CAP_QUEUE_GROUPS | uapi.CAP_MAP_KIND_TAG))


def test_get_dev_info_on_a_non_snvme_fd_names_the_ioctl():
    fd = os.open("/dev/null", os.O_RDWR)
    try:
        with pytest.raises(OSError, match="NVM_GET_DEV_INFO") as ei:
            uapi.get_dev_info(fd, "/dev/null")
        assert ei.value.errno in (errno.ENOTTY, errno.EINVAL)
    finally:
        os.close(fd)
