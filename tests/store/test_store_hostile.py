"""A store other users cannot turn against it: links, foreign or shared files, FIFOs and a
replaced lock, each refused with an error naming the file, and nothing outside the root touched.

Cross-user cases chown files to another uid (the suite runs as root); ownership checks compare
with the effective uid, which root does not bypass.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from tutti.io.safefs import UnsafeFileError
from tutti.store.chunk_store import ChunkStore, StoreLockedError, StoreRootError, namespace_dir

from test_chunk_store import SEG, make_fp  # noqa: E402

CAP = 4 * 3 * SEG
OTHER_UID = 4242


def open_store(root, writer=True):
    return ChunkStore(str(root), make_fp(), capacity_bytes=CAP, writer=writer)


def test_files_and_directories_are_private(tmp_path):
    root = tmp_path / "fresh"
    st = open_store(root)
    st.location(0, 0)
    st.record_put(b"k" * 32, 0, [1, 2, 3])
    st.sync_journal()
    ns = namespace_dir(str(root), make_fp())
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ns).st_mode) == 0o700
    for name in os.listdir(ns):
        if name != "journal.bin":  # the journal's mode is the journal's (tests/io/test_journal*)
            assert stat.S_IMODE(os.stat(os.path.join(ns, name)).st_mode) == 0o600, name
    st.close()


def test_a_linked_lock_in_a_planted_namespace_is_never_truncated(tmp_path):
    """Another user pre-creates the namespace in a shared root with LOCK -> a victim file."""
    root = tmp_path / "shared"
    root.mkdir(mode=0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 100)
    os.chmod(victim, 0o600)
    ns = namespace_dir(str(root), make_fp())
    os.mkdir(ns, 0o777)
    os.chmod(ns, 0o777)
    os.symlink(victim, os.path.join(ns, "LOCK"))
    os.chown(ns, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match="namespace .*refused"):
        open_store(root)
    assert victim.read_bytes() == b"precious" * 100
    os.chown(ns, os.geteuid(), os.getegid())  # ours but shared with everyone: still refused
    with pytest.raises(UnsafeFileError, match="writable by group or others"):
        open_store(root)
    os.chmod(ns, 0o700)  # ours and private: the link itself is refused
    with pytest.raises(UnsafeFileError, match="lock file .*symbolic link"):
        open_store(root)
    assert victim.read_bytes() == b"precious" * 100


def test_a_linked_namespace_is_refused_and_nothing_is_created_outside(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, namespace_dir(str(root), make_fp()))
    for writer in (True, False):
        with pytest.raises(UnsafeFileError, match="symbolic link"):
            open_store(root, writer=writer)
    assert os.listdir(elsewhere) == []
    os.rmdir(elsewhere)
    os.symlink(root, tmp_path / "link")
    with pytest.raises(StoreRootError, match="symbolic link; pass the directory it points to"):
        open_store(tmp_path / "link")


def test_a_linked_manifest_temporary_is_replaced_not_followed(tmp_path):
    root = tmp_path / "root"
    open_store(root).close()
    ns = namespace_dir(str(root), make_fp())
    os.unlink(os.path.join(ns, "manifest.json"))  # the next writer writes it again
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, os.path.join(ns, "manifest.json.tmp"))
    open_store(root).close()
    assert victim.read_bytes() == b"keep"
    assert os.path.isfile(os.path.join(ns, "manifest.json")) and not os.path.islink(os.path.join(ns, "manifest.json"))


@pytest.mark.parametrize("name", ["manifest.json", "slab-0.bin", "LOCK"])
def test_a_fifo_is_refused_without_hanging(tmp_path, name):
    root = tmp_path / "root"
    st = open_store(root)
    st.location(0, 0)
    st.close()
    ns = namespace_dir(str(root), make_fp())
    os.unlink(os.path.join(ns, name))
    os.mkfifo(os.path.join(ns, name), 0o600)
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_store_hostile import open_store
        for writer in (True, False):
            try:
                st = open_store({str(root)!r}, writer=writer)
                st.location(0, 0)
                print("OPENED")
            except Exception as exc:
                print(type(exc).__name__, exc)
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = p.stdout
    assert "OPENED" not in out.splitlines()[0], out  # the writer refuses it
    assert "FIFO" in out or "regular file" in out or "refused" in out, out


def test_slab_hard_link_and_foreign_slab_are_refused(tmp_path):
    root = tmp_path / "root"
    st = open_store(root)
    st.location(0, 0)
    st.close()
    ns = namespace_dir(str(root), make_fp())
    slab = os.path.join(ns, "slab-0.bin")
    os.link(slab, tmp_path / "second-name")
    rd = open_store(root, writer=False)
    with pytest.raises(UnsafeFileError, match="2 hard links"):
        rd.location(0, 0)
    rd.close()
    os.unlink(tmp_path / "second-name")
    os.chown(slab, OTHER_UID, OTHER_UID)
    rd = open_store(root, writer=False)
    with pytest.raises(UnsafeFileError, match="owned by uid 4242"):
        rd.location(0, 0)
    rd.close()


def test_a_writer_whose_lock_was_unlinked_stops_recording(tmp_path):
    root = tmp_path / "root"
    st = open_store(root)
    st.record_put(b"k" * 32, 0, [1, 2, 3])
    st.sync_journal()
    os.unlink(os.path.join(namespace_dir(str(root), make_fp()), "LOCK"))
    second = open_store(root)  # the lock is gone, so a second writer gets in...
    st.record_put(b"q" * 32, 1, [1, 2, 3])
    with pytest.raises(StoreLockedError, match="removed or replaced"):
        st.sync_journal()  # ...and the first one notices before it writes another record
    second.close()


def test_a_deeply_nested_manifest_is_refused_naming_the_file(tmp_path):
    """Round three, item 9: a manifest.json nested past the parser's recursion limit refused the
    start with a bare RecursionError; it is a damaged manifest, named with the fix."""
    from tutti.store.chunk_store import ManifestMismatchError

    with ChunkStore(str(tmp_path), make_fp(), capacity_bytes=4 * 3 * SEG, writer=True) as st:
        ns = st.namespaces[0]
    with open(os.path.join(ns, "manifest.json"), "w") as f:
        f.write("[" * 100000 + "]" * 100000)
    with pytest.raises(ManifestMismatchError, match="manifest.json.*not valid JSON.*move"):
        ChunkStore(str(tmp_path), make_fp(), capacity_bytes=4 * 3 * SEG, writer=True)
