"""Descriptors, keys and transfer configs, with LLM-DataDist's names and rules.

Also the argument checks shared by the rest of the library
(:func:`check_int`, :func:`check_uint64`, :func:`check_layer_range`, ...):
a wrong type raises ``TypeError``, an integer out of its range
``ValueError``, semantic misuse ``LLMException(LLM_PARAM_INVALID)``; every
message names the argument.
"""

from __future__ import annotations

import abc
import enum
import ipaddress
import math
import numbers
import socket
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import LLMException, LLMStatusCode, enum_format, enum_str, param_invalid

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

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1

#: The "no id" value of a uint64 id field (LLM-DataDist's ``_INVALID_ID``).
INVALID_ID = UINT64_MAX
#: Most dimensions a :class:`CacheDesc` shape may have.
MAX_SHAPE_DIMS = 32
#: Longest transfer tag, in bytes (UTF-8 for a ``str`` tag).
MAX_TAG_BYTES = 4096


# --------------------------------------------------------------------------
# argument checks


def _type_names(types: type | tuple[type, ...]) -> str:
    if isinstance(types, type):
        return types.__name__
    return " or ".join(t.__name__ for t in types)


def check_isinstance(name: str, value: Any, types: type | tuple[type, ...]) -> Any:
    """Return ``value`` if it is an instance of ``types``, else raise ``TypeError``."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {_type_names(types)}, got {type(value).__name__}")
    return value


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Check that ``value`` is an integer in ``[lo, hi]`` (a ``None`` bound is open).

    ``bool`` is not an integer here.  NumPy integers are accepted and
    returned as ``int``.  Raises ``TypeError`` for a non-integer and
    ``ValueError`` for one out of range; both messages name ``name``.
    """
    if type(value) is int:  # the common case, without the ABC check
        result = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    else:
        result = int(value)
    if (lo is not None and result < lo) or (hi is not None and result > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "+inf" if hi is None else str(hi)
        raise ValueError(f"{name} is out of range: {result} not in [{lo_s}, {hi_s}]")
    return result


def check_uint64(name: str, value: Any) -> int:
    """:func:`check_int` for ``[0, 2**64-1]``."""
    return check_int(name, value, 0, UINT64_MAX)


def check_uint32(name: str, value: Any) -> int:
    """:func:`check_int` for ``[0, 2**32-1]``."""
    return check_int(name, value, 0, UINT32_MAX)


def check_int64(name: str, value: Any) -> int:
    """:func:`check_int` for ``[-2**63, 2**63-1]``."""
    return check_int(name, value, INT64_MIN, INT64_MAX)


def check_layer_range(name: str, layer_range: Any) -> range | None:
    """Check a layer range: ``None``, or a ``range`` with step 1 and ``0 <= start < stop``.

    A value that is neither ``None`` nor a ``range`` raises ``TypeError``; a
    bad ``range`` raises ``LLMException(LLM_PARAM_INVALID)`` naming ``name``.
    """
    if layer_range is None:
        return None
    if not isinstance(layer_range, range):
        raise TypeError(f"{name} must be range or None, got {type(layer_range).__name__}")
    if layer_range.step != 1:
        raise param_invalid(f"{name}.step must be 1, got {name}={layer_range!r}")
    if not 0 <= layer_range.start < layer_range.stop:
        raise param_invalid(f"{name} must satisfy 0 <= start < stop, got {name}={layer_range!r}")
    return layer_range


def check_tag(name: str, tag: Any) -> str | bytes | None:
    """Check a transfer tag: ``None``, or a ``str`` / ``bytes`` of at most
    :data:`MAX_TAG_BYTES` bytes.  Returns it unchanged."""
    if tag is None:
        return None
    if not isinstance(tag, (str, bytes)):
        raise TypeError(f"{name} must be str, bytes or None, got {type(tag).__name__}")
    size = len(tag.encode("utf-8")) if isinstance(tag, str) else len(tag)
    if size > MAX_TAG_BYTES:
        raise ValueError(f"{name} is too long: {size} bytes > {MAX_TAG_BYTES}")
    return tag


def is_valid_id(value: int) -> bool:
    """Whether a uint64 id field holds a real id (anything but :data:`INVALID_ID`)."""
    return value != INVALID_ID


def check_cache_key(name: str, cache_key: CacheKey) -> None:
    """LLM-DataDist's rule for a :class:`CacheKey` used to find a remote cache:
    exactly one of ``req_id`` / ``prefix_id`` is valid (not ``2**64-1``).

    Raises ``LLMException(LLM_PARAM_INVALID)`` otherwise.  Not applied at
    construction, because a key with neither is the placeholder that
    ``allocate_cache`` accepts for an unused batch slot.
    """
    req_ok = is_valid_id(cache_key.req_id)
    prefix_ok = is_valid_id(cache_key.prefix_id)
    if req_ok == prefix_ok:
        which = "both" if req_ok else "neither"
        raise param_invalid(
            f"{name}: exactly one of req_id and prefix_id must be valid ([0, 2**64-1)), "
            f"{which} is: req_id={cache_key.req_id}, prefix_id={cache_key.prefix_id}"
        )


# --------------------------------------------------------------------------
# enums


class DataType(enum.Enum):
    """Element type of a cache tensor, with LLM-DataDist's (GE's) values."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    # LLM-DataDist has it; a cache cannot hold it (no fixed element size).
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element; ``ValueError`` for ``DT_STRING``."""
        size = _ITEMSIZE.get(self)
        if size is None:
            raise ValueError(f"{self} has no fixed element size")
        return size

    def to_numpy(self) -> np.dtype[Any]:
        """The NumPy dtype that stores this type.

        NumPy has no bfloat16, so ``DT_BF16`` is stored as ``uint16`` (same
        size, raw bits).
        """
        if self not in _TO_NUMPY:
            raise ValueError(f"{self} has no NumPy dtype")
        return np.dtype(_TO_NUMPY[self])

    @classmethod
    def from_numpy(cls, dtype: Any) -> DataType:
        """The :class:`DataType` for a dtype-like: ``np.dtype``, a type such as
        ``np.float16``, a name such as ``"float16"``, ml_dtypes' ``bfloat16``
        (found by name, so ml_dtypes need not be installed), a torch dtype, or
        a :class:`DataType` (returned as is).

        Raises ``TypeError`` for a dtype with no counterpart.
        """
        if isinstance(dtype, DataType):
            return dtype
        name = _dtype_name(dtype)
        if name is not None and name in _FROM_NAME:
            return _FROM_NAME[name]
        raise TypeError(f"unsupported dtype for a cache tensor: {dtype!r}")


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:  # np.dtype(None) would mean float64
        return None
    if isinstance(dtype, type):
        # Scalar types by name: covers ml_dtypes.bfloat16 whether or not
        # NumPy has it registered.
        if dtype.__name__ in _FROM_NAME:
            return dtype.__name__
    else:
        # torch dtypes print as "torch.float16".
        text = (dtype if isinstance(dtype, str) else str(dtype)).removeprefix("torch.")
        if text in _FROM_NAME:
            return text
    try:
        np_dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        return None
    if not np_dtype.isnative:
        return None
    return str(np_dtype.name)


_ITEMSIZE: dict[DataType, int] = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}

_TO_NUMPY: dict[DataType, npt.DTypeLike] = {
    DataType.DT_FLOAT: np.float32,
    DataType.DT_FLOAT16: np.float16,
    DataType.DT_INT8: np.int8,
    DataType.DT_INT32: np.int32,
    DataType.DT_UINT8: np.uint8,
    DataType.DT_INT16: np.int16,
    DataType.DT_UINT16: np.uint16,
    DataType.DT_UINT32: np.uint32,
    DataType.DT_INT64: np.int64,
    DataType.DT_UINT64: np.uint64,
    DataType.DT_DOUBLE: np.float64,
    DataType.DT_BOOL: np.bool_,
    DataType.DT_BF16: np.uint16,
}

_FROM_NAME: dict[str, DataType] = {
    "float32": DataType.DT_FLOAT,
    "float16": DataType.DT_FLOAT16,
    "int8": DataType.DT_INT8,
    "int32": DataType.DT_INT32,
    "uint8": DataType.DT_UINT8,
    "int16": DataType.DT_INT16,
    "uint16": DataType.DT_UINT16,
    "uint32": DataType.DT_UINT32,
    "int64": DataType.DT_INT64,
    "uint64": DataType.DT_UINT64,
    "float64": DataType.DT_DOUBLE,
    "bool": DataType.DT_BOOL,
    "bfloat16": DataType.DT_BF16,
}


class Placement(enum.IntEnum):
    """Where a cache's memory lives."""

    HOST = 0
    DEVICE = 1

    __str__ = enum_str
    __format__ = enum_format


class LLMRole(enum.IntEnum):
    """Role of an LLMDataDist instance."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    __str__ = enum_str
    __format__ = enum_format


def _check_enum(name: str, value: Any, enum_cls: type[enum.IntEnum]) -> Any:
    if isinstance(value, enum_cls):
        return value
    number = check_int(name, value)
    try:
        return enum_cls(number)
    except ValueError:
        allowed = ", ".join(f"{m.name}={m.value}" for m in enum_cls)
        raise ValueError(f"{name} must be one of {allowed}, got {number}") from None


# --------------------------------------------------------------------------
# CacheDesc / Cache


class CacheDesc:
    """Describes a cache: ``num_tensors`` tensors of one ``shape`` and ``data_type``.

    Rules: ``num_tensors`` in ``[1, 2**32-1]``; ``shape`` a list or tuple of
    1..32 int64 dims, each ``>= 0``; ``0 <= batch_dim_index < len(shape)``;
    ``seq_len_dim_index`` is -1 (unset) or in ``[0, len(shape))``;
    ``kv_tensor_format`` a str or None.  Wrong types raise ``TypeError``,
    values out of range ``ValueError``.
    """

    __slots__ = (
        "_batch_dim_index",
        "_data_type",
        "_kv_tensor_format",
        "_num_tensors",
        "_placement",
        "_seq_len_dim_index",
        "_shape",
        "_size",
    )

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement | int = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        self._num_tensors = check_int("num_tensors", num_tensors, 1, UINT32_MAX)
        check_isinstance("shape", shape, (list, tuple))
        if not 1 <= len(shape) <= MAX_SHAPE_DIMS:
            raise ValueError(f"shape must have 1..{MAX_SHAPE_DIMS} dims, got {len(shape)}")
        self._shape: tuple[int, ...] = tuple(
            check_int(f"shape[{i}]", dim, 0, INT64_MAX) for i, dim in enumerate(shape)
        )
        self._data_type: DataType = check_isinstance("data_type", data_type, DataType)
        if data_type not in _ITEMSIZE:
            raise ValueError(
                f"data_type {data_type} is not supported: a cache holds fixed-size elements"
            )
        self._placement: Placement = _check_enum("placement", placement, Placement)
        ndim = len(self._shape)
        self._batch_dim_index = check_int("batch_dim_index", batch_dim_index, 0, ndim - 1)
        self._seq_len_dim_index = check_int("seq_len_dim_index", seq_len_dim_index, -1, ndim - 1)
        if kv_tensor_format is not None:
            check_isinstance("kv_tensor_format", kv_tensor_format, str)
        self._kv_tensor_format = kv_tensor_format
        size = math.prod(self._shape) * data_type.itemsize
        if size > INT64_MAX:
            raise ValueError(f"shape {list(self._shape)} is too large: {size} bytes per tensor")
        self._size = size

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the cache."""
        return self._num_tensors

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of each tensor."""
        return self._shape

    @property
    def data_type(self) -> DataType:
        """Element type of each tensor."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """Where the memory lives."""
        return self._placement

    @property
    def batch_dim_index(self) -> int:
        """Index of the batch dimension in :attr:`shape`."""
        return self._batch_dim_index

    @property
    def batch_dim(self) -> int:
        """Alias of :attr:`batch_dim_index` (LLM-DataDist's property name)."""
        return self._batch_dim_index

    @property
    def seq_len_dim_index(self) -> int:
        """Index of the sequence-length dimension, or -1 when unset."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Free-form tensor format label, or None."""
        return self._kv_tensor_format

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim_index]``."""
        return self._shape[self._batch_dim_index]

    @property
    def size(self) -> int:
        """Bytes of ONE tensor: ``prod(shape) * itemsize``."""
        return self._size

    def _key(self) -> tuple[Any, ...]:
        return (
            self._num_tensors,
            self._shape,
            self._data_type,
            self._placement,
            self._batch_dim_index,
            self._seq_len_dim_index,
            self._kv_tensor_format,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheDesc):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={list(self._shape)}, "
            f"data_type={self._data_type}, placement=Placement.{self._placement.name}, "
            f"batch_dim_index={self._batch_dim_index}, "
            f"seq_len_dim_index={self._seq_len_dim_index}, "
            f"kv_tensor_format={self._kv_tensor_format!r})"
        )


class Cache:
    """A cache allocated or registered by a CacheManager; not built by users.

    :attr:`tensors` gives NumPy arrays viewing the memory of a HOST cache.
    After the cache is deallocated the object is invalid: :attr:`tensors`
    raises ``LLMException(LLM_KV_CACHE_NOT_EXIST)`` and :attr:`tensor_addrs`
    is empty.
    """

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: Iterable[int],
        is_blocks_cache: bool = False,
        *,
        arrays: Sequence[npt.NDArray[Any]] | None = None,
        owner: object = None,
    ) -> None:
        self._cache_id = check_int64("cache_id", cache_id)
        self._cache_desc: CacheDesc = check_isinstance("cache_desc", cache_desc, CacheDesc)
        self._tensor_addrs = [check_uint64("tensor_addrs[]", a) for a in tensor_addrs]
        self._is_blocks_cache = bool(is_blocks_cache)
        self._arrays = None if arrays is None else list(arrays)
        # Whatever keeps the memory alive (a mapping, the user's tensors...).
        self._owner = owner
        self._valid = True

    @property
    def cache_id(self) -> int:
        """Id of this cache in its CacheManager."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """The descriptor the cache was made from."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """Address of each tensor (empty once deallocated)."""
        return list(self._tensor_addrs)

    @property
    def is_blocks_cache(self) -> bool:
        """Whether this is a blocks (paged) cache."""
        return self._is_blocks_cache

    @property
    def tensors(self) -> list[npt.NDArray[Any]]:
        """NumPy arrays viewing each tensor's memory (HOST caches).

        Raises ``LLMException(LLM_KV_CACHE_NOT_EXIST)`` once the cache is
        deallocated, ``LLMException(LLM_FEATURE_NOT_ENABLED)`` for memory that
        NumPy cannot view (e.g. DEVICE).
        """
        if not self._valid:
            raise LLMException(
                f"cache {self._cache_id} has been deallocated",
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        if self._arrays is None:
            raise LLMException(
                f"cache {self._cache_id} has no host view "
                f"(placement={self._cache_desc.placement.name})",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        return list(self._arrays)

    def _invalidate(self) -> None:
        # Called by the library on deallocate/unregister: drop our views and
        # the owner reference so the memory can go.
        self._valid = False
        self._arrays = None
        self._owner = None
        self._tensor_addrs = []

    def __repr__(self) -> str:
        state = "" if self._valid else ", deallocated"
        return (
            f"Cache(cache_id={self._cache_id}, num_tensors={len(self._tensor_addrs)}, "
            f"is_blocks_cache={self._is_blocks_cache}{state})"
        )


# --------------------------------------------------------------------------
# keys


def _cluster_id_arg(cluster_id: Any, prompt_cluster_id: Any, cls_name: str) -> int:
    if cluster_id is not None and prompt_cluster_id is not None:
        raise TypeError(f"{cls_name}: pass cluster_id or prompt_cluster_id, not both")
    if cluster_id is None and prompt_cluster_id is None:
        raise TypeError(f"{cls_name}: missing required argument cluster_id (or prompt_cluster_id)")
    if cluster_id is None:
        return check_uint64("prompt_cluster_id", prompt_cluster_id)
    return check_uint64("cluster_id", cluster_id)


class CacheKey:
    """Names a remote cache by request (or prefix) id.

    ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=2**64-1)``;
    ``prompt_cluster_id=`` is accepted instead of ``cluster_id=``.  All fields
    are uint64.  A key used to find a cache needs exactly one of
    ``req_id`` / ``prefix_id`` valid (see :func:`check_cache_key`); a key
    with neither is a placeholder for an unused batch slot in
    ``allocate_cache``.
    """

    __slots__ = ("_cluster_id", "_model_id", "_prefix_id", "_req_id")

    def __init__(
        self,
        cluster_id: int | None = None,
        req_id: int | None = None,
        model_id: int = 0,
        prefix_id: int = INVALID_ID,
        *,
        prompt_cluster_id: int | None = None,
    ) -> None:
        self._cluster_id = _cluster_id_arg(cluster_id, prompt_cluster_id, "CacheKey")
        if req_id is None:
            raise TypeError("CacheKey: missing required argument req_id")
        self._req_id = check_uint64("req_id", req_id)
        self._model_id = check_uint64("model_id", model_id)
        self._prefix_id = check_uint64("prefix_id", prefix_id)

    @property
    def cluster_id(self) -> int:
        """Cluster id of the instance holding the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Alias of :attr:`cluster_id`."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id (``2**64-1`` = none)."""
        return self._req_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    @property
    def prefix_id(self) -> int:
        """Shared-prefix id (``2**64-1`` = none)."""
        return self._prefix_id

    @property
    def is_placeholder(self) -> bool:
        """True when neither req_id nor prefix_id is valid."""
        return not is_valid_id(self._req_id) and not is_valid_id(self._prefix_id)

    def _key(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheKey):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((CacheKey, *self._key()))

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"model_id={self._model_id}, prefix_id={self._prefix_id})"
        )


class CacheKeyByIdAndIndex:
    """Names one batch slot of a remote cache by cache id.

    ``cluster_id`` uint64, ``cache_id`` int64, ``batch_index`` uint32.
    """

    __slots__ = ("_batch_index", "_cache_id", "_cluster_id")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = check_uint64("cluster_id", cluster_id)
        self._cache_id = check_int64("cache_id", cache_id)
        self._batch_index = check_uint32("batch_index", batch_index)

    @property
    def cluster_id(self) -> int:
        """Cluster id of the instance holding the cache."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """Id of the remote cache."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """Batch slot in the remote cache."""
        return self._batch_index

    def _key(self) -> tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheKeyByIdAndIndex):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((CacheKeyByIdAndIndex, *self._key()))

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, "
            f"cache_id={self._cache_id}, batch_index={self._batch_index})"
        )


class BlocksCacheKey:
    """Names a remote blocks (paged) cache.

    ``BlocksCacheKey(cluster_id, model_id=0)``; ``prompt_cluster_id=`` is
    accepted instead of ``cluster_id=``.  Both fields are uint64.
    """

    __slots__ = ("_cluster_id", "_model_id")

    def __init__(
        self,
        cluster_id: int | None = None,
        model_id: int = 0,
        *,
        prompt_cluster_id: int | None = None,
    ) -> None:
        self._cluster_id = _cluster_id_arg(cluster_id, prompt_cluster_id, "BlocksCacheKey")
        self._model_id = check_uint64("model_id", model_id)

    @property
    def cluster_id(self) -> int:
        """Cluster id of the instance holding the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Alias of :attr:`cluster_id`."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlocksCacheKey):
            return NotImplemented
        return (self._cluster_id, self._model_id) == (other._cluster_id, other._model_id)

    def __hash__(self) -> int:
        return hash((BlocksCacheKey, self._cluster_id, self._model_id))

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


# --------------------------------------------------------------------------
# LLMClusterInfo


def _ip_to_str(name: str, ip: Any) -> str:
    if isinstance(ip, str):
        try:
            return str(ipaddress.IPv4Address(ip))
        except ValueError:
            raise ValueError(f"{name} is not a dotted-quad IPv4 address: {ip!r}") from None
    # LLM-DataDist's int form: the 4 address bytes read as a little-endian
    # uint32 (what int.from_bytes(socket.inet_aton(ip), "little") gives).
    number = check_int(name, ip, 0, UINT32_MAX)
    return socket.inet_ntoa(number.to_bytes(4, "little"))


def _ip_to_int(ip: str) -> int:
    return int.from_bytes(socket.inet_aton(ip), "little")


class LLMClusterInfo:
    """A peer to link to: its cluster id, role and addresses.

    ``ip`` is a dotted-quad ``str`` or LLM-DataDist's ``int`` form (the
    address bytes as a little-endian uint32); ``port`` is in ``[0, 65535]``.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | None = None
        self._local_ip_info: list[tuple[str, int]] = []
        self._remote_ip_info: list[tuple[str, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id (uint64), or None until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_uint64("remote_cluster_id", value)

    @property
    def remote_role_type(self) -> LLMRole | None:
        """The peer's role, or None until set."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        self._remote_role_type = _check_enum("remote_role_type", value, LLMRole)

    @staticmethod
    def _ip_port(ip: Any, port: Any) -> tuple[str, int]:
        if not isinstance(ip, (str, int)) or isinstance(ip, bool):
            raise TypeError(f"ip must be str or int, got {type(ip).__name__}")
        return _ip_to_str("ip", ip), check_int("port", port, 0, UINT16_MAX)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local address to link from."""
        self._local_ip_info.append(self._ip_port(ip, port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add an address of the peer."""
        self._remote_ip_info.append(self._ip_port(ip, port))

    @property
    def local_ip_info(self) -> list[tuple[str, int]]:
        """Local addresses as ``(ip_str, port)``."""
        return list(self._local_ip_info)

    @property
    def remote_ip_info(self) -> list[tuple[str, int]]:
        """Peer addresses as ``(ip_str, port)``."""
        return list(self._remote_ip_info)

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """Local addresses in LLM-DataDist's form ``(ip_int, port)``."""
        return [(_ip_to_int(ip), port) for ip, port in self._local_ip_info]

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """Peer addresses in LLM-DataDist's form ``(ip_int, port)``."""
        return [(_ip_to_int(ip), port) for ip, port in self._remote_ip_info]

    def __repr__(self) -> str:
        role = None if self._remote_role_type is None else self._remote_role_type.name
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={role}, local_ip_info={self._local_ip_info}, "
            f"remote_ip_info={self._remote_ip_info})"
        )


# --------------------------------------------------------------------------
# transfer_cache_async configs


class LayerSynchronizer(abc.ABC):
    """Tells ``transfer_cache_async`` when a layer's K/V is ready to send.

    Implement :meth:`synchronize_layer` as a plain method or as a coroutine
    (``async def``); either way it returns True when layer ``layer_index``
    is ready, False to abort the transfer of that layer.
    """

    @abc.abstractmethod
    def synchronize_layer(
        self, layer_index: int, timeout_in_millis: int | None
    ) -> bool | Awaitable[bool]:
        """Wait until layer ``layer_index`` is computed; None = no timeout."""


def _check_addrs(name: str, addrs: Any) -> list[int]:
    check_isinstance(name, addrs, (list, tuple))
    return [check_uint64(f"{name}[{i}]", a) for i, a in enumerate(addrs)]


class TransferConfig:
    """One destination of ``transfer_cache_async``, given by raw addresses.

    ``dst_addrs`` lists the destination tensor addresses (uint64), two per
    layer sent (K, V): already offset to the batch slot for a contiguous
    destination, the tensors' base addresses for a blocks destination
    (``dst_block_indices``). Each must lie inside a remote-accessible cache
    of that cluster, with room for what is sent (checked before any byte
    moves). ``src_layer_range`` is the local layers to send (``None`` =
    all); ``src_batch_index`` uint32.  **[ours]** ``tag``: a ``str`` /
    ``bytes`` notification tag, as for ``push_cache``; the destination layer
    it reports is the one the first address falls in.
    """

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: Sequence[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
        *,
        tag: str | bytes | None = None,
    ) -> None:
        self._dst_cluster_id = check_uint64("dst_cluster_id", dst_cluster_id)
        self._dst_addrs = _check_addrs("dst_addrs", dst_addrs)
        self._src_layer_range = check_layer_range("src_layer_range", src_layer_range)
        self._src_batch_index = check_uint32("src_batch_index", src_batch_index)
        self._tag = check_tag("tag", tag)

    @property
    def dst_cluster_id(self) -> int:
        """Cluster id of the destination instance."""
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        self._dst_cluster_id = check_uint64("dst_cluster_id", value)

    @property
    def dst_addrs(self) -> list[int]:
        """Destination tensor addresses."""
        return list(self._dst_addrs)

    @dst_addrs.setter
    def dst_addrs(self, value: Sequence[int]) -> None:
        self._dst_addrs = _check_addrs("dst_addrs", value)

    @property
    def src_layer_range(self) -> range | None:
        """Local layers to send; None = all."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        self._src_layer_range = check_layer_range("src_layer_range", value)

    @property
    def dst_layer_range(self) -> None:
        """Always None: :attr:`dst_addrs` already names the destination tensors."""
        return None

    @property
    def src_batch_index(self) -> int:
        """Local batch slot to send."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        self._src_batch_index = check_uint32("src_batch_index", value)

    @property
    def tag(self) -> str | bytes | None:
        """Notification tag, or None."""
        return self._tag

    @tag.setter
    def tag(self, value: str | bytes | None) -> None:
        self._tag = check_tag("tag", value)

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, "
            f"dst_addrs={self._dst_addrs}, src_layer_range={self._src_layer_range}, "
            f"src_batch_index={self._src_batch_index}, tag={self._tag!r})"
        )


class TransferWithCacheKeyConfig:
    """One destination of ``transfer_cache_async``, given by a cache key.

    ``cache_key`` is a :class:`BlocksCacheKey` or :class:`CacheKeyByIdAndIndex`;
    ``src_layer_range`` / ``dst_layer_range`` are the local and remote layers
    (equal lengths; **[ours]** ``None`` = all layers, where LLM-DataDist
    requires both); ``src_batch_index`` uint32, and 0 for a BlocksCacheKey.
    **[ours]** ``tag`` as for ``push_cache``.
    """

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
        *,
        tag: str | bytes | None = None,
    ) -> None:
        self._cache_key = self._check_key(cache_key)
        self._src_layer_range = check_layer_range("src_layer_range", src_layer_range)
        self._dst_layer_range = check_layer_range("dst_layer_range", dst_layer_range)
        self._check_lengths(self._src_layer_range, self._dst_layer_range)
        self._src_batch_index = self._check_batch(self._cache_key, src_batch_index)
        self._tag = check_tag("tag", tag)

    @staticmethod
    def _check_key(cache_key: Any) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        result: BlocksCacheKey | CacheKeyByIdAndIndex = check_isinstance(
            "cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex)
        )
        return result

    @staticmethod
    def _check_lengths(src: range | None, dst: range | None) -> None:
        if src is not None and dst is not None and len(src) != len(dst):
            raise param_invalid(
                f"src_layer_range and dst_layer_range must have the same length, "
                f"got {src!r} and {dst!r}"
            )

    @staticmethod
    def _check_batch(cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, src_batch_index: Any) -> int:
        index = check_uint32("src_batch_index", src_batch_index)
        if isinstance(cache_key, BlocksCacheKey) and index != 0:
            raise param_invalid(
                f"src_batch_index must be 0 when cache_key is a BlocksCacheKey, got {index}"
            )
        return index

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        """Key of the destination cache."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        key = self._check_key(value)
        self._check_batch(key, self._src_batch_index)
        self._cache_key = key

    @property
    def dst_cluster_id(self) -> int:
        """``cache_key.cluster_id``."""
        return self._cache_key.cluster_id

    @property
    def src_layer_range(self) -> range | None:
        """Local layers to send; None = all."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        checked = check_layer_range("src_layer_range", value)
        self._check_lengths(checked, self._dst_layer_range)
        self._src_layer_range = checked

    @property
    def dst_layer_range(self) -> range | None:
        """Remote layers to write; None = all."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range | None) -> None:
        checked = check_layer_range("dst_layer_range", value)
        self._check_lengths(self._src_layer_range, checked)
        self._dst_layer_range = checked

    @property
    def src_batch_index(self) -> int:
        """Local batch slot to send."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        self._src_batch_index = self._check_batch(self._cache_key, value)

    @property
    def tag(self) -> str | bytes | None:
        """Notification tag, or None."""
        return self._tag

    @tag.setter
    def tag(self, value: str | bytes | None) -> None:
        self._tag = check_tag("tag", value)

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self._cache_key}, "
            f"src_layer_range={self._src_layer_range}, "
            f"dst_layer_range={self._dst_layer_range}, "
            f"src_batch_index={self._src_batch_index}, tag={self._tag!r})"
        )
