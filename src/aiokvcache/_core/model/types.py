"""Descriptors, keys and transfer configs, with LLM-DataDist's names and rules.

Also the argument checks shared by the rest of the library
(:func:`check_int`, :func:`check_uint64`, :func:`check_layer_range`, ...):
a wrong type raises ``TypeError``, an integer out of its range
``ValueError``, semantic misuse ``LLMException(LLM_PARAM_INVALID)``; every
message names the argument.

The definitions live in one module per kind: :mod:`.checks`, :mod:`.cachedesc`,
:mod:`.keys`, :mod:`.clusterinfo` and :mod:`.transferconfigs`; this module
gathers them under one name, the one ``aiokvcache.types`` makes public.
"""

from __future__ import annotations

from .cachedesc import Cache, CacheDesc, DataType, Placement
from .checks import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    INVALID_ID,
    MAX_SHAPE_DIMS,
    MAX_TAG_BYTES,
    UINT16_MAX,
    UINT32_MAX,
    UINT64_MAX,
    check_int,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_tag,
    check_uint32,
    check_uint64,
    is_valid_id,
)
from .clusterinfo import LLMClusterInfo, LLMRole
from .keys import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, check_cache_key
from .transferconfigs import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "INVALID_ID",
    "MAX_SHAPE_DIMS",
    "MAX_TAG_BYTES",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "LLMClusterInfo",
    "LLMRole",
    "LayerSynchronizer",
    "Placement",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "check_cache_key",
    "check_int",
    "check_int64",
    "check_isinstance",
    "check_layer_range",
    "check_tag",
    "check_uint32",
    "check_uint64",
    "is_valid_id",
]
