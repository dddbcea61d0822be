"""``LLMConfig`` and the option keys it generates.

Defined in the private core; this module is their public home.
"""

from __future__ import annotations

from ._core.options import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    KEY_AUTH_TOKEN,
    KEY_DIRECT_COPY,
    KEY_ENABLE_CACHE_MANAGER,
    KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    KEY_HOST_MEM_POOL_CONFIG,
    KEY_LINK_RETRY_COUNT,
    KEY_LINK_TOTAL_TIME,
    KEY_LISTEN_IP_INFO,
    KEY_MAX_INFLIGHT_BYTES,
    KEY_MEM_POOL_CONFIG,
    KEY_SYNC_KV_TIMEOUT,
    KEY_TRANSPORT,
    TRANSPORTS,
    EngineOptions,
    LLMConfig,
)

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "KEY_AUTH_TOKEN",
    "KEY_DIRECT_COPY",
    "KEY_ENABLE_CACHE_MANAGER",
    "KEY_ENABLE_REMOTE_CACHE_ACCESSIBLE",
    "KEY_HOST_MEM_POOL_CONFIG",
    "KEY_LINK_RETRY_COUNT",
    "KEY_LINK_TOTAL_TIME",
    "KEY_LISTEN_IP_INFO",
    "KEY_MAX_INFLIGHT_BYTES",
    "KEY_MEM_POOL_CONFIG",
    "KEY_SYNC_KV_TIMEOUT",
    "KEY_TRANSPORT",
    "TRANSPORTS",
    "EngineOptions",
    "LLMConfig",
]
