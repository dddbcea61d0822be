"""Transfers between this instance's caches and peers' caches.

Public methods check their own arguments' types and ranges, then call one
method here, which checks them against the local cache, resolves remote
caches (:class:`.lookups.Lookups`, on the peer-service thread), checks
bounds against them, plans segment tables (:mod:`.planner`, :mod:`.slots`)
and runs them (:class:`.runner.Runner`).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ... import _telemetry
from ..._bridge import OP_GET, OP_PUT
from ..._loopside import LoopSide, ServiceGone, TaskHandle
from ..memory.state import Link, LocalCache, RemoteCache, State
from ..model.errors import LLMException, LLMStatusCode, LLMTimeoutError, make_error, param_invalid
from ..model.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, check_cache_key
from ..peers.lookups import Lookups
from ..peers.servicethread import ServiceThread
from . import notify, planner
from .runner import Runner, engine_finalized, run_jobs, time_left
from .slots import SlotTransfer, copy_inline, slot_plan

__all__ = ["BlocksCall", "Transfers"]

T = TypeVar("T")

_NO_ROWS = np.zeros((0, 4), np.uint64)
"""The segment table of a job that moves nothing."""


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


def _check_pull_blocks(
    key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
    dst: LocalCache,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
) -> None:
    """``pull_blocks``' block lists checked against ``dst`` and the kind of key."""
    if not dst.cache.is_blocks_cache:
        raise param_invalid("dst_cache is not a blocks cache: use pull_cache")
    if dst_ids.size == 0:
        raise param_invalid("dst_blocks can not be empty")
    nb = planner.num_blocks(dst.desc)
    planner.check_in_range("dst_blocks", dst_ids, nb, "dst_cache")
    planner.check_unique("dst_blocks", dst_ids, nb)
    if isinstance(key, BlocksCacheKey):
        if src_ids.size != dst_ids.size:
            raise param_invalid(
                f"src_blocks has {src_ids.size} blocks but dst_blocks has {dst_ids.size}"
            )
    else:
        if isinstance(key, CacheKey):
            check_cache_key("src_cache_key", key)
        if src_ids.size:
            raise param_invalid(
                "src_blocks must be empty when src_cache_key is not a BlocksCacheKey"
            )


def _pull_blocks_plan(
    remote: RemoteCache,
    sb: int | None,
    dst: LocalCache,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
) -> planner.SpanPlan:
    """What ``pull_blocks`` moves: remote blocks ``src_ids`` (``sb`` None), or
    remote batch slot ``sb`` split over ``dst_ids``, checked against ``remote``."""
    block = planner.block_bytes(dst.desc)
    if sb is None:
        planner.check_in_range(
            "src_blocks", src_ids, planner.num_blocks(remote.desc), "the remote cache"
        )
        planner.check_block_sizes(remote.desc, dst.desc, "the remote cache", "dst_cache")
        return planner.blocks_plan(dst_ids, src_ids, block)
    if sb >= remote.desc.batch_size:
        raise param_invalid(
            f"src_cache_key.batch_index={sb} is out of range for the remote batch size "
            f"{remote.desc.batch_size}"
        )
    off, length = planner.slot_span(remote.desc, sb, "the remote cache")
    planner.check_block_count("dst_blocks", dst_ids, length, block)
    return planner.slot_blocks_plan(off, length, dst_ids, block, blocks_local=True)


@dataclass(slots=True)
class BlocksCall:
    """What one ``push_blocks`` / ``pull_blocks`` moves, its types checked:
    local and remote block ids (``src_ids`` are the sender's), tensors per
    layer, layer ranges, the notification tag (push only)."""

    src_ids: npt.NDArray[np.int64]
    dst_ids: npt.NDArray[np.int64]
    n: int
    src_r: range | None
    dst_r: range | None
    tag: str | bytes | None = None

    def plan_key(self) -> tuple[Any, ...]:
        """What identifies the call's checks and tables (with its two caches)."""
        return (
            self.n, self.src_r, self.dst_r, self.tag,
            self.src_ids.tobytes(), self.dst_ids.tobytes(),
        )  # fmt: skip


#: Most push_blocks job sets kept (see Transfers._push_blocks_into).
_BLOCKS_PLANS = 256


@dataclass(slots=True, eq=False)
class _BlocksJobs:
    """One push_blocks' checked jobs: (segment table, notification) per layer."""

    src: LocalCache
    remote: RemoteCache
    parts: list[tuple[npt.NDArray[np.uint64], bytes]]
    labels: list[str]

    @classmethod
    def make(cls, src: LocalCache, remote: RemoteCache, c: BlocksCall) -> _BlocksJobs:
        """The block lists checked against both caches, the tables planned."""
        src_ids, dst_ids, n, tag = c.src_ids, c.dst_ids, c.n, c.tag
        planner.check_in_range("src_blocks", src_ids, planner.num_blocks(src.desc), "src_cache")
        nb = planner.num_blocks(remote.desc)
        planner.check_in_range("dst_blocks", dst_ids, nb, "the remote cache")
        planner.check_unique("dst_blocks", dst_ids, nb)
        pairs = planner.layer_pairs(
            n, src.desc, remote.desc, c.src_r, c.dst_r, "src_cache", "the remote cache"
        )
        size = planner.check_block_sizes(src.desc, remote.desc, "src_cache", "the remote cache")
        plan = planner.blocks_plan(src_ids, dst_ids, size)
        block_list = notify.block_list(tag, dst_ids)
        parts = []
        for sl, dl in pairs:
            rows = planner.layer_rows(
                plan,
                src.addrs[sl * n : (sl + 1) * n],
                remote.addrs[dl * n : (dl + 1) * n],
                remote.tensor_rkey[dl * n : (dl + 1) * n],
            )
            parts.append((rows, notify.payload(tag, remote.cache_id, None, dl, block_list)))
        return cls(src, remote, parts, [f"layer {dl}" for _, dl in pairs])


class Transfers:
    """Lookups of remote caches and every transfer path to and from peers."""

    def __init__(
        self, state: State, thread: ServiceThread, lookups: Lookups, runner: Runner
    ) -> None:
        self.state = state
        #: The peer-service thread, and our lookups of peers' caches that run on it.
        self.thread = thread
        self.lookups = lookups
        self.runner = runner
        #: The owner's loop (asyncio or trio).
        self.side: LoopSide = runner.bridge.side
        #: Background tasks on the owner's loop (transfer_cache_async), ended by finalize.
        self.tasks: set[TaskHandle] = set()
        #: push_blocks' checked job sets, most recent last.
        self._blocks_plans: collections.OrderedDict[tuple[Any, ...], _BlocksJobs] = (
            collections.OrderedDict()
        )

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> TaskHandle:
        """Run ``fn()`` in the background on the owner's loop until it ends;
        finalize() cancels what is left."""
        # Ended tasks are dropped here: a handle has no done-callback on
        # every loop, and the set stays as small as what is in flight.
        self.tasks = {t for t in self.tasks if not t.done()}
        handle = self.side.spawn(fn, name)
        self.tasks.add(handle)
        return handle

    async def end_tasks(self) -> None:
        """Cancel the background tasks left (finalize) and wait until they end."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            await task.wait_done(None)

    async def on_service(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the peer-service thread, awaited on the owner's loop."""
        cf: concurrent.futures.Future[T] = self.thread.call(coro)
        try:
            return await self.side.from_service(cf)
        except ServiceGone:
            raise engine_finalized() from None

    def require_remote_access(self, what: str) -> None:
        """Pushing writes peers' memory: only with llm.EnableRemoteCacheAccessible on."""
        if not self.state.options.enable_remote_cache_accessible:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{what} needs llm.EnableRemoteCacheAccessible on",
            )

    # ------------------------------------------------------------ lookups

    async def _ask(self, coro: Coroutine[Any, Any, T], tmo: float | None, timed_out: str) -> T:
        """``coro`` on the service loop, within the call's ``tmo``; LLMTimeoutError after."""
        try:
            async with self.side.deadline(tmo):
                return await self.on_service(coro)
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
            self.lookups.remote_by_id(link, cache_id),
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
                self.lookups.remote_by_key(link, key),
                tmo,
                f"{what} timed out looking up the {role} cache",
            )
            return found
        rc = await self.remote_by_id(link, key.cache_id, tmo, what, role)
        return rc, key.batch_index

    async def remote_blocks(
        self, link: Link, key: BlocksCacheKey, tmo: float | None, what: str
    ) -> RemoteCache:
        """The remote blocks cache bound to ``key``, asked (and recorded on the link)."""
        found: RemoteCache = await self._ask(
            self.lookups.remote_blocks(link, key), tmo, f"{what} timed out looking up {key!r}"
        )
        with self.state.lock:
            link.blocks_keys[key.model_id] = found
        return found

    def _recorded_blocks(self, link: Link, key: BlocksCacheKey) -> RemoteCache | None:
        """The blocks cache ``key`` was last found bound to, while its record is valid."""
        with self.state.lock:
            rc = link.blocks_keys.get(key.model_id)
            if rc is not None and rc.valid and link.remote.get(rc.cache_id) is rc:
                return rc
            link.blocks_keys.pop(key.model_id, None)
        return None

    async def by_blocks_key(
        self,
        link: Link,
        key: BlocksCacheKey,
        tmo: float | None,
        what: str,
        run: Callable[[RemoteCache, float | None], Coroutine[Any, Any, None]],
    ) -> None:
        """``run(remote, time left)`` on the remote blocks cache bound to ``key``.

        The peer is not asked on every call: a BlocksCacheKey leaves its
        cache only when the cache retires, so the link's record of it, while
        valid, is the binding. If the recorded cache turns out retired under
        the call (``KV_CACHE_NOT_EXIST``: the owner deallocated it, maybe
        bound the key to a new cache, and its invalidation had not reached
        us), the peer is asked and the call runs again, once: what it moved
        went into retired memory no one reads.
        """
        start = self.side.time()
        remote = self._recorded_blocks(link, key)
        if remote is not None:
            try:
                await run(remote, time_left(tmo, start, self.side.time))
                return
            except LLMException as exc:
                if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                    raise
                with self.state.lock:
                    if link.blocks_keys.get(key.model_id) is remote:
                        del link.blocks_keys[key.model_id]
                if _telemetry.active:
                    _telemetry.restart()
        remote = await self.remote_blocks(link, key, time_left(tmo, start, self.side.time), what)
        await run(remote, time_left(tmo, start, self.side.time))

    # ------------------------------------------------------------ slots

    async def slot(
        self, t: SlotTransfer, link: Link, tag: str | bytes | None, timeout: float | None
    ) -> None:
        """Move the batch slot ``t`` names over ``link``, a job per layer.

        The segment tables come from a plan built (and checked) once per
        shape; with ``tag`` every layer notifies the peer.
        """
        plan = slot_plan(t)
        remote = t.remote
        if tag is None and plan.inline is not False:
            if copy_inline(self.state, t.op, link, plan, remote):
                return
        per_job_ms = self.state.options.sync_kv_timeout_ms
        ep = link.ep
        guards = _guards(remote, len(plan.layers))
        if tag is None:
            jobs = [
                (t.op, ep, rows, b"", per_job_ms, g)
                for (rows, _), g in zip(plan.layers, guards, strict=True)
            ]
        else:
            rid, rb = remote.cache_id, t.remote_batch
            jobs = [
                (t.op, ep, rows, notify.payload(tag, rid, rb, dst), per_job_ms, g)
                for (rows, dst), g in zip(plan.layers, guards, strict=True)
            ]
        await self.runner.run(jobs, plan.labels, timeout, t.local, remote, checked=True)

    async def push_slot(
        self,
        key: CacheKey | CacheKeyByIdAndIndex,
        src: LocalCache,
        sb: int,
        n: int,
        src_r: range | None,
        dst_r: range | None,
        size: int,
        tag: str | bytes | None,
        tmo: float | None,
    ) -> None:
        """``push_cache`` after its argument checks: the source slot checked,
        then the destination looked up (a CacheKey names a slot the peer
        bound, looked up as ``pull_slot`` does, every time) and pushed."""
        if size != -1:
            raise param_invalid(f"size must be -1 for push_cache, got {size}")
        if src.cache.is_blocks_cache:
            raise param_invalid("src_cache is a blocks cache: use push_blocks")
        if sb >= src.desc.batch_size:
            raise param_invalid(
                f"src_batch_index={sb} is out of range for a batch size of {src.desc.batch_size}"
            )
        self.require_remote_access("push_cache")
        link = self.state.link_for(key.cluster_id)
        start = self.side.time()
        remote, db = await self.remote_slot(link, key, tmo, "push_cache", "destination")
        name = (
            "dst_cache_key.batch_index"
            if isinstance(key, CacheKeyByIdAndIndex)
            else "the batch index dst_cache_key is bound to"
        )
        t = SlotTransfer(OP_PUT, src, sb, remote, db, name, n, src_r, dst_r)
        await self.slot(t, link, tag, time_left(tmo, start, self.side.time))

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
        """``pull_cache`` after its argument checks: the destination slot
        checked, then the source looked up and pulled."""
        if dst.cache.is_blocks_cache:
            raise param_invalid("cache is a blocks cache: use pull_blocks")
        if db >= dst.desc.batch_size:
            raise param_invalid(
                f"batch_index={db} is out of range for a batch size of {dst.desc.batch_size}"
            )
        if size != -1 and size <= 0:
            raise param_invalid(f"size must be -1 or > 0, got {size}")
        link = self.state.link_for(key.cluster_id)
        start = self.side.time()
        remote, sb = await self.remote_slot(link, key, tmo, "pull_cache")
        t = SlotTransfer(
            OP_GET, dst, db, remote, sb, "cache_key.batch_index", n, src_r, dst_r, size
        )
        await self.slot(t, link, None, time_left(tmo, start, self.side.time))

    # ------------------------------------------------------------ blocks

    async def push_blocks(
        self, key: BlocksCacheKey, src: LocalCache, c: BlocksCall, tmo: float | None
    ) -> None:
        """``push_blocks`` after its argument checks: the block lists checked
        against both caches (the source's with the remote's, once the remote
        is known), then pushed."""
        if not src.cache.is_blocks_cache:
            raise param_invalid("src_cache is not a blocks cache: use push_cache")
        if c.dst_ids.size == 0:
            raise param_invalid("dst_blocks can not be empty")
        if c.src_ids.size != c.dst_ids.size:
            raise param_invalid(
                f"src_blocks has {c.src_ids.size} blocks but dst_blocks has {c.dst_ids.size}"
            )
        self.require_remote_access("push_blocks")
        link = self.state.link_for(key.cluster_id)

        async def run(remote: RemoteCache, left: float | None) -> None:
            await self._push_blocks_into(remote, link, src, c, left)

        await self.by_blocks_key(link, key, tmo, "push_blocks", run)

    async def _push_blocks_into(
        self, remote: RemoteCache, link: Link, src: LocalCache, c: BlocksCall, tmo: float | None
    ) -> None:
        """``push_blocks`` into ``remote``: the block lists checked against it, then run.

        The checks and the segment tables are made once per (caches, block
        lists, layers, tag) and kept (:class:`_BlocksJobs`, a small LRU): the
        32 layer calls of one request share their block lists, and only the
        first pays for them.
        """
        ck = (id(src), id(remote), *c.plan_key())
        plans = self._blocks_plans
        made = plans.get(ck)
        if made is None or not (made.src.valid and made.remote.valid):
            made = _BlocksJobs.make(src, remote, c)
            plans[ck] = made
            if len(plans) > _BLOCKS_PLANS:
                plans.popitem(last=False)
        else:
            plans.move_to_end(ck)
        per_job_ms = self.state.options.sync_kv_timeout_ms
        guards = _guards(remote, len(made.parts))
        jobs = [
            (OP_PUT, link.ep, rows, payload, per_job_ms, g)
            for (rows, payload), g in zip(made.parts, guards, strict=True)
        ]
        await self.runner.run(jobs, made.labels, tmo, src, remote, checked=True)

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
        c: BlocksCall,
        tmo: float | None,
    ) -> None:
        """``pull_blocks`` after its argument checks: the block lists checked
        against the destination cache, then against the remote one it looks up."""
        _check_pull_blocks(key, dst, c.src_ids, c.dst_ids)
        link = self.state.link_for(key.cluster_id)
        if isinstance(key, BlocksCacheKey):

            async def run(remote: RemoteCache, left: float | None) -> None:
                await self._pull_blocks_from(remote, None, link, dst, c, left)

            await self.by_blocks_key(link, key, tmo, "pull_blocks", run)
            return
        start = self.side.time()
        remote, sb = await self.remote_slot(link, key, tmo, "pull_blocks")
        await self._pull_blocks_from(
            remote, sb, link, dst, c, time_left(tmo, start, self.side.time)
        )

    async def _pull_blocks_from(
        self,
        remote: RemoteCache,
        sb: int | None,
        link: Link,
        dst: LocalCache,
        c: BlocksCall,
        tmo: float | None,
    ) -> None:
        """``pull_blocks`` from ``remote`` (blocks, or batch slot ``sb``): checked, then run."""
        n = c.n
        pairs = planner.layer_pairs(
            n, remote.desc, dst.desc, c.src_r, c.dst_r, "the remote cache", "dst_cache"
        )
        plan = _pull_blocks_plan(remote, sb, dst, c.src_ids, c.dst_ids)
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
