"""CacheManager: local caches, remote cache metadata, and transfers.

A transfer call turns descriptors into one native job per layer — a table of
(local address, remote address, length, remote key) rows built with NumPy —
submits them all at once and awaits them as a group through the bridge.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import numbers
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from . import blocks, control, layerwise
from ._bridge import OP_GET, OP_PUT, settle, time_left
from ._loader import native
from .errors import LLMException, LLMStatusCode, LLMTimeoutError, make_error, param_invalid
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
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

if TYPE_CHECKING:
    from .datadist import LLMDataDist, _Link

__all__ = ["CacheManager", "Notification"]

log = logging.getLogger("aiokvcache")

# How long a deallocated cache's memory waits for peers to confirm they will
# not write it any more before it is released anyway.
_RETIRE_TIMEOUT_S = 5.0
_METADATA_TIMEOUT_S = 10.0
_MAX_ADDRS_PER_REQUEST = 4096
# Receiver state caps (see API.md, "Receiver notifications").
MAX_TAG_RECORDS = 4096
MAX_QUEUED_NOTIFICATIONS = 65536


class _NoBlocks:
    """Marks a notification of a contiguous (not blocks) destination."""


_NO_BLOCKS = _NoBlocks()


class Notification(NamedTuple):
    """A layer of a tagged push landed in one of our caches.

    ``batch_index`` is the destination batch index for a contiguous cache;
    for a blocks destination it is the tuple of destination block ids — or
    None when that list was too long to travel with the notification (more
    than about 1000 scattered ids; runs of consecutive ids travel as runs, so
    long consecutive lists fit), or when a ``TransferConfig``'s raw address
    does not name a batch slot.
    """

    tag: str | bytes
    src_cluster_id: int
    cache_id: int
    batch_index: int | tuple[int, ...] | None
    layer: int

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """The destination block ids of a blocks push (None otherwise)."""
        return self.batch_index if isinstance(self.batch_index, tuple) else None


@dataclass(eq=False)
class _LocalCache:
    cache: Cache
    desc: CacheDesc
    addrs: list[int]
    regions: list[tuple[int, int, int]]  # (region id, base, length)
    tensor_region: list[int]  # index into regions, per tensor
    remote_accessible: bool
    allocated: bool
    keys: dict[CacheKey, int] = field(default_factory=dict)  # key -> batch index
    active: set[Any] = field(default_factory=set)  # bridge groups using it
    valid: bool = True
    rkeys: list[bytes] | None = None  # packed, per region (lazily)
    blocks_key: BlocksCacheKey | None = None


@dataclass(eq=False)
class _RemoteCache:
    cache_id: int
    desc: CacheDesc
    addrs: list[int]
    tensor_rkey: list[int]  # native rkey id per tensor
    rkey_ids: list[int]
    is_blocks: bool = False
    active: set[Any] = field(default_factory=set)
    valid: bool = True


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    value = float(timeout)
    if not value > 0:  # also rejects NaN
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    return value


def _slot_spans(desc: CacheDesc, batch_index: int) -> tuple[npt.NDArray[np.uint64], int]:
    """Byte offsets of one batch slot inside a tensor, and the span length.

    With the batch dimension first a slot is one contiguous span; otherwise
    it is one span per index of the dimensions before it.
    """
    shape = desc.shape
    bdi = desc.batch_dim_index
    inner = math.prod(shape[bdi + 1 :]) * desc.data_type.itemsize
    outer = math.prod(shape[:bdi])
    batch = shape[bdi]
    starts = (
        np.arange(outer, dtype=np.uint64) * np.uint64(batch) + np.uint64(batch_index)
    ) * np.uint64(inner)
    return starts, inner


def _desc_to_wire(desc: CacheDesc) -> dict[str, Any]:
    return {
        "num_tensors": desc.num_tensors,
        "shape": list(desc.shape),
        "dtype": desc.data_type.value,
        "batch_dim_index": desc.batch_dim_index,
        "seq_len_dim_index": desc.seq_len_dim_index,
    }


def _desc_from_wire(d: dict[str, Any]) -> CacheDesc:
    return CacheDesc(
        d["num_tensors"],
        list(d["shape"]),
        DataType(d["dtype"]),
        Placement.HOST,
        d["batch_dim_index"],
        d["seq_len_dim_index"],
    )


class CacheManager:
    """Allocates, registers and transfers KV caches (LLM-DataDist's ``CacheManager``).

    Obtained from :attr:`LLMDataDist.cache_manager`. Local bookkeeping is
    synchronous; every transfer is a coroutine with ``timeout=`` (seconds,
    whole call). See ``docs/api.md`` for the rules each call checks.
    """

    def __init__(self, datadist: LLMDataDist) -> None:
        self._dd = datadist
        self._engine: Any = datadist._engine
        self._bridge = datadist._bridge
        assert self._bridge is not None
        self._next_cache_id = 1
        self._caches: dict[int, _LocalCache] = {}
        self._keys: dict[CacheKey, tuple[int, int]] = {}  # key -> (cache id, batch index)
        self._blocks_keys: dict[BlocksCacheKey, int] = {}  # key -> cache id
        self._allocated_bytes = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        # Receiver notifications.
        self._tag_records: collections.OrderedDict[str | bytes, set[int]] = (
            collections.OrderedDict()
        )
        self._tag_waiters: dict[str | bytes, list[tuple[set[int], asyncio.Future[None]]]] = {}
        self._subscribers: list[asyncio.Queue[Notification]] = []
        self._dropped_records = 0
        self._dropped_notifications = 0
        self._bad_notifications = 0

    # ------------------------------------------------------------- helpers

    def _check_ready(self) -> None:
        self._dd._check_ready()

    def _require_remote_access(self, what: str) -> None:
        """Pushing writes peers' memory: only with llm.EnableRemoteCacheAccessible on."""
        if not self._dd.options.enable_remote_cache_accessible:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{what} needs llm.EnableRemoteCacheAccessible on",
            )

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("aiokvcache: background task failed", exc_info=task.exception())

    def _new_cache_id(self) -> int:
        cid = self._next_cache_id
        self._next_cache_id += 1
        return cid

    def _local(self, name: str, cache: Any) -> _LocalCache:
        check_isinstance(name, cache, Cache)
        rec = self._caches.get(cache.cache_id)
        if rec is None or rec.cache is not cache:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{name} (cache {cache.cache_id}) is not a live cache of this cache manager",
            )
        return rec

    def stats(self) -> dict[str, int]:
        """Counters: native engine stats plus cache and notification bookkeeping."""
        out = dict(self._engine.stats())
        out.update(
            caches=len(self._caches),
            allocated_bytes=self._allocated_bytes,
            tag_records=len(self._tag_records),
            dropped_tag_records=self._dropped_records,
            dropped_notifications=self._dropped_notifications,
            bad_notifications=self._bad_notifications,
        )
        return out

    # ---------------------------------------------------- local: allocate

    def _check_host_desc(self, cache_desc: Any) -> CacheDesc:
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

    def _check_keys(self, cache_keys: Any, batch_size: int) -> list[CacheKey]:
        if not isinstance(cache_keys, (list, tuple)):
            raise TypeError(
                f"cache_keys must be a list of CacheKey, got {type(cache_keys).__name__}"
            )
        keys = [check_isinstance(f"cache_keys[{i}]", k, CacheKey) for i, k in enumerate(cache_keys)]
        if len(keys) > batch_size:
            raise param_invalid(
                f"cache_keys has {len(keys)} keys but the cache's batch size is {batch_size}"
            )
        seen: set[CacheKey] = set()
        for i, k in enumerate(keys):
            if k.is_placeholder:
                continue
            if k in seen:
                raise param_invalid(f"cache_keys[{i}] = {k!r} appears twice")
            if k in self._keys:
                raise param_invalid(f"cache_keys[{i}] = {k!r} is already bound to a cache")
            seen.add(k)
        return keys

    def _bind_keys(self, rec: _LocalCache, keys: list[CacheKey]) -> None:
        for i, k in enumerate(keys):
            if not k.is_placeholder:
                rec.keys[k] = i
                self._keys[k] = (rec.cache.cache_id, i)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Allocate a cache in memory that same-host peers can map (zero-copy).

        Key *i* of ``cache_keys`` binds batch index *i*. ``cache.tensors``
        gives NumPy views of the memory.
        """
        self._check_ready()
        desc = self._check_host_desc(cache_desc)
        keys = self._check_keys(cache_keys, desc.batch_size)
        return self._allocate("allocate_cache", desc, keys, None, False)

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
        desc = self._check_host_desc(cache_desc)
        key = self._check_blocks_key(blocks_cache_key)
        return self._allocate("allocate_blocks_cache", desc, [], key, True)

    def _check_blocks_key(self, key: Any) -> BlocksCacheKey | None:
        if key is None:
            return None
        check_isinstance("blocks_cache_key", key, BlocksCacheKey)
        if key in self._blocks_keys:
            raise param_invalid(f"blocks_cache_key = {key!r} is already bound to a cache")
        result: BlocksCacheKey = key
        return result

    def _allocate(
        self,
        what: str,
        desc: CacheDesc,
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
        is_blocks: bool,
    ) -> Cache:
        total = desc.size * desc.num_tensors
        cap = self._dd.options.host_mem_pool_bytes
        if cap is not None and self._allocated_bytes + total > cap:
            raise make_error(
                LLMStatusCode.LLM_OUT_OF_MEMORY,
                f"{what}: {total} bytes would exceed the host memory pool "
                f"({self._allocated_bytes} of {cap} bytes in use)",
            )
        try:
            region, base = self._engine.mem_alloc(total)
        except native.EngineClosedError as exc:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "engine is finalized") from exc
        except Exception as exc:
            raise make_error(LLMStatusCode.LLM_OUT_OF_MEMORY, f"{what} failed: {exc}") from exc
        addrs = [base + i * desc.size for i in range(desc.num_tensors)]
        arrays = self._views(desc, addrs)
        cache = Cache(self._new_cache_id(), desc, addrs, is_blocks, arrays=arrays, owner=self)
        rec = _LocalCache(
            cache, desc, addrs, [(region, base, total)], [0] * desc.num_tensors, True, True
        )
        self._caches[cache.cache_id] = rec
        self._bind_keys(rec, keys)
        self._bind_blocks_key(rec, blocks_key)
        self._allocated_bytes += total
        return cache

    def _bind_blocks_key(self, rec: _LocalCache, key: BlocksCacheKey | None) -> None:
        if key is not None:
            rec.blocks_key = key
            self._blocks_keys[key] = rec.cache.cache_id

    @staticmethod
    def _views(desc: CacheDesc, addrs: list[int]) -> list[npt.NDArray[Any]]:
        dtype = desc.data_type.to_numpy()
        return [
            np.frombuffer(native.buffer_from_address(a, desc.size), dtype=dtype).reshape(desc.shape)
            for a in addrs
        ]

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
        desc = self._check_host_desc(cache_desc)
        if remote_accessible is not None:
            check_isinstance("remote_accessible", remote_accessible, bool)
        keys = self._check_keys(cache_keys, desc.batch_size)
        return self._register(desc, addrs, keys, None, False, remote_accessible)

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
        desc = self._check_host_desc(cache_desc)
        if remote_accessible is not None:
            check_isinstance("remote_accessible", remote_accessible, bool)
        key = self._check_blocks_key(blocks_cache_key)
        return self._register(desc, addrs, [], key, True, remote_accessible)

    def _register(
        self,
        desc: CacheDesc,
        addrs: Sequence[Any],
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
        is_blocks: bool,
        remote_accessible: bool | None,
    ) -> Cache:
        if not isinstance(addrs, (list, tuple)):
            raise TypeError(f"addrs must be a list, got {type(addrs).__name__}")
        if len(addrs) != desc.num_tensors:
            raise param_invalid(
                f"addrs has {len(addrs)} entries but cache_desc.num_tensors is {desc.num_tensors}"
            )
        owners: list[Any] = []
        addr_list: list[int] = []
        for i, a in enumerate(addrs):
            if isinstance(a, numbers.Integral) and not isinstance(a, bool):
                v = check_int(f"addrs[{i}]", a, 0, 2**64 - 1)
                if v == 0:
                    raise param_invalid(f"addrs[{i}] is 0")
                addr_list.append(v)
            else:
                arr = _as_array(f"addrs[{i}]", a)
                if arr.nbytes != desc.size:
                    raise param_invalid(
                        f"addrs[{i}] has {arr.nbytes} bytes, cache_desc.size is {desc.size}"
                    )
                owners.append(a)
                addr_list.append(int(arr.ctypes.data))
        regions: list[tuple[int, int, int]] = []
        try:
            for a in addr_list:
                regions.append((self._engine.mem_register(a, desc.size), a, desc.size))
        except BaseException as exc:
            for rid, _, _ in regions:
                with contextlib.suppress(Exception):
                    self._engine.mem_release(rid)
            if isinstance(exc, native.EngineClosedError):
                raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "engine is finalized") from exc
            if isinstance(exc, Exception):
                raise make_error(LLMStatusCode.LLM_FAILED, f"register_cache failed: {exc}") from exc
            raise
        arrays = self._views(desc, addr_list)
        cache = Cache(self._new_cache_id(), desc, addr_list, is_blocks, arrays=arrays, owner=owners)
        rec = _LocalCache(
            cache,
            desc,
            addr_list,
            regions,
            list(range(desc.num_tensors)),
            remote_accessible is not False,
            False,
        )
        self._caches[cache.cache_id] = rec
        self._bind_keys(rec, keys)
        self._bind_blocks_key(rec, blocks_key)
        return cache

    def deallocate_cache(self, cache: Cache) -> None:
        """Free an allocated cache.

        Peers are told at once; the memory itself is released once no
        transfer of ours uses it and every linked peer has confirmed that it
        will not write it any more (bounded wait), so no write lands in freed
        memory. A later push to it fails with KV_CACHE_NOT_EXIST.
        """
        self._check_ready()
        rec = self._local("cache", cache)
        if rec.cache.is_blocks_cache:
            raise param_invalid(
                f"cache {cache.cache_id} is a blocks cache: use deallocate_blocks_cache"
            )
        if not rec.allocated:
            raise param_invalid(f"cache {cache.cache_id} was registered: use unregister_cache")
        self._retire(rec)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Free a blocks cache (allocated, or registered: then like :meth:`unregister_cache`).

        Same safety as :meth:`deallocate_cache`; its BlocksCacheKey is unbound.
        """
        self._check_ready()
        rec = self._local("cache", cache)
        if not rec.cache.is_blocks_cache:
            raise param_invalid(
                f"cache {cache.cache_id} is not a blocks cache: use deallocate_cache"
            )
        self._retire(rec)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache (see :meth:`deallocate_cache` for safety)."""
        self._check_ready()
        cid = check_int("cache_id", cache_id, 0, 2**63 - 1)
        rec = self._caches.get(cid)
        if rec is None:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache_id {cid} is not registered"
            )
        if rec.allocated:
            raise param_invalid(f"cache {cid} was allocated: use deallocate_cache")
        self._retire(rec)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a CacheKey from its cache (no-op when it is not bound)."""
        self._check_ready()
        check_isinstance("cache_key", cache_key, CacheKey)
        bound = self._keys.pop(cache_key, None)
        if bound is not None:
            rec = self._caches.get(bound[0])
            if rec is not None:
                rec.keys.pop(cache_key, None)

    def _retire(self, rec: _LocalCache) -> None:
        cid = rec.cache.cache_id
        rec.valid = False
        del self._caches[cid]
        for k in rec.keys:
            self._keys.pop(k, None)
        if rec.blocks_key is not None and self._blocks_keys.get(rec.blocks_key) == cid:
            del self._blocks_keys[rec.blocks_key]
        if rec.allocated:
            self._allocated_bytes -= sum(r[2] for r in rec.regions)
        owners = rec.cache._owner
        rec.cache._invalidate()
        # Our own transfers on it stop now; the memory waits for them below.
        for group in list(rec.active):
            self._bridge_cancel(group)
        task = asyncio.get_running_loop().create_task(self._release_later(rec, owners))
        self._track(task)

    def _bridge_cancel(self, group: Any) -> None:
        assert self._bridge is not None
        self._bridge.cancel_group(group)  # a no-op once the engine is closed

    async def _release_later(self, rec: _LocalCache, owners: Any) -> None:
        cid = rec.cache.cache_id
        try:
            for group in list(rec.active):
                await asyncio.shield(group.released)
            if rec.remote_accessible:
                links = [lk for lk in self._dd._links.values() if not lk.broken]
                await asyncio.gather(
                    *(self._invalidate_at(lk, cid) for lk in links), return_exceptions=True
                )
        finally:
            for rid, _, _ in rec.regions:
                with contextlib.suppress(Exception):
                    self._engine.mem_release(rid)
            del owners  # user buffers may go now

    async def _invalidate_at(self, link: _Link, cache_id: int) -> None:
        try:
            await link.conn.request("invalidate", {"cache_id": cache_id}, timeout=_RETIRE_TIMEOUT_S)
        except LLMException as exc:
            log.info(
                "aiokvcache: cluster %d did not confirm invalidation: %s", link.cluster_id, exc
            )

    # ------------------------------------------------------ control: serve

    def _metadata(self, rec: _LocalCache) -> dict[str, Any]:
        if rec.rkeys is None:
            rec.rkeys = [self._engine.rkey_pack(rid) for rid, _, _ in rec.regions]
        return {
            "cache_id": rec.cache.cache_id,
            "desc": _desc_to_wire(rec.desc),
            "is_blocks": rec.cache.is_blocks_cache,
            "addrs": list(rec.addrs),
            "regions": [
                {"base": base, "len": length, "rkey": rk}
                for (_, base, length), rk in zip(rec.regions, rec.rkeys, strict=True)
            ],
            "tensor_region": list(rec.tensor_region),
        }

    def _served(self, cache_id: int) -> _LocalCache:
        rec = self._caches.get(cache_id)
        if rec is None or not rec.valid:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {cache_id} does not exist on the peer"
            )
        if not rec.remote_accessible or not self._dd.options.enable_remote_cache_accessible:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED, f"cache {cache_id} is not remote accessible"
            )
        return rec

    async def _serve(self, link: _Link, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "cache_by_id":
            cid = body.get("cache_id")
            if not isinstance(cid, int):
                raise param_invalid("cache_by_id: cache_id must be int")
            return self._metadata(self._served(cid))
        if op == "cache_by_key":
            try:
                key = CacheKey(
                    cluster_id=body["cluster_id"],
                    req_id=body["req_id"],
                    model_id=body["model_id"],
                    prefix_id=body["prefix_id"],
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise param_invalid(f"cache_by_key: bad key: {exc}") from None
            bound = self._keys.get(key)
            if bound is None:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no cache is bound to {key!r}"
                )
            out = self._metadata(self._served(bound[0]))
            out["batch_index"] = bound[1]
            return out
        if op == "blocks_by_key":
            try:
                bkey = BlocksCacheKey(body["cluster_id"], body["model_id"])
            except (KeyError, TypeError, ValueError) as exc:
                raise param_invalid(f"blocks_by_key: bad key: {exc}") from None
            bound_id = self._blocks_keys.get(bkey)
            if bound_id is None:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no blocks cache is bound to {bkey!r}"
                )
            return self._metadata(self._served(bound_id))
        if op == "cache_by_addr":
            addrs = body.get("addrs")
            if (
                not isinstance(addrs, list)
                or len(addrs) > _MAX_ADDRS_PER_REQUEST
                or not all(isinstance(a, int) for a in addrs)
            ):
                raise param_invalid("cache_by_addr: addrs must be a list of ints")
            found: dict[int, dict[str, Any]] = {}
            for a in addrs:
                for rec in self._caches.values():
                    if rec.cache.cache_id in found or not rec.valid or not rec.remote_accessible:
                        continue
                    if any(t <= a < t + rec.desc.size for t in rec.addrs):
                        found[rec.cache.cache_id] = self._metadata(self._served(rec.cache.cache_id))
                        break
            return {"caches": list(found.values())}
        if op == "invalidate":
            cid = body.get("cache_id")
            if not isinstance(cid, int):
                raise param_invalid("invalidate: cache_id must be int")
            await self._drop_remote(link, cid)
            return {}
        raise param_invalid(f"unknown request {op!r}")

    # --------------------------------------------------- remote metadata

    async def _remote_cache(
        self, link: _Link, cache_id: int, timeout: float | None
    ) -> _RemoteCache:
        rc: _RemoteCache | None = link.remote.get(cache_id)
        if rc is not None:
            return rc
        fut = link.fetching.get(cache_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            link.fetching[cache_id] = fut
            task = asyncio.get_running_loop().create_task(self._fetch(link, cache_id, fut))
            self._track(task)
        async with asyncio.timeout(timeout):
            result: _RemoteCache = await asyncio.shield(fut)
        return result

    async def _fetch(self, link: _Link, cache_id: int, fut: asyncio.Future[Any]) -> None:
        try:
            meta = await link.conn.request(
                "cache_by_id", {"cache_id": cache_id}, timeout=_METADATA_TIMEOUT_S
            )
            rc = self._install_remote(link, meta)
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, Exception) else LLMException(str(exc)))
                fut.exception()  # retrieved: waiters may have given up already
            if not isinstance(exc, Exception):
                raise
        else:
            if not fut.done():
                fut.set_result(rc)
        finally:
            link.fetching.pop(cache_id, None)

    def _install_remote(self, link: _Link, meta: dict[str, Any]) -> _RemoteCache:
        try:
            cid = int(meta["cache_id"])
            desc = _desc_from_wire(meta["desc"])
            addrs = [int(a) for a in meta["addrs"]]
            regions = meta["regions"]
            tensor_region = [int(i) for i in meta["tensor_region"]]
            is_blocks = meta.get("is_blocks", False)
            if not isinstance(is_blocks, bool):
                raise ValueError("is_blocks must be a bool")
            if len(addrs) != desc.num_tensors or len(tensor_region) != desc.num_tensors:
                raise ValueError("tensor count mismatch")
            for a, r in zip(addrs, tensor_region, strict=True):
                reg = regions[r]
                if not reg["base"] <= a or a + desc.size > reg["base"] + reg["len"]:
                    raise ValueError("tensor outside its region")
        except (KeyError, TypeError, ValueError, IndexError, LLMException) as exc:
            raise make_error(
                LLMStatusCode.LLM_FAILED,
                f"cluster {link.cluster_id} sent bad cache metadata: {exc}",
            ) from None
        if link.broken:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED, f"link to cluster {link.cluster_id} broke"
            )
        existing: _RemoteCache | None = link.remote.get(cid)
        if existing is not None:
            return existing
        rkey_ids: list[int] = []
        try:
            for reg in regions:
                rkey_ids.append(
                    self._engine.rkey_unpack(link.ep, reg["rkey"], reg["base"], reg["len"])
                )
        except Exception as exc:
            for k in rkey_ids:
                with contextlib.suppress(Exception):
                    self._engine.rkey_release(k)
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED, f"cannot use cluster {link.cluster_id}'s keys: {exc}"
            ) from exc
        rc = _RemoteCache(
            cid, desc, addrs, [rkey_ids[r] for r in tensor_region], rkey_ids, bool(is_blocks)
        )
        link.remote[cid] = rc
        return rc

    async def _drop_remote(self, link: _Link, cache_id: int) -> None:
        """The peer retires a cache: stop using it, then confirm."""
        rc: _RemoteCache | None = link.remote.pop(cache_id, None)
        if rc is None:
            return
        rc.valid = False
        for group in list(rc.active):
            self._bridge_cancel(group)
        for group in list(rc.active):
            await asyncio.shield(group.released)
        self._release_keys(rc)

    def _release_keys(self, rc: _RemoteCache) -> None:
        for k in rc.rkey_ids:
            with contextlib.suppress(Exception):
                self._engine.rkey_release(k)
        rc.rkey_ids = []

    def _forget_link(self, link: _Link) -> None:
        for rc in link.remote.values():
            rc.valid = False
            if not rc.active:
                self._release_keys(rc)
        link.remote.clear()

    # ------------------------------------------------------------ transfers

    def _check_common(
        self,
        tensor_num_per_layer: Any,
        src_layer_range: Any,
        dst_layer_range: Any,
        timeout: Any,
    ) -> tuple[int, range | None, range | None, float | None]:
        n = check_int("tensor_num_per_layer", tensor_num_per_layer, 1, 2**31 - 1)
        src = check_layer_range("src_layer_range", src_layer_range)
        dst = check_layer_range("dst_layer_range", dst_layer_range)
        return n, src, dst, _check_timeout(timeout)

    @staticmethod
    def _layers(
        n: int,
        src_desc: CacheDesc,
        dst_desc: CacheDesc,
        src_range: range | None,
        dst_range: range | None,
        src_name: str,
        dst_name: str,
    ) -> list[tuple[int, int]]:
        """(source layer, destination layer) pairs, all bounds checked."""
        for name, desc in ((src_name, src_desc), (dst_name, dst_desc)):
            if n > desc.num_tensors or desc.num_tensors % n:
                raise param_invalid(
                    f"tensor_num_per_layer={n} must divide {name}'s num_tensors={desc.num_tensors}"
                )
        src_layers = src_desc.num_tensors // n
        dst_layers = dst_desc.num_tensors // n
        # One range given: the other is the same (LLM-DataDist wants them equal).
        src_r = src_range if src_range is not None else dst_range
        dst_r = dst_range if dst_range is not None else src_range
        src_r = src_r if src_r is not None else range(src_layers)
        dst_r = dst_r if dst_r is not None else range(dst_layers)
        if src_r.stop > src_layers:
            raise param_invalid(
                f"src_layer_range={src_r!r} exceeds the {src_layers} layers of {src_name}"
            )
        if dst_r.stop > dst_layers:
            raise param_invalid(
                f"dst_layer_range={dst_r!r} exceeds the {dst_layers} layers of {dst_name}"
            )
        if len(src_r) != len(dst_r):
            raise param_invalid(
                f"src_layer_range ({len(src_r)} layers) and dst_layer_range ({len(dst_r)} layers) "
                "must have the same length"
            )
        return list(zip(src_r, dst_r, strict=True))

    @staticmethod
    def _pair_spans(
        src_desc: CacheDesc,
        src_batch: int,
        dst_desc: CacheDesc,
        dst_batch: int,
        size: int,
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], int]:
        """Matching byte spans of a source slot and a destination slot."""
        s_off, s_len = _slot_spans(src_desc, src_batch)
        d_off, d_len = _slot_spans(dst_desc, dst_batch)
        if len(s_off) == 1 and len(d_off) == 1:
            length = s_len if size < 0 else size
            if length > min(s_len, d_len):
                raise param_invalid(
                    f"a batch slot of {length} bytes does not fit: source slot {s_len} bytes, "
                    f"destination slot {d_len} bytes"
                )
            return s_off, d_off, length
        if len(s_off) != len(d_off) or s_len != d_len or (size >= 0 and size != s_len * len(s_off)):
            raise param_invalid(
                "source and destination batch slots have different layouts "
                f"(shapes {src_desc.shape} / {dst_desc.shape}, batch_dim_index "
                f"{src_desc.batch_dim_index} / {dst_desc.batch_dim_index})"
            )
        return s_off, d_off, s_len

    @staticmethod
    def _layer_rows(
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        remote_rkeys: Sequence[int],
        local_tensors: range,
        remote_tensors: range,
        local_off: npt.NDArray[np.uint64],
        remote_off: npt.NDArray[np.uint64],
        length: int,
    ) -> npt.NDArray[np.uint64]:
        m = len(local_off)
        rows = np.empty((len(local_tensors) * m, 4), dtype=np.uint64)
        for k, (lt, rt) in enumerate(zip(local_tensors, remote_tensors, strict=True)):
            block = rows[k * m : (k + 1) * m]
            block[:, 0] = local_off + np.uint64(local_addrs[lt])
            block[:, 1] = remote_off + np.uint64(remote_addrs[rt])
            block[:, 2] = length
            block[:, 3] = remote_rkeys[rt]
        return rows

    def _payload(
        self,
        tag: str | bytes | None,
        cache_id: int,
        batch_index: int | None,
        layer: int,
        block_list: bytes | _NoBlocks | None = _NO_BLOCKS,
    ) -> bytes:
        """One layer's notification: ``block_list`` from :meth:`_block_list` for blocks."""
        if tag is None:
            return b""
        d: dict[str, Any] = {
            "t": tag,
            "c": self._dd.cluster_id,
            "i": cache_id,
            "b": batch_index,
            "l": layer,
        }
        if not isinstance(block_list, _NoBlocks):
            d["k"] = block_list
        out = control.encode(d)
        if len(out) > native.MAX_PAYLOAD:
            raise param_invalid(
                f"tag is too long for a notification ({len(out)} > {native.MAX_PAYLOAD} bytes)"
            )
        return out

    def _block_list(self, tag: str | bytes | None, ids: npt.NDArray[np.int64]) -> bytes | None:
        """Destination block ids in the compact form that fits next to ``tag``, or None."""
        if tag is None:
            return None
        base = len(self._payload(tag, 2**63 - 1, None, 2**31 - 1, b""))
        return blocks.encode_block_ids(ids, native.MAX_PAYLOAD - base)

    async def _run(
        self,
        jobs: list[tuple[int, int, Any, bytes, int]],
        labels: list[str],
        timeout: float | None,
        local: _LocalCache,
        remote: _RemoteCache,
    ) -> None:
        assert self._bridge is not None
        # The whole-call timeout becomes the jobs' native deadline.
        group = self._bridge.submit_group(jobs, timeout=timeout)
        local.active.add(group)
        remote.active.add(group)
        try:
            await self._bridge.wait(group, labels=labels)
        except LLMException as exc:
            # Jobs we cancelled because a cache went away, or that the engine
            # refused because its key was released meanwhile: say so.
            cancelled = exc.status_code in (
                LLMStatusCode.LLM_FAILED,
                LLMStatusCode.LLM_PARAM_INVALID,
            )
            for rec, what in ((remote, "the remote cache"), (local, "the local cache")):
                if not rec.valid and cancelled:
                    raise make_error(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                        f"{what} was deallocated during the transfer; {exc.message}",
                    ) from exc
            if exc.status_code == LLMStatusCode.LLM_PARAM_INVALID:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"destination cache went away: {exc.message}",
                ) from exc
            raise
        finally:
            local.active.discard(group)
            remote.active.discard(group)
            if not remote.valid and not remote.active:
                self._release_keys(remote)

    async def _slot_transfer(
        self,
        op: int,
        link: _Link,
        local: _LocalCache,
        local_batch: int,
        remote: _RemoteCache,
        remote_batch: int,
        remote_batch_name: str,
        n: int,
        src_range: range | None,
        dst_range: range | None,
        size: int,
        tag: str | bytes | None,
        timeout: float | None,
    ) -> None:
        """Move one batch slot between a local and a remote cache, a job per layer.

        ``op`` OP_PUT pushes local -> remote, OP_GET pulls remote -> local; the
        layer ranges keep their source/destination meaning.
        """
        if remote_batch >= remote.desc.batch_size:
            raise param_invalid(
                f"{remote_batch_name}={remote_batch} is out of range for the remote batch size "
                f"{remote.desc.batch_size}"
            )
        push = op == OP_PUT
        if push:
            pairs = self._layers(
                n, local.desc, remote.desc, src_range, dst_range, "src_cache", "the remote cache"
            )
            l_off, r_off, length = self._pair_spans(
                local.desc, local_batch, remote.desc, remote_batch, size
            )
        else:
            pairs = self._layers(
                n, remote.desc, local.desc, src_range, dst_range, "the remote cache", "cache"
            )
            r_off, l_off, length = self._pair_spans(
                remote.desc, remote_batch, local.desc, local_batch, size
            )
        per_job_ms = self._dd.options.sync_kv_timeout_ms
        jobs = []
        for src_layer, dst_layer in pairs:
            local_layer, remote_layer = (src_layer, dst_layer) if push else (dst_layer, src_layer)
            rows = self._layer_rows(
                local.addrs,
                remote.addrs,
                remote.tensor_rkey,
                range(local_layer * n, (local_layer + 1) * n),
                range(remote_layer * n, (remote_layer + 1) * n),
                l_off,
                r_off,
                length,
            )
            payload = self._payload(tag, remote.cache_id, remote_batch, dst_layer) if push else b""
            jobs.append((op, link.ep, rows, payload, per_job_ms))
        labels = [f"layer {dst_layer}" for _, dst_layer in pairs]
        await self._run(jobs, labels, timeout, local, remote)

    async def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
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

        One native job per layer, all in flight at once; returns when every
        layer has landed at the peer. With ``tag`` the peer is notified per
        landed layer. On failure raises :class:`LLMException` naming the
        layers that landed; on timeout :class:`LLMTimeoutError`. Whatever
        happens, nothing is read or written after this returns or raises.
        """
        self._check_ready()
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        src = self._local("src_cache", src_cache)
        sb = check_int("src_batch_index", src_batch_index, 0, 2**31 - 1)
        size_v = check_int("size", size, -(2**63), 2**63 - 1)
        n, src_r, dst_r, tmo = self._check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        tag_v = check_tag("tag", tag)
        if size_v != -1:
            raise param_invalid(f"size must be -1 for push_cache, got {size_v}")
        if src.cache.is_blocks_cache:
            raise param_invalid("src_cache is a blocks cache: use push_blocks")
        if sb >= src.desc.batch_size:
            raise param_invalid(
                f"src_batch_index={sb} is out of range for a batch size of {src.desc.batch_size}"
            )
        self._require_remote_access("push_cache")
        link = self._dd._link_for(dst_cache_key.cluster_id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            remote = await self._remote_cache(link, dst_cache_key.cache_id, tmo)
        except TimeoutError:
            raise LLMTimeoutError("push_cache timed out looking up the destination cache") from None
        tmo = time_left(tmo, start)
        await self._slot_transfer(
            OP_PUT,
            link,
            src,
            sb,
            remote,
            dst_cache_key.batch_index,
            "dst_cache_key.batch_index",
            n,
            src_r,
            dst_r,
            -1,
            tag_v,
            tmo,
        )

    async def _remote_slot(
        self,
        link: _Link,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        tmo: float | None,
        what: str,
    ) -> tuple[_RemoteCache, int]:
        """The remote cache and batch index a CacheKey / CacheKeyByIdAndIndex names."""
        try:
            async with asyncio.timeout(tmo):
                if isinstance(cache_key, CacheKey):
                    meta = await link.conn.request(
                        "cache_by_key",
                        {
                            "cluster_id": cache_key.cluster_id,
                            "req_id": cache_key.req_id,
                            "model_id": cache_key.model_id,
                            "prefix_id": cache_key.prefix_id,
                        },
                        timeout=_METADATA_TIMEOUT_S,
                    )
                    sb = meta.get("batch_index")
                    if not isinstance(sb, int):
                        raise make_error(LLMStatusCode.LLM_FAILED, "peer sent no batch_index")
                    return self._install_remote(link, meta), sb
                remote = await self._remote_cache(link, cache_key.cache_id, None)
                return remote, cache_key.batch_index
        except TimeoutError:
            raise LLMTimeoutError(f"{what} timed out looking up the source cache") from None

    async def _remote_blocks(
        self, link: _Link, key: BlocksCacheKey, tmo: float | None, what: str
    ) -> _RemoteCache:
        """The remote blocks cache bound to ``key`` (asked every time: keys rebind)."""
        try:
            async with asyncio.timeout(tmo):
                meta = await link.conn.request(
                    "blocks_by_key",
                    {"cluster_id": key.cluster_id, "model_id": key.model_id},
                    timeout=_METADATA_TIMEOUT_S,
                )
        except TimeoutError:
            raise LLMTimeoutError(f"{what} timed out looking up {key!r}") from None
        remote = self._install_remote(link, meta)
        if not remote.is_blocks:
            raise make_error(
                LLMStatusCode.LLM_FAILED, f"cluster {link.cluster_id} sent a non-blocks cache"
            )
        return remote

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
        check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        dst = self._local("cache", cache)
        db = check_int("batch_index", batch_index, 0, 2**31 - 1)
        size_v = check_int("size", size, -(2**63), 2**63 - 1)
        n, src_r, dst_r, tmo = self._check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        if isinstance(cache_key, CacheKey):
            check_cache_key("cache_key", cache_key)
        if dst.cache.is_blocks_cache:
            raise param_invalid("cache is a blocks cache: use pull_blocks")
        if db >= dst.desc.batch_size:
            raise param_invalid(
                f"batch_index={db} is out of range for a batch size of {dst.desc.batch_size}"
            )
        if size_v != -1 and size_v <= 0:
            raise param_invalid(f"size must be -1 or > 0, got {size_v}")
        link = self._dd._link_for(cache_key.cluster_id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        remote, sb = await self._remote_slot(link, cache_key, tmo, "pull_cache")
        tmo = time_left(tmo, start)
        await self._slot_transfer(
            OP_GET,
            link,
            dst,
            db,
            remote,
            sb,
            "cache_key.batch_index",
            n,
            src_r,
            dst_r,
            size_v,
            None,
            tmo,
        )

    async def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
    ) -> None:
        """Copy a batch slot between two local caches, tensor by tensor.

        ``offset`` and ``size`` (bytes, -1 = to the end of the slot) select
        a part of each tensor's slot.
        """
        self._check_ready()
        d = self._local("dst", dst)
        s = self._local("src", src)
        db = check_int("dst_batch_index", dst_batch_index, 0, 2**31 - 1)
        sb = check_int("src_batch_index", src_batch_index, 0, 2**31 - 1)
        off = check_int("offset", offset, 0, 2**63 - 1)
        size_v = check_int("size", size, -(2**63), 2**63 - 1)
        if d.desc.num_tensors != s.desc.num_tensors:
            raise param_invalid(
                f"dst has {d.desc.num_tensors} tensors but src has {s.desc.num_tensors}"
            )
        if db >= d.desc.batch_size:
            raise param_invalid(f"dst_batch_index={db} is out of range ({d.desc.batch_size})")
        if sb >= s.desc.batch_size:
            raise param_invalid(f"src_batch_index={sb} is out of range ({s.desc.batch_size})")
        s_off, s_len = _slot_spans(s.desc, sb)
        d_off, d_len = _slot_spans(d.desc, db)
        if len(s_off) != 1 or len(d_off) != 1:
            raise param_invalid("copy_cache needs batch_dim_index 0 on both caches")
        if size_v != -1 and size_v <= 0:
            raise param_invalid(f"size must be -1 or > 0, got {size_v}")
        length = s_len - off if size_v == -1 else size_v
        if off + length > s_len or off + length > d_len or length <= 0:
            raise param_invalid(
                f"offset={off} + size={length} exceeds a slot (src {s_len}, dst {d_len} bytes)"
            )
        views = []
        for ts in range(s.desc.num_tensors):
            src_v = np.frombuffer(
                native.buffer_from_address(s.addrs[ts] + int(s_off[0]) + off, length, True),
                np.uint8,
            )
            dst_v = np.frombuffer(
                native.buffer_from_address(d.addrs[ts] + int(d_off[0]) + off, length), np.uint8
            )
            views.append((dst_v, src_v))
        await self._in_thread(_copy_all, views)

    # --------------------------------------------------------------- blocks

    @staticmethod
    def _ids(name: str, value: Any) -> npt.NDArray[np.int64]:
        return blocks.block_ids(name, value)

    @staticmethod
    def _slot_span(desc: CacheDesc, batch_index: int, what: str) -> tuple[int, int]:
        """(offset, length) of a batch slot that must be one contiguous span."""
        off, length = _slot_spans(desc, batch_index)
        if len(off) != 1:
            raise param_invalid(
                f"{what}'s batch slots are not contiguous (shape {list(desc.shape)}, "
                f"batch_dim_index {desc.batch_dim_index}): it cannot be split into blocks"
            )
        return int(off[0]), length

    @staticmethod
    def _check_block_count(
        name: str, ids: npt.NDArray[np.int64], slot_len: int, block: int
    ) -> None:
        need = -(-slot_len // block)
        if ids.size != need:
            raise param_invalid(
                f"{name} has {ids.size} blocks but a batch slot of {slot_len} bytes fills "
                f"{need} blocks of {block} bytes"
            )

    @staticmethod
    def _check_block_sizes(src_desc: CacheDesc, dst_desc: CacheDesc, src: str, dst: str) -> int:
        sb, db = blocks.block_bytes(src_desc), blocks.block_bytes(dst_desc)
        if sb != db:
            raise param_invalid(f"{src} has blocks of {sb} bytes but {dst} has {db}-byte blocks")
        return sb

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
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey)
        src = self._local("src_cache", src_cache)
        src_ids = self._ids("src_blocks", src_blocks)
        dst_ids = self._ids("dst_blocks", dst_blocks)
        n, src_r, dst_r, tmo = self._check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        tag_v = check_tag("tag", tag)
        if not src.cache.is_blocks_cache:
            raise param_invalid("src_cache is not a blocks cache: use push_cache")
        if dst_ids.size == 0:
            raise param_invalid("dst_blocks can not be empty")
        if src_ids.size != dst_ids.size:
            raise param_invalid(
                f"src_blocks has {src_ids.size} blocks but dst_blocks has {dst_ids.size}"
            )
        blocks.check_in_range("src_blocks", src_ids, blocks.num_blocks(src.desc), "src_cache")
        self._require_remote_access("push_blocks")
        link = self._dd._link_for(dst_cache_key.cluster_id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        remote = await self._remote_blocks(link, dst_cache_key, tmo, "push_blocks")
        tmo = time_left(tmo, start)
        nb = blocks.num_blocks(remote.desc)
        blocks.check_in_range("dst_blocks", dst_ids, nb, "the remote cache")
        blocks.check_unique("dst_blocks", dst_ids, nb)
        pairs = self._layers(
            n, src.desc, remote.desc, src_r, dst_r, "src_cache", "the remote cache"
        )
        size = self._check_block_sizes(src.desc, remote.desc, "src_cache", "the remote cache")
        plan = blocks.blocks_plan(src_ids, dst_ids, size)
        block_list = self._block_list(tag_v, dst_ids)
        per_job_ms = self._dd.options.sync_kv_timeout_ms
        jobs = []
        for sl, dl in pairs:
            rows = blocks.layer_rows(
                plan,
                src.addrs[sl * n : (sl + 1) * n],
                remote.addrs[dl * n : (dl + 1) * n],
                remote.tensor_rkey[dl * n : (dl + 1) * n],
            )
            payload = self._payload(tag_v, remote.cache_id, None, dl, block_list)
            jobs.append((OP_PUT, link.ep, rows, payload, per_job_ms))
        await self._run(jobs, [f"layer {dl}" for _, dl in pairs], tmo, src, remote)

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
        remote blocks. With a :class:`CacheKey` or
        :class:`CacheKeyByIdAndIndex`, ``src_blocks`` must be empty: the
        remote batch slot (contiguous) is split over ``dst_blocks`` in order,
        ``ceil(slot bytes / block bytes)`` of them, the last one partly used.
        Same checks, failure and quiescence rules as :meth:`push_blocks`.
        """
        self._check_ready()
        check_isinstance(
            "src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
        )
        dst = self._local("dst_cache", dst_cache)
        src_ids = self._ids("src_blocks", src_blocks)
        dst_ids = self._ids("dst_blocks", dst_blocks)
        n, src_r, dst_r, tmo = self._check_common(
            tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )
        if not dst.cache.is_blocks_cache:
            raise param_invalid("dst_cache is not a blocks cache: use pull_cache")
        if dst_ids.size == 0:
            raise param_invalid("dst_blocks can not be empty")
        nb = blocks.num_blocks(dst.desc)
        blocks.check_in_range("dst_blocks", dst_ids, nb, "dst_cache")
        blocks.check_unique("dst_blocks", dst_ids, nb)
        by_blocks = isinstance(src_cache_key, BlocksCacheKey)
        if by_blocks:
            if src_ids.size != dst_ids.size:
                raise param_invalid(
                    f"src_blocks has {src_ids.size} blocks but dst_blocks has {dst_ids.size}"
                )
        else:
            if isinstance(src_cache_key, CacheKey):
                check_cache_key("src_cache_key", src_cache_key)
            if src_ids.size:
                raise param_invalid(
                    "src_blocks must be empty when src_cache_key is not a BlocksCacheKey"
                )
        link = self._dd._link_for(src_cache_key.cluster_id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        if isinstance(src_cache_key, BlocksCacheKey):
            remote = await self._remote_blocks(link, src_cache_key, tmo, "pull_blocks")
            sb = 0
        else:
            remote, sb = await self._remote_slot(link, src_cache_key, tmo, "pull_blocks")
        tmo = time_left(tmo, start)
        pairs = self._layers(
            n, remote.desc, dst.desc, src_r, dst_r, "the remote cache", "dst_cache"
        )
        block = blocks.block_bytes(dst.desc)
        if by_blocks:
            blocks.check_in_range(
                "src_blocks", src_ids, blocks.num_blocks(remote.desc), "the remote cache"
            )
            self._check_block_sizes(remote.desc, dst.desc, "the remote cache", "dst_cache")
            plan = blocks.blocks_plan(dst_ids, src_ids, block)
        else:
            if sb >= remote.desc.batch_size:
                raise param_invalid(
                    f"src_cache_key.batch_index={sb} is out of range for the remote batch size "
                    f"{remote.desc.batch_size}"
                )
            off, length = self._slot_span(remote.desc, sb, "the remote cache")
            self._check_block_count("dst_blocks", dst_ids, length, block)
            plan = blocks.slot_blocks_plan(off, length, dst_ids, block, blocks_local=True)
        per_job_ms = self._dd.options.sync_kv_timeout_ms
        jobs = []
        for sl, dl in pairs:
            rows = blocks.layer_rows(
                plan,
                dst.addrs[dl * n : (dl + 1) * n],
                remote.addrs[sl * n : (sl + 1) * n],
                remote.tensor_rkey[sl * n : (sl + 1) * n],
            )
            jobs.append((OP_GET, link.ep, rows, b"", per_job_ms))
        await self._run(jobs, [f"layer {dl}" for _, dl in pairs], tmo, dst, remote)

    @staticmethod
    def _mapping(name: str, value: Any, many: bool) -> tuple[list[int], list[int]]:
        """``{src: [dst, ...]}`` (many) or ``{src: dst}`` as parallel id lists."""
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
        srcs: list[int] = []
        dsts: list[int] = []
        for k, v in value.items():
            src = check_int(f"{name} key", k, 0, 2**63 - 1)
            if many:
                if not isinstance(v, (list, tuple)):
                    raise TypeError(f"{name}[{src}] must be a list of ints, got {type(v).__name__}")
                for d in v:
                    dsts.append(check_int(f"{name}[{src}][]", d, 0, 2**63 - 1))
                    srcs.append(src)
            else:
                dsts.append(check_int(f"{name}[{src}]", v, 0, 2**63 - 1))
                srcs.append(src)
        return srcs, dsts

    async def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy blocks inside one blocks cache: ``{src block: [dst block, ...]}``, every tensor.

        Ids are checked against the cache; a destination may appear only once
        and may not also be a source (the result would depend on order).
        """
        self._check_ready()
        rec = self._local("cache", cache)
        srcs, dsts = self._mapping("copy_block_info", copy_block_info, True)
        if not rec.cache.is_blocks_cache:
            raise param_invalid("cache is not a blocks cache")
        nb = blocks.num_blocks(rec.desc)
        s_ids = np.asarray(srcs, dtype=np.int64)
        d_ids = np.asarray(dsts, dtype=np.int64)
        blocks.check_in_range("copy_block_info (source)", s_ids, nb, "cache")
        blocks.check_in_range("copy_block_info (destination)", d_ids, nb, "cache")
        blocks.check_unique("copy_block_info (destination)", d_ids, nb)
        both = np.intersect1d(s_ids, d_ids)
        if both.size:
            raise param_invalid(
                f"copy_block_info: block {int(both[0])} is both a source and a destination"
            )
        if not srcs:
            return
        bs = blocks.block_bytes(rec.desc)
        views = [self._block_view(a, nb, bs) for a in rec.addrs]
        await self._in_thread(_copy_blocks_all, [(v, v) for v in views], s_ids, d_ids)

    async def swap_blocks(
        self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]
    ) -> None:
        """Copy block ``src`` of ``src_cache`` to block ``dst`` of ``dst_cache``, every tensor.

        Both are blocks caches with the same number of tensors and block size.
        LLM-DataDist swaps between HOST and DEVICE; without a CUDA device,
        HOST↔HOST is what is allowed here **[ours]**.
        """
        self._check_ready()
        s = self._local("src_cache", src_cache)
        d = self._local("dst_cache", dst_cache)
        srcs, dsts = self._mapping("src_to_dst", src_to_dst, False)
        if not s.cache.is_blocks_cache:
            raise param_invalid("src_cache is not a blocks cache")
        if not d.cache.is_blocks_cache:
            raise param_invalid("dst_cache is not a blocks cache")
        if s is d:
            raise param_invalid("src_cache and dst_cache are the same cache: use copy_blocks")
        if s.desc.num_tensors != d.desc.num_tensors:
            raise param_invalid(
                f"src_cache has {s.desc.num_tensors} tensors but dst_cache has {d.desc.num_tensors}"
            )
        bs = self._check_block_sizes(s.desc, d.desc, "src_cache", "dst_cache")
        s_nb, d_nb = blocks.num_blocks(s.desc), blocks.num_blocks(d.desc)
        s_ids = np.asarray(srcs, dtype=np.int64)
        d_ids = np.asarray(dsts, dtype=np.int64)
        blocks.check_in_range("src_to_dst (source)", s_ids, s_nb, "src_cache")
        blocks.check_in_range("src_to_dst (destination)", d_ids, d_nb, "dst_cache")
        blocks.check_unique("src_to_dst (destination)", d_ids, d_nb)
        if not srcs:
            return
        pairs = [
            (self._block_view(da, d_nb, bs), self._block_view(sa, s_nb, bs))
            for da, sa in zip(d.addrs, s.addrs, strict=True)
        ]
        await self._in_thread(_copy_blocks_all, pairs, s_ids, d_ids)

    @staticmethod
    def _block_view(addr: int, nb: int, bs: int) -> npt.NDArray[np.uint8]:
        return np.frombuffer(native.buffer_from_address(addr, nb * bs), np.uint8).reshape(nb, bs)

    @staticmethod
    async def _in_thread(fn: Any, *args: Any) -> None:
        # Host copies run in a worker thread; a cancelled caller still waits
        # for the copy to finish, so nothing is written after we return.
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            await settle(work)
        finally:
            if work.done() and not work.cancelled():
                work.result()  # the copy's own error, if any, comes first

    # ------------------------------------------------------ layer-wise

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
    ) -> layerwise.CacheTask:
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
        return await layerwise.transfer_cache_async(
            self,
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            timeout,
        )

    # --------------------------------------------------------- notifications

    def _on_notify(self, payload: bytes) -> None:
        try:
            d = control.decode(payload)
            if not isinstance(d, dict):
                raise control.ProtocolError("not a dict")
            where: int | tuple[int, ...] | None
            if "k" in d:
                where = None if d["k"] is None else blocks.decode_block_ids(d["k"])
            else:
                where = None if d["b"] is None else int(d["b"])
            note = Notification(d["t"], int(d["c"]), int(d["i"]), where, int(d["l"]))
            if not isinstance(note.tag, (str, bytes)):
                raise control.ProtocolError("bad tag")
        except (control.ProtocolError, KeyError, TypeError, ValueError, IndexError):
            self._bad_notifications += 1
            log.warning("aiokvcache: dropped a malformed notification (%d bytes)", len(payload))
            return
        rec = self._tag_records.get(note.tag)
        if rec is None:
            rec = set()
            self._tag_records[note.tag] = rec
            while len(self._tag_records) > MAX_TAG_RECORDS:
                # Oldest first, but never what someone waits for (few: skip them).
                victim = next((t for t in self._tag_records if t not in self._tag_waiters), None)
                if victim is None or victim == note.tag:
                    break
                del self._tag_records[victim]
                self._dropped_records += 1
        rec.add(note.layer)
        for want, fut in self._tag_waiters.get(note.tag, []):
            if not fut.done() and want <= rec:
                fut.set_result(None)
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
                self._dropped_notifications += 1
            q.put_nowait(note)

    async def wait_for_layers(
        self, tag: str | bytes, layers: Iterable[int], timeout: float | None = None
    ) -> None:
        """Return once every layer in ``layers`` of pushes tagged ``tag`` has landed.

        Layers that landed before the call count. The tag's record is
        dropped when this returns. Raises :class:`LLMTimeoutError` on timeout.
        """
        self._check_ready()
        if tag is None:
            raise TypeError("tag must be str or bytes, got NoneType")
        check_tag("tag", tag)
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(f"layers must be an iterable of ints, got {type(layers).__name__}")
        want = {check_int("layers[]", x, 0, 2**31 - 1) for x in layers}
        tmo = _check_timeout(timeout)
        rec = self._tag_records.get(tag)
        if rec is None or not want <= rec:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (want, fut)
            self._tag_waiters.setdefault(tag, []).append(entry)
            try:
                async with asyncio.timeout(tmo):
                    await fut
            except TimeoutError:
                have = sorted(self._tag_records.get(tag, set()) & want)
                raise LLMTimeoutError(
                    f"wait_for_layers({tag!r}) timed out; landed: {have or 'none'}"
                ) from None
            finally:
                waiters = self._tag_waiters.get(tag, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._tag_waiters.pop(tag, None)
        if tag not in self._tag_waiters:
            self._tag_records.pop(tag, None)

    def discard_tag(self, tag: str | bytes) -> None:
        """Drop what is recorded for ``tag``."""
        check_tag("tag", tag)
        self._tag_records.pop(tag, None)

    async def notifications(self) -> AsyncIterator[Notification]:
        """Every notification that arrives from now on, as an async iterator."""
        self._check_ready()
        q: asyncio.Queue[Notification] = asyncio.Queue(MAX_QUEUED_NOTIFICATIONS)
        self._subscribers.append(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._subscribers.remove(q)

    # ------------------------------------------------------------- teardown

    def _finalizing(self) -> None:
        for rec in self._caches.values():
            rec.valid = False
        for waiters in self._tag_waiters.values():
            for _, fut in waiters:
                if not fut.done():
                    fut.set_exception(
                        make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "finalized while waiting")
                    )

    async def _finalized(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for rec in self._caches.values():
            rec.cache._invalidate()
        self._caches.clear()
        self._keys.clear()
        self._blocks_keys.clear()


def _copy_blocks_all(
    pairs: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]],
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
) -> None:
    for d, s in pairs:
        d[dst] = s[src]


def _copy_all(views: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]) -> None:
    for d, s in views:
        np.copyto(d, s)


def _as_array(name: str, obj: Any) -> npt.NDArray[Any]:
    """A NumPy view of a buffer-protocol or DLPack object, checked for use as memory."""
    try:
        arr = np.asarray(memoryview(obj))
    except TypeError:
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(
                f"{name} must be an int address or an object with the buffer protocol or "
                f"DLPack, got {type(obj).__name__}"
            ) from None
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{name}: cannot view it as host memory ({exc})",
            ) from None
    if not arr.flags.c_contiguous:
        raise param_invalid(f"{name} must be C-contiguous")
    if not arr.flags.writeable:
        raise param_invalid(f"{name} must be writable")
    return arr
