"""Probe KV connector: logs each call (pid, thread, role) to /tmp/vtest/probe.log."""
import os, threading, time, json
from typing import Any
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)

LOG = "/tmp/vtest/probe.log"
_seen = {}

def _log(self, name, **kw):
    key = (self._role.name, name)
    _seen[key] = _seen.get(key, 0) + 1
    if _seen[key] > 3 and name not in ("register_kv_caches", "request_finished", "get_num_new_matched_tokens", "update_state_after_alloc"):
        return
    with open(LOG, "a") as f:
        f.write(json.dumps({"t": round(time.time(), 3), "pid": os.getpid(), "thread": threading.current_thread().name,
                            "role": self._role.name, "call": name, "n": _seen[key], **kw}, default=str) + "\n")

class ProbeMeta(KVConnectorMetadata):
    def __init__(self, reqs): self.reqs = reqs

class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        _log(self, "__init__", kv_role=vllm_config.kv_transfer_config.kv_role,
             extra=vllm_config.kv_transfer_config.kv_connector_extra_config,
             engine_id=vllm_config.kv_transfer_config.engine_id,
             num_blocks=kv_cache_config.num_blocks,
             block_size=vllm_config.cache_config.block_size)
        self._pending = {}
    # worker side
    def register_kv_caches(self, kv_caches):
        info = {}
        for n, t in kv_caches.items():
            st = t.untyped_storage()
            info[n] = dict(shape=list(t.shape), stride=list(t.stride()), dtype=str(t.dtype),
                           device=str(t.device), data_ptr=t.data_ptr(), storage_ptr=st.data_ptr(),
                           storage_nbytes=st.nbytes(), nbytes=t.nbytes, contiguous=t.is_contiguous())
        _log(self, "register_kv_caches", caches=info)
    def start_load_kv(self, forward_context, **kw): _log(self, "start_load_kv", meta=getattr(self._connector_metadata, "reqs", None))
    def wait_for_layer_load(self, layer_name): _log(self, "wait_for_layer_load", layer=layer_name)
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kw):
        _log(self, "save_kv_layer", layer=layer_name, shape=list(kv_layer.shape), slot_mapping=getattr(attn_metadata, "slot_mapping", None).tolist()[:40] if getattr(attn_metadata, "slot_mapping", None) is not None else None)
    def wait_for_save(self): _log(self, "wait_for_save")
    def get_finished(self, finished_req_ids):
        _log(self, "get_finished", finished_req_ids=sorted(finished_req_ids)); return None, None
    def get_block_ids_with_load_errors(self):
        _log(self, "get_block_ids_with_load_errors"); return set()
    def shutdown(self): _log(self, "shutdown")
    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        _log(self, "get_num_new_matched_tokens", req=request.request_id, num_computed=num_computed_tokens,
             params=request.kv_transfer_params, n_prompt=request.num_prompt_tokens)
        return 0, False
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        _log(self, "update_state_after_alloc", req=request.request_id, blocks=blocks.get_block_ids(), n_ext=num_external_tokens)
    def build_connector_meta(self, scheduler_output):
        _log(self, "build_connector_meta", finished=sorted(scheduler_output.finished_req_ids))
        return ProbeMeta({})
    def update_connector_output(self, connector_output): _log(self, "update_connector_output", out=repr(connector_output)[:300])
    def on_new_request(self, request): _log(self, "on_new_request", req=request.request_id, params=request.kv_transfer_params)
    def request_finished(self, request, block_ids):
        _log(self, "request_finished", req=request.request_id, status=str(request.status), block_ids=block_ids,
             num_computed=request.num_computed_tokens)
        return False, {"probe": "hello", "block_ids": list(block_ids)}
