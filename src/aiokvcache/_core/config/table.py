"""The engine option table: every option of ``LLMDataDist.init`` declared
once (key, property, fields, parser, range, default, doc, UCX mapping), with
the value parsers and the data-plane transports.

:mod:`.options` builds :class:`~.options.LLMConfig` and
:class:`~.options.EngineOptions` from it; ``docs/tuning.md``'s tables are
generated from it (:mod:`.docs`).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._loader import native
from ..model.types import INT32_MAX, INT64_MAX, UINT16_MAX, UINT32_MAX, check_int, check_isinstance

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


@dataclass(frozen=True)
class Transport:
    """A data-plane transport ``transport`` may name."""

    name: str
    #: UCX's ``TLS`` for it; None: UCX's own choice (``UCX_TLS`` honoured).
    ucx_tls: str | None
    means: str
    use_when: str


#: The data-plane transports, in the order the docs list them: the rows of
#: ``ext/transports.def``, which the engine reads too.
TRANSPORT_TABLE = tuple(
    Transport(name, tls or None, means, use_when)
    for name, tls, means, use_when in native.TRANSPORTS
)
#: Data-plane transports ``transport`` may name.
TRANSPORTS = tuple(t.name for t in TRANSPORT_TABLE)

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_MAX_INFLIGHT_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_UNCONFIRMED_BYTES = 2 * 1024 * 1024
_MAX_COPY_LANES = 64
# page_shift of a memory pool config, as LLM-DataDist checks it: [10, 31).
_PAGE_SHIFT_MIN, _PAGE_SHIFT_MAX = 10, 30


# --------------------------------------------------------------------------
# value parsers, shared by LLMConfig setters and EngineOptions.from_options;
# each raises BadValue, which the callers turn into their own error type.


class BadValue(Exception):
    pass


_DIGITS = re.compile(r"[0-9]+")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _parse_uint(text: str, lo: int, hi: int) -> int:
    if not _DIGITS.fullmatch(text):
        raise BadValue(f"must be a decimal integer in [{lo}, {hi}], got {text!r}")
    value = int(text)
    if not lo <= value <= hi:
        raise BadValue(f"must be in [{lo}, {hi}], got {value}")
    return value


def _parse_flag(text: str) -> bool:
    if text == "1":
        return True
    if text == "0":
        return False
    raise BadValue(f'must be "1" or "0", got {text!r}')


def _check_host(host: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise BadValue(f"bad IPv6 address {host!r}") from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        # A dotted all-numeric name is a mistyped IPv4 address, not a host name.
        if not all(label.isdigit() for label in labels):
            return host
    raise BadValue(f"bad host {host!r}: expected an IPv4 address, [IPv6] or a host name")


def _parse_listen(text: str) -> tuple[str, int]:
    if ";" in text:
        raise BadValue(f"only one listen address is supported, got {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise BadValue(f'must be "ip:port", got {text!r}')
    return _check_host(host), _parse_uint(port, 0, UINT16_MAX)


def _parse_mem_pool(text: str) -> int:
    try:
        cfg = json.loads(text)
    except ValueError:
        raise BadValue(
            f"must be JSON such as '{{\"memory_size\": 1073741824}}', got {text!r}"
        ) from None
    if not isinstance(cfg, dict):
        raise BadValue(f"must be a JSON object, got {text!r}")
    size = cfg.get("memory_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= INT64_MAX:
        raise BadValue(f'needs "memory_size", a positive integer, got {text!r}')
    shift = cfg.get("page_shift")
    if shift is not None and (
        isinstance(shift, bool)
        or not isinstance(shift, int)
        or not _PAGE_SHIFT_MIN <= shift <= _PAGE_SHIFT_MAX
    ):
        raise BadValue(
            f'"page_shift" must be an integer in [{_PAGE_SHIFT_MIN}, {_PAGE_SHIFT_MAX}], '
            f"got {shift!r}"
        )
    return size


_NET_DEVICE = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


def _parse_net_devices(text: str) -> str:
    names = text.split(",")
    if text != "all" and not all(_NET_DEVICE.fullmatch(n) for n in names):
        raise BadValue(f"must be 'all' or a comma list of interface names, got {text!r}")
    return text


def _parse_etcd_endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadValue(f"must be host:port (etcd's client URL, e.g. 127.0.0.1:2379), got {text!r}")
    return text


_ETCD_PREFIX = re.compile(r"/([A-Za-z0-9._-]+/)*")


def _parse_etcd_prefix(text: str) -> str:
    if not _ETCD_PREFIX.fullmatch(text):
        raise BadValue(
            f"must be a key prefix that starts and ends with '/' (e.g. /aiokvcache/), got {text!r}"
        )
    return text


def parse_transport(text: str) -> str:
    if text not in TRANSPORTS:
        raise BadValue(f"must be one of {', '.join(TRANSPORTS)}, got {text!r}")
    return text


def _parse_auth_token(text: str) -> bytes:
    if not text:
        raise BadValue("must not be empty")
    return text.encode("utf-8")


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


def _accept_int(
    lo: int, hi: int, *, digits: bool = False, gap: int = 0
) -> Callable[[str, Any], Any]:
    """An int in ``[lo, hi]`` (or a digit string when ``digits``); with
    ``gap``, the values in ``(0, gap)`` are refused."""

    def accept(name: str, value: Any) -> int:
        if digits and isinstance(value, str):
            return int(setter_value(name, lambda t: _parse_uint(t, lo, hi), value))
        v = check_int(name, value, lo, hi)
        if 0 < v < gap:
            raise ValueError(f"{name} must be 0 or >= {gap} ms, got {v}")
        return v

    return accept


def _accept_text(parse: Callable[[str], Any]) -> Callable[[str, Any], Any]:
    """A ``str`` that ``parse`` accepts, kept as given."""

    def accept(name: str, value: Any) -> str:
        check_isinstance(name, value, str)
        setter_value(name, parse, value)
        return str(value)

    return accept


def accept_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type(value).__name__}")
    return value


def _accept_token(name: str, value: Any) -> str:
    check_isinstance(name, value, (str, bytes))
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{name} bytes must be UTF-8 (pass e.g. token.hex() instead)"
            ) from None
    setter_value(name, _parse_auth_token, value)
    return str(value)


def _emit_flag(value: Any) -> str:
    return "1" if value else "0"


def _uint(
    key: str,
    prop: str,
    fld: str | None,
    lo: int,
    hi: int,
    default: Any,
    doc: str,
    default_text: str,
    range_text: str,
    **kw: Any,
) -> Option:
    gap = kw.pop("gap", 0)
    digits = kw.pop("digits", False)

    def parse(text: str) -> int:
        v = _parse_uint(text, lo, hi)
        if 0 < v < gap:
            raise BadValue(f"must be 0 or >= {gap} ms, got {v}")
        return v

    return Option(
        key,
        prop,
        (fld,) if fld else (),
        parse,
        _accept_int(lo, hi, digits=digits, gap=gap),
        str,
        default,
        kw.pop("unset", default),
        doc,
        default_text,
        range_text,
        **kw,
    )


def _flag(
    key: str, prop: str, fld: str | None, default: bool, doc: str, default_text: str, **kw: Any
) -> Option:
    return Option(
        key,
        prop,
        (fld,) if fld else (),
        _parse_flag,
        accept_bool,
        _emit_flag,
        default,
        default,
        doc,
        default_text,
        '`"1"` / `"0"`',
        **kw,
    )


def _text(
    key: str,
    prop: str,
    fields: tuple[str, ...],
    parse: Callable[[str], Any],
    default: Any,
    unset: Any,
    doc: str,
    default_text: str,
    range_text: str,
    **kw: Any,
) -> Option:
    return Option(
        key,
        prop,
        fields,
        parse,
        _accept_text(parse),
        str,
        default,
        unset,
        doc,
        default_text,
        range_text,
        **kw,
    )


#: Every option LLMConfig sets and EngineOptions reads, in the order
#: LLMConfig.generate_options emits them (the docs list aiokvcache's own first).
OPTIONS: tuple[Option, ...] = (
    _uint(
        KEY_RDMA_TRAFFIC_CLASS,
        "rdma_traffic_class",
        "rdma_traffic_class",
        0,
        255,
        None,
        "RDMA traffic class, ``[0, 255]``: UCX's ``IB_TRAFFIC_CLASS`` for this engine's rdma "
        "lanes (no effect without RDMA); unset: UCX's default.",
        "UCX's",
        "0 to 255",
        ucx="IB_TRAFFIC_CLASS",
    ),
    _uint(
        KEY_RDMA_SERVICE_LEVEL,
        "rdma_service_level",
        "rdma_service_level",
        0,
        7,
        None,
        "RDMA service level, ``[0, 7]``: UCX's ``IB_SL`` for this engine's rdma lanes (no "
        "effect without RDMA); unset: UCX's default.",
        "UCX's",
        "0 to 7",
        ucx="IB_SL",
    ),
    _text(
        KEY_LISTEN_IP_INFO,
        "listen_ip_info",
        ("listen_host", "listen_port"),
        lambda t: _parse_listen(t),
        None,
        "",
        'Control-plane listen address ``"ip:port"`` (port 0 = pick one); ``""`` when unset '
        "(client only).",
        "unset: client only",
        '`"host:port"`, port 0 picks one',
    ),
    _uint(
        KEY_SYNC_KV_TIMEOUT,
        "sync_kv_timeout",
        "sync_kv_timeout_ms",
        1,
        INT32_MAX,
        DEFAULT_SYNC_KV_TIMEOUT_MS,
        "Per-layer transfer timeout in ms (default 1000); an int or a digit string in "
        "``[1, 2**31-1]``.",
        "1000 ms",
        "1 to 2**31-1",
        digits=True,
    ),
    _flag(
        KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE,
        "enable_remote_cache_accessible",
        "enable_remote_cache_accessible",
        True,
        "Whether peers may push into / pull from this instance's caches (default True in "
        "aiokvcache).",
        "on",
    ),
    _flag(
        KEY_ENABLE_CACHE_MANAGER,
        "enable_cache_manager",
        None,
        True,
        "Accepted for LLM-DataDist compatibility; the cache manager is always on.",
        "on",
        effect=False,
    ),
    _text(
        KEY_MEM_POOL_CONFIG,
        "mem_pool_cfg",
        ("mem_pool_bytes",),
        lambda t: _parse_mem_pool(t),
        None,
        "",
        'JSON ``{"memory_size": N}``: optional cap on DEVICE cache bytes; ``""`` when unset.',
        "unset: no cap",
        'JSON `{"memory_size": N}`',
        effect=False,
    ),
    _text(
        KEY_HOST_MEM_POOL_CONFIG,
        "host_mem_pool_cfg",
        ("host_mem_pool_bytes",),
        lambda t: _parse_mem_pool(t),
        None,
        "",
        'JSON ``{"memory_size": N}``: optional cap on HOST cache bytes; ``""`` when unset.',
        "unset: no cap",
        'JSON `{"memory_size": N}`',
    ),
    _uint(
        KEY_LINK_TOTAL_TIME,
        "link_total_time",
        "link_total_time_s",
        0,
        UINT32_MAX,
        0,
        "Total time for a link attempt in seconds, ``[0, 2**32-1]``; 0 (default) = the library "
        "default.",
        "0 s: no cap",
        "0 to 2**32-1",
    ),
    _uint(
        KEY_LINK_RETRY_COUNT,
        "link_retry_count",
        "link_retry_count",
        1,
        100,
        1,
        "Link attempts within :attr:`link_total_time`, ``[1, 100]``, default 1.",
        "1",
        "1 to 100",
    ),
    _text(
        KEY_TRANSPORT,
        "transport",
        ("transport",),
        lambda t: parse_transport(t),
        "auto",
        "auto",
        'Transports the data plane may use: ``"auto"`` (default), ``"shm"``, ``"tcp"`` or '
        '``"rdma"``.',
        "`auto`",
        ", ".join(f"`{t}`" for t in TRANSPORTS),
        ours=True,
        ucx="TLS",
    ),
    Option(
        KEY_AUTH_TOKEN,
        "auth_token",
        ("auth_token",),
        lambda t: _parse_auth_token(t),
        _accept_token,
        str,
        None,
        None,
        "Shared secret; a peer without it cannot link.  A ``str``, or ``bytes`` that are UTF-8.",
        "unset",
        "a non-empty `str`, or UTF-8 `bytes`",
        ours=True,
    ),
    _uint(
        KEY_MAX_INFLIGHT_BYTES,
        "max_inflight_bytes",
        "max_inflight_bytes",
        1,
        INT64_MAX,
        DEFAULT_MAX_INFLIGHT_BYTES,
        "Backpressure window of the native engine in bytes, ``[1, 2**63-1]``, default 64 MiB.",
        "64 MiB",
        "1 to 2**63-1",
        ours=True,
    ),
    _uint(
        KEY_MAX_UNCONFIRMED_BYTES,
        "max_unconfirmed_bytes",
        "max_unconfirmed_bytes",
        0,
        INT64_MAX,
        DEFAULT_MAX_UNCONFIRMED_BYTES,
        "Per link, the most bytes of transfers that the peer has not yet confirmed, "
        "``[0, 2**63-1]``, default 2 MiB; 0 means no bound. It bounds what a frozen peer can "
        'still apply after a call raised (``docs/design.md``, "Late writes").',
        "2 MiB",
        "0 (no bound) to 2**63-1",
        ours=True,
    ),
    _uint(
        KEY_COPY_LANES,
        "copy_lanes",
        "copy_lanes",
        0,
        _MAX_COPY_LANES,
        0,
        f"Threads that run same-host direct copies, ``[0, {_MAX_COPY_LANES}]``; 1 copies on the "
        "progress thread, 0 (default) picks half the cores, at most 8.",
        "0: half the cores, at most 8",
        f"0 to {_MAX_COPY_LANES}",
        ours=True,
    ),
    _uint(
        KEY_PROGRESS_SPIN_US,
        "progress_spin_us",
        "progress_spin_us",
        0,
        100_000,
        100,
        "Microseconds the progress thread keeps polling after its last work on a transfer of "
        "its own before it sleeps, ``[0, 100000]``, default 100: a caller that awaits each small "
        "transfer then finds it awake instead of paying two thread wake-ups. A peer's arriving "
        "bytes or a connect start no spin; idle it never spins.",
        "100 µs",
        "0 to 100000",
        ours=True,
    ),
    _flag(
        KEY_DIRECT_COPY,
        "direct_copy",
        "direct_copy",
        True,
        "Move bytes to and from same-host peers with one memcpy into their mapped shared "
        "memory (default on); off, every byte goes through UCX's own lanes.",
        'on (`"1"`)',
        ours=True,
    ),
    _flag(
        KEY_PREWARM,
        "prewarm",
        "prewarm",
        True,
        "At init, run each operation a link uses once over an endpoint to a helper worker of "
        "the engine's own UCX context (default on): UCX selects and caches its protocols then, "
        "not in the first link (about 40 ms of CPU over tcp here, against 8-10 for a later "
        "link); init takes that much longer.",
        'on (`"1"`)',
        ours=True,
    ),
    _flag(
        KEY_PREFAULT,
        "prefault",
        "prefault",
        True,
        "Fault in every page of a cache when it is allocated or registered, and the pages a "
        "same-host peer's cache has when its key is installed (default on): a cache's first "
        "transfer otherwise faults each page in on both sides (25x slower than the next, "
        "512 MiB over shared memory here); the allocation takes that time instead. Its memory "
        "is committed then: register_cache makes the user's pages writable without writing "
        "them (MADV_POPULATE_WRITE), so untouched memory becomes resident, a sparse file mapped "
        "shared gets its blocks, a private file mapping its copy. A peer's pages are mapped only "
        "where the peer made them, at most 2 GiB per cache. A link this side makes to a "
        "same-host peer installs the caches the peer has then (the newest 32) in the "
        "background once it is up, so that their mapping is not made by the first transfer; "
        "those caches are then exposed to this side, so the peer retiring one waits for its "
        "answer (a frozen side is cut off and the memory quarantined, design.md).",
        'on (`"1"`)',
        ours=True,
    ),
    _uint(
        KEY_HANDSHAKE_TIMEOUT,
        "handshake_timeout",
        "handshake_timeout_ms",
        1,
        INT32_MAX,
        5000,
        "Milliseconds an accepted control connection may take to finish its handshake, "
        "``[1, 2**31-1]``, default 5000: a socket that sends nothing holds a slot no longer.",
        "5000 ms",
        "1 to 2**31-1",
        ours=True,
    ),
    _uint(
        KEY_MAX_CONNECTIONS,
        "max_connections",
        "max_connections",
        1,
        UINT16_MAX,
        1024,
        "Established control connections the listener keeps at once, ``[1, 65535]``, default "
        "1024; a handshake beyond that is refused.",
        "1024",
        "1 to 65535",
        ours=True,
    ),
    _uint(
        KEY_PEER_TIMEOUT,
        "peer_timeout",
        "peer_timeout_ms",
        0,
        INT32_MAX,
        5000,
        "Milliseconds a linked peer may stay silent before the link is declared broken, ``0`` "
        "(never) or ``[100, 2**31-1]``, default 5000. Each side's native progress thread sends "
        "the other a keep-alive every quarter of it (off the GIL: starved Python threads are not "
        "silence), so a frozen host or a cut cable is noticed without waiting for TCP.",
        "5000 ms",
        "0 (never), or 100 to 2**31-1",
        ours=True,
        gap=100,
    ),
    _text(
        KEY_NET_DEVICES,
        "net_devices",
        ("net_devices",),
        lambda t: _parse_net_devices(t),
        "all",
        "all",
        "The network interfaces the data plane may use and advertise, as UCX's "
        '``NET_DEVICES``: ``"all"`` (default) or a comma list such as ``"eth1"`` or '
        '``"eth1,eth2"``. On a multi-homed host (a management NIC beside the data NIC), name '
        "the data NIC: UCX then listens, advertises and connects only there.",
        "`all`",
        "`all` or a comma list of interfaces",
        ours=True,
        ucx="NET_DEVICES",
    ),
    _text(
        KEY_ETCD_ENDPOINT,
        "etcd_endpoint",
        ("etcd_endpoint",),
        lambda t: _parse_etcd_endpoint(t),
        None,
        None,
        "An etcd server (``host:port``) to register in and find peers through (the ``etcd`` "
        "extra): this instance's role and control address go under :attr:`etcd_prefix` on a "
        "lease of :attr:`etcd_lease_ttl` seconds, ``link_clusters`` resolves a cluster given "
        "without ``remote_ip_info`` there, and a link to an instance whose entry went (its "
        "lease ended) is broken. Unset (default): no etcd.",
        "unset",
        "`host:port`",
        ours=True,
    ),
    _text(
        KEY_ETCD_PREFIX,
        "etcd_prefix",
        ("etcd_prefix",),
        lambda t: _parse_etcd_prefix(t),
        "/aiokvcache/",
        "/aiokvcache/",
        "The etcd key prefix instances register under (``<prefix>clusters/<cluster id>``): "
        "instances that should find each other share it.",
        "`/aiokvcache/`",
        "`/`, or `/name/.../`",
        ours=True,
    ),
    _uint(
        KEY_ETCD_LEASE_TTL,
        "etcd_lease_ttl",
        "etcd_lease_ttl_s",
        1,
        3600,
        3,
        "Seconds an instance's etcd entry outlives its last keep-alive, ``[1, 3600]``, default "
        "3 (etcd rounds very short leases up to its own minimum, about 2 s): how soon peers "
        "break their links to an instance that was killed, froze, or lost etcd.",
        "3 s",
        "1 to 3600",
        ours=True,
    ),
)
OPTION_BY_KEY = {opt.key: opt for opt in OPTIONS}
OPTION_BY_PROP = {opt.prop: opt for opt in OPTIONS}


def default(prop: str) -> Any:
    """The engine's value of the option behind ``LLMConfig.<prop>`` when unset."""
    return OPTION_BY_PROP[prop].default


def setter_value(name: str, parse: Any, text: str) -> Any:
    try:
        return parse(text)
    except BadValue as exc:
        raise ValueError(f"{name} {exc}") from None
