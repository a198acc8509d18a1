"""Every "auto" of the configuration, decided here and only here, from what the server runs on.

Each rule takes the configured value and the facts it needs (the roots' file systems, CUDA,
vLLM's scheduling, the store's sharing, a secret) and returns a `Choice`: the value the engine
uses and why, in a few words. The worker collects its choices in a `Decisions`, and the start-up
line prints them, so "auto" is never a mystery in a log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tutti.engine import claims
from tutti.engine.config.values import DEFAULT_WRITE_WINDOW

#: idle_load_wait_s "auto" where tutti's loading thread loads: 2 ms (see EngineConfig.idle_load_wait_s)
IDLE_WAIT_THREAD_S = 0.002
#: The key "auto" staging is recorded under: its three numbers, in this order
STAGING = "staging_bytes/staging_slots/max_inflight_stores"
#: How the reason of "auto" staging starts where host memory cut the stores' room
STAGING_CAPPED = "capped at a quarter of host memory"


@dataclass(frozen=True)
class Choice:
    value: Any
    why: str  # "" where the value was configured, not decided


@dataclass
class Decisions:
    """The choices one half made at start-up, in the order it made them."""

    made: dict[str, Choice] = field(default_factory=dict)

    def take(self, key: str, choice: Choice) -> Any:
        self.made[key] = choice
        return choice.value

    def describe(self) -> str:
        """`key=value (why)` for every decided "auto", for the start-up line."""
        return " ".join(f"{k}={_short(c.value)} ({c.why})" for k, c in self.made.items() if c.why)


def _short(v: Any) -> str:
    if v is None:
        return "off"
    if v == "":
        return "''"
    if isinstance(v, tuple):
        return "/".join(_short(x) for x in v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int) and v >= 1 << 20:
        return f"{v >> 20}MiB"
    return str(v)


def _given(v: Any) -> Choice:
    return Choice(v, "")


def kernel_variant(value: str, *, cuda: bool) -> Choice:
    if value != "auto":
        return _given(value)
    return Choice("triton", "CUDA") if cuda else Choice("torch", "no CUDA: the torch reference")


def io_backend(value: str, *, on_ram: bool) -> Choice:
    """On RAM file systems io_uring punts every request to its io-wq workers and copies through
    the page cache: the thread pool reads /dev/shm several times faster there
    (bench/load_rate.py); elsewhere the queue's own "auto" (tutti.io.queue) decides."""
    if value == "auto" and on_ram:
        return Choice("threads", "RAM root")
    return _given(value)


def write_window_bytes(value: Any, *, on_ram: bool) -> Choice:
    """A drive's queue is shared by reads and writes; memory's is not."""
    if value != "auto":
        return _given(value)
    return Choice(None, "RAM root") if on_ram else Choice(DEFAULT_WRITE_WINDOW, "a drive")


def mapped_loads(value: Any, *, on_ram: bool, shared: bool, secret: bool, codec: bool = False) -> Choice:
    """Never with a secret: a keyed tag checked on the host over the mapping and a DMA that copies
    the mapping later read the bytes twice, and an owner's rewrite in between would be served
    unverified; the file path checks the staged copy that then goes to the GPU. Never with a codec
    (other than "identity"): a mapped load copies the stored bytes to the device with no step that
    decodes them, and the writer maps its slabs only where loads do, so the mapped store path is off
    too (true is refused by the config). "auto": private RAM roots only (a mapping of a file someone
    else truncates faults)."""
    if codec:
        return Choice(False, "a codec: loads read and decode on the host") if value is not False else _given(False)
    if secret:
        return Choice(False, "a secret: loads verify the staged copy") if value is not False else _given(False)
    if value == "auto":
        if shared:
            return Choice(False, "a shared root")
        return Choice(on_ram, "RAM root" if on_ram else "not a RAM root")
    return _given(value)


def reads_first(value: Any, *, window: Any) -> Choice:
    """Writes yield to hits' reads wherever a write window is on (a drive)."""
    on = value is not False and isinstance(window, int)
    if value == "auto":
        return Choice(on, "a write window" if on else "no write window")
    return _given(on)


def async_loads(value: Any, *, hybrid: bool, schedules_async: bool) -> Choice:
    """Hybrid models always (vLLM takes their failures per request only); "auto": where vLLM
    schedules asynchronously, since a layer-wise load failing its checksum there would already
    have a token sampled from its KV in flight."""
    if hybrid:
        return Choice(True, "hybrid model")
    if value == "auto":
        return Choice(schedules_async, "vLLM schedules asynchronously" if schedules_async else
                      "vLLM schedules synchronously")
    return _given(value is True)


def async_launch(value: str, *, can: bool, cuda: bool) -> Choice:
    """The step's thread launches asynchronous loads where nothing is read (a mapped RAM root, one
    KV cache group, no secret: `can`), and for "auto" where launching is not doing the work (on
    the CPU a launch is the whole copy, checksum and scatter: the loading thread keeps it)."""
    if value == "auto":
        on = can and cuda
        return Choice("step" if on else "thread", "a mapped root on CUDA" if on else
                      "needs a mapped root, one KV cache group, no secret and CUDA")
    return _given("step" if can and value == "step" else "thread")


def idle_load_wait_s(value: Any, *, on_step: bool) -> Choice:
    """"auto" waits only where tutti's loading thread loads (the wait lets it have the GIL)."""
    if value == "auto":
        return Choice(0.0, "the step's thread launches") if on_step else \
            Choice(IDLE_WAIT_THREAD_S, "the loading thread loads")
    return _given(float(value))


def mapped_store_copy(value: str, *, cuda: bool) -> Choice:
    """On the CPU every store copies from the host staging; "auto" = "dma_chunk" (a decode step's
    own copy waits behind one chunk at most)."""
    if not cuda:
        return Choice("host", "no CUDA") if value != "host" else _given("host")
    return Choice("dma_chunk", "CUDA") if value == "auto" else _given(value)


def lookahead(value: Any, *, num_layers: int) -> Choice:
    """"auto": as far as the load staging slots allow (every layer)."""
    return Choice(num_layers, "the load slots bound it") if value == "auto" else _given(value)


def staging(value: tuple, *, segment_bytes: int, chunk_bytes: int, chunk_tokens: int, step_tokens: int | None,
            memory_bytes: int | None) -> Choice:
    """(staging_bytes, staging_slots, max_inflight_stores); "auto" (`value` the three as configured,
    "auto" first): slots of about 8 MiB (whole segments), room for the stores of two steps of
    `step_tokens` prefill tokens (one being gathered while the last is written: at the storage's
    own pace nothing is skipped; 8192 where vLLM's budget is unknown), and load slots for four
    chunks (at least 16, so the default lookahead fits any geometry). Capped at a quarter of
    `memory_bytes` (the ring is pinned); the reason then starts with STAGING_CAPPED."""
    if value[0] != "auto":
        return _given(tuple(value))
    slot = segment_bytes * max(1, (8 << 20) // segment_bytes)
    step = step_tokens if step_tokens and step_tokens > 0 else 8192
    step_chunks = -(-step // chunk_tokens)
    store_chunks = want = max(4, 2 * step_chunks)
    load_slots = max(16, -(-4 * chunk_bytes // slot))  # a lookahead past them is refused (validate)
    cap = memory_bytes // 4 if memory_bytes else None
    while True:
        inflight = max(1, -(-store_chunks * chunk_bytes // slot))
        total = (inflight + load_slots) * slot
        if cap is None or total <= cap or store_chunks <= 2:
            break
        store_chunks -= 1
    loads = "4 chunks of loads" if load_slots == -(-4 * chunk_bytes // slot) else f"{load_slots} load slots"
    if store_chunks < want:
        why = (f"{STAGING_CAPPED} (pinned): stores of more than {store_chunks} chunks in flight are skipped "
               f"(a step of {step} tokens makes {step_chunks})")
    else:
        why = f"2 steps of {step} tokens of stores, {loads}"
    return Choice((total, inflight + load_slots, inflight), why)


def writer_candidates(value: str, *, workers: int, checksums: bool) -> Choice:
    """The writer ids a writing worker tries for its store, in order (tutti.engine.claims): the
    configured one; for "auto" the namespace's writer slot ('') and then auto-1, auto-2, ... (held
    ones passed over, at most claims.MAX_AUTO_WRITERS), or the namespace's slot only where
    several workers (TP/PP > 1) would each pick a slot on its own, or checksums are off (a writer
    that trusts its own chunks unchecked must be the namespace's only one). Which one it took
    needs the store's locks: `writer_taken` says why."""
    if value != claims.AUTO:
        return _given([value])
    if workers > 1:
        return Choice([""], "with several workers (TP/PP > 1) each rank would pick its slot on its own")
    if not checksums:
        return Choice([""], "verify_checksums is off")
    return Choice(["", *(f"auto-{n}" for n in range(1, claims.MAX_AUTO_NAMES))],
                  "the namespace's writer slot, else the first free auto-<n>")


def writer_taken(writer_id: str, *, writes: bool = True) -> Choice:
    """The writer id an "auto" worker took (`writes`: it writes; else a reader rank, which reads
    its writer rank's slot)."""
    if not writes:
        return Choice("", "a reader rank: its writer rank's slot")
    return Choice(writer_id, f"slot held: took {writer_id}" if writer_id else "the namespace's writer slot")


def sync_load_budget_bytes(*, rate: float | None, overhead: float, prefill_rate: float | None, step_tokens: int,
                           step_s: float = 0.0) -> float | None:
    """sync_load_budget_bytes "auto", at run time: what the measured read `rate` (bytes/s, less
    its fixed `overhead` seconds per load) moves while the GPU computes a full step of
    `step_tokens` at `prefill_rate` (tokens/s), or `step_s` if longer; None while either rate is
    unmeasured (no budget yet)."""
    if not rate or not prefill_rate:
        return None
    return max(0.0, rate * (max(step_tokens / prefill_rate, step_s) - overhead))


#: File system types (/proc/mounts) of network clients: a root there is, or may be, shared by
#: servers on other machines (NFS, SMB, CephFS, Lustre, IBM Storage Scale, BeeGFS, WekaFS, 9p,
#: AFS, OrangeFS). Any FUSE mount ("fuse" or "fuse.<name>": GlusterFS, ceph-fuse, JuiceFS, 3FS,
#: sshfs) counts too; "fuseblk" (a FUSE driver of a local block device) does not.
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "gpfs", "beegfs",
                                 "wekafs", "9p", "afs", "pvfs2", "orangefs", "glusterfs"})


def network_filesystem(kinds: "list[str] | tuple[str, ...]") -> str | None:
    """The first of these file system types that is a network or FUSE one, or None."""
    for kind in kinds:
        if kind in NETWORK_FILESYSTEMS or kind == "fuse" or kind.startswith("fuse."):
            return kind
    return None


def tier_io_backend(value: str, *, fs_types: "list[str] | tuple[str, ...]") -> Choice:
    """One tier's IO backend, from the file system types of its roots. Each tier has its own
    queue where the backends (or io_options) differ (tutti.io.routed), so a RAM tier in front of
    a drive takes the thread pool and the drive io_uring.

    "auto" on a network or FUSE root: the queue's own "auto" (io_uring where the kernel has it,
    else threads), said so: through GlusterFS's FUSE client io_uring reads and writes as fast as
    the thread pool (every request is punted to its workers, as a thread would block), fails the
    same way when the client dies or its link is cut (ENOTCONN), and O_DIRECT is taken where the
    file system takes it (open_direct opens buffered where it is refused). On RAM roots and
    elsewhere: io_backend."""
    kind = network_filesystem(fs_types)
    if value == "auto" and kind is not None:
        return Choice("auto", f"a {kind} root, a network file system: io_uring where the kernel has it, else threads")
    from tutti.store.rammap import RAM_FILESYSTEMS

    return io_backend(value, on_ram=bool(fs_types) and all(t in RAM_FILESYSTEMS for t in fs_types))


def network_roots(mapped_loads: Any, *, first_tier: "list[str] | tuple[str, ...]") -> dict[str, Choice]:
    """mapped_loads "auto" where the first tier's roots (their file system types) are on a network
    or FUSE file system: {"mapped_loads": Choice}, or {} (the other rules decide). False, whatever
    the store's sharing: a mapping of a file other machines write is not coherent with their
    writes, and one the owner truncates or a client that vanishes faults (SIGBUS) instead of
    failing one read. (Lower tiers are never mapped; their io_backend: tier_io_backend.)"""
    first = network_filesystem(first_tier)
    if mapped_loads == "auto" and first is not None:
        return {"mapped_loads": Choice(False, f"a {first} root, a network file system: a mapping is not "
                                              "coherent with other nodes' writes")}
    return {}
