"""The engine option table: every option of ``LLMDataDist.init`` declared
once, with keywords (key, property, fields, parser, range, default, doc, UCX
mapping): adding an option is one entry in :data:`OPTIONS` (and its
:class:`~.options.EngineOptions` field).

:mod:`.values` holds the parsers the entries name and the transports;
:mod:`.options` builds :class:`~.options.LLMConfig` and
:class:`~.options.EngineOptions` from the table; ``docs/tuning.md``'s tables
are generated from it (:mod:`.docs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.types import INT32_MAX, INT64_MAX, UINT16_MAX, UINT32_MAX
from .values import (
    TRANSPORTS,
    BadValue,
    accept_bool,
    accept_int,
    accept_text,
    accept_token,
    emit_flag,
    parse_auth_token,
    parse_etcd_endpoint,
    parse_etcd_prefix,
    parse_flag,
    parse_listen,
    parse_mem_pool,
    parse_net_devices,
    parse_transport,
    parse_uint,
)

KEY_LISTEN_IP_INFO = "llm.listenIpInfo"
KEY_SYNC_KV_TIMEOUT = "llm.SyncKvCacheWaitTime"
KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
KEY_ENABLE_CACHE_MANAGER = "llm.EnableCacheManager"
KEY_MEM_POOL_CONFIG = "llm.MemPoolConfig"
KEY_HOST_MEM_POOL_CONFIG = "llm.HostMemPoolConfig"
KEY_LINK_TOTAL_TIME = "llm.LinkTotalTime"
KEY_LINK_RETRY_COUNT = "llm.LinkRetryCount"
KEY_TRANSPORT = "aiokvcache.transport"
KEY_AUTH_TOKEN = "aiokvcache.authToken"
KEY_MAX_INFLIGHT_BYTES = "aiokvcache.maxInflightBytes"
KEY_MAX_UNCONFIRMED_BYTES = "aiokvcache.maxUnconfirmedBytes"
KEY_COPY_LANES = "aiokvcache.copyLanes"
KEY_PROGRESS_SPIN_US = "aiokvcache.progressSpinUs"
KEY_DIRECT_COPY = "aiokvcache.directCopy"
KEY_PREWARM = "aiokvcache.prewarm"
KEY_PREFAULT = "aiokvcache.prefault"
KEY_HANDSHAKE_TIMEOUT = "aiokvcache.handshakeTimeout"
KEY_MAX_CONNECTIONS = "aiokvcache.maxConnections"
KEY_PEER_TIMEOUT = "aiokvcache.peerTimeout"
KEY_NET_DEVICES = "aiokvcache.netDevices"
KEY_ETCD_ENDPOINT = "aiokvcache.etcdEndpoint"
KEY_ETCD_PREFIX = "aiokvcache.etcdPrefix"
KEY_ETCD_LEASE_TTL = "aiokvcache.etcdLeaseTtl"
KEY_RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
KEY_RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
# Emitted by LLMConfig.device_id for code ported from LLM-DataDist.
KEY_DEVICE_ID = "ge.exec.deviceId"
KEY_SESSION_DEVICE_ID = "ge.session_device_id"
# LLM-DataDist's options that mean nothing to this engine (NPU devices, its
# HCCL resources and backends, offline mode, the v1 role switch): accepted,
# checked for form where LLMConfig sets them, listed once at init.
KEY_DEPLOY_RES_PATH = "llm.deployResPath"
KEY_BUF_POOL_CFG = "llm.BufPoolCfg"
KEY_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
KEY_MEM_UTILIZATION = "llm.MemoryUtilization"
KEY_CLUSTER_INFO = "llm.ClusterInfo"
KEY_ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
KEY_LOCAL_COMM_RES = "llm.LocalCommRes"
KEY_TRANSFER_BACKEND = "llm.TransferBackend"
KEY_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
NO_EFFECT_KEYS = frozenset(
    {
        KEY_DEVICE_ID,
        KEY_SESSION_DEVICE_ID,
        KEY_DEPLOY_RES_PATH,
        KEY_BUF_POOL_CFG,
        KEY_OUTPUT_MAX_SIZE,
        KEY_MEM_UTILIZATION,
        KEY_CLUSTER_INFO,
        KEY_ENABLE_SWITCH_ROLE,
        KEY_LOCAL_COMM_RES,
        KEY_TRANSFER_BACKEND,
        KEY_GLOBAL_RESOURCE_CONFIG,
        # Set by LLM-DataDist's own Python layer from the others.
        "llm.Role",
        "llm.ListenIp",
        "llm.ListenPort",
        "ge.flowGraphMemMaxSize",
    }
)

#: The environment variable that picks the transport when the options do not
#: (``aiokvcache.transport``): ported LLM-DataDist code runs unchanged on any.
ENV_TRANSPORT = "AIOKVCACHE_TRANSPORT"


DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_MAX_INFLIGHT_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_UNCONFIRMED_BYTES = 2 * 1024 * 1024
_MAX_COPY_LANES = 64


# --------------------------------------------------------------------------
# the option table


@dataclass(frozen=True)
class Option:
    """One engine option: everything about it, in one place.

    ``parse`` turns the option's text into the value of the
    :class:`EngineOptions` field(s) ``fields`` (raising ``BadValue``);
    ``accept`` checks what a program assigns to the :class:`LLMConfig`
    property ``prop`` and returns what is kept (raising ``TypeError`` or
    ``ValueError`` naming the property); ``emit`` gives the option text of a
    kept value. ``unset`` is what the property reads when nothing was set;
    ``default`` the field's value then.
    """

    key: str
    prop: str
    fields: tuple[str, ...]
    parse: Callable[[str], Any]
    accept: Callable[[str, Any], Any]
    emit: Callable[[Any], str]
    default: Any
    unset: Any
    doc: str
    #: For the docs' table: the default and the accepted values, as prose.
    default_text: str
    range_text: str
    #: An aiokvcache option (not one of LLM-DataDist's).
    ours: bool = False
    #: The UCX setting it becomes, if any.
    ucx: str | None = None
    #: False for LLM-DataDist's options that are checked and then unused.
    effect: bool = True

    def field_values(self, text: str) -> dict[str, Any]:
        value = self.parse(text)
        if not self.fields:  # checked for form only
            return {}
        if len(self.fields) == 1:
            return {self.fields[0]: value}
        return dict(zip(self.fields, value, strict=True))


#: ``unset`` not given: the property reads the default.
_SAME: Any = object()


def _option(
    key: str, prop: str, field: str | None, fields: tuple[str, ...] | None, **rest: Any
) -> Option:
    """An :class:`Option` whose EngineOptions fields are ``fields``, else
    ``field``, else the one named like its property; ``rest`` are the
    Option's other fields (``doc``, ``default_text`` and ``range_text`` among
    them, given by each entry)."""
    chosen = fields if fields is not None else (field or prop,)
    return Option(key=key, prop=prop, fields=chosen, **rest)


def uint_option(
    key: str,
    *,
    prop: str,
    lo: int,
    hi: int,
    default: Any,
    field: str | None = None,
    fields: tuple[str, ...] | None = None,
    gap: int = 0,
    digits: bool = False,
    unset: Any = _SAME,
    **rest: Any,
) -> Option:
    """An integer in ``[lo, hi]`` (with ``gap``: 0, or at least ``gap``);
    ``digits``: the property also takes a digit string."""

    def parse(text: str) -> int:
        v = parse_uint(text, lo, hi)
        if 0 < v < gap:
            raise BadValue(f"must be 0 or >= {gap} ms, got {v}")
        return v

    accept = accept_int(lo, hi, digits=digits, gap=gap)
    unset = default if unset is _SAME else unset
    return _option(
        key,
        prop,
        field,
        fields,
        parse=parse,
        accept=accept,
        emit=str,
        default=default,
        unset=unset,
        **rest,
    )


def flag_option(
    key: str,
    *,
    prop: str,
    default: bool,
    field: str | None = None,
    fields: tuple[str, ...] | None = None,
    **rest: Any,
) -> Option:
    """On or off: ``"1"`` / ``"0"`` as text, a ``bool`` as a property."""
    return _option(
        key,
        prop,
        field,
        fields,
        parse=parse_flag,
        accept=accept_bool,
        emit=emit_flag,
        default=default,
        unset=default,
        range_text='`"1"` / `"0"`',
        **rest,
    )


def text_option(
    key: str,
    *,
    prop: str,
    parse: Callable[[str], Any],
    field: str | None = None,
    fields: tuple[str, ...] | None = None,
    **rest: Any,
) -> Option:
    """A ``str`` that ``parse`` accepts, kept as given (``default`` and
    ``unset`` given by the entry)."""
    return _option(
        key, prop, field, fields, parse=parse, accept=accept_text(parse), emit=str, **rest
    )


#: Every option LLMConfig sets and EngineOptions reads, in the order
#: LLMConfig.generate_options emits them (the docs list aiokvcache's own first).
OPTIONS: tuple[Option, ...] = (
    uint_option(
        KEY_RDMA_TRAFFIC_CLASS,
        prop="rdma_traffic_class",
        lo=0,
        hi=255,
        default=None,
        ucx="IB_TRAFFIC_CLASS",
        default_text="UCX's",
        range_text="0 to 255",
        doc=(
            "RDMA traffic class, ``[0, 255]``: UCX's ``IB_TRAFFIC_CLASS`` for this engine's rdma "
            "lanes (no effect without RDMA); unset: UCX's default."
        ),
    ),
    uint_option(
        KEY_RDMA_SERVICE_LEVEL,
        prop="rdma_service_level",
        lo=0,
        hi=7,
        default=None,
        ucx="IB_SL",
        default_text="UCX's",
        range_text="0 to 7",
        doc=(
            "RDMA service level, ``[0, 7]``: UCX's ``IB_SL`` for this engine's rdma lanes (no "
            "effect without RDMA); unset: UCX's default."
        ),
    ),
    text_option(
        KEY_LISTEN_IP_INFO,
        prop="listen_ip_info",
        fields=("listen_host", "listen_port"),
        parse=parse_listen,
        default=None,
        unset="",
        default_text="unset: client only",
        range_text='`"host:port"`, port 0 picks one',
        doc=(
            'Control-plane listen address ``"ip:port"`` (port 0 = pick one); ``""`` when unset '
            "(client only)."
        ),
    ),
    uint_option(
        KEY_SYNC_KV_TIMEOUT,
        prop="sync_kv_timeout",
        field="sync_kv_timeout_ms",
        lo=1,
        hi=INT32_MAX,
        default=DEFAULT_SYNC_KV_TIMEOUT_MS,
        digits=True,
        default_text="1000 ms",
        range_text="1 to 2**31-1",
        doc=(
            "Per-layer transfer timeout in ms (default 1000); an int or a digit string in ``[1, "
            "2**31-1]``."
        ),
    ),
    flag_option(
        KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE,
        prop="enable_remote_cache_accessible",
        default=True,
        default_text="on",
        doc=(
            "Whether peers may push into / pull from this instance's caches (default True in "
            "aiokvcache)."
        ),
    ),
    flag_option(
        KEY_ENABLE_CACHE_MANAGER,
        prop="enable_cache_manager",
        fields=(),
        default=True,
        effect=False,
        default_text="on",
        doc="Accepted for LLM-DataDist compatibility; the cache manager is always on.",
    ),
    text_option(
        KEY_MEM_POOL_CONFIG,
        prop="mem_pool_cfg",
        fields=("mem_pool_bytes",),
        parse=parse_mem_pool,
        default=None,
        unset="",
        effect=False,
        default_text="unset: no cap",
        range_text='JSON `{"memory_size": N}`',
        doc='JSON ``{"memory_size": N}``: optional cap on DEVICE cache bytes; ``""`` when unset.',
    ),
    text_option(
        KEY_HOST_MEM_POOL_CONFIG,
        prop="host_mem_pool_cfg",
        fields=("host_mem_pool_bytes",),
        parse=parse_mem_pool,
        default=None,
        unset="",
        default_text="unset: no cap",
        range_text='JSON `{"memory_size": N}`',
        doc='JSON ``{"memory_size": N}``: optional cap on HOST cache bytes; ``""`` when unset.',
    ),
    uint_option(
        KEY_LINK_TOTAL_TIME,
        prop="link_total_time",
        field="link_total_time_s",
        lo=0,
        hi=UINT32_MAX,
        default=0,
        default_text="0 s: no cap",
        range_text="0 to 2**32-1",
        doc=(
            "Total time for a link attempt in seconds, ``[0, 2**32-1]``; 0 (default) = the "
            "library default."
        ),
    ),
    uint_option(
        KEY_LINK_RETRY_COUNT,
        prop="link_retry_count",
        lo=1,
        hi=100,
        default=1,
        default_text="1",
        range_text="1 to 100",
        doc="Link attempts within :attr:`link_total_time`, ``[1, 100]``, default 1.",
    ),
    text_option(
        KEY_TRANSPORT,
        prop="transport",
        fields=("transport",),
        parse=parse_transport,
        default="auto",
        unset="auto",
        ours=True,
        ucx="TLS",
        default_text="`auto`",
        range_text=", ".join(f"`{t}`" for t in TRANSPORTS),
        doc=(
            'Transports the data plane may use: ``"auto"`` (default), ``"shm"``, ``"tcp"`` or '
            '``"rdma"``.'
        ),
    ),
    Option(
        KEY_AUTH_TOKEN,
        prop="auth_token",
        fields=("auth_token",),
        parse=parse_auth_token,
        accept=accept_token,
        emit=str,
        default=None,
        unset=None,
        ours=True,
        default_text="unset",
        range_text="a non-empty `str`, or UTF-8 `bytes`",
        doc=(
            "Shared secret; a peer without it cannot link.  A ``str``, or ``bytes`` that are UTF-8."
        ),
    ),
    uint_option(
        KEY_MAX_INFLIGHT_BYTES,
        prop="max_inflight_bytes",
        lo=1,
        hi=INT64_MAX,
        default=DEFAULT_MAX_INFLIGHT_BYTES,
        ours=True,
        default_text="64 MiB",
        range_text="1 to 2**63-1",
        doc="Backpressure window of the native engine in bytes, ``[1, 2**63-1]``, default 64 MiB.",
    ),
    uint_option(
        KEY_MAX_UNCONFIRMED_BYTES,
        prop="max_unconfirmed_bytes",
        lo=0,
        hi=INT64_MAX,
        default=DEFAULT_MAX_UNCONFIRMED_BYTES,
        ours=True,
        default_text="2 MiB",
        range_text="0 (no bound) to 2**63-1",
        doc=(
            "Per link, the most bytes of transfers that the peer has not yet confirmed, "
            "``[0, 2**63-1]``, default 2 MiB; 0 means no bound. It bounds what a frozen peer can "
            'still apply after a call raised (``docs/design.md``, "Late writes").'
        ),
    ),
    uint_option(
        KEY_COPY_LANES,
        prop="copy_lanes",
        lo=0,
        hi=_MAX_COPY_LANES,
        default=0,
        ours=True,
        default_text="0: half the cores, at most 8",
        range_text=f"0 to {_MAX_COPY_LANES}",
        doc=(
            f"Threads that run same-host direct copies, ``[0, {_MAX_COPY_LANES}]``; 1 copies on "
            "the progress thread, 0 (default) picks half the cores, at most 8."
        ),
    ),
    uint_option(
        KEY_PROGRESS_SPIN_US,
        prop="progress_spin_us",
        lo=0,
        hi=100_000,
        default=100,
        ours=True,
        default_text="100 µs",
        range_text="0 to 100000",
        doc=(
            "Microseconds the progress thread keeps polling after its last work on a transfer of "
            "its own before it sleeps, ``[0, 100000]``, default 100: a caller that awaits each "
            "small transfer then finds it awake instead of paying two thread wake-ups. A peer's "
            "arriving bytes or a connect start no spin; idle it never spins."
        ),
    ),
    flag_option(
        KEY_DIRECT_COPY,
        prop="direct_copy",
        default=True,
        ours=True,
        default_text='on (`"1"`)',
        doc=(
            "Move bytes to and from same-host peers with one memcpy into their mapped shared "
            "memory (default on); off, every byte goes through UCX's own lanes."
        ),
    ),
    flag_option(
        KEY_PREWARM,
        prop="prewarm",
        default=True,
        ours=True,
        default_text='on (`"1"`)',
        doc=(
            "At init, run each operation a link uses once over an endpoint to a helper worker of "
            "the engine's own UCX context (default on): UCX selects and caches its protocols "
            "then, not in the first link (about 40 ms of CPU over tcp here, against 8-10 for a "
            "later link); init takes that much longer."
        ),
    ),
    flag_option(
        KEY_PREFAULT,
        prop="prefault",
        default=True,
        ours=True,
        default_text='on (`"1"`)',
        doc=(
            "Fault in every page of a cache when it is allocated or registered, and the pages a "
            "same-host peer's cache has when its key is installed (default on): a cache's first "
            "transfer otherwise faults each page in on both sides (25x slower than the next, 512 "
            "MiB over shared memory here); the allocation takes that time instead. Its memory is "
            "committed then: register_cache makes the user's pages writable without writing them "
            "(MADV_POPULATE_WRITE), so untouched memory becomes resident, a sparse file mapped "
            "shared gets its blocks, a private file mapping its copy. A peer's pages are mapped "
            "only where the peer made them, at most 2 GiB per cache. A link this side makes to a "
            "same-host peer installs the caches the peer has then (the newest 32) in the "
            "background once it is up, so that their mapping is not made by the first transfer; "
            "those caches are then exposed to this side, so the peer retiring one waits for its "
            "answer (a frozen side is cut off and the memory quarantined, design.md)."
        ),
    ),
    uint_option(
        KEY_HANDSHAKE_TIMEOUT,
        prop="handshake_timeout",
        field="handshake_timeout_ms",
        lo=1,
        hi=INT32_MAX,
        default=5000,
        ours=True,
        default_text="5000 ms",
        range_text="1 to 2**31-1",
        doc=(
            "Milliseconds an accepted control connection may take to finish its handshake, ``[1, "
            "2**31-1]``, default 5000: a socket that sends nothing holds a slot no longer."
        ),
    ),
    uint_option(
        KEY_MAX_CONNECTIONS,
        prop="max_connections",
        lo=1,
        hi=UINT16_MAX,
        default=1024,
        ours=True,
        default_text="1024",
        range_text="1 to 65535",
        doc=(
            "Established control connections the listener keeps at once, ``[1, 65535]``, default "
            "1024; a handshake beyond that is refused."
        ),
    ),
    uint_option(
        KEY_PEER_TIMEOUT,
        prop="peer_timeout",
        field="peer_timeout_ms",
        lo=0,
        hi=INT32_MAX,
        default=5000,
        gap=100,
        ours=True,
        default_text="5000 ms",
        range_text="0 (never), or 100 to 2**31-1",
        doc=(
            "Milliseconds a linked peer may stay silent before the link is declared broken, "
            "``0`` (never) or ``[100, 2**31-1]``, default 5000. Each side's native progress "
            "thread sends the other a keep-alive every quarter of it (off the GIL: starved "
            "Python threads are not silence), so a frozen host or a cut cable is noticed without "
            "waiting for TCP."
        ),
    ),
    text_option(
        KEY_NET_DEVICES,
        prop="net_devices",
        fields=("net_devices",),
        parse=parse_net_devices,
        default="all",
        unset="all",
        ours=True,
        ucx="NET_DEVICES",
        default_text="`all`",
        range_text="`all` or a comma list of interfaces",
        doc=(
            "The network interfaces the data plane may use and advertise, as UCX's "
            '``NET_DEVICES``: ``"all"`` (default) or a comma list such as ``"eth1"`` or '
            '``"eth1,eth2"``. On a multi-homed host (a management NIC beside the data NIC), name '
            "the data NIC: UCX then listens, advertises and connects only there."
        ),
    ),
    text_option(
        KEY_ETCD_ENDPOINT,
        prop="etcd_endpoint",
        fields=("etcd_endpoint",),
        parse=parse_etcd_endpoint,
        default=None,
        unset=None,
        ours=True,
        default_text="unset",
        range_text="`host:port`",
        doc=(
            "An etcd server (``host:port``) to register in and find peers through (the ``etcd`` "
            "extra): this instance's role and control address go under :attr:`etcd_prefix` on a "
            "lease of :attr:`etcd_lease_ttl` seconds, ``link_clusters`` resolves a cluster given "
            "without ``remote_ip_info`` there, and a link to an instance whose entry went (its "
            "lease ended) is broken. Unset (default): no etcd."
        ),
    ),
    text_option(
        KEY_ETCD_PREFIX,
        prop="etcd_prefix",
        fields=("etcd_prefix",),
        parse=parse_etcd_prefix,
        default="/aiokvcache/",
        unset="/aiokvcache/",
        ours=True,
        default_text="`/aiokvcache/`",
        range_text="`/`, or `/name/.../`",
        doc=(
            "The etcd key prefix instances register under (``<prefix>clusters/<cluster id>``): "
            "instances that should find each other share it."
        ),
    ),
    uint_option(
        KEY_ETCD_LEASE_TTL,
        prop="etcd_lease_ttl",
        field="etcd_lease_ttl_s",
        lo=1,
        hi=3600,
        default=3,
        ours=True,
        default_text="3 s",
        range_text="1 to 3600",
        doc=(
            "Seconds an instance's etcd entry outlives its last keep-alive, ``[1, 3600]``, "
            "default 3 (etcd rounds very short leases up to its own minimum, about 2 s): how "
            "soon peers break their links to an instance that was killed, froze, or lost etcd."
        ),
    ),
)
OPTION_BY_KEY = {opt.key: opt for opt in OPTIONS}
OPTION_BY_PROP = {opt.prop: opt for opt in OPTIONS}


def default(prop: str) -> Any:
    """The engine's value of the option behind ``LLMConfig.<prop>`` when unset."""
    return OPTION_BY_PROP[prop].default
