"""The worker's half of TuttiConnectorV1: vLLM's worker callbacks translated to the worker
pipeline (tutti.engine.worker.pipeline), which moves the bytes: the registered KV caches read
as a layout, a step's plan started, layers awaited and saved, completions and failures told back."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from tutti.engine import claims, handoff
from tutti.engine.build import build_worker
from tutti.engine.config.values import human
from tutti.engine.hostcost import WAITS, HookClock, ThreadCPU, timed, worker_threads
from tutti.engine.plan import StepPlan, WorkerReport
from tutti.vllm import compat, internals, layout, translate
from tutti.vllm.stats import TuttiKVConnectorStats, stats_from

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.tutti.connector")


def _rate(nbytes: int, seconds: float) -> str:
    """A start-up read probe, for the ready line."""
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if nbytes and seconds > 0 else "nothing stored yet"


class WorkerHalf:
    def __init__(self, vllm_config: "VllmConfig", setup: translate.Setup) -> None:
        self.setup = setup
        self._vllm_config = vllm_config
        self._hooks = HookClock()  # host time of the worker's hooks, as a metric
        self._threads = ThreadCPU(worker_threads, interval_s=0.0)
        self.worker = None  # tutti.engine.worker.pipeline.WorkerPipeline, once the caches are registered
        self._layer_index: dict[str, int] = {}
        self._layer_work = False  # this step has layer-wise loads: the per-layer hooks have work
        self._failed_async_blocks: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor], owner: Any) -> None:
        """Build the worker over vLLM's KV caches (`owner`: the connector vLLM holds globally)."""
        s, vc = self.setup, self._vllm_config
        self.shutdown()  # registered again (a new engine in this process): release the old store first
        # a hybrid model's segments follow the model's layer order, as its namespace says
        names = layout.layer_order(list(kv_caches)) if s.hybrid else list(kv_caches)
        if s.hybrid and len(names) != len(s.geom.groups.split(",")):
            raise ValueError(f"TuttiConnectorV1: {len(names)} KV cache tensors registered for "
                             f"{len(s.geom.groups.split(','))} attention layers in the KV cache groups")
        self._layer_index = {n: i for i, n in enumerate(names)}
        caches = [kv_caches[n] for n in names]
        kinds = s.geom.kind_of_layer
        if "state" in kinds:  # Mamba / linear-attention layers: their pages seen as an attention layer's
            like = next(c for c, k in zip(caches, kinds) if k != "state")
            caches = [layout.state_page_view(c, like, n) if k == "state" else c
                      for c, k, n in zip(caches, kinds, names)]
        first_attn = next((n for n, k in zip(names, kinds) if k != "state"), names[0])
        paged, views, kbpb = layout.discover_layout(vc, caches, layer_name=first_attn)
        geom = s.geom.for_rank(*translate.worker_ranks(vc))
        try:
            self.worker = build_worker(s.cfg, geom, caches=views, layout=paged, kernel_blocks_per_block=kbpb,
                                       rank=translate.worker_rank(vc),
                                       async_loads=(s.async_loads and not s.hybrid) or ("split" if s.budgeted else False),
                                       step_tokens=translate.step_tokens(vc), engine_id=s.engine_id, mac=s.mac)
        except Exception:
            internals.release_global_connector(owner)  # the engine will not start: do not haunt the next one
            raise
        self.worker.warm_up()
        handoff.record_probe(s.engine_id, *self.worker.probe)  # the scheduler in this process prices hits with it
        self._log_ready(paged, len(caches))

    def _log_ready(self, paged: Any, num_layers: int) -> None:
        """The start-up lines (rank 0 at INFO, other ranks at DEBUG): a short one a user reads (the
        store, how hits load, the measured read rate), and the details at DEBUG (layout, kernel,
        staging, mappings, the interpreter's settings, every "auto" decided and why)."""
        w, cfg = self.worker, self.setup.cfg
        rank = translate.worker_rank(self._vllm_config)
        info = logger.info if rank == 0 else logger.debug
        probe = _rate(*w.probe)
        tiers = "".join(f" tier {i}: roots={list(t.roots)} capacity={human(t.capacity_bytes)} "
                        f"({len(journal)} chunks stored, read probe: {_rate(*p)}, write_policy={cfg.write_policy});"
                        for i, (t, (_, journal), p) in enumerate(zip(cfg.tiers, w.ctx.lower, w.lower_probes), 1))
        info("tutti: ready: roots=%s capacity=%s (%d chunks of %d tokens stored) backend=%s hits=%s read probe: %s;%s "
             "start-up took %.2f s", list(w.cfg.roots), human(cfg.capacity_bytes), w.resident_chunks, cfg.chunk_tokens,
             w.queue.caps().backend, self.setup.load_mode, probe, tiers, w.warmup_seconds)
        logger.debug(
            "tutti: details: layout=%s kernel=%s layers=%d rank=%d staging=%d B (%d store chunks) mapped=%d B in %.2f s%s "
            "read probe=%d B in %.3f s gil_switch_interval=%g s idle_load_wait=%g s; auto: %s",
            paged, w.kernel.name, num_layers, rank, w.cfg.staging_bytes, w.stores.arena.num_regions, w.mapped_bytes,
            w.map_seconds, f" (stores copy into it: {w.stores.map_copy})" if w.stores.into_maps else "",
            w.probe[0], w.probe[1], sys.getswitchinterval(), w.idle_wait_s, w.decisions.describe() or "none")

    # ------------------------------------------------------------------ the step
    @timed("_hooks")
    def start_step(self, plan: StepPlan) -> None:
        # whether this step's forward runs the per-layer hooks matters only to its loads and
        # stores (a quiet decode step does not ask the forward context)
        layerwise = bool(plan.loads or plan.stores) and compat.step_runs_layer_hooks(compat.current_forward_context())
        self.worker.start_step(plan, layerwise=layerwise)
        self._layer_work = bool(plan.loads) and layerwise

    def _layer(self, layer_name: str) -> int:
        idx = self._layer_index.get(layer_name)
        if idx is None:
            idx = self._layer_index[layer_name] = len(self._layer_index)
        return idx

    def wait_layer(self, layer_name: str) -> None:
        # called for every layer of every piecewise step: a step without layer-wise loads returns
        # at once (its stores are gathered after the forward, in end_step)
        if self._layer_work:
            self._wait_layer(layer_name)

    @timed("_hooks")
    def _wait_layer(self, layer_name: str) -> None:
        self.worker.wait_layer(self._layer(layer_name))

    def save_layer(self, layer_name: str) -> None:
        if self._layer_work:
            self._save_layer(layer_name)

    @timed("_hooks")
    def _save_layer(self, layer_name: str) -> None:
        self.worker.save_layer(self._layer(layer_name))

    @timed("_hooks")
    def end_step(self) -> None:
        if self.worker is not None:
            self.worker.end_step()

    # ------------------------------------------------------------------ completions and failures
    def completions(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose stores are done, asynchronous loads received, asynchronous loads failed).
        With one KV cache group a failed request is received, its bad blocks reported with this
        step's invalid blocks (vLLM recomputes from the first); hybrid models fail per request."""
        if self.worker is None:
            return set(), set(), set()
        received, failed, blocks = self.worker.received_requests()
        if not self.setup.hybrid:
            received, failed = received | failed, set()
            self._failed_async_blocks |= blocks
        return self.worker.finished_requests(set(finished_req_ids)), received, failed

    @timed("_hooks")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, received, failed = self.completions(finished_req_ids)
        # failures are told through get_transfer_results; a vLLM without it is refused for hybrid models at start
        assert not failed, "asynchronous load failures need get_transfer_results (refused at start otherwise)"
        return (done or None), received or None

    @timed("_hooks")
    def transfer_results(self, finished_req_ids: set[str]) -> Any:
        return compat.make_transfer_results(*self.completions(finished_req_ids))

    @timed("_hooks")
    def failed_blocks(self) -> set[int]:
        if self.worker is None:
            return set()
        out, self._failed_async_blocks = self._failed_async_blocks, set()
        return out | self.worker.take_failed_blocks()

    @timed("_hooks")
    def take_report(self) -> WorkerReport | None:
        if self.worker is None:
            return None
        report = self.worker.take_report()
        return None if report.is_empty() else report

    @timed("_hooks")
    def preempt(self, plan: StepPlan) -> None:
        if self.worker is not None:
            self.worker.preempt(plan.preempted)

    def stats(self, host_costs: bool) -> TuttiKVConnectorStats | None:
        """Bytes and seconds moved and stores skipped since the last call."""
        if self.worker is None:
            return None
        w = self.worker.take_stats()  # the engine's counter names are the metrics' fields
        if host_costs:
            w["worker_hook_seconds"], w["worker_thread_cpu_seconds"] = self._hooks.take(), self._threads.take()
            w["worker_thread_wait_seconds"] = WAITS.take()
        return stats_from(w)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            claims.release(self.setup.engine_id)  # its writer slot's lock is gone with its store
