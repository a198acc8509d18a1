"""Sharing one store root between servers of different users (Access with a group), run as
real separate uids: each case forks, drops to its uid, gid and groups (setresuid, as a login
would), and works on a sticky world-writable root like a cluster's scratch directory.

Needs root to switch uids; elsewhere it is skipped (saying so)."""

from __future__ import annotations

import os
import pickle
import stat
import tempfile
import traceback

import pytest

from tutti.store.integrity import SegmentMac
from tutti.io.safefs import PRIVATE, Access, UnsafeFileError
from tutti.store.chunk_store import ChunkStore, StoreRootError

from tutti.engine import build  # imported before a case forks: the other uids cannot read the packages
from tutti.engine.config.settings import EngineConfig
from tutti.engine.geometry import Geometry

from test_chunk_store import SEG, chunk_key, layer_bytes, make_fp, pwrite_all

GROUP = 4400
ALICE, BOB, CAROL, MALLORY = 4401, 4402, 4403, 4404
SECRET = b"s" * 32
SHARED = Access(GROUP)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to other uids needs root; not run here")


def as_user(uid: int, groups: list[int], fn, *args):
    """Run fn(*args) in a child process with uid/gid/groups dropped for good and umask 077
    (the narrowest a user may have); return its result or re-raise its exception's text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups(groups)
            os.setresgid(groups[0], groups[0], groups[0])
            os.setresuid(uid, uid, uid)
            os.umask(0o077)
            out = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001
            out = ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


@pytest.fixture
def scratch():
    d = tempfile.mkdtemp(prefix="tutti-scratch-", dir="/tmp")
    os.chmod(d, 0o1777)  # like /scratch: everyone may create, nobody may remove others' entries
    yield os.path.join(d, "kv")
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def open_store(root, access, writer=True):
    return ChunkStore(root, make_fp(), capacity_bytes=8 * 3 * SEG, writer=writer, access=access)


def put_chunk(root, access, i, slot, mac: SegmentMac | None, bytes_of: int | None = None):
    """Write chunk i (with the bytes of chunk `bytes_of`, default i) into `slot` with keyed tags
    (or unkeyed stand-ins without a mac)."""
    with open_store(root, access) as st:
        key = chunk_key(i)
        tags = []
        for layer in range(3):
            data = layer_bytes(chunk_key(i if bytes_of is None else bytes_of), layer, SEG)
            fd, off = st.location(slot, layer)
            pwrite_all(fd, data, off)
            tags.append(mac.tag(key, layer, data) if mac else sum(data))
        st.record_free([slot])
        st.sync_journal()
        st.sync_data([slot])
        st.record_put(key, slot, tags)
        st.sync_journal()
        return sorted(st.entries())


def verify_all(root, access, mac: SegmentMac):
    """slot -> whether every layer's bytes match their journaled keyed tag (as a server checks)."""
    with open_store(root, access, writer=False) as st:
        out = {}
        for slot, e in st.entries().items():
            ok = True
            for layer in range(3):
                fd, off = st.location(slot, layer)
                ok &= mac.tag(e.key, layer, os.pread(fd, SEG, off)) == e.checksums[layer]
            out[slot] = ok
        return out


def modes(root):
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (stat.S_IMODE(st.st_mode), st.st_gid)
    return out


def test_two_users_of_one_group_share_a_store(scratch):
    mac = SegmentMac(SECRET)
    res = as_user(ALICE, [GROUP], put_chunk, scratch, SHARED, 0, 0, mac)
    assert res == ("ok", [0]), res
    # created 2770 / 0660 with the sharing group although the users' umask is 077
    got = as_user(ALICE, [GROUP], modes, scratch)[1]
    assert got and all((m, g) == ((0o2770 if os.path.isdir(os.path.join(scratch, p)) else 0o660), GROUP)
                       for p, (m, g) in got.items()), got
    # Bob, another uid in the group, becomes the writer: he reads Alice's chunk and adds his own
    res = as_user(BOB, [GROUP], put_chunk, scratch, SHARED, 1, 5, mac)
    assert res == ("ok", [0, 5]), res
    # Alice, now a reader, serves both, and every tag checks
    assert as_user(ALICE, [GROUP], verify_all, scratch, SHARED, mac) == ("ok", {0: True, 5: True})
    # ... and after Bob's writes everything is still of the group, nothing world-accessible
    got = as_user(BOB, [GROUP], modes, scratch)[1]
    assert all(g == GROUP and not m & 0o007 for m, g in got.values()), got


def test_a_private_store_refuses_the_files_of_another_user(scratch):
    assert as_user(ALICE, [GROUP], put_chunk, scratch, SHARED, 0, 0, SegmentMac(SECRET))[0] == "ok"
    res = as_user(BOB, [GROUP], put_chunk, scratch, PRIVATE, 1, 1, None)
    assert res[0] == "err" and UnsafeFileError.__name__ in res[1] and f"owned by uid {ALICE}" in res[1], res


def test_a_user_outside_the_group_can_neither_read_nor_write(scratch):
    assert as_user(ALICE, [GROUP], put_chunk, scratch, SHARED, 0, 0, SegmentMac(SECRET))[0] == "ok"
    for fn, args in ((verify_all, (scratch, SHARED, SegmentMac(SECRET))), (put_chunk, (scratch, SHARED, 1, 1, None))):
        res = as_user(CAROL, [CAROL], fn, *args)
        assert res[0] == "err" and ("Permission denied" in res[1] or "permission" in res[1]), res
        assert any(t in res[1] for t in (StoreRootError.__name__, "PermissionError")), res


def test_a_group_member_without_the_secret_cannot_forge_kv(scratch):
    mac = SegmentMac(SECRET)
    assert as_user(ALICE, [GROUP], put_chunk, scratch, SHARED, 0, 0, mac)[0] == "ok"
    # Mallory is in the group (he may write the files) but lacks the secret: he files other
    # bytes under Alice's chunk's key, with the tags he can compute (none keyed by the secret)
    forged = as_user(MALLORY, [GROUP], put_chunk, scratch, SHARED, 0, 0, SegmentMac(b"m" * 32), 9)
    assert forged == ("ok", [0]), forged
    assert as_user(BOB, [GROUP], verify_all, scratch, SHARED, mac) == ("ok", {0: False})


def open_named(root, access, writer_id, writer=True):
    return ChunkStore(root, make_fp(), capacity_bytes=8 * 3 * SEG, writer=writer, access=access, writer_id=writer_id)


def put_named(root, slot):
    return put_as(root, "alice", slot)


def squat(ns):
    """What a member without the secret tries against another member's writer directory."""
    import fcntl

    out = {}
    for name, flags in (("LOCK", os.O_RDONLY), ("manifest.json", os.O_WRONLY), ("slab-0.bin", os.O_WRONLY)):
        try:
            fd = os.open(os.path.join(ns, name), flags)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) if name == "LOCK" else os.write(fd, b"x")
                out[name] = "done"
            finally:
                os.close(fd)
        except OSError as exc:
            out[name] = exc.errno
    try:
        os.rename(os.path.join(ns, "manifest.json"), os.path.join(ns, "m.old"))
        out["rename"] = "done"
    except OSError as exc:
        out["rename"] = exc.errno
    return out


def reads(root):
    with open_named(root, SHARED, "alice", writer=False) as st:
        return sorted(st.entries())


def test_a_member_cannot_lock_replace_or_write_a_named_writers_directory(scratch):
    """Round two, item 2b: a named writer's directory (w-<id>) is its owner's to write (2750,
    files 0640, LOCK 0600): another member of the group reads its chunks (and serves them
    against their tags) but can neither hold its LOCK (stopping its restart), nor overwrite or
    replace its manifest, nor write its slabs. The namespace directory stays group-writable."""
    import errno

    res = as_user(ALICE, [GROUP], put_named, scratch, 3)
    assert res[0] == "ok", res
    ns = res[1]
    assert as_user(BOB, [GROUP], reads, scratch) == ("ok", [3])
    assert as_user(BOB, [GROUP], squat, ns) == ("ok", {"LOCK": errno.EACCES, "manifest.json": errno.EACCES,
                                                      "slab-0.bin": errno.EACCES, "rename": errno.EACCES})
    assert as_user(ALICE, [GROUP], put_named, scratch, 4)[0] == "ok"  # Alice restarts as the writer
    got = as_user(ALICE, [GROUP], modes, scratch)[1]
    writer_dir = os.path.relpath(ns, scratch)
    assert got[writer_dir][0] == 0o2750 and got[os.path.dirname(writer_dir)][0] == 0o2770
    assert got[os.path.join(writer_dir, "LOCK")][0] == 0o600
    assert got[os.path.join(writer_dir, "manifest.json")][0] == 0o640


def put_as(root, writer_id, slot):
    """A named writer stores one chunk (keyed tags) and returns its writer directory."""
    mac = SegmentMac(SECRET)
    with open_named(root, SHARED, writer_id) as st:
        key = chunk_key(slot)
        tags = []
        for layer in range(3):
            data = layer_bytes(key, layer, SEG)
            fd, off = st.location(slot, layer)
            pwrite_all(fd, data, off)
            tags.append(mac.tag(key, layer, data))
        st.record_free([slot])
        st.sync_journal()
        st.sync_data([slot])
        st.record_put(key, slot, tags)
        st.sync_journal()
        return st.namespaces[0]


def test_a_named_writer_that_creates_the_root_leaves_it_to_the_group(scratch):
    """Round three, item 4: a named writer creating a shared root made it 2750 (its own
    directory's mode), and every other member's server then refused to start ("lacks read,
    write and search permission"). The root is the group's, like the namespace."""
    assert as_user(ALICE, [GROUP], put_as, scratch, "alice", 1)[0] == "ok"
    st = os.stat(scratch)
    assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == GROUP
    res = as_user(BOB, [GROUP], put_as, scratch, "bob", 2)
    assert res[0] == "ok", res


def plant_writer_dir(ns_top, writer_id):
    """What a member does to take over another's writer directory: rename it away, make her own."""
    path = os.path.join(ns_top, "w-" + writer_id)
    if os.path.exists(path):
        os.rename(path, path + ".moved")
    os.mkdir(path)
    os.chmod(path, 0o2770)  # as the group's own directories are
    return sorted(os.listdir(path))


def test_a_member_cannot_make_a_named_writer_write_into_her_directory(scratch):
    """Round three, item 3: the namespace directory is group-writable (2770, no sticky bit: the
    namespace's only writer `''` is a role members take in turns, and renames its files), so a
    member can rename `w-alice/` away and plant her own. Alice's restart wrote into the planted
    directory; now a named writer uses its directory only if it owns it, and says whose it is."""
    ns = as_user(ALICE, [GROUP], put_as, scratch, "alice", 1)[1]
    top = os.path.dirname(ns)
    assert as_user(MALLORY, [GROUP], plant_writer_dir, top, "alice") == ("ok", [])
    res = as_user(ALICE, [GROUP], put_as, scratch, "alice", 2)
    assert res[0] == "err" and "WriterDirectoryTakenError" in res[1] and f"uid {MALLORY}" in res[1], res
    assert os.listdir(ns) == []  # nothing written into hers


def _geometry():
    return Geometry(model="tiny", cache_dtype="float32", chunk_tokens=32, block_size=16, num_layers=3, num_heads=2,
                    content_bytes=2 * 8 * 4)


GEOM = _geometry()


def hold_the_namespace_and_plant_every_auto_slot(root, ready_w, release_r):
    """Mallory takes the namespace's writer slot '' (a real store holding its LOCK) and plants
    w-auto-1 .. w-auto-63, then holds on until told to stop."""
    from tutti.engine.claims import MAX_AUTO_WRITERS

    st = ChunkStore(root, GEOM.fingerprint(), capacity_bytes=8 * GEOM.slot_bytes, writer=True, access=SHARED,
                    writer_id="")
    top = st.namespaces[0]
    for n in range(1, MAX_AUTO_WRITERS + 1):
        plant_writer_dir(top, f"auto-{n}")
    os.write(ready_w, b"1")
    os.read(release_r, 1)
    st.close()


def claim_auto(root):
    os.environ["TUTTI_TEST_SECRET"] = SECRET.hex()
    cfg = EngineConfig.of({"root": root, "capacity_bytes": 8 * GEOM.slot_bytes, "chunk_tokens": 32,
                           "share_group": str(GROUP),
                           "secret_env": "TUTTI_TEST_SECRET"})
    store, cfg = build._claim_store(cfg, GEOM, "", open_file=None, access=build.store_access(cfg), maps=False)
    store.close()
    return cfg.writer_id


def test_planted_auto_slots_never_stop_an_auto_server(scratch):
    """Round three, item 3: holding the group-writable `''` LOCK and planting 63 `w-auto-N`
    directories stopped every `auto` server from starting ("all 64 writer slots are held").
    A slot whose directory another member owns is passed over without counting."""
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([GROUP])
            os.setresgid(GROUP, GROUP, GROUP)
            os.setresuid(MALLORY, MALLORY, MALLORY)
            hold_the_namespace_and_plant_every_auto_slot(scratch, ready_w, release_r)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        res = as_user(BOB, [GROUP], claim_auto, scratch)
        assert res == ("ok", "auto-64"), res
    finally:
        os.write(release_w, b"1")
        os.waitpid(pid, 0)


def open_writer_on(root):
    with open_store(root, PRIVATE):
        return "opened"


def test_a_root_the_user_cannot_write_is_reported_as_read_only(scratch):
    """A writer on a root its user may read but not write was told it "lacks read, write and search
    permission"; it is told the root is read-only for it, and how to fix that."""
    def make_read_only(root):
        os.makedirs(root)
        os.chmod(root, 0o555)

    assert as_user(ALICE, [ALICE], make_read_only, scratch)[0] == "ok"
    res = as_user(ALICE, [ALICE], open_writer_on, scratch)
    assert res[0] == "err" and "is read-only for this process" in res[1] and "chmod u+w" in res[1], res
