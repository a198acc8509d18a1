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
from dataclasses import dataclass

DIR_MODE = 0o700  # private by default
FILE_MODE = 0o600
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFileError(OSError):
    """A store path that is a link, not ours, shared with other users, or of the wrong type."""


@dataclass(frozen=True)
class Access:
    """Who may own and write a store's files.

    Private (the default, `gid=None`): this uid alone; directories 0700, files 0600, and a
    file owned by anyone else, or writable by group or others, is refused.
    Shared with group `gid`: servers of several users share one root. Directories are made
    2770 (setgid, so what is created below inherits the group) and files 0660, both of group
    `gid`; a file or directory of another uid is accepted only if its group is `gid` and no
    one outside the group can write it. The group is trusted to keep the data (read access to
    the KV); what it may write is trusted only through the keyed tags of a shared secret, which
    the configuration requires with a group (tutti.engine.config.settings).
    """

    gid: int | None = None
    # False: what this creates is the group's to read, not to write (2750 / 0640): a named
    # writer's own directory in a shared namespace, which no other member may lock, replace or
    # write (tests/store/test_store_sharing.py::test_a_member_cannot_lock_replace_or_write_a_named_writers_directory). True: the namespace's only writer, a role the
    # group's members take in turns, so its files stay group-writable (their tags are checked).
    group_write: bool = True

    @property
    def shared(self) -> bool:
        return self.gid is not None

    @property
    def dir_mode(self) -> int:
        if not self.shared:
            return DIR_MODE
        return 0o2770 if self.group_write else 0o2750

    @property
    def file_mode(self) -> int:
        if not self.shared:
            return FILE_MODE
        return 0o660 if self.group_write else 0o640

    def owner_writes(self) -> "Access":
        """This access, with what it creates writable by its owner only."""
        return Access(self.gid, group_write=False) if self.shared else self

    def adopt(self, fd: int, mode: int | None = None) -> None:
        """Give a descriptor this process just created the group and mode (the umask may have
        removed group bits); `mode`: a file's own (narrower) mode. Private: nothing to do (the
        create mode is already the narrowest)."""
        if not self.shared:
            return
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return
        if st.st_gid != self.gid:
            os.fchown(fd, -1, self.gid)
        want = self.dir_mode if stat.S_ISDIR(st.st_mode) else (self.file_mode if mode is None else mode)
        if stat.S_IMODE(st.st_mode) != want:
            os.fchmod(fd, want)


PRIVATE = Access()


def _describe(st: os.stat_result) -> str:
    kind = ("directory" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else
            "socket" if stat.S_ISSOCK(st.st_mode) else "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "regular file" if stat.S_ISREG(st.st_mode) else "symbolic link" if stat.S_ISLNK(st.st_mode) else "file")
    return f"a {kind} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, {st.st_nlink} links"


def check_fd(fd: int, where: str, *, directory: bool = False, access: Access = PRIVATE) -> os.stat_result:
    """fstat `fd` and refuse it unless it is what a store file (or directory) must be under `access`."""
    st = os.fstat(fd)
    ok_type = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    problems = []
    if not ok_type:
        problems.append("not a " + ("directory" if directory else "regular file"))
    in_group = access.shared and st.st_gid == access.gid
    if st.st_uid != os.geteuid() and not in_group:
        problems.append(f"owned by uid {st.st_uid}, not this process's uid {os.geteuid()}"
                        + (f", and its group {st.st_gid} is not the sharing group {access.gid}" if access.shared else ""))
    if not directory and st.st_nlink != 1:
        problems.append(f"{st.st_nlink} hard links (a file of ours has one)")
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not in_group):
        problems.append(f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}, group {st.st_gid}"
                        + (f", sharing group {access.gid})" if access.shared else
                           "; only a store configured with share_group may be group-writable)"))
    if problems:
        raise UnsafeFileError(errno.EPERM, f"{where}: refused, {'; '.join(problems)} ({_describe(st)}); "
                              "tutti opens only files written by it (or by its sharing group); move it aside", where)
    return st


def open_dir(name: str, *, dir_fd: int | None = None, create: bool = False, check: bool = True,
             access: Access = PRIVATE, where: str | None = None) -> int:
    """A descriptor of directory `name` (relative to `dir_fd` when given), never through a link.
    `create`: make it first (mode `access.dir_mode`), if missing. `check`: see check_fd."""
    where = where or name
    made = False
    if create:
        try:
            os.mkdir(name, access.dir_mode, dir_fd=dir_fd)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFileError(exc.errno, f"{where}: refused, a symbolic link or not a directory; "
                                  "tutti never follows links inside a store; move it aside", where) from None
        raise
    try:
        if made:
            access.adopt(fd)
        if check:
            check_fd(fd, where, directory=True, access=access)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(name: str, flags: int, *, dir_fd: int | None = None, mode: int | None = None, check: bool = True,
              access: Access = PRIVATE, where: str | None = None) -> int:
    """os.open(name, flags) relative to `dir_fd`, with O_NOFOLLOW, and without blocking on a FIFO
    (O_NONBLOCK for the open only); then `check_fd` unless check=False. A file this call may
    have created (O_CREAT) gets `access`'s group and mode; `mode` defaults to `access.file_mode`."""
    where = where or name
    own_mode = mode
    mode = access.file_mode if mode is None else mode
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
        if flags & os.O_CREAT and access.shared:
            access.adopt(fd, own_mode)
        if check:
            check_fd(fd, where, access=access)
        if not flags & _O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_file(name: str, data: bytes, *, dir_fd: int, access: Access = PRIVATE, where: str | None = None,
                 durable: bool = False) -> None:
    """Replace `name` in `dir_fd` with `data` atomically: a temporary created exclusively (a stale
    one, or a link planted there, is removed, never followed), written whole, then renamed over.
    `durable`: the data and the rename are synced, so a crash leaves the old file or the new one."""
    tmp = name + ".tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd, access=access,
                   where=f"{where or name}.tmp")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if durable:
        os.fsync(dir_fd)
