"""Engine options: :class:`LLMConfig` builds the ``dict[str, str]`` that
``LLMDataDist.init`` takes; :class:`EngineOptions` parses and checks it. Both
are built from the option table (:mod:`.table`), where each option is
declared once.

Keys and value formats are LLM-DataDist's (``llm.*``; booleans as ``"1"`` /
``"0"``), plus aiokvcache's own ``aiokvcache.*`` keys.  Keys aiokvcache does
not know are ignored and listed in :attr:`EngineOptions.unknown_keys`, so
option dicts written for LLM-DataDist keep working.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..model.errors import param_invalid
from ..model.types import INT32_MAX, INT64_MAX, check_int, check_isinstance
from .table import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_MAX_UNCONFIRMED_BYTES,
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    ENV_TRANSPORT,
    KEY_AUTH_TOKEN,
    KEY_BUF_POOL_CFG,
    KEY_CLUSTER_INFO,
    KEY_COPY_LANES,
    KEY_DEPLOY_RES_PATH,
    KEY_DEVICE_ID,
    KEY_DIRECT_COPY,
    KEY_ENABLE_CACHE_MANAGER,
    KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    KEY_ENABLE_SWITCH_ROLE,
    KEY_GLOBAL_RESOURCE_CONFIG,
    KEY_HANDSHAKE_TIMEOUT,
    KEY_HOST_MEM_POOL_CONFIG,
    KEY_LINK_RETRY_COUNT,
    KEY_LINK_TOTAL_TIME,
    KEY_LISTEN_IP_INFO,
    KEY_LOCAL_COMM_RES,
    KEY_MAX_CONNECTIONS,
    KEY_MAX_INFLIGHT_BYTES,
    KEY_MAX_UNCONFIRMED_BYTES,
    KEY_MEM_POOL_CONFIG,
    KEY_MEM_UTILIZATION,
    KEY_NET_DEVICES,
    KEY_OUTPUT_MAX_SIZE,
    KEY_PEER_TIMEOUT,
    KEY_PROGRESS_SPIN_US,
    KEY_RDMA_SERVICE_LEVEL,
    KEY_RDMA_TRAFFIC_CLASS,
    KEY_SESSION_DEVICE_ID,
    KEY_SYNC_KV_TIMEOUT,
    KEY_TRANSFER_BACKEND,
    KEY_TRANSPORT,
    NO_EFFECT_KEYS,
    OPTION_BY_KEY,
    OPTION_BY_PROP,
    OPTIONS,
    Option,
    default,
)
from .values import TRANSPORTS, BadValue, Transport, accept_bool, parse_transport

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
    "OPTIONS",
    "TRANSPORTS",
    "EngineOptions",
    "LLMConfig",
    "LlmConfig",
    "Option",
    "Transport",
]

# --------------------------------------------------------------------------
# LLMConfig


def _option_property(prop: str) -> Any:
    """The :class:`LLMConfig` property ``prop`` of the option table: reads the
    value set, or the option's ``unset``; a rejected value leaves the config
    as it was."""
    opt = OPTION_BY_PROP[prop]

    def fget(self: LLMConfig) -> Any:
        return self._values.get(opt.key, opt.unset)

    def fset(self: LLMConfig, value: Any) -> None:
        self._values[opt.key] = opt.accept(opt.prop, value)

    fget.__name__ = fset.__name__ = opt.prop
    marker = "**[ours]** " if opt.ours else ""
    return property(fget, fset, doc=f"{marker}{opt.doc}  Key ``{opt.key}``.")


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
    __slots__ = ("_device_id", "_ge_options", "_passthrough", "_values")

    def __init__(self) -> None:
        # The values of the option table's properties that were set, by key.
        self._values: dict[str, Any] = {}
        self._device_id: int | tuple[int, ...] | None = None
        self._ge_options: dict[str, str] = {}
        # LLM-DataDist's options without an effect here, by key, as emitted.
        self._passthrough: dict[str, str] = {}

    def generate_options(self) -> dict[str, str]:
        """The option dict: one entry per property that was set."""
        options = dict(self._ge_options)
        if self._device_id is not None:
            ids = self._device_id if isinstance(self._device_id, tuple) else (self._device_id,)
            options[KEY_DEVICE_ID] = ";".join(str(i) for i in ids)
            options[KEY_SESSION_DEVICE_ID] = str(ids[0])
        options.update(self._passthrough)
        for opt in OPTIONS:
            if opt.key in self._values:
                options[opt.key] = opt.emit(self._values[opt.key])
        return options

    # One property per row of OPTIONS, built from it (tests/test_options.py
    # checks that every row has its property).
    transport = _option_property("transport")
    direct_copy = _option_property("direct_copy")
    prewarm = _option_property("prewarm")
    prefault = _option_property("prefault")
    copy_lanes = _option_property("copy_lanes")
    progress_spin_us = _option_property("progress_spin_us")
    max_inflight_bytes = _option_property("max_inflight_bytes")
    max_unconfirmed_bytes = _option_property("max_unconfirmed_bytes")
    net_devices = _option_property("net_devices")
    etcd_endpoint = _option_property("etcd_endpoint")
    etcd_prefix = _option_property("etcd_prefix")
    etcd_lease_ttl = _option_property("etcd_lease_ttl")
    peer_timeout = _option_property("peer_timeout")
    handshake_timeout = _option_property("handshake_timeout")
    max_connections = _option_property("max_connections")
    auth_token = _option_property("auth_token")
    listen_ip_info = _option_property("listen_ip_info")
    sync_kv_timeout = _option_property("sync_kv_timeout")
    link_retry_count = _option_property("link_retry_count")
    link_total_time = _option_property("link_total_time")
    enable_remote_cache_accessible = _option_property("enable_remote_cache_accessible")
    host_mem_pool_cfg = _option_property("host_mem_pool_cfg")
    mem_pool_cfg = _option_property("mem_pool_cfg")
    rdma_traffic_class = _option_property("rdma_traffic_class")
    rdma_service_level = _option_property("rdma_service_level")
    enable_cache_manager = _option_property("enable_cache_manager")

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

    def _set_passthrough(self, key: str, text: str) -> None:
        self._passthrough[key] = text

    def _get_passthrough(self, key: str, default: Any, parse: Callable[[str], Any]) -> Any:
        text = self._passthrough.get(key)
        return default if text is None else parse(text)

    local_comm_res = _passthrough_str(
        "local_comm_res",
        KEY_LOCAL_COMM_RES,
        "**[no effect]** LLM-DataDist's HCCL resource description.  Key "
        '``llm.LocalCommRes`` (emitted even when ``""``, as there).',
    )
    transfer_backend = _passthrough_str(
        "transfer_backend",
        KEY_TRANSFER_BACKEND,
        '**[no effect]** LLM-DataDist\'s transfer backend (``"hixl"``); this '
        "engine's is UCX (see ``transport``).  Key ``llm.TransferBackend``.",
    )
    global_resource_config = _passthrough_str(
        "global_resource_config",
        KEY_GLOBAL_RESOURCE_CONFIG,
        "**[no effect]** JSON for LLM-DataDist's HIXL backend.  Key ``llm.GlobalResourceConfig``.",
    )
    deploy_res_path = _passthrough_str(
        "deploy_res_path", KEY_DEPLOY_RES_PATH, "**[no effect]** Key ``llm.deployResPath``."
    )
    buf_pool_cfg = _passthrough_str(
        "buf_pool_cfg", KEY_BUF_POOL_CFG, "**[no effect]** Key ``llm.BufPoolCfg``."
    )

    @property
    def cluster_info(self) -> str:
        """**[no effect]** LLM-DataDist's offline cluster description (JSON).
        Key ``llm.ClusterInfo``."""
        return str(self._get_passthrough(KEY_CLUSTER_INFO, "", str))

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_isinstance("cluster_info", value, str)
        try:
            json.loads(value)
        except ValueError:
            raise ValueError(f"cluster_info must be JSON, got {value!r}") from None
        self._set_passthrough(KEY_CLUSTER_INFO, value)

    @property
    def output_max_size(self) -> int | None:
        """**[no effect]** Key ``llm.OutputMaxSize``."""
        return self._get_passthrough(KEY_OUTPUT_MAX_SIZE, None, int)  # type: ignore[no-any-return]

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        v = check_int("output_max_size", value, 0, INT64_MAX)
        self._set_passthrough(KEY_OUTPUT_MAX_SIZE, str(v))

    @property
    def mem_utilization(self) -> float:
        """**[no effect]** Device memory share, ``[0, 1]``, default 0.95.
        Key ``llm.MemoryUtilization``."""
        return float(self._get_passthrough(KEY_MEM_UTILIZATION, 0.95, float))

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"mem_utilization must be a float, got {type(value).__name__}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"mem_utilization must be in [0, 1], got {value}")
        self._set_passthrough(KEY_MEM_UTILIZATION, str(float(value)))

    @property
    def enable_switch_role(self) -> bool:
        """**[no effect]** LLM-DataDist's v1 switch; ``switch_role`` always
        works here.  Key ``llm.EnableSwitchRole``."""
        return bool(self._get_passthrough(KEY_ENABLE_SWITCH_ROLE, False, lambda t: t == "1"))

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        flag = accept_bool("enable_switch_role", value)
        self._set_passthrough(KEY_ENABLE_SWITCH_ROLE, "1" if flag else "0")


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
    """Checked, typed engine options; build with :meth:`from_options`.

    The defaults are the option table's (:data:`OPTIONS`)."""

    listen_host: str | None = None
    listen_port: int | None = None
    sync_kv_timeout_ms: int = default("sync_kv_timeout")
    enable_remote_cache_accessible: bool = default("enable_remote_cache_accessible")
    mem_pool_bytes: int | None = default("mem_pool_cfg")
    host_mem_pool_bytes: int | None = default("host_mem_pool_cfg")
    link_total_time_s: int = default("link_total_time")
    link_retry_count: int = default("link_retry_count")
    transport: str = default("transport")
    auth_token: bytes | None = field(default=default("auth_token"), repr=False)
    max_inflight_bytes: int = default("max_inflight_bytes")
    max_unconfirmed_bytes: int = default("max_unconfirmed_bytes")
    copy_lanes: int = default("copy_lanes")
    progress_spin_us: int = default("progress_spin_us")
    direct_copy: bool = default("direct_copy")
    prewarm: bool = default("prewarm")
    prefault: bool = default("prefault")
    handshake_timeout_ms: int = default("handshake_timeout")
    max_connections: int = default("max_connections")
    peer_timeout_ms: int = default("peer_timeout")
    net_devices: str = default("net_devices")
    etcd_endpoint: str | None = default("etcd_endpoint")
    etcd_prefix: str = default("etcd_prefix")
    etcd_lease_ttl_s: int = default("etcd_lease_ttl")
    rdma_traffic_class: int | None = default("rdma_traffic_class")
    rdma_service_level: int | None = default("rdma_service_level")
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
            opt = OPTION_BY_KEY.get(key)
            if opt is None:
                unknown.append(key)
                continue
            try:
                fields.update(opt.field_values(text))
            except BadValue as exc:
                raise param_invalid(f"option {key} {exc}") from None
        return cls(**fields, unknown_keys=tuple(unknown), no_effect_keys=tuple(no_effect))

    def with_environment(self, options: Mapping[str, str] | None) -> EngineOptions:
        """These options, with ``AIOKVCACHE_TRANSPORT`` as the transport when
        ``options`` names none; a bad value raises ``LLM_PARAM_INVALID``."""
        text = os.environ.get(ENV_TRANSPORT)
        if text is None or (options is not None and KEY_TRANSPORT in options):
            return self
        try:
            transport = parse_transport(text)
        except BadValue as exc:
            raise param_invalid(f"environment variable {ENV_TRANSPORT} {exc}") from None
        return dataclasses.replace(self, transport=transport)
