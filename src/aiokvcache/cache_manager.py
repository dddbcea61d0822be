"""CacheManager: the public surface for caches and transfers.

Each method checks its own arguments (the exception type and message
``docs/api.md`` names) and makes one call into the private core, reached
through :class:`~aiokvcache._core.runtime.Runtime`, which checks them against
the caches they name, resolves remote caches, plans the native segment
tables and runs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _telemetry as _t
from ._core.model.errors import LLMStatusCode, make_error, param_invalid
from ._core.model.types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_cache_key,
    check_int,
    check_isinstance,
    check_layer_range,
    check_tag,
)
from ._core.transfer import layerwise, planner
from ._core.transfer.layerwise import CacheTask
from ._core.transfer.notify import Notification, Notifications
from ._core.transfer.runner import check_timeout
from ._core.transfer.transfers import BlocksCall
from ._telemetry import measure as _measure

if TYPE_CHECKING:
    from ._core.runtime import Runtime

__all__ = ["CacheManager", "Notification", "Notifications"]


def _check_host_desc(cache_desc: Any) -> CacheDesc:
    desc: CacheDesc = check_isinstance("cache_desc", cache_desc, CacheDesc)
    if desc.placement != Placement.HOST:
        raise make_error(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"cache_desc.placement={desc.placement.name}: no CUDA device is usable here; "
            "use Placement.HOST",
        )
    if desc.size == 0:
        raise param_invalid(f"cache_desc.shape {desc.shape} holds no bytes")
    return desc


def _check_common(
    tensor_num_per_layer: Any,
    src_layer_range: Any,
    dst_layer_range: Any,
    timeout: Any,
) -> tuple[int, range | None, range | None, float | None]:
    """The arguments every remote transfer takes: layers per tensor, layer ranges, timeout."""
    n = check_int("tensor_num_per_layer", tensor_num_per_layer, 1, 2**31 - 1)
    src = check_layer_range("src_layer_range", src_layer_range)
    dst = check_layer_range("dst_layer_range", dst_layer_range)
    return n, src, dst, check_timeout(timeout)


class CacheManager:
    """Allocates, registers and transfers KV caches (LLM-DataDist's ``CacheManager``).

    Obtained from :attr:`LLMDataDist.cache_manager`. Local bookkeeping is
    synchronous and thread-safe (``deallocate_cache`` may be called from
    another thread while the event loop is busy); every transfer is a
    coroutine with ``timeout=`` (seconds, whole call). See ``docs/api.md``
    for the rules each call checks.
    """

    __slots__ = ("_check_ready", "_rt")

    def __init__(self, runtime: Runtime, check_ready: Any) -> None:
        self._rt = runtime
        self._check_ready = check_ready

    def stats(self) -> dict[str, int]:
        """Counters: native engine stats plus cache and notification bookkeeping.

        ``regions`` counts the memory regions of caches (allocated, or
        registered user memory) not yet released; the engine's own control
        region (probe slots, retirement words) is not among them.
        """
        return self._rt.stats()

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Allocate a cache in memory that same-host peers can map (zero-copy).

        Key *i* of ``cache_keys`` binds batch index *i*. ``cache.tensors``
        gives NumPy views of the memory.
        """
        self._check_ready()
        desc = _check_host_desc(cache_desc)
        keys = self._rt.caches.check_keys(cache_keys, desc.batch_size)
        return self._rt.caches.allocate("allocate_cache", desc, keys, None, False)

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        """Allocate a blocks (paged) cache: ``cache_desc.shape[0]`` blocks per tensor.

        Block *b* of a tensor is bytes ``[b*s, (b+1)*s)`` with ``s =
        cache_desc.size // shape[0]``. ``blocks_cache_key`` lets peers find
        it (``push_blocks`` / ``pull_blocks``). Free it with
        :meth:`deallocate_blocks_cache`.
        """
        self._check_ready()
        desc = _check_host_desc(cache_desc)
        key = self._rt.caches.check_blocks_key(blocks_cache_key)
        return self._rt.caches.allocate("allocate_blocks_cache", desc, [], key, True)

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[Any],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register user memory as a cache.

        ``addrs``: one address (int) per tensor, or one object per tensor
        exposing the buffer protocol or DLPack (NumPy arrays, CPU torch
        tensors) of exactly ``cache_desc.size`` bytes; the Cache keeps those
        objects alive. ``remote_accessible=False`` keeps peers from reading or
        writing it.
        """
        self._check_ready()
        desc = _check_host_desc(cache_desc)
        if remote_accessible is not None:
            check_isinstance("remote_accessible", remote_accessible, bool)
        keys = self._rt.caches.check_keys(cache_keys, desc.batch_size)
        return self._rt.caches.register(desc, addrs, keys, None, False, remote_accessible)

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[Any],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register user memory as a blocks (paged) cache.

        ``addrs`` as for :meth:`register_cache`; the layout is
        :meth:`allocate_blocks_cache`'s. Forget it with :meth:`unregister_cache`
        (or :meth:`deallocate_blocks_cache`).
        """
        self._check_ready()
        desc = _check_host_desc(cache_desc)
        if remote_accessible is not None:
            check_isinstance("remote_accessible", remote_accessible, bool)
        key = self._rt.caches.check_blocks_key(blocks_cache_key)
        return self._rt.caches.register(desc, addrs, [], key, True, remote_accessible)

    def deallocate_cache(self, cache: Cache) -> None:
        """Free an allocated cache.

        Peers are told at once; the memory itself is released once no
        transfer of ours uses it and every linked peer has confirmed that it
        will not write it any more (bounded wait), so no write lands in freed
        memory. A later push to it fails with KV_CACHE_NOT_EXIST.
        """
        self._check_ready()
        self._rt.caches.deallocate(cache, blocks=False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Free a blocks cache (allocated, or registered: then like :meth:`unregister_cache`).

        Same safety as :meth:`deallocate_cache`; its BlocksCacheKey is unbound.
        """
        self._check_ready()
        self._rt.caches.deallocate(cache, blocks=True)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache (see :meth:`deallocate_cache` for safety)."""
        self._check_ready()
        cid = check_int("cache_id", cache_id, 0, 2**63 - 1)
        self._rt.caches.unregister(cid)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a CacheKey from its cache (no-op when it is not bound)."""
        self._check_ready()
        check_isinstance("cache_key", cache_key, CacheKey)
        self._rt.caches.remove_key(cache_key)

    async def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex | CacheKey,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = 2,
        *,
        timeout: float | None = None,
        tag: str | bytes | None = None,
    ) -> None:
        """Push a batch slot of ``src_cache``, layer by layer, into a remote cache.

        ``dst_cache_key`` names the destination slot by id and index, or
        (ours) by a :class:`CacheKey` the peer bound to one of its slots,
        resolved as :meth:`pull_cache` resolves it (``cluster_id`` is the
        peer's). One native job per layer, all in flight at once; returns
        when every layer has landed at the peer. With ``tag`` the peer is
        notified per landed layer. On failure raises :class:`LLMException` naming the
        layers that landed; on timeout :class:`LLMTimeoutError`. Whatever
        happens, nothing is read or written after this returns or raises.
        """
        self._check_ready()
        self._rt.check_loop()
        check_isinstance("dst_cache_key", dst_cache_key, (CacheKeyByIdAndIndex, CacheKey))
        src = self._rt.caches.local("src_cache", src_cache)
        sb = check_int("src_batch_index", src_batch_index, 0, 2**31 - 1)
        size_v = check_int("size", size, -(2**63), 2**63 - 1)
        n, src_r, dst_r, tmo = _check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        tag_v = check_tag("tag", tag)
        if isinstance(dst_cache_key, CacheKey):
            check_cache_key("dst_cache_key", dst_cache_key)
        coro = self._rt.transfers.push_slot(
            dst_cache_key, src, sb, n, src_r, dst_r, size_v, tag_v, tmo
        )
        await (_measure("push_cache", dst_cache_key.cluster_id, coro) if _t.active else coro)

    async def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        timeout: float | None = None,
    ) -> None:
        """Pull a remote batch slot (by CacheKey or by id and index) into ``cache``.

        ``size``: -1 for the whole slot, else ``0 < size <= slot bytes`` per
        tensor. Same failure and quiescence rules as :meth:`push_cache`.
        """
        self._check_ready()
        self._rt.check_loop()
        check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        dst = self._rt.caches.local("cache", cache)
        db = check_int("batch_index", batch_index, 0, 2**31 - 1)
        size_v = check_int("size", size, -(2**63), 2**63 - 1)
        n, src_r, dst_r, tmo = _check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        if isinstance(cache_key, CacheKey):
            check_cache_key("cache_key", cache_key)
        coro = self._rt.transfers.pull_slot(cache_key, dst, db, n, src_r, dst_r, size_v, tmo)
        await (_measure("pull_cache", cache_key.cluster_id, coro) if _t.active else coro)

    async def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copy a batch slot between two local caches, tensor by tensor.

        ``offset`` and ``size`` (bytes, -1 = to the end of the slot) select
        a part of each tensor's slot.  ``req_id`` (an int in ``[0, 2**64-1]``
        or None) only labels the copy in logs, as in LLM-DataDist.
        """
        self._check_ready()
        self._rt.check_loop()
        if req_id is not None:
            check_int("req_id", req_id, 0, 2**64 - 1)
        d = self._rt.caches.local("dst", dst)
        s = self._rt.caches.local("src", src)
        db = check_int("dst_batch_index", dst_batch_index, 0, 2**31 - 1)
        sb = check_int("src_batch_index", src_batch_index, 0, 2**31 - 1)
        off = check_int("offset", offset, 0, 2**63 - 1)
        size_v = check_int("size", size, -(2**63), 2**63 - 1)
        await self._rt.copies.copy_slot(d, s, db, sb, off, size_v)

    async def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int] | npt.NDArray[np.integer[Any]] = (),
        dst_blocks: Sequence[int] | npt.NDArray[np.integer[Any]] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        timeout: float | None = None,
        tag: str | bytes | None = None,
    ) -> None:
        """Push blocks ``src_blocks`` of a local blocks cache into blocks ``dst_blocks``
        of the remote blocks cache bound to ``dst_cache_key``.

        Block lists are lists, tuples or NumPy integer arrays of equal length;
        every id is checked against both caches and destination ids must be
        distinct, before any byte moves. Runs of blocks consecutive on both
        sides travel as one segment. One native job per layer, as
        :meth:`push_cache`; ``tag`` notifications carry the destination block
        ids (see :class:`Notification`).
        """
        self._check_ready()
        self._rt.check_loop()
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey)
        src = self._rt.caches.local("src_cache", src_cache)
        src_ids = planner.block_ids("src_blocks", src_blocks)
        dst_ids = planner.block_ids("dst_blocks", dst_blocks)
        n, src_r, dst_r, tmo = _check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        call = BlocksCall(src_ids, dst_ids, n, src_r, dst_r, check_tag("tag", tag))
        coro = self._rt.transfers.push_blocks(dst_cache_key, src, call, tmo)
        await (_measure("push_blocks", dst_cache_key.cluster_id, coro) if _t.active else coro)

    async def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int] | npt.NDArray[np.integer[Any]] = (),
        dst_blocks: Sequence[int] | npt.NDArray[np.integer[Any]] = (),
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        timeout: float | None = None,
    ) -> None:
        """Pull remote blocks into blocks ``dst_blocks`` of a local blocks cache.

        With a :class:`BlocksCacheKey`, ``src_blocks`` (same length) names the
        remote planner. With a :class:`CacheKey` or
        :class:`CacheKeyByIdAndIndex`, ``src_blocks`` must be empty: the
        remote batch slot (contiguous) is split over ``dst_blocks`` in order,
        ``ceil(slot bytes / block bytes)`` of them, the last one partly used.
        Same checks, failure and quiescence rules as :meth:`push_blocks`.
        """
        self._check_ready()
        self._rt.check_loop()
        check_isinstance(
            "src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
        )
        dst = self._rt.caches.local("dst_cache", dst_cache)
        src_ids = planner.block_ids("src_blocks", src_blocks)
        dst_ids = planner.block_ids("dst_blocks", dst_blocks)
        n, src_r, dst_r, tmo = _check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        call = BlocksCall(src_ids, dst_ids, n, src_r, dst_r)
        coro = self._rt.transfers.pull_blocks(src_cache_key, dst, call, tmo)
        await (_measure("pull_blocks", src_cache_key.cluster_id, coro) if _t.active else coro)

    async def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy blocks inside one blocks cache: ``{src block: [dst block, ...]}``, every tensor.

        Ids are checked against the cache; a destination may appear only once
        and may not also be a source (the result would depend on order).
        """
        self._check_ready()
        self._rt.check_loop()
        rec = self._rt.caches.local("cache", cache)
        srcs, dsts = planner.block_mapping("copy_block_info", copy_block_info, True)
        await self._rt.copies.copy_blocks(rec, srcs, dsts)

    async def swap_blocks(
        self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]
    ) -> None:
        """Copy block ``src`` of ``src_cache`` to block ``dst`` of ``dst_cache``, every tensor.

        Both are blocks caches with the same number of tensors and block size.
        LLM-DataDist swaps between HOST and DEVICE; without a CUDA device,
        HOST↔HOST is what is allowed here **[ours]**.
        """
        self._check_ready()
        self._rt.check_loop()
        s = self._rt.caches.local("src_cache", src_cache)
        d = self._rt.caches.local("dst_cache", dst_cache)
        srcs, dsts = planner.block_mapping("src_to_dst", src_to_dst, False)
        await self._rt.copies.swap_blocks(s, d, srcs, dsts)

    async def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        dst_block_indices: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        dst_block_memory_size: int | None = None,
        *,
        timeout: float | None = None,
    ) -> CacheTask:
        """Send ``src_cache`` layer by layer as each layer becomes ready.

        For each source layer *i* that some config includes, awaits
        ``layer_synchronizer.synchronize_layer(i, None)`` (a plain method, or
        **[ours]** a coroutine; a plain one runs on the event loop and must
        not block), then pushes layer *i* to every config that includes it
        and moves on without waiting for those bytes: transfer of layer *i*
        overlaps the computation of layer *i + 1*. The synchronizer
        returning False stops the task: configs that include layer *i* end
        with ``LLM_PARAM_INVALID``, nothing from layer *i* on is sent.

        Destinations: :class:`TransferWithCacheKeyConfig` (a
        :class:`CacheKeyByIdAndIndex` batch slot, or a
        :class:`BlocksCacheKey` with ``dst_block_indices``) or
        :class:`TransferConfig` (raw destination tensor addresses, two per
        layer, which must lie inside remote-accessible caches of that
        cluster). Blocks: a blocks ``src_cache`` needs ``src_block_indices``
        and ``dst_block_indices`` of equal length; a contiguous
        ``src_cache`` with ``dst_block_indices`` splits its batch slot over
        those blocks (``dst_block_memory_size`` gives the block size of a
        ``TransferConfig`` destination).

        Every argument, destination and bound is checked here, before any
        byte moves; then the returned :class:`CacheTask` runs in the
        background. ``timeout`` **[ours]** (seconds) bounds lookups plus the
        whole task. A failing destination stops receiving layers; the others
        go on.
        """
        self._check_ready()
        self._rt.check_loop()
        return await layerwise.transfer_cache_async(
            self._rt.transfers,
            self._rt.caches.local("src_cache", src_cache),
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            check_timeout(timeout),
        )

    async def wait_for_layers(
        self,
        tag: str | bytes,
        layers: Iterable[int],
        timeout: float | None = None,
        *,
        src_cluster_id: int | None = None,
    ) -> None:
        """Return once every layer in ``layers`` of pushes tagged ``tag`` has landed.

        Layers that landed before the call count. The tag's record is
        dropped when this returns. Raises :class:`LLMTimeoutError` on timeout.
        **[ours]** ``src_cluster_id``: count only notifications that arrived
        on the link to that cluster (a notification's source is the link it
        came on, never what its payload claims); None counts every linked
        peer's, so any peer that knows the tag can complete the wait.
        """
        self._check_ready()
        self._rt.check_loop()
        if tag is None:
            raise TypeError("tag must be str or bytes, got NoneType")
        check_tag("tag", tag)
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(f"layers must be an iterable of ints, got {type(layers).__name__}")
        want = {check_int("layers[]", x, 0, 2**31 - 1) for x in layers}
        src = (
            None
            if src_cluster_id is None
            else check_int("src_cluster_id", src_cluster_id, 0, 2**64 - 1)
        )
        await self._rt.receiver.wait_for_layers(tag, want, check_timeout(timeout), src)

    async def notify(
        self, cluster_id: int, tag: str | bytes, *, timeout: float | None = None
    ) -> None:
        """**[ours]** Send a notification that moves no bytes to linked cluster ``cluster_id``.

        The peer's :meth:`notifications` yield ``Notification(tag, our cluster
        id, cache_id=-1, batch_index=None, layer=-1)``: a control signal
        ("done reading request 7") on the transfer's own path, after
        everything this side pushed before it was posted. Returns once the
        peer's engine took it; raises ``LLM_NOT_YET_LINK`` / ``LLM_LINK_FAILED``
        for a missing or broken link and :class:`LLMTimeoutError` on timeout.
        """
        self._check_ready()
        self._rt.check_loop()
        cid = check_int("cluster_id", cluster_id, 0, 2**64 - 1)
        if tag is None:
            raise TypeError("tag must be str or bytes, got NoneType")
        tag_v = check_tag("tag", tag)
        assert tag_v is not None
        coro = self._rt.transfers.notify(cid, tag_v, check_timeout(timeout))
        await (_measure("notify", cid, coro) if _t.active else coro)

    def discard_tag(self, tag: str | bytes) -> None:
        """Drop what is recorded for ``tag``."""
        check_tag("tag", tag)
        self._rt.receiver.discard(tag)

    def notifications(self) -> Notifications:
        """Every notification that arrives from now on, as an async iterator
        (``async for note in cm.notifications()``).

        It ends when the instance is finalized; ``async with
        cm.notifications() as notes:`` or ``aclose()`` stops it earlier (one
        dropped without either stops when it is garbage collected).
        """
        self._check_ready()
        self._rt.check_loop()
        return self._rt.receiver.subscribe()
