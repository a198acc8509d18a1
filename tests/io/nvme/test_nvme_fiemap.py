"""FIEMAP on a real file of this machine's filesystem, plus range translation rules."""

import errno
import os

import pytest

from tutti.io.nvme.fiemap import (FIEMAP_EXTENT_UNWRITTEN, Extent, ExtentError, FiemapResolver, FileExtents,
                                  fiemap)


def _fiemap_or_skip(fd):
    try:
        return fiemap(fd)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
            pytest.skip(f"this filesystem does not support FIEMAP ({exc})")
        raise


def _written_file(path, size):
    data = os.urandom(size)
    with open(path, "wb") as f:
        for i in range(0, size, 96 * 1024):  # several writes, like a slab being filled
            f.write(data[i:i + 96 * 1024])
        f.flush()
        os.fsync(f.fileno())
    return data


def test_extents_of_a_written_file_cover_it_in_order(tmp_path):
    size = 1 << 20 | 12288  # 1 MiB + 3 blocks
    p = tmp_path / "slab.bin"
    _written_file(p, size)
    fd = os.open(p, os.O_RDONLY)
    try:
        ext = _fiemap_or_skip(fd)
    finally:
        os.close(fd)
    assert ext, "a written, fsynced file has at least one extent"
    assert ext[0].logical == 0
    for a, b in zip(ext, ext[1:]):
        assert a.end == b.logical  # sorted and contiguous in logical space, no holes
    assert ext[-1].end >= size and ext[-1].end - size < 4096 * 16
    assert ext[-1].flags & 0x1  # FIEMAP_EXTENT_LAST
    assert all(not e.flags & FIEMAP_EXTENT_UNWRITTEN for e in ext)
    segs = FileExtents(ext).translate(0, size, align=512)
    assert sum(s.length for s in segs) == size
    assert segs[0].file_offset == 0
    for a, b in zip(segs, segs[1:]):
        assert a.file_offset + a.length == b.file_offset
        assert a.device_offset + a.length != b.device_offset  # merged when physically contiguous


def test_resolver_caches_per_file_version(tmp_path):
    p = tmp_path / "slab.bin"
    _written_file(p, 64 * 1024)
    fd = os.open(p, os.O_RDWR)
    try:
        _fiemap_or_skip(fd)
        r = FiemapResolver()
        a = r.resolve(fd)
        assert r.resolve(fd) is a  # resolved once, cached
        os.pwrite(fd, b"x" * 4096, 64 * 1024)  # the file grows: new size/mtime -> re-mapped
        os.fsync(fd)
        b = r.resolve(fd)
        assert b is not a and b.extents[-1].end >= 68 * 1024
    finally:
        os.close(fd)


def test_file_on_another_device_is_refused(tmp_path):
    p = tmp_path / "slab.bin"
    _written_file(p, 4096)
    fd = os.open(p, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        with pytest.raises(ExtentError, match="snvme namespace") as ei:
            FiemapResolver(expected_dev=st.st_dev + 1, device_name="/dev/snvme0n1").resolve(fd)
        assert ei.value.errno == errno.EXDEV
    finally:
        os.close(fd)


def test_fallocated_file_is_refused_as_unwritten(tmp_path):
    p = tmp_path / "prealloc.bin"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, 64 * 1024)
        except OSError as exc:
            pytest.skip(f"fallocate unsupported here: {exc}")
        ext = _fiemap_or_skip(fd)
        if not any(e.flags & FIEMAP_EXTENT_UNWRITTEN for e in ext):
            pytest.skip("this filesystem does not report unwritten extents")
        with pytest.raises(ExtentError, match="unwritten"):
            FileExtents(ext).translate(0, 4096)
    finally:
        os.close(fd)


def test_sparse_file_hole_is_refused(tmp_path):
    p = tmp_path / "sparse.bin"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"a" * 4096, 0)
        os.pwrite(fd, b"b" * 4096, 1 << 20)
        os.fsync(fd)
        fe = FileExtents(_fiemap_or_skip(fd))
        assert fe.translate(0, 4096)[0].length == 4096
        with pytest.raises(ExtentError, match=r"bytes \[4096, ") as ei:
            fe.translate(0, 8192)
        assert ei.value.errno == errno.ENXIO
    finally:
        os.close(fd)


def test_translate_splits_across_extents_and_merges_contiguous_ones():
    fe = FileExtents([Extent(8192, 1 << 20, 8192), Extent(0, 40960, 4096), Extent(4096, 45056, 4096)])
    # first two are physically contiguous -> one segment; the third is elsewhere
    segs = fe.translate(2048, 12288)
    assert [(s.file_offset, s.device_offset, s.length) for s in segs] == [
        (2048, 40960 + 2048, 6144), (8192, 1 << 20, 6144)]
    with pytest.raises(ExtentError, match="past the end"):
        fe.translate(12288, 8192)
    with pytest.raises(ExtentError, match="not a multiple"):
        FileExtents([Extent(0, 100, 4096)]).translate(0, 512, align=512)
    with pytest.raises(ExtentError, match="overlapping"):
        FileExtents([Extent(0, 0, 8192), Extent(4096, 65536, 4096)])
