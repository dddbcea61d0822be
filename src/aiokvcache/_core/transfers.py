"""Cache memory and transfers below the public ``CacheManager``.

Public methods check their own arguments' types and ranges, then call one
method here, which resolves remote caches (through the peer service), checks
bounds against them, plans segment tables (:mod:`.planner`) and runs them
(:class:`.runner.Runner`). Local copies run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .._bridge import OP_GET, OP_PUT, settle
from .._loader import native
from . import notify, planner
from .errors import LLMStatusCode, LLMTimeoutError, make_error, param_invalid
from .runner import Runner, engine_finalized, run_jobs, time_left
from .service import PeerService
from .state import Link, LocalCache, RemoteCache, State
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    check_int,
    check_isinstance,
)

__all__ = ["Transfers"]

T = TypeVar("T")

_NO_ROWS = np.zeros((0, 4), np.uint64)
"""The segment table of a job that moves nothing."""


def _views(desc: CacheDesc, addrs: list[int]) -> list[npt.NDArray[Any]]:
    dtype = desc.data_type.to_numpy()
    return [
        np.frombuffer(native.buffer_from_address(a, desc.size), dtype=dtype).reshape(desc.shape)
        for a in addrs
    ]


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


def _block_view(addr: int, nb: int, bs: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(native.buffer_from_address(addr, nb * bs), np.uint8).reshape(nb, bs)


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


async def _in_thread(state: State, holders: Sequence[LocalCache], fn: Any, *args: Any) -> None:
    """Copy in a worker thread under a lease on ``holders``.

    A retirement of either cache (or finalize) waits for the lease, so memory
    is not released under the copy; a cancelled caller still waits for the
    copy to finish, so nothing is written after we return. A copy one of
    whose caches was deallocated meanwhile ran to its end, into memory not
    yet released, and raises KV_CACHE_NOT_EXIST, as a transfer would.
    """
    lease = state.lease(holders)
    try:
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    except BaseException:
        state.end_lease(lease)
        raise
    try:
        await settle(work)  # returns only once the copy is done
    finally:
        state.end_lease(lease)
        if work.done() and not work.cancelled():
            work.result()  # the copy's own error, if any, comes first
    if state.finalized:
        raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "finalized during the copy")
    gone = next((h for h in holders if not h.valid), None)
    if gone is not None:
        raise make_error(
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            f"cache {gone.cache_id} was deallocated during the copy",
        )


def _guards(remote: RemoteCache, n: int) -> list[tuple[int, int, int, bool] | None]:
    """The retirement guards of a call's ``n`` jobs on ``remote``.

    A call fails as a whole at its first failed job, so one guard tells it
    the cache was retired: the first job carries it. A strict guard
    (registered memory: no byte may move before the word was read) goes on
    every job.
    """
    g = remote.guard
    if g is None or g[3]:
        return [g] * n
    return [g] + [None] * (n - 1)


#: Plans kept per remote cache record (then the record's plans start over).
MAX_PLANS = 256


#: A tagless transfer of at most this many bytes whose every segment maps
#: the peer's memory (same host, direct copy) is copied on the caller's
#: thread: no job, no thread crossing, done when the call returns.
INLINE_COPY_MAX = 64 * 1024


@dataclass(eq=False)
class Plan:
    """One slot transfer's checked segment tables: (rows, destination layer)
    per layer job, the jobs' labels, and whether it copies inline (None:
    not tried yet; a plan that could not once never can: its keys do not map)."""

    local: LocalCache
    layers: tuple[tuple[Any, int], ...]
    labels: tuple[str, ...]
    nbytes: int
    inline: bool | None = None


class Transfers:
    """Local memory, lookups of remote caches, and every transfer path."""

    def __init__(self, state: State, service: PeerService, runner: Runner) -> None:
        self.state = state
        self.service = service
        self.runner = runner
        #: Background tasks on the owner's loop (transfer_cache_async), ended by finalize.
        self.tasks: set[asyncio.Task[Any]] = set()

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep ``task`` until it ends; finalize() cancels what is left."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def require_remote_access(self, what: str) -> None:
        """Pushing writes peers' memory: only with llm.EnableRemoteCacheAccessible on."""
        if not self.state.options.enable_remote_cache_accessible:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{what} needs llm.EnableRemoteCacheAccessible on",
            )

    # ------------------------------------------------------------ local

    def local(self, name: str, cache: Any) -> LocalCache:
        """The live record of ``cache``, or KV_CACHE_NOT_EXIST naming ``name``."""
        if not isinstance(cache, Cache):
            raise TypeError(f"{name} must be Cache, got {type(cache).__name__}")
        with self.state.lock:
            rec = self.state.registry.caches.get(cache.cache_id)
        if rec is None or rec.cache is not cache:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{name} (cache {cache.cache_id}) is not a live cache of this cache manager",
            )
        return rec

    def allocate(
        self,
        what: str,
        desc: CacheDesc,
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
        is_blocks: bool,
    ) -> Cache:
        """Memory from the engine that same-host peers can map, as a new cache."""
        st = self.state
        total = desc.size * desc.num_tensors
        cap = st.options.host_mem_pool_bytes
        with st.lock:
            in_use = st.registry.allocated_bytes
        if cap is not None and in_use + total > cap:
            raise make_error(
                LLMStatusCode.LLM_OUT_OF_MEMORY,
                f"{what}: {total} bytes would exceed the host memory pool "
                f"({in_use} of {cap} bytes in use)",
            )
        try:
            region, base = st.engine.mem_alloc(total)
        except native.EngineClosedError as exc:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "engine is finalized") from exc
        except native.NativeError as exc:
            raise make_error(LLMStatusCode.LLM_OUT_OF_MEMORY, f"{what} failed: {exc}") from exc
        addrs = [base + i * desc.size for i in range(desc.num_tensors)]
        try:
            with st.lock:
                cache_id = st.registry.new_cache_id()
                slot = st.ctl.guard_alloc(cache_id)
                cache = Cache(cache_id, desc, addrs, is_blocks, arrays=_views(desc, addrs))
                rec = LocalCache(
                    cache, desc, addrs, [(region, base, total)], [0] * desc.num_tensors, True, True
                )
                rec.guard_slot = slot
                st.registry.add(rec, keys, blocks_key)
        except BaseException:
            with contextlib.suppress(native.NativeError):
                st.engine.mem_release(region)  # nobody saw it yet
            raise
        return cache

    def register(
        self,
        desc: CacheDesc,
        addrs: Sequence[Any],
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
        is_blocks: bool,
        remote_accessible: bool | None,
    ) -> Cache:
        """User memory (addresses or buffer objects, one per tensor) as a new cache."""
        if not isinstance(addrs, (list, tuple)):
            raise TypeError(f"addrs must be a list, got {type(addrs).__name__}")
        if len(addrs) != desc.num_tensors:
            raise param_invalid(
                f"addrs has {len(addrs)} entries but cache_desc.num_tensors is {desc.num_tensors}"
            )
        owners: list[Any] = []
        addr_list: list[int] = []
        # Per tensor: the object whose buffer the engine registers with an
        # export held (so it cannot be resized or freed while registered),
        # or None for a plain address.
        exports: list[Any] = []
        for i, a in enumerate(addrs):
            if isinstance(a, numbers.Integral) and not isinstance(a, bool):
                v = check_int(f"addrs[{i}]", a, 0, 2**64 - 1)
                if v == 0:
                    raise param_invalid(f"addrs[{i}] is 0")
                addr_list.append(v)
                exports.append(None)
            else:
                arr = _as_array(f"addrs[{i}]", a)
                if arr.nbytes != desc.size:
                    raise param_invalid(
                        f"addrs[{i}] has {arr.nbytes} bytes, cache_desc.size is {desc.size}"
                    )
                owners.append(a)
                addr_list.append(int(arr.ctypes.data))
                exports.append(arr)
        engine = self.state.engine
        regions: list[tuple[int, int, int]] = []
        try:
            for a, arr in zip(addr_list, exports, strict=True):
                if arr is None:
                    regions.append((engine.mem_register(a, desc.size), a, desc.size))
                else:
                    # The engine keeps a memoryview of it until the region is
                    # released: the export outlives every use of the memory.
                    rid, _, _ = engine.mem_register_buffer(arr)
                    regions.append((rid, a, desc.size))
        except BaseException as exc:
            for rid, _, _ in regions:
                with contextlib.suppress(native.NativeError):
                    engine.mem_release(rid)
            if isinstance(exc, native.EngineClosedError):
                raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "engine is finalized") from exc
            if isinstance(exc, native.NativeError):
                raise make_error(LLMStatusCode.LLM_FAILED, f"register_cache failed: {exc}") from exc
            raise
        arrays = _views(desc, addr_list)
        st = self.state
        try:
            with st.lock:
                cache_id = st.registry.new_cache_id()
                slot = st.ctl.guard_alloc(cache_id)
                cache = Cache(cache_id, desc, addr_list, is_blocks, arrays=arrays, owner=owners)
                rec = LocalCache(
                    cache,
                    desc,
                    addr_list,
                    regions,
                    list(range(desc.num_tensors)),
                    remote_accessible is not False,
                    False,
                )
                rec.guard_slot = slot
                st.registry.add(rec, keys, blocks_key)
        except BaseException:
            for rid, _, _ in regions:
                with contextlib.suppress(native.NativeError):
                    engine.mem_release(rid)
            raise
        return cache

    def check_keys(self, cache_keys: Any, batch_size: int) -> list[CacheKey]:
        """``cache_keys`` as a list; duplicates and keys bound elsewhere refused."""
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
        with self.state.lock:
            bound = self.state.registry.keys
            for i, k in enumerate(keys):
                if k.is_placeholder:
                    continue
                if k in seen:
                    raise param_invalid(f"cache_keys[{i}] = {k!r} appears twice")
                if k in bound:
                    raise param_invalid(f"cache_keys[{i}] = {k!r} is already bound to a cache")
                seen.add(k)
        return keys

    def check_blocks_key(self, key: Any) -> BlocksCacheKey | None:
        """A BlocksCacheKey not bound yet, or None."""
        if key is None:
            return None
        check_isinstance("blocks_cache_key", key, BlocksCacheKey)
        with self.state.lock:
            if key in self.state.registry.blocks_keys:
                raise param_invalid(f"blocks_cache_key = {key!r} is already bound to a cache")
        result: BlocksCacheKey = key
        return result

    def remove_key(self, cache_key: CacheKey) -> None:
        """Unbind a CacheKey from its cache (no-op when it is not bound)."""
        with self.state.lock:
            bound = self.state.registry.keys.pop(cache_key, None)
            if bound is not None:
                rec = self.state.registry.caches.get(bound[0])
                if rec is not None:
                    rec.keys.pop(cache_key, None)

    def retire(self, rec: LocalCache) -> None:
        """Deallocate / unregister: see :meth:`.service.PeerService.retire_local`."""
        self.service.retire_local(rec)

    # ------------------------------------------------------------ lookups

    async def _ask(self, coro: Coroutine[Any, Any, T], tmo: float | None, timed_out: str) -> T:
        """``coro`` on the service loop, within the call's ``tmo``; LLMTimeoutError after."""
        try:
            async with asyncio.timeout(tmo):
                return await self.service.call(coro)
        except TimeoutError:
            raise LLMTimeoutError(timed_out) from None

    async def remote_by_id(
        self, link: Link, cache_id: int, tmo: float | None, what: str, role: str = "destination"
    ) -> RemoteCache:
        """The peer's cache ``cache_id``: the link's record, else fetched once."""
        with self.state.lock:
            rc = link.remote.get(cache_id)
        if rc is not None:
            return rc
        fetched: RemoteCache = await self._ask(
            self.service.remote_by_id(link, cache_id),
            tmo,
            f"{what} timed out looking up the {role} cache",
        )
        return fetched

    async def remote_slot(
        self,
        link: Link,
        key: CacheKey | CacheKeyByIdAndIndex,
        tmo: float | None,
        what: str,
        role: str = "source",
    ) -> tuple[RemoteCache, int]:
        """The remote cache and batch index a CacheKey / CacheKeyByIdAndIndex names."""
        if isinstance(key, CacheKey):
            found: tuple[RemoteCache, int] = await self._ask(
                self.service.remote_by_key(link, key),
                tmo,
                f"{what} timed out looking up the {role} cache",
            )
            return found
        rc = await self.remote_by_id(link, key.cache_id, tmo, what, role)
        return rc, key.batch_index

    async def remote_blocks(
        self, link: Link, key: BlocksCacheKey, tmo: float | None, what: str
    ) -> RemoteCache:
        """The remote blocks cache bound to ``key`` (asked every time: keys rebind)."""
        found: RemoteCache = await self._ask(
            self.service.remote_blocks(link, key), tmo, f"{what} timed out looking up {key!r}"
        )
        return found

    # ------------------------------------------------------------ slots

    async def slot(
        self,
        op: int,
        link: Link,
        local: LocalCache,
        local_batch: int,
        remote: RemoteCache,
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
        layer ranges keep their source/destination meaning. The segment
        tables come from a plan built (and checked) once per shape.
        """
        plan = self._slot_plan(
            op, local, local_batch, remote, remote_batch, remote_batch_name, n,
            src_range, dst_range, size,
        )  # fmt: skip
        per_job_ms = self.state.options.sync_kv_timeout_ms
        ep = link.ep
        if tag is None and plan.inline is not False and self._copy_inline(op, link, plan, remote):
            return
        guards = _guards(remote, len(plan.layers))
        if tag is None:
            jobs = [
                (op, ep, rows, b"", per_job_ms, g)
                for (rows, _), g in zip(plan.layers, guards, strict=True)
            ]
        else:
            rid = remote.cache_id
            jobs = [
                (op, ep, rows, notify.payload(tag, rid, remote_batch, dst), per_job_ms, g)
                for (rows, dst), g in zip(plan.layers, guards, strict=True)
            ]
        await self.runner.run(jobs, plan.labels, timeout, local, remote, checked=True)

    def _copy_inline(self, op: int, link: Link, plan: Plan, remote: RemoteCache) -> bool:
        """Copy a small same-host transfer now, inside the lease's critical
        section (so no retirement can free either side meanwhile); False: use
        jobs."""
        if plan.nbytes > INLINE_COPY_MAX:
            plan.inline = False
            return False
        st = self.state
        outcome: int = native.INLINE_NO

        def copy() -> list[int]:
            nonlocal outcome
            if link.broken:
                return []  # the job path reports it
            outcome = int(
                st.engine.copy_inline(
                    op, link.ep, [rows for rows, _ in plan.layers], INLINE_COPY_MAX, remote.guard
                )
            )
            return []

        try:
            st.lease((plan.local, remote), copy)
        except native.EngineClosedError as exc:
            raise engine_finalized() from exc
        except native.NativeError as exc:  # the peer's memory vanished under the copy
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"link to cluster {link.cluster_id} failed during a copy: {exc}",
            ) from None
        if outcome == native.INLINE_RETIRED:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"the remote cache {remote.cache_id} was deallocated",
            )
        done = outcome == native.INLINE_COPIED
        if plan.inline is None:
            plan.inline = done
        return done

    def _slot_plan(
        self,
        op: int,
        local: LocalCache,
        local_batch: int,
        remote: RemoteCache,
        remote_batch: int,
        remote_batch_name: str,
        n: int,
        src_range: range | None,
        dst_range: range | None,
        size: int,
    ) -> Plan:
        """The checked segment tables of one slot transfer, cached on ``remote``.

        A plan depends only on the two caches (whose addresses and keys never
        change), the batch indices, the layer ranges and the size; it goes
        with the remote record (dropped on invalidation or unlink) and is
        only built, never changed, so a hit skips every check it made.
        """
        key = (
            op, local.cache_id, local_batch, remote_batch, n, size,
            None if src_range is None else (src_range.start, src_range.stop),
            None if dst_range is None else (dst_range.start, dst_range.stop),
        )  # fmt: skip
        plan: Plan | None = remote.plans.get(key)
        if plan is not None and plan.local is local:
            return plan
        if remote_batch >= remote.desc.batch_size:
            raise param_invalid(
                f"{remote_batch_name}={remote_batch} is out of range for the remote batch size "
                f"{remote.desc.batch_size}"
            )
        push = op == OP_PUT
        if push:
            pairs = planner.layer_pairs(
                n, local.desc, remote.desc, src_range, dst_range, "src_cache", "the remote cache"
            )
            l_off, r_off, length = planner.pair_spans(
                local.desc, local_batch, remote.desc, remote_batch, size
            )
        else:
            pairs = planner.layer_pairs(
                n, remote.desc, local.desc, src_range, dst_range, "the remote cache", "cache"
            )
            r_off, l_off, length = planner.pair_spans(
                remote.desc, remote_batch, local.desc, local_batch, size
            )
        layers = []
        for src_layer, dst_layer in pairs:
            local_layer, remote_layer = (src_layer, dst_layer) if push else (dst_layer, src_layer)
            rows = planner.slot_layer_rows(
                local.addrs,
                remote.addrs,
                remote.tensor_rkey,
                range(local_layer * n, (local_layer + 1) * n),
                range(remote_layer * n, (remote_layer + 1) * n),
                l_off,
                r_off,
                length,
            )
            rows.setflags(write=False)  # shared by every call of this shape
            layers.append((rows, dst_layer))
        plan = Plan(
            local,
            tuple(layers),
            tuple(f"layer {d}" for _, d in pairs),
            sum(int(rows[:, 2].sum()) for rows, _ in layers),
        )
        if len(remote.plans) >= MAX_PLANS:
            remote.plans.clear()  # a bound, not an LRU: shapes per peer cache are few
        remote.plans[key] = plan
        return plan

    async def push_slot(
        self,
        key: CacheKey | CacheKeyByIdAndIndex,
        src: LocalCache,
        sb: int,
        n: int,
        src_r: range | None,
        dst_r: range | None,
        tag: str | bytes | None,
        tmo: float | None,
    ) -> None:
        """``push_cache`` after its argument checks; a CacheKey names a slot
        the peer bound (looked up as ``pull_slot`` does, every time)."""
        link = self.state.link_for(key.cluster_id)
        start = asyncio.get_running_loop().time()
        remote, db = await self.remote_slot(link, key, tmo, "push_cache", "destination")
        await self.slot(
            OP_PUT,
            link,
            src,
            sb,
            remote,
            db,
            "dst_cache_key.batch_index"
            if isinstance(key, CacheKeyByIdAndIndex)
            else "the batch index dst_cache_key is bound to",
            n,
            src_r,
            dst_r,
            -1,
            tag,
            time_left(tmo, start),
        )

    async def pull_slot(
        self,
        key: CacheKey | CacheKeyByIdAndIndex,
        dst: LocalCache,
        db: int,
        n: int,
        src_r: range | None,
        dst_r: range | None,
        size: int,
        tmo: float | None,
    ) -> None:
        """``pull_cache`` after its argument checks."""
        link = self.state.link_for(key.cluster_id)
        start = asyncio.get_running_loop().time()
        remote, sb = await self.remote_slot(link, key, tmo, "pull_cache")
        await self.slot(
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
            size,
            None,
            time_left(tmo, start),
        )

    # ------------------------------------------------------------ blocks

    async def push_blocks(
        self,
        key: BlocksCacheKey,
        src: LocalCache,
        src_ids: npt.NDArray[np.int64],
        dst_ids: npt.NDArray[np.int64],
        n: int,
        src_r: range | None,
        dst_r: range | None,
        tag: str | bytes | None,
        tmo: float | None,
    ) -> None:
        """``push_blocks`` after its argument checks."""
        link = self.state.link_for(key.cluster_id)
        start = asyncio.get_running_loop().time()
        remote = await self.remote_blocks(link, key, tmo, "push_blocks")
        tmo = time_left(tmo, start)
        nb = planner.num_blocks(remote.desc)
        planner.check_in_range("dst_blocks", dst_ids, nb, "the remote cache")
        planner.check_unique("dst_blocks", dst_ids, nb)
        pairs = planner.layer_pairs(
            n, src.desc, remote.desc, src_r, dst_r, "src_cache", "the remote cache"
        )
        size = planner.check_block_sizes(src.desc, remote.desc, "src_cache", "the remote cache")
        plan = planner.blocks_plan(src_ids, dst_ids, size)
        block_list = notify.block_list(tag, dst_ids)
        per_job_ms = self.state.options.sync_kv_timeout_ms
        jobs = []
        guards = _guards(remote, len(pairs))
        for (sl, dl), g in zip(pairs, guards, strict=True):
            rows = planner.layer_rows(
                plan,
                src.addrs[sl * n : (sl + 1) * n],
                remote.addrs[dl * n : (dl + 1) * n],
                remote.tensor_rkey[dl * n : (dl + 1) * n],
            )
            payload = notify.payload(tag, remote.cache_id, None, dl, block_list)
            jobs.append((OP_PUT, link.ep, rows, payload, per_job_ms, g))
        await self.runner.run(jobs, [f"layer {dl}" for _, dl in pairs], tmo, src, remote)

    async def notify(self, cluster_id: int, tag: str | bytes, tmo: float | None) -> None:
        """``notify`` after its argument checks: one job that moves nothing
        and carries the notification (layer -1, cache id -1)."""
        link = self.state.link_for(cluster_id)
        payload = notify.payload(tag, -1, None, -1)
        job = (OP_PUT, link.ep, _NO_ROWS, payload, self.state.options.sync_kv_timeout_ms)
        await run_jobs(self.runner.bridge, [job], timeout=tmo, labels=["notification"])

    async def pull_blocks(
        self,
        key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst: LocalCache,
        src_ids: npt.NDArray[np.int64],
        dst_ids: npt.NDArray[np.int64],
        n: int,
        src_r: range | None,
        dst_r: range | None,
        tmo: float | None,
    ) -> None:
        """``pull_blocks`` after its argument checks."""
        link = self.state.link_for(key.cluster_id)
        start = asyncio.get_running_loop().time()
        by_blocks = isinstance(key, BlocksCacheKey)
        if isinstance(key, BlocksCacheKey):
            remote = await self.remote_blocks(link, key, tmo, "pull_blocks")
            sb = 0
        else:
            remote, sb = await self.remote_slot(link, key, tmo, "pull_blocks")
        tmo = time_left(tmo, start)
        pairs = planner.layer_pairs(
            n, remote.desc, dst.desc, src_r, dst_r, "the remote cache", "dst_cache"
        )
        block = planner.block_bytes(dst.desc)
        if by_blocks:
            planner.check_in_range(
                "src_blocks", src_ids, planner.num_blocks(remote.desc), "the remote cache"
            )
            planner.check_block_sizes(remote.desc, dst.desc, "the remote cache", "dst_cache")
            plan = planner.blocks_plan(dst_ids, src_ids, block)
        else:
            if sb >= remote.desc.batch_size:
                raise param_invalid(
                    f"src_cache_key.batch_index={sb} is out of range for the remote batch size "
                    f"{remote.desc.batch_size}"
                )
            off, length = planner.slot_span(remote.desc, sb, "the remote cache")
            planner.check_block_count("dst_blocks", dst_ids, length, block)
            plan = planner.slot_blocks_plan(off, length, dst_ids, block, blocks_local=True)
        per_job_ms = self.state.options.sync_kv_timeout_ms
        jobs = []
        guards = _guards(remote, len(pairs))
        for (sl, dl), g in zip(pairs, guards, strict=True):
            rows = planner.layer_rows(
                plan,
                dst.addrs[dl * n : (dl + 1) * n],
                remote.addrs[sl * n : (sl + 1) * n],
                remote.tensor_rkey[sl * n : (sl + 1) * n],
            )
            jobs.append((OP_GET, link.ep, rows, b"", per_job_ms, g))
        await self.runner.run(jobs, [f"layer {dl}" for _, dl in pairs], tmo, dst, remote)

    # ------------------------------------------------------------ local copies

    async def copy_slot(
        self, d: LocalCache, s: LocalCache, db: int, sb: int, off: int, size: int
    ) -> None:
        """``copy_cache`` after its argument checks."""
        s_off, s_len = planner.slot_spans(s.desc, sb)
        d_off, d_len = planner.slot_spans(d.desc, db)
        if len(s_off) != 1 or len(d_off) != 1:
            raise param_invalid("copy_cache needs batch_dim_index 0 on both caches")
        if size != -1 and size <= 0:
            raise param_invalid(f"size must be -1 or > 0, got {size}")
        length = s_len - off if size == -1 else size
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
        await _in_thread(self.state, (d, s), _copy_all, views)

    async def copy_blocks(
        self, rec: LocalCache, s_ids: npt.NDArray[np.int64], d_ids: npt.NDArray[np.int64]
    ) -> None:
        """``copy_blocks`` after its checks: blocks inside one cache, every tensor."""
        nb = planner.num_blocks(rec.desc)
        bs = planner.block_bytes(rec.desc)
        views = [_block_view(a, nb, bs) for a in rec.addrs]
        pairs = [(v, v) for v in views]
        await _in_thread(self.state, (rec,), _copy_blocks_all, pairs, s_ids, d_ids)

    async def swap_blocks(
        self,
        s: LocalCache,
        d: LocalCache,
        s_ids: npt.NDArray[np.int64],
        d_ids: npt.NDArray[np.int64],
        bs: int,
    ) -> None:
        """``swap_blocks`` after its checks: blocks of one cache into another."""
        s_nb, d_nb = planner.num_blocks(s.desc), planner.num_blocks(d.desc)
        pairs = [
            (_block_view(da, d_nb, bs), _block_view(sa, s_nb, bs))
            for da, sa in zip(d.addrs, s.addrs, strict=True)
        ]
        await _in_thread(self.state, (s, d), _copy_blocks_all, pairs, s_ids, d_ids)
