"""Our lookups of a peer's caches: ask for their metadata, install what it sends.

A cache named by id is fetched once per link (concurrent asks share one
request); caches named by key are asked every time, since the peer may
rebind its keys. Before any of a peer's metadata is installed, the link
holds our key to the peer's control region, so every remote cache record
has its retirement guard. Everything here runs on the service loop.

Once a link we made to a same-host peer is up, its caches are asked for
and installed in the background (:meth:`Lookups.prefetch_soon`): a
same-host cache is mapped into this process, and making those page-table
entries costs about as much as copying the cache once (4 KiB pages), so
the first transfer would pay it. A lookup by id takes its cache off that
queue, or waits for its install if one is under way (never for the others).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ..._loader import native
from ..memory.catalog import install_remote
from ..memory.state import Link, RemoteCache, State
from ..model.errors import LLMException, LLMStatusCode, make_error
from ..model.types import BlocksCacheKey, CacheKey
from ..wire.messages import (
    MAX_ADDRS_PER_REQUEST,
    MAX_CACHES_PER_ANSWER,
    BadReply,
    BlocksByKey,
    CacheByAddr,
    CacheById,
    CacheByKey,
    Caches,
    Message,
    ProbeInfo,
    Request,
    ask,
)
from .probe import Prober
from .servicethread import ServiceThread

__all__ = ["METADATA_TIMEOUT_S", "Lookups"]

#: How long a peer may take to answer one metadata request.
METADATA_TIMEOUT_S = 10.0

log = logging.getLogger("aiokvcache")

R = TypeVar("R", bound=Message)
T = TypeVar("T")


class Lookups:
    """The asking side of the metadata requests (service loop)."""

    def __init__(self, state: State, thread: ServiceThread, prober: Prober) -> None:
        self._state = state
        self._thread = thread
        self._prober = prober
        self._asking: dict[tuple[int, Any], asyncio.Future[Any]] = {}
        # The background installs (prefetch_soon): per link (by id), the
        # caches listed and not started yet, and the one being installed.
        self._queued: dict[int, dict[int, dict[str, Any]]] = {}
        self._installing: dict[tuple[int, int], asyncio.Future[None]] = {}

    async def _ask(self, link: Link, request: Request[R]) -> R:
        """``request``'s answer from the peer of ``link``; an answer that does
        not fit is LLM_FAILED."""
        try:
            return await ask(link.conn, request, METADATA_TIMEOUT_S)
        except BadReply as exc:
            raise make_error(
                LLMStatusCode.LLM_FAILED,
                f"cluster {link.cluster_id} sent a bad {request.op.value} answer: {exc}",
            ) from None

    async def ensure_ctl(self, link: Link) -> None:
        """Our key to the peer's control region, before any of its metadata
        is installed: every remote cache record then has its retirement
        guard (a lookup can come before the link's probe installed the key)."""
        if link.ctl_rkey is not None:
            return
        try:
            slot = await ask(link.conn, ProbeInfo(), METADATA_TIMEOUT_S)
            self._prober.install_ctl(link, slot)
        except (ValueError, native.NativeError) as exc:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cluster {link.cluster_id} sent a bad control region: {exc}",
            ) from None

    def prefetch_soon(self, link: Link) -> None:
        """Ask a same-host peer for its caches and install them, in the
        background (service loop; with ``aiokvcache.prefault``, the default),
        so that their mappings are made before the first transfer. A peer
        that refuses, answers badly or is not on this host changes nothing:
        each cache is then looked up when it is first used, as always."""
        st = self._state
        host = st.local.host_id
        if not st.options.prefault or not host or link.conn.peer_host_id != host:
            return
        if id(link) in self._queued:
            return
        self._queued[id(link)] = {}
        self._thread.spawn(self._prefetch(link))

    async def _prefetch(self, link: Link) -> None:
        """Install the caches the peer lists, one at a time, each in a worker
        thread: mapping a cache takes up to some 0.6 s (2 GiB of 4 KiB pages)
        and the service loop must answer the peer meanwhile (an invalidate
        of one of them included: see :meth:`Retirement.drop_remote`'s
        tombstones, which keep a cache retired meanwhile from being stored)."""
        queued = self._queued[id(link)]
        loop = asyncio.get_running_loop()
        try:
            await self.ensure_ctl(link)
            answer = await self._ask(link, Caches())
            for meta in answer.caches[:MAX_CACHES_PER_ANSWER]:
                cid = meta.get("cache_id")
                if type(cid) is int and (id(link), ("id", cid)) not in self._asking:
                    queued.setdefault(cid, meta)  # not when a look-up of it is under way
            while queued and not link.broken:
                cid, meta = next(iter(queued.items()))
                done: asyncio.Future[None] = loop.create_future()
                self._installing[(id(link), cid)] = done
                del queued[cid]
                try:
                    await loop.run_in_executor(None, install_remote, self._state, link, meta)
                except LLMException as exc:
                    log.debug(
                        "aiokvcache: cluster %d's cache %d not installed ahead: %s",
                        link.cluster_id,
                        cid,
                        exc,
                    )
                finally:
                    del self._installing[(id(link), cid)]
                    done.set_result(None)
        except LLMException as exc:
            log.debug(
                "aiokvcache: cluster %d's caches not installed ahead: %s", link.cluster_id, exc
            )
        finally:
            del self._queued[id(link)]

    async def _before_lookup(self, link: Link, cache_id: int) -> None:
        """A lookup of ``cache_id`` on ``link`` goes first: a background
        install of it not started yet is taken off the queue (the lookup
        installs it); one under way is waited for (it then finds the cache
        installed instead of mapping it a second time)."""
        queued = self._queued.get(id(link))
        if queued is not None:
            queued.pop(cache_id, None)
        done = self._installing.get((id(link), cache_id))
        if done is not None:
            await asyncio.shield(done)

    async def remote_by_id(self, link: Link, cache_id: int) -> RemoteCache:
        """The peer's cache ``cache_id``, fetched once per link (concurrent asks share it)."""
        with self._state.lock:
            rc = link.remote.get(cache_id)
        if rc is not None:
            return rc

        async def ask() -> RemoteCache:
            await self._before_lookup(link, cache_id)
            with self._state.lock:
                rc = link.remote.get(cache_id)
            if rc is not None:
                return rc
            await self.ensure_ctl(link)
            answer = await self._ask(link, CacheById(cache_id))
            return install_remote(self._state, link, answer.meta)

        return await self._shared(link, ("id", cache_id), ask)

    async def _shared(self, link: Link, what: Any, ask: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``ask()``'s answer, one ask in flight per (link, ``what``): callers
        that come while it is in flight share its answer. Keys are asked
        every time (the peer may rebind them), but 32 layers of one push round
        asking at once are one question, not 32: the answer they share is one
        the peer gave after the first of them asked."""
        key = (id(link), what)
        fut = self._asking.get(key)
        if fut is None:
            loop = self._thread.loop
            fut = loop.create_future()
            self._asking[key] = fut
            loop.create_task(self._run_shared(key, fut, ask))
        result: T = await asyncio.shield(fut)
        return result

    async def _run_shared(
        self, key: tuple[int, Any], fut: asyncio.Future[Any], ask: Callable[[], Awaitable[Any]]
    ) -> None:
        try:
            result = await ask()
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, Exception) else LLMException(str(exc)))
                fut.exception()  # retrieved: waiters may have given up already
            if not isinstance(exc, Exception):
                raise
        else:
            if not fut.done():
                fut.set_result(result)
        finally:
            self._asking.pop(key, None)

    async def remote_by_key(self, link: Link, key: CacheKey) -> tuple[RemoteCache, int]:
        """The peer's cache and batch index bound to ``key`` (asked every time;
        concurrent asks share one, see :meth:`_shared`)."""

        async def ask() -> tuple[RemoteCache, int]:
            await self.ensure_ctl(link)
            answer = await self._ask(link, CacheByKey(key))
            return install_remote(self._state, link, answer.meta), answer.batch_index

        what = ("key", key.cluster_id, key.req_id, key.model_id, key.prefix_id)
        return await self._shared(link, what, ask)

    async def remote_blocks(self, link: Link, key: BlocksCacheKey) -> RemoteCache:
        """The peer's blocks cache bound to ``key`` (asked every time: keys
        rebind; concurrent asks share one, see :meth:`_shared`)."""

        async def ask() -> RemoteCache:
            await self.ensure_ctl(link)
            answer = await self._ask(link, BlocksByKey(key))
            remote = install_remote(self._state, link, answer.meta)
            if not remote.is_blocks:
                raise make_error(
                    LLMStatusCode.LLM_FAILED, f"cluster {link.cluster_id} sent a non-blocks cache"
                )
            return remote

        return await self._shared(link, ("blocks", key.cluster_id, key.model_id), ask)

    async def remotes_by_addr(self, link: Link, addrs: list[int]) -> None:
        """Ask the peer which caches hold ``addrs``; record every one it names."""
        await self.ensure_ctl(link)
        for k in range(0, len(addrs), MAX_ADDRS_PER_REQUEST):
            chunk = tuple(addrs[k : k + MAX_ADDRS_PER_REQUEST])
            answer = await self._ask(link, CacheByAddr(chunk))
            for meta in answer.caches:
                install_remote(self._state, link, meta)
