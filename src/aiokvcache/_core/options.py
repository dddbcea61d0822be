"""Engine options: :class:`LLMConfig` builds the ``dict[str, str]`` that
``LLMDataDist.init`` takes; :class:`EngineOptions` parses and checks it.

Keys and value formats are LLM-DataDist's (``llm.*``; booleans as ``"1"`` /
``"0"``), plus aiokvcache's own ``aiokvcache.*`` keys.  Keys aiokvcache does
not know are ignored and listed in :attr:`EngineOptions.unknown_keys`, so
option dicts written for LLM-DataDist keep working.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import param_invalid
from .types import INT32_MAX, INT64_MAX, UINT16_MAX, UINT32_MAX, check_int, check_isinstance

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MAX_UNCONFIRMED_BYTES",
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "ENV_TRANSPORT",
    "KEY_AUTH_TOKEN",
    "KEY_COPY_LANES",
    "KEY_DIRECT_COPY",
    "KEY_ENABLE_CACHE_MANAGER",
    "KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE",
    "KEY_HANDSHAKE_TIMEOUT",
    "KEY_HOST_MEM_POOL_CONFIG",
    "KEY_LINK_RETRY_COUNT",
    "KEY_LINK_TOTAL_TIME",
    "KEY_LISTEN_IP_INFO",
    "KEY_MAX_CONNECTIONS",
    "KEY_MAX_INFLIGHT_BYTES",
    "KEY_MAX_UNCONFIRMED_BYTES",
    "KEY_MEM_POOL_CONFIG",
    "KEY_NET_DEVICES",
    "KEY_PEER_TIMEOUT",
    "KEY_PROGRESS_SPIN_US",
    "KEY_RDMA_SERVICE_LEVEL",
    "KEY_RDMA_TRAFFIC_CLASS",
    "KEY_SYNC_KV_TIMEOUT",
    "KEY_TRANSPORT",
    "NO_EFFECT_KEYS",
    "TRANSPORTS",
    "EngineOptions",
    "LLMConfig",
    "LlmConfig",
]

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
KEY_HANDSHAKE_TIMEOUT = "aiokvcache.handshakeTimeout"
KEY_MAX_CONNECTIONS = "aiokvcache.maxConnections"
KEY_PEER_TIMEOUT = "aiokvcache.peerTimeout"
KEY_NET_DEVICES = "aiokvcache.netDevices"
KEY_RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
KEY_RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
# Emitted by LLMConfig.device_id for code ported from LLM-DataDist.
_KEY_DEVICE_ID = "ge.exec.deviceId"
_KEY_SESSION_DEVICE_ID = "ge.session_device_id"
# LLM-DataDist's options that mean nothing to this engine (NPU devices, its
# HCCL resources and backends, offline mode, the v1 role switch): accepted,
# checked for form where LLMConfig sets them, listed once at init.
_KEY_DEPLOY_RES_PATH = "llm.deployResPath"
_KEY_BUF_POOL_CFG = "llm.BufPoolCfg"
_KEY_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
_KEY_MEM_UTILIZATION = "llm.MemoryUtilization"
_KEY_CLUSTER_INFO = "llm.ClusterInfo"
_KEY_ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
_KEY_LOCAL_COMM_RES = "llm.LocalCommRes"
_KEY_TRANSFER_BACKEND = "llm.TransferBackend"
_KEY_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
NO_EFFECT_KEYS = frozenset(
    {
        _KEY_DEVICE_ID,
        _KEY_SESSION_DEVICE_ID,
        _KEY_DEPLOY_RES_PATH,
        _KEY_BUF_POOL_CFG,
        _KEY_OUTPUT_MAX_SIZE,
        _KEY_MEM_UTILIZATION,
        _KEY_CLUSTER_INFO,
        _KEY_ENABLE_SWITCH_ROLE,
        _KEY_LOCAL_COMM_RES,
        _KEY_TRANSFER_BACKEND,
        _KEY_GLOBAL_RESOURCE_CONFIG,
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
#: Data-plane transports ``transport`` may name.
TRANSPORTS = ("auto", "shm", "tcp", "rdma")
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_MAX_INFLIGHT_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_UNCONFIRMED_BYTES = 2 * 1024 * 1024
DEFAULT_PROGRESS_SPIN_US = 100
PROGRESS_SPIN_US_MAX = 100_000
DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_PEER_TIMEOUT_MS = 5000
LINK_RETRY_COUNT_MAX = 100
# page_shift of a memory pool config, as LLM-DataDist checks it: [10, 31).
_PAGE_SHIFT_MIN, _PAGE_SHIFT_MAX = 10, 30


# --------------------------------------------------------------------------
# value parsers, shared by LLMConfig setters and EngineOptions.from_options;
# each raises _BadValue, which the callers turn into their own error type.


class _BadValue(Exception):
    pass


_DIGITS = re.compile(r"[0-9]+")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _parse_uint(text: str, lo: int, hi: int) -> int:
    if not _DIGITS.fullmatch(text):
        raise _BadValue(f"must be a decimal integer in [{lo}, {hi}], got {text!r}")
    value = int(text)
    if not lo <= value <= hi:
        raise _BadValue(f"must be in [{lo}, {hi}], got {value}")
    return value


def _parse_flag(text: str) -> bool:
    if text == "1":
        return True
    if text == "0":
        return False
    raise _BadValue(f'must be "1" or "0", got {text!r}')


def _check_host(host: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise _BadValue(f"bad IPv6 address {host!r}") from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        # A dotted all-numeric name is a mistyped IPv4 address, not a host name.
        if not all(label.isdigit() for label in labels):
            return host
    raise _BadValue(f"bad host {host!r}: expected an IPv4 address, [IPv6] or a host name")


def _parse_listen(text: str) -> tuple[str, int]:
    if ";" in text:
        raise _BadValue(f"only one listen address is supported, got {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise _BadValue(f'must be "ip:port", got {text!r}')
    return _check_host(host), _parse_uint(port, 0, UINT16_MAX)


def _parse_mem_pool(text: str) -> int:
    try:
        cfg = json.loads(text)
    except ValueError:
        raise _BadValue(
            f"must be JSON such as '{{\"memory_size\": 1073741824}}', got {text!r}"
        ) from None
    if not isinstance(cfg, dict):
        raise _BadValue(f"must be a JSON object, got {text!r}")
    size = cfg.get("memory_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= INT64_MAX:
        raise _BadValue(f'needs "memory_size", a positive integer, got {text!r}')
    shift = cfg.get("page_shift")
    if shift is not None and (
        isinstance(shift, bool)
        or not isinstance(shift, int)
        or not _PAGE_SHIFT_MIN <= shift <= _PAGE_SHIFT_MAX
    ):
        raise _BadValue(
            f'"page_shift" must be an integer in [{_PAGE_SHIFT_MIN}, {_PAGE_SHIFT_MAX}], '
            f"got {shift!r}"
        )
    return size


def _parse_peer_timeout(text: str) -> int:
    v = _parse_uint(text, 0, INT32_MAX)
    if 0 < v < 100:
        raise _BadValue(f"must be 0 or >= 100 ms, got {v}")
    return v


_NET_DEVICE = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


def _parse_net_devices(text: str) -> str:
    names = text.split(",")
    if text != "all" and not all(_NET_DEVICE.fullmatch(n) for n in names):
        raise _BadValue(f"must be 'all' or a comma list of interface names, got {text!r}")
    return text


def _parse_transport(text: str) -> str:
    if text not in TRANSPORTS:
        raise _BadValue(f"must be one of {', '.join(TRANSPORTS)}, got {text!r}")
    return text


def _parse_auth_token(text: str) -> bytes:
    if not text:
        raise _BadValue("must not be empty")
    return text.encode("utf-8")


# --------------------------------------------------------------------------
# LLMConfig


def _setter_value(name: str, parse: Any, text: str) -> Any:
    try:
        return parse(text)
    except _BadValue as exc:
        raise ValueError(f"{name} {exc}") from None


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type(value).__name__}")
    return value


def _passthrough_str(name: str, key: str, doc: str) -> Any:
    """A ``str`` property of LLMConfig kept under ``key`` as emitted (``""``
    when unset): LLM-DataDist's options without an effect here."""

    def fget(self: LLMConfig) -> str:
        return str(self._get_passthrough(key, "", str))

    def fset(self: LLMConfig, value: str) -> None:
        self._set_passthrough(key, check_isinstance(name, value, str))

    return property(fget, fset, doc=doc)


class LLMConfig:
    """Builds the option dict for ``LLMDataDist.init``.

    Set properties, then call :meth:`generate_options`; only what was set
    is emitted.  A getter returns the value set, or when unset the value
    the engine will use.  Setters raise ``TypeError`` for a wrong type and
    ``ValueError`` for a bad value.

    Every property LLM-DataDist's ``LLMConfig`` has is here with its option
    key; those without an effect on this engine are listed once at init.
    """

    # Fixed attributes: a misspelt or unknown property raises AttributeError
    # instead of being dropped silently.
    __slots__ = (
        "_auth_token",
        "_copy_lanes",
        "_device_id",
        "_direct_copy",
        "_enable_cache_manager",
        "_enable_remote_cache_accessible",
        "_ge_options",
        "_handshake_timeout",
        "_host_mem_pool_cfg",
        "_link_retry_count",
        "_link_total_time",
        "_listen_ip_info",
        "_max_connections",
        "_max_inflight_bytes",
        "_max_unconfirmed_bytes",
        "_mem_pool_cfg",
        "_net_devices",
        "_passthrough",
        "_peer_timeout",
        "_progress_spin_us",
        "_rdma_service_level",
        "_rdma_traffic_class",
        "_sync_kv_timeout",
        "_transport",
    )

    def __init__(self) -> None:
        self._listen_ip_info: str | None = None
        self._sync_kv_timeout: int | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._enable_cache_manager: bool | None = None
        self._mem_pool_cfg: str | None = None
        self._host_mem_pool_cfg: str | None = None
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._transport: str | None = None
        self._auth_token: str | None = None
        self._max_inflight_bytes: int | None = None
        self._max_unconfirmed_bytes: int | None = None
        self._copy_lanes: int | None = None
        self._progress_spin_us: int | None = None
        self._direct_copy: bool | None = None
        self._handshake_timeout: int | None = None
        self._max_connections: int | None = None
        self._peer_timeout: int | None = None
        self._net_devices: str | None = None
        self._device_id: int | tuple[int, ...] | None = None
        self._ge_options: dict[str, str] = {}
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        # LLM-DataDist's options without an effect here, by key, as emitted.
        self._passthrough: dict[str, str] = {}

    def generate_options(self) -> dict[str, str]:
        """The option dict: one entry per property that was set."""
        options = dict(self._ge_options)
        if self._device_id is not None:
            ids = self._device_id if isinstance(self._device_id, tuple) else (self._device_id,)
            options[_KEY_DEVICE_ID] = ";".join(str(i) for i in ids)
            options[_KEY_SESSION_DEVICE_ID] = str(ids[0])
        options.update(self._passthrough)
        if self._rdma_traffic_class is not None:
            options[KEY_RDMA_TRAFFIC_CLASS] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            options[KEY_RDMA_SERVICE_LEVEL] = str(self._rdma_service_level)
        if self._listen_ip_info is not None:
            options[KEY_LISTEN_IP_INFO] = self._listen_ip_info
        if self._sync_kv_timeout is not None:
            options[KEY_SYNC_KV_TIMEOUT] = str(self._sync_kv_timeout)
        if self._enable_remote_cache_accessible is not None:
            options[KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE] = (
                "1" if self._enable_remote_cache_accessible else "0"
            )
        if self._enable_cache_manager is not None:
            options[KEY_ENABLE_CACHE_MANAGER] = "1" if self._enable_cache_manager else "0"
        if self._mem_pool_cfg is not None:
            options[KEY_MEM_POOL_CONFIG] = self._mem_pool_cfg
        if self._host_mem_pool_cfg is not None:
            options[KEY_HOST_MEM_POOL_CONFIG] = self._host_mem_pool_cfg
        if self._link_total_time is not None:
            options[KEY_LINK_TOTAL_TIME] = str(self._link_total_time)
        if self._link_retry_count is not None:
            options[KEY_LINK_RETRY_COUNT] = str(self._link_retry_count)
        if self._transport is not None:
            options[KEY_TRANSPORT] = self._transport
        if self._auth_token is not None:
            options[KEY_AUTH_TOKEN] = self._auth_token
        if self._max_inflight_bytes is not None:
            options[KEY_MAX_INFLIGHT_BYTES] = str(self._max_inflight_bytes)
        if self._max_unconfirmed_bytes is not None:
            options[KEY_MAX_UNCONFIRMED_BYTES] = str(self._max_unconfirmed_bytes)
        if self._copy_lanes is not None:
            options[KEY_COPY_LANES] = str(self._copy_lanes)
        if self._progress_spin_us is not None:
            options[KEY_PROGRESS_SPIN_US] = str(self._progress_spin_us)
        if self._direct_copy is not None:
            options[KEY_DIRECT_COPY] = "1" if self._direct_copy else "0"
        if self._handshake_timeout is not None:
            options[KEY_HANDSHAKE_TIMEOUT] = str(self._handshake_timeout)
        if self._max_connections is not None:
            options[KEY_MAX_CONNECTIONS] = str(self._max_connections)
        if self._peer_timeout is not None:
            options[KEY_PEER_TIMEOUT] = str(self._peer_timeout)
        if self._net_devices is not None:
            options[KEY_NET_DEVICES] = self._net_devices
        return options

    @property
    def listen_ip_info(self) -> str:
        """Control-plane listen address ``"ip:port"`` (port 0 = pick one);
        ``""`` when unset (client only).  Key ``llm.listenIpInfo``."""
        return self._listen_ip_info or ""

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        check_isinstance("listen_ip_info", value, str)
        _setter_value("listen_ip_info", _parse_listen, value)
        self._listen_ip_info = value

    @property
    def sync_kv_timeout(self) -> int:
        """Per-layer transfer timeout in ms (default 1000); an int or a digit
        string in ``[1, 2**31-1]``.  Key ``llm.SyncKvCacheWaitTime``."""
        if self._sync_kv_timeout is None:
            return DEFAULT_SYNC_KV_TIMEOUT_MS
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        if isinstance(value, str):
            self._sync_kv_timeout = _setter_value(
                "sync_kv_timeout", lambda t: _parse_uint(t, 1, INT32_MAX), value
            )
        else:
            self._sync_kv_timeout = check_int("sync_kv_timeout", value, 1, INT32_MAX)

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """Whether peers may push into / pull from this instance's caches
        (default True in aiokvcache).  Key ``llm.EnableRemoteCacheAccessible``."""
        if self._enable_remote_cache_accessible is None:
            return True
        return self._enable_remote_cache_accessible

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        self._enable_remote_cache_accessible = _check_bool("enable_remote_cache_accessible", value)

    @property
    def enable_cache_manager(self) -> bool:
        """Accepted for LLM-DataDist compatibility; the cache manager is
        always on.  Key ``llm.EnableCacheManager``."""
        if self._enable_cache_manager is None:
            return True
        return self._enable_cache_manager

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        self._enable_cache_manager = _check_bool("enable_cache_manager", value)

    @property
    def mem_pool_cfg(self) -> str:
        """JSON ``{"memory_size": N}``: optional cap on DEVICE cache bytes;
        ``""`` when unset.  Key ``llm.MemPoolConfig``."""
        return self._mem_pool_cfg or ""

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str) -> None:
        check_isinstance("mem_pool_cfg", value, str)
        _setter_value("mem_pool_cfg", _parse_mem_pool, value)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        """JSON ``{"memory_size": N}``: optional cap on HOST cache bytes;
        ``""`` when unset.  Key ``llm.HostMemPoolConfig``."""
        return self._host_mem_pool_cfg or ""

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str) -> None:
        check_isinstance("host_mem_pool_cfg", value, str)
        _setter_value("host_mem_pool_cfg", _parse_mem_pool, value)
        self._host_mem_pool_cfg = value

    @property
    def link_total_time(self) -> int:
        """Total time for a link attempt in seconds, ``[0, 2**32-1]``; 0
        (default) = the library default.  Key ``llm.LinkTotalTime``."""
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        self._link_total_time = check_int("link_total_time", value, 0, UINT32_MAX)

    @property
    def link_retry_count(self) -> int:
        """Link attempts within :attr:`link_total_time`, ``[1, 100]``, default 1.
        Key ``llm.LinkRetryCount``."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        self._link_retry_count = check_int("link_retry_count", value, 1, LINK_RETRY_COUNT_MAX)

    @property
    def transport(self) -> str:
        """**[ours]** Transports the data plane may use: ``"auto"`` (default),
        ``"shm"``, ``"tcp"`` or ``"rdma"``.  Key ``aiokvcache.transport``."""
        return self._transport or "auto"

    @transport.setter
    def transport(self, value: str) -> None:
        check_isinstance("transport", value, str)
        self._transport = _setter_value("transport", _parse_transport, value)

    @property
    def auth_token(self) -> str | None:
        """**[ours]** Shared secret; a peer without it cannot link.  A ``str``,
        or ``bytes`` that are UTF-8.  Key ``aiokvcache.authToken``."""
        return self._auth_token

    @auth_token.setter
    def auth_token(self, value: str | bytes) -> None:
        check_isinstance("auth_token", value, (str, bytes))
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(
                    "auth_token bytes must be UTF-8 (pass e.g. token.hex() instead)"
                ) from None
        _setter_value("auth_token", _parse_auth_token, value)
        self._auth_token = value

    @property
    def max_inflight_bytes(self) -> int:
        """**[ours]** Backpressure window of the native engine in bytes,
        ``[1, 2**63-1]``, default 64 MiB.  Key ``aiokvcache.maxInflightBytes``."""
        if self._max_inflight_bytes is None:
            return DEFAULT_MAX_INFLIGHT_BYTES
        return self._max_inflight_bytes

    @max_inflight_bytes.setter
    def max_inflight_bytes(self, value: int) -> None:
        self._max_inflight_bytes = check_int("max_inflight_bytes", value, 1, INT64_MAX)

    @property
    def max_unconfirmed_bytes(self) -> int:
        """**[ours]** Per link, the most bytes of transfers that the peer has
        not yet confirmed, ``[0, 2**63-1]``, default 2 MiB; 0 means no bound.
        It bounds what a frozen peer can still apply after a call raised
        (``docs/design.md``, "Late writes").  Key
        ``aiokvcache.maxUnconfirmedBytes``."""
        if self._max_unconfirmed_bytes is None:
            return DEFAULT_MAX_UNCONFIRMED_BYTES
        return self._max_unconfirmed_bytes

    @max_unconfirmed_bytes.setter
    def max_unconfirmed_bytes(self, value: int) -> None:
        self._max_unconfirmed_bytes = check_int("max_unconfirmed_bytes", value, 0, INT64_MAX)

    @property
    def copy_lanes(self) -> int:
        """**[ours]** Threads that run same-host direct copies, ``[0, 64]``;
        1 copies on the progress thread, 0 (default) picks half the cores,
        at most 8.  Key ``aiokvcache.copyLanes``."""
        return 0 if self._copy_lanes is None else self._copy_lanes

    @copy_lanes.setter
    def copy_lanes(self, value: int) -> None:
        self._copy_lanes = check_int("copy_lanes", value, 0, 64)

    @property
    def progress_spin_us(self) -> int:
        """**[ours]** Microseconds the progress thread keeps polling after its
        last work before it sleeps, ``[0, 100000]``, default
        100: a caller that awaits each small transfer then finds it awake
        instead of paying two thread wake-ups. Idle it never spins. Key
        ``aiokvcache.progressSpinUs``."""
        if self._progress_spin_us is None:
            return DEFAULT_PROGRESS_SPIN_US
        return self._progress_spin_us

    @progress_spin_us.setter
    def progress_spin_us(self, value: int) -> None:
        self._progress_spin_us = check_int("progress_spin_us", value, 0, PROGRESS_SPIN_US_MAX)

    @property
    def handshake_timeout(self) -> int:
        """**[ours]** Milliseconds an accepted control connection may take to
        finish its handshake, ``[1, 2**31-1]``, default 5000: a socket that
        sends nothing holds a slot no longer. Key ``aiokvcache.handshakeTimeout``."""
        if self._handshake_timeout is None:
            return DEFAULT_HANDSHAKE_TIMEOUT_MS
        return self._handshake_timeout

    @handshake_timeout.setter
    def handshake_timeout(self, value: int) -> None:
        self._handshake_timeout = check_int("handshake_timeout", value, 1, INT32_MAX)

    @property
    def max_connections(self) -> int:
        """**[ours]** Established control connections the listener keeps at
        once, ``[1, 65535]``, default 1024; a handshake beyond that is
        refused. Key ``aiokvcache.maxConnections``."""
        if self._max_connections is None:
            return DEFAULT_MAX_CONNECTIONS
        return self._max_connections

    @max_connections.setter
    def max_connections(self, value: int) -> None:
        self._max_connections = check_int("max_connections", value, 1, UINT16_MAX)

    @property
    def peer_timeout(self) -> int:
        """**[ours]** Milliseconds a linked peer may stay silent before the link
        is declared broken, ``0`` (never) or ``[100, 2**31-1]``, default 5000.
        Each side's native progress thread sends the other a keep-alive every
        quarter of it (off the GIL: starved Python threads are not silence), so
        a frozen host or a cut cable is noticed without waiting for TCP. Key
        ``aiokvcache.peerTimeout``."""
        if self._peer_timeout is None:
            return DEFAULT_PEER_TIMEOUT_MS
        return self._peer_timeout

    @peer_timeout.setter
    def peer_timeout(self, value: int) -> None:
        v = check_int("peer_timeout", value, 0, INT32_MAX)
        if 0 < v < 100:
            raise ValueError(f"peer_timeout must be 0 or >= 100 ms, got {v}")
        self._peer_timeout = v

    @property
    def net_devices(self) -> str:
        """**[ours]** The network interfaces the data plane may use and
        advertise, as UCX's ``NET_DEVICES``: ``"all"`` (default) or a comma
        list such as ``"eth1"`` or ``"eth1,eth2"``. On a multi-homed host
        (a management NIC beside the data NIC), name the data NIC: UCX then
        listens, advertises and connects only there. Key
        ``aiokvcache.netDevices``."""
        return "all" if self._net_devices is None else self._net_devices

    @net_devices.setter
    def net_devices(self, value: str) -> None:
        check_isinstance("net_devices", value, str)
        self._net_devices = _setter_value("net_devices", _parse_net_devices, value)

    @property
    def direct_copy(self) -> bool:
        """**[ours]** Move bytes to and from same-host peers with one memcpy
        into their mapped shared memory (default on); off, every byte goes
        through UCX's own lanes.  Key ``aiokvcache.directCopy``."""
        return True if self._direct_copy is None else self._direct_copy

    @direct_copy.setter
    def direct_copy(self, value: bool) -> None:
        self._direct_copy = _check_bool("direct_copy", value)

    @property
    def device_id(self) -> int | tuple[int, ...] | None:
        """LLM-DataDist's device id (``ge.exec.deviceId``): accepted so ported
        code runs; aiokvcache ignores it."""
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | Sequence[int]) -> None:
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("device_id must not be empty")
            self._device_id = tuple(
                check_int(f"device_id[{i}]", v, 0, INT32_MAX) for i, v in enumerate(value)
            )
        else:
            self._device_id = check_int("device_id", value, 0, INT32_MAX)

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra raw options merged into :meth:`generate_options` (the
        properties above win on a clash)."""
        return dict(self._ge_options)

    @ge_options.setter
    def ge_options(self, value: Mapping[str, str]) -> None:
        _check_str_dict("ge_options", value)
        self._ge_options = dict(value)

    @property
    def options(self) -> dict[str, str]:
        """What :meth:`generate_options` returns (read-only)."""
        return self.generate_options()

    @property
    def rdma_traffic_class(self) -> int | None:
        """RDMA traffic class, ``[0, 255]``: UCX's ``IB_TRAFFIC_CLASS`` for
        this engine's rdma lanes (no effect without RDMA).  Key
        ``llm.RdmaTrafficClass``; unset: UCX's default."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        self._rdma_traffic_class = check_int("rdma_traffic_class", value, 0, 255)

    @property
    def rdma_service_level(self) -> int | None:
        """RDMA service level, ``[0, 7]``: UCX's ``IB_SL`` for this engine's
        rdma lanes (no effect without RDMA).  Key ``llm.RdmaServiceLevel``;
        unset: UCX's default."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        self._rdma_service_level = check_int("rdma_service_level", value, 0, 7)

    def _set_passthrough(self, key: str, text: str) -> None:
        self._passthrough[key] = text

    def _get_passthrough(self, key: str, default: Any, parse: Callable[[str], Any]) -> Any:
        text = self._passthrough.get(key)
        return default if text is None else parse(text)

    local_comm_res = _passthrough_str(
        "local_comm_res",
        _KEY_LOCAL_COMM_RES,
        "**[no effect]** LLM-DataDist's HCCL resource description.  Key "
        '``llm.LocalCommRes`` (emitted even when ``""``, as there).',
    )
    transfer_backend = _passthrough_str(
        "transfer_backend",
        _KEY_TRANSFER_BACKEND,
        '**[no effect]** LLM-DataDist\'s transfer backend (``"hixl"``); this '
        "engine's is UCX (see ``transport``).  Key ``llm.TransferBackend``.",
    )
    global_resource_config = _passthrough_str(
        "global_resource_config",
        _KEY_GLOBAL_RESOURCE_CONFIG,
        "**[no effect]** JSON for LLM-DataDist's HIXL backend.  Key ``llm.GlobalResourceConfig``.",
    )
    deploy_res_path = _passthrough_str(
        "deploy_res_path", _KEY_DEPLOY_RES_PATH, "**[no effect]** Key ``llm.deployResPath``."
    )
    buf_pool_cfg = _passthrough_str(
        "buf_pool_cfg", _KEY_BUF_POOL_CFG, "**[no effect]** Key ``llm.BufPoolCfg``."
    )

    @property
    def cluster_info(self) -> str:
        """**[no effect]** LLM-DataDist's offline cluster description (JSON).
        Key ``llm.ClusterInfo``."""
        return str(self._get_passthrough(_KEY_CLUSTER_INFO, "", str))

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_isinstance("cluster_info", value, str)
        try:
            json.loads(value)
        except ValueError:
            raise ValueError(f"cluster_info must be JSON, got {value!r}") from None
        self._set_passthrough(_KEY_CLUSTER_INFO, value)

    @property
    def output_max_size(self) -> int | None:
        """**[no effect]** Key ``llm.OutputMaxSize``."""
        return self._get_passthrough(_KEY_OUTPUT_MAX_SIZE, None, int)  # type: ignore[no-any-return]

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        v = check_int("output_max_size", value, 0, INT64_MAX)
        self._set_passthrough(_KEY_OUTPUT_MAX_SIZE, str(v))

    @property
    def mem_utilization(self) -> float:
        """**[no effect]** Device memory share, ``[0, 1]``, default 0.95.
        Key ``llm.MemoryUtilization``."""
        return float(self._get_passthrough(_KEY_MEM_UTILIZATION, 0.95, float))

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"mem_utilization must be a float, got {type(value).__name__}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"mem_utilization must be in [0, 1], got {value}")
        self._set_passthrough(_KEY_MEM_UTILIZATION, str(float(value)))

    @property
    def enable_switch_role(self) -> bool:
        """**[no effect]** LLM-DataDist's v1 switch; ``switch_role`` always
        works here.  Key ``llm.EnableSwitchRole``."""
        return bool(self._get_passthrough(_KEY_ENABLE_SWITCH_ROLE, False, lambda t: t == "1"))

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        flag = _check_bool("enable_switch_role", value)
        self._set_passthrough(_KEY_ENABLE_SWITCH_ROLE, "1" if flag else "0")


#: LLM-DataDist's other name for :class:`LLMConfig`.
LlmConfig = LLMConfig


def _check_str_dict(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be str, got {type(key).__name__}")
        if not isinstance(item, str):
            raise TypeError(f"{name}[{key!r}] must be str, got {type(item).__name__}")


# --------------------------------------------------------------------------
# EngineOptions


@dataclass(frozen=True)
class EngineOptions:
    """Checked, typed engine options; build with :meth:`from_options`."""

    listen_host: str | None = None
    listen_port: int | None = None
    sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS
    enable_remote_cache_accessible: bool = True
    mem_pool_bytes: int | None = None
    host_mem_pool_bytes: int | None = None
    link_total_time_s: int = 0
    link_retry_count: int = 1
    transport: str = "auto"
    auth_token: bytes | None = field(default=None, repr=False)
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_unconfirmed_bytes: int = DEFAULT_MAX_UNCONFIRMED_BYTES
    copy_lanes: int = 0
    progress_spin_us: int = DEFAULT_PROGRESS_SPIN_US
    direct_copy: bool = True
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    peer_timeout_ms: int = DEFAULT_PEER_TIMEOUT_MS
    net_devices: str = "all"
    rdma_traffic_class: int | None = None
    rdma_service_level: int | None = None
    unknown_keys: tuple[str, ...] = ()
    no_effect_keys: tuple[str, ...] = ()

    @property
    def listen_address(self) -> str | None:
        """``"host:port"`` as configured (port may be 0), or None for client only."""
        if self.listen_host is None or self.listen_port is None:
            return None
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.listen_port}"

    @classmethod
    def from_options(cls, options: Mapping[str, str] | None) -> EngineOptions:
        """Parse an option dict (e.g. from :meth:`LLMConfig.generate_options`).

        ``None`` gives the defaults.  A non-dict, or a key or value that is
        not ``str``, raises ``TypeError``; a bad value raises
        ``LLMException(LLM_PARAM_INVALID)`` whose message names the key.
        Unknown keys are ignored and listed in :attr:`unknown_keys`.
        """
        if options is None:
            return cls()
        _check_str_dict("options", options)
        fields: dict[str, Any] = {}
        unknown: list[str] = []
        no_effect: list[str] = []
        for key, text in options.items():
            if key in NO_EFFECT_KEYS:
                no_effect.append(key)
                continue
            parse = _FIELD_PARSERS.get(key)
            if parse is None:
                unknown.append(key)
                continue
            try:
                fields.update(parse(text))
            except _BadValue as exc:
                raise param_invalid(f"option {key} {exc}") from None
        return cls(**fields, unknown_keys=tuple(unknown), no_effect_keys=tuple(no_effect))

    def with_environment(self, options: Mapping[str, str] | None) -> EngineOptions:
        """These options, with ``AIOKVCACHE_TRANSPORT`` as the transport when
        ``options`` names none; a bad value raises ``LLM_PARAM_INVALID``."""
        text = os.environ.get(ENV_TRANSPORT)
        if text is None or (options is not None and KEY_TRANSPORT in options):
            return self
        try:
            transport = _parse_transport(text)
        except _BadValue as exc:
            raise param_invalid(f"environment variable {ENV_TRANSPORT} {exc}") from None
        return dataclasses.replace(self, transport=transport)


def _listen_fields(text: str) -> dict[str, Any]:
    host, port = _parse_listen(text)
    return {"listen_host": host, "listen_port": port}


def _accept_cache_manager(text: str) -> dict[str, Any]:
    # Checked for form only: the cache manager is always on.
    _parse_flag(text)
    return {}


_FIELD_PARSERS: dict[str, Callable[[str], dict[str, Any]]] = {
    KEY_LISTEN_IP_INFO: _listen_fields,
    KEY_SYNC_KV_TIMEOUT: lambda t: {"sync_kv_timeout_ms": _parse_uint(t, 1, INT32_MAX)},
    KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE: lambda t: {
        "enable_remote_cache_accessible": _parse_flag(t)
    },
    KEY_ENABLE_CACHE_MANAGER: _accept_cache_manager,
    KEY_MEM_POOL_CONFIG: lambda t: {"mem_pool_bytes": _parse_mem_pool(t)},
    KEY_HOST_MEM_POOL_CONFIG: lambda t: {"host_mem_pool_bytes": _parse_mem_pool(t)},
    KEY_LINK_TOTAL_TIME: lambda t: {"link_total_time_s": _parse_uint(t, 0, UINT32_MAX)},
    KEY_LINK_RETRY_COUNT: lambda t: {"link_retry_count": _parse_uint(t, 1, LINK_RETRY_COUNT_MAX)},
    KEY_TRANSPORT: lambda t: {"transport": _parse_transport(t)},
    KEY_AUTH_TOKEN: lambda t: {"auth_token": _parse_auth_token(t)},
    KEY_MAX_INFLIGHT_BYTES: lambda t: {"max_inflight_bytes": _parse_uint(t, 1, INT64_MAX)},
    KEY_MAX_UNCONFIRMED_BYTES: lambda t: {"max_unconfirmed_bytes": _parse_uint(t, 0, INT64_MAX)},
    KEY_COPY_LANES: lambda t: {"copy_lanes": _parse_uint(t, 0, 64)},
    KEY_PROGRESS_SPIN_US: lambda t: {"progress_spin_us": _parse_uint(t, 0, PROGRESS_SPIN_US_MAX)},
    KEY_DIRECT_COPY: lambda t: {"direct_copy": _parse_flag(t)},
    KEY_HANDSHAKE_TIMEOUT: lambda t: {"handshake_timeout_ms": _parse_uint(t, 1, INT32_MAX)},
    KEY_MAX_CONNECTIONS: lambda t: {"max_connections": _parse_uint(t, 1, UINT16_MAX)},
    KEY_PEER_TIMEOUT: lambda t: {"peer_timeout_ms": _parse_peer_timeout(t)},
    KEY_NET_DEVICES: lambda t: {"net_devices": _parse_net_devices(t)},
    KEY_RDMA_TRAFFIC_CLASS: lambda t: {"rdma_traffic_class": _parse_uint(t, 0, 255)},
    KEY_RDMA_SERVICE_LEVEL: lambda t: {"rdma_service_level": _parse_uint(t, 0, 7)},
}
