"""aiokvcache: asyncio-native KV-cache transfer between processes and hosts.

The public surface follows Huawei CANN's LLM-DataDist (cache-manager mode),
made awaitable: code written for it ports by adding ``await``. Transfers run
on a native UCX engine (shared memory, TCP, RDMA) driven by its own progress
thread; the event loop learns of completions from one eventfd.
"""

from __future__ import annotations

from .cache_manager import CacheManager, Notification, Notifications
from .datadist import LLMDataDist
from .errors import InternalError, LLMException, LLMStatusCode, LLMTimeoutError, Status
from .layerwise import CacheTask
from .options import LLMConfig, LlmConfig
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__version__ = "0.1.0"

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "InternalError",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LayerSynchronizer",
    "LlmConfig",
    "Notification",
    "Notifications",
    "Placement",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "__version__",
]
