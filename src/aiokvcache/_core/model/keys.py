"""Keys that name a remote cache: :class:`CacheKey`, :class:`CacheKeyByIdAndIndex`
and :class:`BlocksCacheKey`."""

from __future__ import annotations

from typing import Any

from .checks import INVALID_ID, check_int64, check_uint32, check_uint64, is_valid_id
from .errors import param_invalid

__all__ = ["BlocksCacheKey", "CacheKey", "CacheKeyByIdAndIndex", "check_cache_key"]


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
