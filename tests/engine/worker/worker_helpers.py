"""The worker tests' small geometry and helpers (a worker on CPU tensors, or CUDA ones, with real files,
a real IO queue and real kernels), shared by the tests of tutti/engine/worker/ and of the engine
beside it. `DEV` is the device of the running test (conftest.py's `device` fixture sets it)."""

import time

import torch

from tutti.engine.plan import StepPlan, StoreChunk
from tutti.engine.build import Geometry, build_planner, build_worker
from tutti.io.queue import WrappedQueue
from tutti.kernels import PagedLayout

L, B, H, N, D = 3, 24, 2, 16, 8  # layers, kernel blocks, kv heads, tokens/block, head size
T = 32  # chunk tokens: 2 blocks
BPC = T // N


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


DEV = "cpu"


def make_caches(seed=0):
    g = torch.Generator().manual_seed(seed)
    # vLLM's CPU backend: [B, H, N, 2D], each (block, head) page K rows then V rows
    return [torch.randn(B, H, N, 2 * D, generator=g).to(DEV) for _ in range(L)]


def views(caches):
    return [c.as_strided((B, H, 2, N, D), (c.stride(0), c.stride(1), N * D, D, 1)) for c in caches]


def geometry():
    return Geometry(model="tiny", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L,
                    num_heads=H, content_bytes=2 * D * 4)


def config(root, **kw):
    cfg = {"root": str(root), "capacity_bytes": 64 * geometry().slot_bytes, "chunk_tokens": T,
           "staging_bytes": 16 * 16384, "staging_slots": 16, "max_inflight_stores": 8, "lookahead": 1}
    cfg.update(kw)
    return cfg


def worker(root, caches, **kw):
    v = views(caches)
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    return build_worker(config(root, **kw), geometry(), caches=v, layout=layout)


def run_step(w, plan):
    """One step of `plan` through every layer's hooks, as a forward pass calls them."""
    w.start_step(plan)
    for layer in range(w.num_layers):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()


def block_bytes(caches, blocks):
    return [c[list(blocks)].clone() for c in caches]


def store_chunks(root, caches, chunks):
    w = worker(root, caches)
    stores = [StoreChunk("r", bytes([i]) * 32, slot, tuple(blocks), ticket=i + 1)
              for i, (slot, blocks) in enumerate(chunks)]
    run_step(w, StepPlan(1, stores=stores))
    w.flush()
    rep = w.take_report()
    w.close()
    return rep


class RecordingQueue(WrappedQueue):
    """Wraps a real queue: records each submit and can fail the k-th read."""

    def __init__(self, inner, fail_read=None):
        super().__init__(inner)
        self.fail_read, self.log, self.reads = fail_read, [], 0
        self.sized = []  # (submit, op, offset, length)

    def submit(self, requests):
        futs = self.inner.submit(requests)
        for r, f in zip(requests, futs):
            self.log.append(("submit", r.op, r.offset))
            self.sized.append(("submit", r.op, r.offset, r.length))
            if r.op == "read":
                self.reads += 1
                if self.reads == self.fail_read:
                    f.result()
                    f._error = OSError(5, "injected read failure")
        return futs


def _wrapped_worker(tmp_path, caches, fail_read=None, **kw):
    w = worker(tmp_path, caches, **kw)
    w.queue = RecordingQueue(w.queue, fail_read)
    return w


class StallingQueue(RecordingQueue):
    """A real queue whose reads at chosen file offsets never complete until released (a stalled
    network file system), to prove a load fails its chunk instead of hanging the step."""

    def __init__(self, inner, stall_offsets, op="read"):
        super().__init__(inner)
        self.stall_offsets, self.held, self.op = set(stall_offsets), [], op

    def submit(self, requests):
        from tutti.io.queue import IOFuture

        out = []
        for r in requests:
            if r.op == self.op and r.offset in self.stall_offsets:
                fut = IOFuture(r)
                self.held.append(fut)
                out.append(fut)
            else:
                out.extend(self.inner.submit([r]))
        return out

    def release(self):
        for fut in self.held:
            fut.set_result(fut.request.length)  # the stalled read lands, long after its deadline
        self.held = []


def damage(tmp_path, slot, layer):
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    with open(slab, "r+b") as f:
        off = slot * geometry().slot_bytes + layer * geometry().segment_bytes + 9
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x10]))


def _run_whole(w, step, loads, how):
    """A whole load: a FULL-graph step's (start_step with layerwise=False) or an asynchronous one
    (tutti's loading thread): both go through LoadPipeline.start(layerwise=False)."""
    if how == "full_graph":
        w.start_step(StepPlan(step, loads=loads), layerwise=False)
        w.end_step()
        return w.take_failed_blocks()
    run_step(w, StepPlan(step, async_step=step + 100, async_loads=loads))
    w.flush()
    deadline = time.monotonic() + 30
    done, failed, blocks = set(), set(), set()
    while not (done | failed) and time.monotonic() < deadline:
        w.async_loads.wait(0.05)
        done, failed, blocks = w.received_requests()
    assert done | failed == {"q"}
    return blocks


def server_cfg(root, writer, capacity_chunks: int = 4, **kw) -> dict:
    """A server's config over `root` as `writer` ("auto": found at start-up); `tiers` in `kw`
    replaces the root and capacity."""
    c = {"root": str(root), "capacity_bytes": capacity_chunks * geometry().slot_bytes, "chunk_tokens": T,
         "writer_id": writer, "staging_bytes": 16 * 16384, "staging_slots": 16, "max_inflight_stores": 8,
         "lookahead": 1, "follow_interval_s": 0.05}
    if "tiers" in kw:
        del c["root"], c["capacity_bytes"]
    c.update(kw)
    return c


class Server:
    """A planner and one worker over one config, built as vLLM builds them: the worker first, then
    the scheduler, which learns the writer slot an "auto" worker took under `engine_id`.
    `announce`: the planner records and follows chunks' extras (KV events)."""

    def __init__(self, root, writer, seed, *, engine_id: str = "", announce: bool = False,
                 capacity_chunks: int = 4, **kw) -> None:
        self.caches = make_caches(seed)
        v = views(self.caches)
        layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
        c = server_cfg(root, writer, capacity_chunks, **kw)
        self.worker = build_worker(c, geometry(), caches=v, layout=layout, engine_id=engine_id)
        self.planner = build_planner(c, geometry(), engine_id=engine_id, announce=announce)
        self.writer_id = self.worker.cfg.writer_id

    def request(self, req, tokens, blocks, compute=None):
        """match, allocate, one step computing the rest of the prompt; (hit tokens, failed blocks, plan).
        `compute(hit)`, if given, runs before the step: what a model computes into the blocks not loaded."""
        hit = self.planner.match(req, tokens, 0)
        if compute is not None:
            compute(hit)
        self.planner.on_alloc(req, blocks, hit)
        plan = self.planner.build_step({req: len(tokens) - hit}, {req: hit})
        run_step(self.worker, plan)
        self.worker.flush()
        failed = self.worker.take_failed_blocks()
        self.planner.on_report(self.worker.take_report())
        self.planner.finished(req)
        return hit, failed, plan

    def close(self) -> None:
        self.planner.foreign.close()
        self.worker.close()


def prompt(seed: int, chunks: int) -> list[int]:
    """`chunks` whole chunks of seeded token ids and one token more."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (chunks * T + 1,), generator=g).tolist()
