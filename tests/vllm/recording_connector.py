"""A tiny external KV connector that records which hooks vLLM calls, in order.

Loaded by vLLM through ``kv_connector_module_path``; it moves no data. The
log (JSON lines) goes to ``kv_connector_extra_config["log_path"]``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)


class RecMeta(KVConnectorMetadata):
    def __init__(self, step: int):
        self.step = step


def _t(x: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(x.shape), "stride": list(x.stride()), "dtype": str(x.dtype),
            "ptr": x.data_ptr(), "device": str(x.device),
            "storage_bytes": x.untyped_storage().nbytes(), "offset": x.storage_offset()}


class RecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._path = extra["log_path"]
        self._step = 0
        self._log("__init__", role=role.name,
                  kv_cache_config=repr(kv_cache_config)[:2000])

    def _log(self, hook: str, **kw: Any) -> None:
        with open(self._path, "a") as f:
            f.write(json.dumps({"hook": hook, "pid": os.getpid(), **kw}, default=str) + "\n")

    # worker side
    def register_kv_caches(self, kv_caches):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        import vllm_layout_api
        spec = vllm_layout_api.single_attention_spec(self._kv_cache_config)
        layout = vllm_layout_api.kv_cache_layout_name(self._kv_cache_config, self._vllm_config)
        layers = get_layers_from_vllm_config(self._vllm_config, Attention)
        expected = {}
        for name, kv in kv_caches.items():
            shape, order = vllm_layout_api.layer_kv_cache_shape_and_order(
                layers[name].get_attn_backend(), spec, kv.shape[0], layout)
            expected[name] = {"shape": list(shape), "order": list(order)}
        self._log("register_kv_caches", layers={k: _t(v) for k, v in kv_caches.items()},
                  layout=layout, expected=expected,
                  geometry={k: vllm_layout_api.block_geometry(k, v).__dict__ for k, v in kv_caches.items()},
                  spec={"block_size": spec.block_size, "num_kv_heads": spec.num_kv_heads,
                        "head_size": spec.head_size, "dtype": str(spec.dtype)})

    def bind_connector_metadata(self, m):
        super().bind_connector_metadata(m)
        self._log("bind_connector_metadata", step=getattr(m, "step", None))

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self._log("clear_connector_metadata")

    def handle_preemptions(self, m):
        self._log("handle_preemptions")

    def start_load_kv(self, forward_context, **kw):
        self._log("start_load_kv", kwargs=list(kw),
                  attn_metadata_type=type(forward_context.attn_metadata).__name__)

    def wait_for_layer_load(self, layer_name):
        self._log("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kw):
        am = attn_metadata
        self._log("save_kv_layer", layer=layer_name, kv=_t(kv_layer),
                  attn_metadata_type=type(am).__name__, kwargs=list(kw),
                  slot_mapping=(am.slot_mapping[:4].tolist() if hasattr(am, "slot_mapping") else None))

    def wait_for_save(self):
        self._log("wait_for_save")

    def get_finished(self, finished_req_ids):
        self._log("get_finished", finished=sorted(finished_req_ids))
        return None, None

    def get_transfer_results(self, finished_req_ids):
        self._log("get_transfer_results", finished=sorted(finished_req_ids))
        return super().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        self._log("get_block_ids_with_load_errors")
        return set()

    def get_kv_connector_stats(self):
        self._log("get_kv_connector_stats")
        return None

    def build_connector_worker_meta(self):
        self._log("build_connector_worker_meta")
        return None

    def shutdown(self):
        self._log("shutdown")

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._log("get_num_new_matched_tokens", req=request.request_id,
                  num_computed_tokens=num_computed_tokens,
                  num_prompt_tokens=request.num_prompt_tokens)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._log("update_state_after_alloc", req=request.request_id,
                  block_ids=blocks.get_block_ids(), num_external_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        self._step += 1
        so = scheduler_output
        self._log("build_connector_meta", step=self._step,
                  new=[(r.req_id, r.num_computed_tokens, r.block_ids) for r in so.scheduled_new_reqs],
                  num_scheduled_tokens=dict(so.num_scheduled_tokens))
        return RecMeta(self._step)

    def update_connector_output(self, connector_output):
        self._log("update_connector_output", out=repr(connector_output)[:300])

    def request_finished(self, request, block_ids):
        self._log("request_finished", req=request.request_id, block_ids=block_ids,
                  num_computed_tokens=request.num_computed_tokens)
        return False, None

    def take_events(self):
        self._log("take_events")
        return ()
