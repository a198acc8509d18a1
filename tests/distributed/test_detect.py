"""io_backend and mapped_loads "auto" on a network or FUSE file system (resolve.tier_io_backend,
resolve.network_roots): the rules alone, then a worker built on the GlusterFS mount, which says
what it picked and why, and moves chunks bit-exact between the two nodes."""

from __future__ import annotations

import time

import torch

from tutti.engine.config import resolve


def test_the_rule_names_the_network_file_system_and_leaves_the_rest_alone():
    backend = resolve.tier_io_backend("auto", fs_types=["fuse.glusterfs"])
    assert backend.value == "auto" and "fuse.glusterfs" in backend.why
    net = resolve.network_roots("auto", first_tier=["fuse.glusterfs"])
    assert net["mapped_loads"].value is False and "not coherent" in net["mapped_loads"].why
    for kinds in (["nfs4"], ["lustre"], ["gpfs"], ["ceph"], ["fuse.ceph-fuse"], ["fuse"], ["ext4", "nfs"]):
        assert resolve.network_roots("auto", first_tier=kinds)["mapped_loads"].value is False, kinds
        assert "network file system" in resolve.tier_io_backend("auto", fs_types=kinds).why, kinds
    # a RAM first tier over a network tier: each tier's queue its own, the mapping the RAM tier's
    assert resolve.tier_io_backend("auto", fs_types=["tmpfs"]).value == "threads"
    assert "fuse.glusterfs" in resolve.tier_io_backend("auto", fs_types=["fuse.glusterfs"]).why
    assert resolve.network_roots("auto", first_tier=["tmpfs"]) == {}
    # local file systems, and a FUSE driver of a local disk: the other rules decide
    for kinds in (["ext4"], ["xfs", "tmpfs"], ["fuseblk"]):
        assert resolve.network_roots("auto", first_tier=kinds) == {}, kinds
        assert resolve.tier_io_backend("auto", fs_types=kinds).why in ("", "RAM root"), kinds
    # what the configuration names is never overridden
    assert resolve.network_roots(True, first_tier=["fuse.glusterfs"]) == {}
    assert resolve.tier_io_backend("threads", fs_types=["fuse.glusterfs"]).value == "threads"


def test_a_worker_on_the_mount_says_what_it_picked_and_moves_chunks_across_nodes(on_volume):
    from nodes import BPC, T, Server, prompt, wait_for

    a_root, b_root = on_volume
    a, b = Server(a_root, "a", 0), Server(b_root, "b", 1)
    try:
        for s in (a, b):
            made = s.worker.decisions.made
            assert made["mapped_loads"].value is False and "fuse.glusterfs" in made["mapped_loads"].why, made
            assert made["io_backend"].value == "auto" and "fuse.glusterfs" in made["io_backend"].why, made
            assert "fuse.glusterfs" in s.worker.decisions.describe()
            assert s.worker.mapped_bytes == 0
        print(f"\nthe worker on the mount: backend {a.worker.queue.caps().backend}, O_DIRECT "
              f"{a.worker.queue.caps().direct_io}; auto: {a.worker.decisions.describe()}")
        p = prompt(1, 2)
        hit, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        assert hit == 0 and len(plan.stores) == 2
        t0 = time.monotonic()
        assert wait_for(lambda: all(st.key in b.planner.foreign for st in plan.stores)), "node b never saw them"
        delay = time.monotonic() - t0
        hit, failed, plan_b = b.request("r2", p, list(range(10, 10 + 2 * BPC + 1)))
        assert hit == 2 * T and failed == set() and not plan_b.stores
        assert {ld.source for ld in plan_b.loads} == {"a"}
        for ca, cb in zip(a.caches, b.caches):
            assert torch.equal(cb[10:10 + 2 * BPC], ca[0:2 * BPC])  # bit exact across nodes
        print(f"node a's chunks followed on node b {delay:.2f} s after its step")
    finally:
        a.close()
        b.close()
