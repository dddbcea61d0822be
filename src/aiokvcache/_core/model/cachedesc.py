"""Cache descriptors and caches: :class:`CacheDesc`, :class:`Cache` and the
element types and placements they are made of."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .checks import (
    INT64_MAX,
    MAX_SHAPE_DIMS,
    UINT32_MAX,
    check_enum,
    check_int,
    check_int64,
    check_isinstance,
    check_uint64,
)
from .errors import LLMException, LLMStatusCode, enum_format, enum_str

__all__ = ["Cache", "CacheDesc", "DataType", "Placement", "invalidate_cache"]


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
        self._placement: Placement = check_enum("placement", placement, Placement)
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

    def _invalidate(self) -> object:
        # Called by the library on deallocate/unregister: drop our views and
        # the owner reference so the memory can go.
        owner, self._owner = self._owner, None
        self._valid = False
        self._arrays = None
        self._tensor_addrs = []
        return owner

    def __repr__(self) -> str:
        state = "" if self._valid else ", deallocated"
        return (
            f"Cache(cache_id={self._cache_id}, num_tensors={len(self._tensor_addrs)}, "
            f"is_blocks_cache={self._is_blocks_cache}{state})"
        )


def invalidate_cache(cache: Cache) -> object:
    """Make ``cache`` invalid once the library deallocated or unregistered it;
    returns what kept its memory alive, for the caller to hold or drop."""
    return cache._invalidate()
