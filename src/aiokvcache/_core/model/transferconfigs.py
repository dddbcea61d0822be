"""The destinations of ``transfer_cache_async`` and its layer synchronizer."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Sequence
from typing import Any

from .checks import check_isinstance, check_layer_range, check_tag, check_uint32, check_uint64
from .errors import param_invalid
from .keys import BlocksCacheKey, CacheKeyByIdAndIndex

__all__ = ["LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig"]


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
