"""A vLLM KV connector on aiokvcache: ``AioKVConnector``.

Load it with::

    KVTransferConfig(
        kv_connector="AioKVConnector",
        kv_connector_module_path="aiokvcache.integrations.vllm",
        kv_role="kv_producer",  # or "kv_consumer", "kv_both"
        kv_connector_extra_config={"mode": "pull"},  # or "push"; see EXTRA_CONFIG
    )

The request flow is vLLM's NixlConnector's: a prefill request carries
``kv_transfer_params={"do_remote_decode": True}``; the prefill instance
returns the params a decode request passes back unchanged
(``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``transfer_mode``
and aiokvcache's own ``remote_cluster_id``, ``aiokv_peers``,
``aiokv_layout``, ``aiokv_transfer_id``, ``aiokv_grant_keys`` or
``aiokv_push_keys``), so vLLM's disaggregated proxy and clients written for
NixlConnector work unchanged (``remote_block_ids`` is one list per KV cache
group, as theirs: a hybrid model's sliding-window groups give only their
blocks still in the window, see :mod:`._vllm_groups`). ``aiokv_grant_keys``
(pull, one per prefill worker) are MACs of the request id and its block
list by a secret each prefill worker shares with its own scheduler only:
only a decode instance handed the params can claim (or free) the request's
blocks, and only those blocks.
``aiokv_push_keys`` (push) are MACs of the transfer id by the same secrets:
only a decode handed the params can register for the pushes; decode first,
the client gives both requests an ``aiokv_transfer_key`` of its choosing.

- *pull* (default): the decode worker claims the prefill's blocks, reads
  them with ``pull_blocks`` and tells the prefill to free them.
- *push*: the prefill worker writes each layer into the decode's blocks
  from ``save_kv_layer``, as soon as that layer is computed, once the decode
  registered its blocks; the decode side learns of each layer from
  aiokvcache's notifications. When the client sends the decode request
  first (``do_remote_prefill`` with the prefill's address, an
  ``aiokv_transfer_id`` and an ``aiokv_transfer_key`` it also gives the
  prefill request), pushes overlap the prefill's computation layer by layer.
  A hybrid model's groups are pushed by position, a sliding window's from
  the block the decode's next token attends to (see :mod:`._vllm_groups`).

The scheduler-side connector starts nothing; each worker-side connector owns
one aiokvcache engine on its own thread (:mod:`.kvlink`). No method blocks
the engine step and nothing polls.

A decode request aborted while its KV loads stops the load (its blocks go back
once the load is quiescent); one aborted before its load began, or whose
prompt is all in the local prefix cache, tells the prefill instance to free
its blocks at once instead of at the end of their lease.

Metrics: ``get_kv_connector_stats`` feeds vLLM's periodic "KV Transfer
metrics" log line, and ``build_prom_metrics`` registers
``vllm:aiokvcache_xfer_time_seconds``, ``vllm:aiokvcache_bytes_transferred``,
``vllm:aiokvcache_num_descriptors`` (histograms, one sample per load),
``vllm:aiokvcache_num_failed_transfers`` (by ``reason``) and
``vllm:aiokvcache_num_kv_expired_reqs`` (counters), beside NixlConnector's
``vllm:nixl_*`` equivalents.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ._vllm_groups import KVGroups, block_groups, flat_blocks
from ._vllm_layout import by_heads, kv_layout
from ._vllm_metrics import AioKVPromMetrics, AioKVStats
from ._vllm_worker import WorkerBinding
from .agent.handoff import blocks_digest, grant_key, push_key
from .agent.kvlink import TransferAgent, cluster_id_for
from .agent.kvtypes import GRACE_S

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "EXTRA_CONFIG",
    "AioKVConnector",
    "AioKVHandshake",
    "AioKVMetadata",
    "AioKVStats",
    "kv_layout",
]

log = logging.getLogger("aiokvcache.vllm")

#: ``kv_connector_extra_config`` keys and their defaults.
EXTRA_CONFIG: dict[str, Any] = {
    "mode": "pull",  # "pull" or "push"
    "transport": "auto",  # aiokvcache transport: auto, shm, tcp, rdma
    "host": "127.0.0.1",  # the worker's listen address (AIOKVCACHE_VLLM_HOST overrides)
    "port": 0,  # 0: any free port; else port + tensor-parallel rank
    "cluster_id": None,  # aiokvcache cluster id (+ rank); default from engine_id
    "timeout": 30.0,  # seconds: one request's transfer, from its start
    "kv_lease_duration": 30.0,  # seconds a pull-mode prefill holds finished blocks
    # seconds: the longest a pull-mode prefill holds a request's blocks while a
    # decode that holds its params renews the lease (every kv_lease_duration / 6)
    "kv_lease_max": 600.0,
    "auth_token": None,  # shared secret (AIOKVCACHE_AUTH_TOKEN overrides)
    "record_digests": False,  # tests: hash what each request loaded (costs a pass over it)
    # Seconds: the worker process's sys.setswitchinterval (lowered, never raised); None
    # leaves it. vLLM's engine loop holds the GIL while it steps, and Python hands
    # the GIL to the connector's thread only every switch interval (5 ms by
    # default), so each hop of a transfer would wait up to that long.
    "switch_interval": 0.0002,
}


def _config(extra: dict[str, Any] | None) -> dict[str, Any]:
    cfg = dict(EXTRA_CONFIG)
    for key, value in (extra or {}).items():
        if key in cfg:
            cfg[key] = value
    if cfg["mode"] not in ("pull", "push"):
        raise ValueError(
            f"kv_connector_extra_config['mode'] must be 'pull' or 'push', got {cfg['mode']!r}"
        )
    for key in ("timeout", "kv_lease_duration", "kv_lease_max"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] <= 0:
            raise ValueError(
                f"kv_connector_extra_config[{key!r}] must be a positive number, got {cfg[key]!r}"
            )
    si = cfg["switch_interval"]
    if si is not None and (not isinstance(si, (int, float)) or si <= 0):
        raise ValueError(
            f"kv_connector_extra_config['switch_interval'] must be None or a positive number "
            f"of seconds, got {si!r}"
        )
    if not isinstance(cfg["port"], int) or not 0 <= cfg["port"] < 65536:
        raise ValueError(f"kv_connector_extra_config['port'] must be a port, got {cfg['port']!r}")
    cfg["host"] = os.environ.get("AIOKVCACHE_VLLM_HOST", cfg["host"])
    cfg["auth_token"] = os.environ.get("AIOKVCACHE_AUTH_TOKEN", cfg["auth_token"])
    return cfg


if os.environ.get("AIOKVCACHE_VLLM_DEBUG"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.DEBUG)


@dataclass
class AioKVHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc,unused-ignore]
    """What a worker tells its scheduler at start-up: where its engine listens."""

    host: str
    port: int
    cluster_id: int
    layout: str
    # The worker's grant-key secret (hex): for its own scheduler, which makes
    # each handed-over request's key; never in a request's params.
    grant_secret: str = ""


def _remote_peers(params: dict[str, Any]) -> list[list[Any]]:
    """A request's prefill workers, ``[host, port, cluster_id]`` each, from its params."""
    return params.get("aiokv_peers") or [
        [params.get("remote_host"), params.get("remote_port"), params.get("remote_cluster_id")]
    ]


@dataclass
class _Recv:
    """D: one request to load (pull) or to be pushed (push)."""

    mode: str
    peers: list[list[Any]]  # [[host, port, cluster_id], ...] per tensor-parallel rank
    remote_request_id: str
    remote_block_ids: list[int]  # pull: all the prefill request's blocks, group after group
    first: int  # push: the request's block local_block_ids[0] is for
    local_block_ids: list[int]
    transfer_id: str
    layout: str | None
    grant_keys: list[str] = field(default_factory=list)
    grant_until: int = 0
    push_keys: list[str] = field(default_factory=list)  # push: one per prefill worker
    transfer_key: str = ""  # push, decode first: the key the client gave both requests
    tp_size: int = 0  # the prefill's tensor-parallel size, as its params say (0: not said)
    error: str = ""  # why its params cannot be loaded from ("": they can)
    picks: list[int] | None = None  # pull: the indexes in remote_block_ids read, in order
    groups: list[list[int]] | None = None  # push, several groups: [first, count] of each
    end: int = 0  # the tokens it takes the request to hold (it computes from there)


@dataclass
class _Drop:
    """D: tell the prefill instance its request's KV is not needed."""

    mode: str
    peers: list[list[Any]]
    remote_request_id: str
    remote_block_ids: list[int]
    transfer_id: str
    grant_keys: list[str]
    grant_until: int
    push_keys: list[str] = field(default_factory=list)
    transfer_key: str = ""
    lease: float = 0.0  # pull: the prefill's lease (its params say), 0: not said
    tp_size: int = 0  # the prefill's tensor-parallel size, as its params say (0: not said)

    @classmethod
    def from_params(cls, params: dict[str, Any], mode: str) -> _Drop:
        """The drop of the request whose params are ``params`` (``mode``: the
        connector's, unless the params name one). Params that cannot be read
        give a drop that names no prefill worker: the worker skips it (the
        prefill's hold or pushes run out on their own)."""
        try:
            return cls(
                mode=str(params.get("transfer_mode") or mode),
                peers=_remote_peers(params),
                remote_request_id=str(params.get("remote_request_id", "")),
                remote_block_ids=flat_blocks(params.get("remote_block_ids") or []),
                transfer_id=str(params.get("aiokv_transfer_id") or params.get("remote_request_id")),
                grant_keys=_strs(params.get("aiokv_grant_keys")),
                grant_until=int(params.get("aiokv_grant_until") or 0),
                push_keys=_strs(params.get("aiokv_push_keys")),
                transfer_key=str(params.get("aiokv_transfer_key") or ""),
                lease=_seconds(params.get("aiokv_lease")),
                tp_size=_tp_size(params),
            )
        except (TypeError, ValueError, OverflowError) as exc:
            log.error("aiokvcache: a request's kv_transfer_params cannot be read: %s", exc)
            return cls(mode, [], "", [], "", [], 0)


def _strs(v: Any) -> list[str]:
    """A list of strings from a peer's params (a list or tuple), else raises."""
    if v is None:
        return []
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"expected a list, got {type(v).__name__}")
    return [str(k) for k in v]


def _tp_size(params: dict[str, Any]) -> int:
    """The prefill's tensor-parallel size its params say: a positive int, -1
    for anything else (refused by the worker), 0 when they say none."""
    v = params.get("tp_size")
    if v is None:
        return 0
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 16 else -1


def _seconds(v: Any) -> float:
    """A positive finite number of seconds from a peer's params, else 0."""
    return float(v) if isinstance(v, (int, float)) and 0 < v < 1e9 else 0.0


def _recv_of(
    params: dict[str, Any],
    mode: str,
    groups: KVGroups,
    first: int,
    last: int,
    local: list[list[int]],
    end: int,
) -> _Recv:
    """D: the load of the request whose params are ``params`` (``mode``: the
    connector's, unless they name one) into its blocks ``local`` (one list per
    transfer group), positions ``[first, last)``, its tokens ending at
    ``end``: blocks before ``first`` are in the local prefix cache (they may
    be shared with running requests), neither read nor pushed. Raises
    ``TypeError``/``ValueError`` for params it cannot load from."""
    mode = str(params.get("transfer_mode") or mode)
    recv = _Recv(
        mode=mode,
        peers=_remote_peers(params),
        remote_request_id=str(params.get("remote_request_id", "")),
        remote_block_ids=[],
        first=first,
        local_block_ids=[b for g in local for b in g[first:last]],
        transfer_id=str(params.get("aiokv_transfer_id") or params.get("remote_request_id")),
        layout=params.get("aiokv_layout"),
        grant_keys=_strs(params.get("aiokv_grant_keys")),
        grant_until=int(params.get("aiokv_grant_until") or 0),
        push_keys=_strs(params.get("aiokv_push_keys")),
        transfer_key=str(params.get("aiokv_transfer_key") or ""),
        tp_size=_tp_size(params),
        end=end,
    )
    if mode == "push" and not groups.plain:
        recv.local_block_ids, recv.groups = groups.push_spans(local, first, last, end)
    if mode == "pull":
        remote = block_groups(params.get("remote_block_ids") or [])
        said = params.get("remote_num_tokens")  # the prefill's tokens: where its lists end
        blocks = None
        if isinstance(said, int) and not isinstance(said, bool) and 0 < said < 1 << 40:
            blocks = -(-said // groups.block_size)
        recv.remote_block_ids, recv.picks, recv.local_block_ids = groups.pair(
            local, first, last, remote, blocks, end
        )
    return recv


def _transfer_groups(kv_cache_config: Any, block_ids: Any) -> list[list[int]]:
    """vLLM's block ids of every KV cache group: those of the groups moved."""
    if kv_cache_config is not None and len(block_ids) == len(kv_cache_config.kv_cache_groups):
        block_ids = kv_cache_config.select_transfer_block_ids(block_ids)
    return [list(g) for g in block_ids]


@dataclass
class AioKVMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """What the scheduler tells its workers each step."""

    recv: dict[str, _Recv] = field(default_factory=dict)
    cancel_recv: set[str] = field(default_factory=set)  # D: aborted while loading
    drops: list[_Drop] = field(default_factory=list)  # D: KV not needed after all
    # P pull: req id -> (lease in s, block ids, grant keys' expiry in ms)
    holds: dict[str, tuple[float, list[int], int]] = field(default_factory=dict)
    # P push: req id -> (transfer id, block ids of each KV cache group, token end of
    # this step, last chunk, the client's push key or "", prompt tokens)
    push_steps: dict[str, tuple[str, list[list[int]], int, bool, str, int]] = field(
        default_factory=dict
    )
    # P push, sliding-window groups: req ids stepped past their prompt -> transfer id
    # (vLLM frees their out-of-window blocks: pushes reading them end first)
    push_settle: dict[str, str] = field(default_factory=dict)
    # D pull: requests whose prefill hold the worker renews from now on, and
    # those whose renewals stop (their load started, or they ended)
    renew_start: dict[str, _Drop] = field(default_factory=dict)
    renew_stop: set[str] = field(default_factory=set)
    # P push: req ids preempted this step -> transfer id (their pushes stop before
    # the step reuses their blocks; the recompute pushes them again)
    push_preempted: dict[str, str] = field(default_factory=dict)
    # P push: req id -> (transfer id, aborted), once the engine finished the request
    # and its blocks of each KV cache group then (vLLM freed its out-of-window ones)
    push_release: dict[str, tuple[str, bool, list[list[int]]]] = field(default_factory=dict)


class AioKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
    """vLLM's KV connector interface on aiokvcache (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # the base class refuses a missing one
        self._cfg = _config(ktc.kv_connector_extra_config)
        self._mode: str = self._cfg["mode"]
        self._engine_id: str = str(ktc.engine_id)
        self._block_size: int = int(vllm_config.cache_config.block_size)
        self._groups = KVGroups.of(kv_cache_config, self._block_size)
        pc = vllm_config.parallel_config
        self._tp_size = int(pc.tensor_parallel_size)
        if int(pc.pipeline_parallel_size) != 1:
            raise ValueError("AioKVConnector does not support pipeline parallelism")
        # scheduler side
        self._peers: dict[int, AioKVHandshake] = {}
        self._staged = AioKVMetadata()
        # P push: req id -> (request, transfer id, the client's push key or "")
        self._push_reqs: dict[str, tuple[Any, str, str]] = {}
        self._unreported_push: set[str] = set()
        self._loading: set[str] = set()  # D: loads started and not yet reported
        self._renewing: set[str] = set()  # D, pull: requests whose prefill hold is renewed
        # worker side
        self._agent: TransferAgent | None = None
        self._binding: WorkerBinding | None = None
        self._layer_index: dict[str, int] = {}  # layer name -> its memory unit
        self._unit_layers: list[int] = []  # memory unit -> how many layers share it
        self._step_saved: dict[int, int] = {}  # memory unit -> its layers saved this step
        self._tensors: list[torch.Tensor] = []
        self._step_pushes: list[str] = []
        self._bad_blocks: set[int] = set()
        self._rank = 0

    # ============================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        num_blocks = int(self._kv_cache_config.num_blocks)
        g = self._groups
        layout, units, self._tensors = kv_layout(
            kv_caches, num_blocks, self._block_size, g.described, g.window_tokens
        )
        total = int(self._vllm_config.model_config.get_total_num_kv_heads())
        layout = by_heads(layout, kv_caches, total, self._tp_size)
        self._layer_index = {n: i for i, names in enumerate(units) for n in names}
        self._unit_layers = [len(names) for names in units]
        try:
            self._rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no parallel state (tests): rank 0
            self._rank = 0
        cfg = self._cfg
        base = cfg["cluster_id"]
        cid = (
            int(base) + self._rank
            if base is not None
            else cluster_id_for(self._engine_id, self._rank)
        )
        port = int(cfg["port"]) + self._rank if cfg["port"] else 0
        self._agent = TransferAgent(
            cid,
            layout,
            host=cfg["host"],
            port=port,
            transport=cfg["transport"],
            auth_token=cfg["auth_token"],
            timeout=float(cfg["timeout"]),
            record_digests=bool(cfg["record_digests"]),
        )
        address = self._agent.start()
        lease = float(cfg["kv_lease_duration"])
        self._binding = WorkerBinding(
            self._rank, self._block_size, lease, self._tp_size, layout.heads, layout.total_heads
        )
        si = cfg["switch_interval"]
        if si is not None and sys.getswitchinterval() > si:
            sys.setswitchinterval(float(si))
        log.info(
            "aiokvcache: rank %d serves %d layers x %d blocks of %d bytes at %s (cluster %d)",
            self._rank,
            layout.num_layers,
            num_blocks,
            layout.block_bytes * layout.tensors_per_layer,
            address,
            cid,
        )

    def get_handshake_metadata(self) -> AioKVHandshake | None:
        agent = self._agent
        if agent is None or agent.address is None:
            return None
        host, port = agent.address.rsplit(":", 1)
        return AioKVHandshake(
            host, int(port), agent.cluster_id, agent.layout.digest(), agent.grant_secret.hex()
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Handled here, before the forward pass: save_kv_layer runs inside it.
        meta = connector_metadata
        if self._agent is None or self._binding is None or not isinstance(meta, AioKVMetadata):
            return
        self._step_pushes = self._binding.bind(self._agent, meta)
        self._step_saved = {}

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """P push: vLLM preempted these requests and frees their blocks for
        this step: their pushes stop (quiescent) before this returns, and the
        recompute pushes every layer again."""
        agent = self._agent
        meta = kv_connector_metadata
        if agent is None or not isinstance(meta, AioKVMetadata) or not meta.push_preempted:
            return
        suffix = f"/{self._rank}"
        agent.push_preempt([xid + suffix for xid in meta.push_preempted.values()])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Loads were started in bind_connector_metadata; they run between steps."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Every load is asynchronous: a request runs only once all its layers landed."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if not self._step_pushes or self._agent is None:
            return
        unit = self._layer_index.get(layer_name)
        if unit is None:
            return
        # A memory unit shared by several layers is pushed once all are in.
        n = self._step_saved[unit] = self._step_saved.get(unit, 0) + 1
        if n == self._unit_layers[unit]:
            self._agent.layer_saved(self._step_pushes, unit)

    def wait_for_save(self) -> None:
        """Pushes run on the connector's thread; their source blocks stay
        allocated until they are reported in ``finished_sending``."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._agent is None:
            return KVConnectorTransferResults()
        r = self._agent.take_results()
        self._bad_blocks |= r.invalid_block_ids
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None, r.finished_recving or None)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this worker's loads did since the last call (``None``: nothing)."""
        if self._agent is None:
            return None
        m = self._agent.take_metrics()
        stats = AioKVStats()
        stats.data["transfer_duration"] = m["seconds"]
        stats.data["bytes_transferred"] = m["bytes"]
        stats.data["num_descriptors"] = m["descriptors"]
        stats.data["failures"].update(m["failures"])
        stats.data["num_kv_expired_reqs"] = m["leases_expired"]
        stats.data["calls"] = m["calls"]
        stats.data["phases"] = m["phases"]
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return AioKVStats(data=data) if data is not None else AioKVStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return AioKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        kcc = self._kv_cache_config
        if kcc is not None and len(kcc.kv_cache_groups) > 1:
            # A block id names a block of one group only: vLLM takes a failed
            # load of a hybrid model from failed_recving alone.
            return set()
        return bad

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ============================================================ scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        for rank, meta in metadata.items():
            if isinstance(meta, AioKVHandshake):
                self._peers[int(rank)] = meta

    def _peer_list(self) -> list[list[Any]]:
        return [
            [self._peers[r].host, self._peers[r].port, self._peers[r].cluster_id]
            for r in sorted(self._peers)
        ]

    def on_new_request(self, request: Any) -> None:
        """D, pull: the engine now holds this request's params: its worker
        renews the prefill's hold on the blocks until the load starts (a
        request that waits long for its first step is not failed by an
        expired lease; vLLM's NixlConnector renews alike)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if str(params.get("transfer_mode") or self._mode) != "pull":
            return
        if not params.get("aiokv_grant_keys"):
            return
        rid = request.request_id
        self._renewing.add(rid)
        self._staged.renew_start[rid] = _Drop.from_params(params, "pull")

    def _stop_renewing(self, rid: str) -> None:
        if rid in self._renewing:
            self._renewing.discard(rid)
            self._staged.renew_start.pop(rid, None)
            self._staged.renew_stop.add(rid)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        log.debug("scheduler: %s asks for matches", request.request_id)
        if params and params.get("do_remote_prefill"):
            n = len(request.prompt_token_ids or ())
            said = params.get("remote_num_tokens")
            if isinstance(said, int) and not isinstance(said, bool) and said > 0:
                n = min(n, said)
            count = n - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _mode_of(self, params: dict[str, Any]) -> str:
        """P: a request's transfer mode: its params', else the connector's."""
        return str(params.get("transfer_mode") or self._mode)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        self._stop_renewing(rid)  # its load starts now (or it needs none): the claim holds it
        if params.get("do_remote_prefill"):
            log.debug("scheduler: %s allocated, %d tokens to load", rid, num_external_tokens)
            params["do_remote_prefill"] = False  # one transfer per request
            if num_external_tokens <= 0:
                # Everything is in the local prefix cache: the prefill
                # instance may free its blocks now.
                self._staged.drops.append(_Drop.from_params(params, self._mode))
                return
            bs = self._block_size
            local = _transfer_groups(self._kv_cache_config, blocks.get_block_ids())
            end = request.num_computed_tokens + num_external_tokens
            first, last = request.num_computed_tokens // bs, -(-end // bs)
            try:
                recv = _recv_of(params, self._mode, self._groups, first, last, local, end)
            except (TypeError, ValueError, OverflowError) as exc:
                # A peer's params: the load fails (its blocks reported
                # invalid), the scheduler goes on.
                why = f"the request's kv_transfer_params cannot be read: {exc}"
                mine = [b for g in local for b in g[first:last]]
                recv = _Recv("pull", [], "", [], first, mine, "", None, error=why)
            self._staged.recv[rid] = recv
            self._loading.add(rid)
        elif params.get("do_remote_decode"):
            if self._mode_of(params) == "push" and rid not in self._push_reqs:
                # The transfer's identity: the client's (decode first), else one
                # of this hand-over's own, never the request id alone (an id
                # handed over again is another transfer).
                xid = str(params.get("aiokv_transfer_id") or f"{rid}@{secrets.token_hex(6)}")
                key = str(params.get("aiokv_transfer_key") or "")
                self._push_reqs[rid] = (request, xid, key)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._staged = self._staged, AioKVMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._push_reqs:
                meta.push_preempted[rid] = self._push_reqs[rid][1]
        for rid, (request, xid, key) in self._push_reqs.items():
            n = scheduled.get(rid)
            if not n:
                continue
            end = int(request.num_computed_tokens) + int(n)
            prompt = int(request.num_prompt_tokens)
            kvm = self._kv_cache_manager
            assert kvm is not None  # bound by the scheduler before it schedules
            blocks = _transfer_groups(self._kv_cache_config, kvm.get_blocks(rid).get_block_ids())
            meta.push_steps[rid] = (xid, blocks, min(end, prompt), end >= prompt, key, prompt)
            if int(request.num_computed_tokens) > prompt and any(self._groups.window_tokens):
                meta.push_settle[rid] = xid
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """One KV cache group's blocks (vLLM calls :meth:`request_finished_all_groups`)."""
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        rid = request.request_id
        self._stop_renewing(rid)
        if params.get("do_remote_prefill"):
            # A decode request aborted before it was scheduled: nothing to
            # load, and the prefill instance may free its blocks now.
            params["do_remote_prefill"] = False
            if params.get("remote_host") or params.get("aiokv_peers"):
                self._staged.drops.append(_Drop.from_params(params, self._mode))
            return False, None
        if rid in self._loading:
            # Aborted while its KV loads: stop the load. vLLM keeps the blocks
            # until the load is reported finished (quiescent).
            self._loading.discard(rid)
            self._staged.cancel_recv.add(rid)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        mode = self._mode_of(params)
        held = _transfer_groups(self._kv_cache_config, block_ids)
        groups = self._groups.clip(held)
        if mode == "push":
            return self._finish_push(request, groups, ok, held)
        if not ok or not any(groups):
            return False, None
        return True, self._hand_over_pull(request, groups)

    def _finish_push(
        self, request: Any, groups: list[list[int]], ok: bool, held: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P push: the request finished: its blocks (``held``, of each group;
        ``groups``, what the params hand over) are held until its pushes
        ended (quiescent), whether it finished or not."""
        rid = request.request_id
        entry = self._push_reqs.pop(rid, None)
        if entry is None:
            return False, None  # never scheduled: nothing was pushed
        xid = entry[1]
        self._staged.push_release[rid] = (xid, not ok, held)
        if request.num_computed_tokens > request.num_prompt_tokens and any(
            self._groups.window_tokens
        ):
            self._staged.push_settle[rid] = xid  # it freed window blocks as it finished
        self._unreported_push.add(rid)
        if not ok:
            return True, None
        # Only a decode handed these params may register for the pushes.
        keys = [
            push_key(bytes.fromhex(self._peers[r].grant_secret), f"{xid}/{r}")
            for r in sorted(self._peers)
        ]
        out = self._params(request, groups, xid, "push")
        out["aiokv_push_keys"] = keys
        return True, out

    def _hand_over_pull(self, request: Any, groups: list[list[int]]) -> dict[str, Any]:
        """P pull: hold the blocks ``groups`` (one list per transfer group) for
        the decode's claims; the params with their grant keys."""
        ids = [b for g in groups for b in g]
        rid = request.request_id
        lease = float(self._cfg["kv_lease_duration"])
        # The keys expire with the longest hold (renewed leases) and a grace
        # (for the hand-over to reach the workers): a claim with these params
        # after that is refused, and so is one after the hold was released.
        longest = max(lease, float(self._cfg["kv_lease_max"]))
        until = int((time.time() + longest + GRACE_S) * 1000)
        self._staged.holds[rid] = (lease, ids, until)
        digest = blocks_digest(ids)
        keys = [
            grant_key(bytes.fromhex(self._peers[r].grant_secret), rid, len(ids), digest, until)
            for r in sorted(self._peers)
        ]
        out = self._params(request, groups, rid, "pull", keys, until)
        out["aiokv_lease"] = lease  # a decode renews the hold every sixth of it
        return out

    def _params(
        self,
        request: Any,
        groups: list[list[int]],
        xid: str,
        mode: str,
        keys: list[str] | None = None,
        until: int = 0,
    ) -> dict[str, Any]:
        first = self._peers.get(0)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # One list per KV cache group, as vLLM's own connectors give it.
            "remote_block_ids": tuple(groups),
            "remote_engine_id": self._engine_id,
            "remote_request_id": request.request_id,
            "remote_host": first.host if first else None,
            "remote_port": first.port if first else None,
            "remote_cluster_id": first.cluster_id if first else None,
            "aiokv_peers": self._peer_list(),
            "aiokv_layout": first.layout if first else None,
            "aiokv_transfer_id": xid,
            "aiokv_grant_keys": keys or [],
            "aiokv_grant_until": until,
            "tp_size": self._tp_size,
            "remote_num_tokens": int(request.num_computed_tokens),
            "transfer_mode": mode,
        }

    def update_connector_output(self, connector_output: Any) -> None:
        self._unreported_push -= set(connector_output.finished_sending or ())
        self._loading -= set(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        return bool(self._unreported_push)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None
