"""Opening files the way a storage engine does: relative to a directory descriptor, never
following a symbolic link, never blocking on a FIFO, and checking what was opened.

Why: store roots live on shared scratch space. A path opened by name can be swapped for a
link to another user's file between two calls, a FIFO hangs an open(), and a file another user
can write can hold forged KV. Every store file is opened with O_NOFOLLOW relative to a
descriptor of its (itself checked) directory and then fstat-ed: a regular file owned by us,
with one link and no group or world write bit, or it is refused with an error naming it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

DIR_MODE = 0o700  # private by default
FILE_MODE = 0o600
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFileError(OSError):
    """A store path that is a link, not ours, shared with other users, or of the wrong type."""


def _describe(st: os.stat_result) -> str:
    kind = ("directory" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else
            "socket" if stat.S_ISSOCK(st.st_mode) else "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "regular file" if stat.S_ISREG(st.st_mode) else "symbolic link" if stat.S_ISLNK(st.st_mode) else "file")
    return f"a {kind} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, {st.st_nlink} links"


def check_fd(fd: int, where: str, *, directory: bool = False, shared: bool = False) -> os.stat_result:
    """fstat `fd` and refuse it unless it is what a store file (or directory) must be."""
    st = os.fstat(fd)
    ok_type = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    problems = []
    if not ok_type:
        problems.append("not a " + ("directory" if directory else "regular file"))
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not this process's uid {os.geteuid()}")
    if not directory and st.st_nlink != 1:
        problems.append(f"{st.st_nlink} hard links (a file of ours has one)")
    if not shared and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        raise UnsafeFileError(errno.EPERM, f"{where}: refused, {'; '.join(problems)} ({_describe(st)}); "
                              "tutti opens only files it created; move it aside", where)
    return st


def open_dir(name: str, *, dir_fd: int | None = None, create: bool = False, check: bool = True,
             shared: bool = False, where: str | None = None) -> int:
    """A descriptor of directory `name` (relative to `dir_fd` when given), never through a link.
    `create`: make it first (mode 0700), if missing. `check`: ours and not writable by others."""
    where = where or name
    if create:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFileError(exc.errno, f"{where}: refused, a symbolic link or not a directory; "
                                  "tutti never follows links inside a store; move it aside", where) from None
        raise
    if check:
        try:
            check_fd(fd, where, directory=True, shared=shared)
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_file(name: str, flags: int, *, dir_fd: int | None = None, mode: int = FILE_MODE, check: bool = True,
              shared: bool = False, where: str | None = None) -> int:
    """os.open(name, flags) relative to `dir_fd`, with O_NOFOLLOW, and without blocking on a FIFO
    (O_NONBLOCK for the open only); then `check_fd` unless check=False."""
    where = where or name
    try:
        fd = os.open(name, flags | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(exc.errno, f"{where}: refused, a symbolic link; tutti never follows links "
                                  "inside a store; move it aside", where) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no writer, opened for writing without blocking
            raise UnsafeFileError(exc.errno, f"{where}: refused, a FIFO; move it aside", where) from None
        raise
    try:
        if check:
            check_fd(fd, where, shared=shared)
        if not flags & _O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd
