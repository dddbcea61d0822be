"""Serving linked peers: the :class:`.control.Handler` of every control connection.

A finished handshake makes a link and a closed connection breaks it
(:class:`.links.Links`); a peer's requests are served here: its lookups of
our caches' metadata, the checks of its half of a link's data path, its
invalidations of its own caches, its unlink and its finalize.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from ..memory.catalog import metadata
from ..memory.state import Link, LocalCache, State
from ..model.errors import LLMStatusCode, make_error
from ..model.types import BlocksCacheKey, CacheKey
from ..wire import control
from ..wire.messages import (
    LINK_UP,
    LOOKUPS,
    MAX_CACHES_PER_ANSWER,
    Alive,
    BlocksByKey,
    CacheByAddr,
    CacheById,
    CacheByKey,
    CacheMeta,
    CacheMetas,
    Caches,
    Finalizing,
    Invalidate,
    KeyedCacheMeta,
    Message,
    ProbeBack,
    ProbeInfo,
    ProbeResult,
    Request,
    Served,
    Unlink,
    parse_request,
)
from .links import PEER_FINALIZING, Links
from .probe import PROBE_MAX_S, Prober, new_nonce
from .retire import Retirement

__all__ = ["PeerHandler"]

log = logging.getLogger("aiokvcache")


class PeerHandler:
    """Answers linked peers' requests (service loop); a :class:`.control.Handler`."""

    def __init__(self, state: State, links: Links, prober: Prober, retirement: Retirement) -> None:
        self._state = state
        self._links = links
        self._prober = prober
        self._retirement = retirement

    def on_connected(self, conn: control.ControlConnection) -> None:
        """A handshake finished: make its connection a link (see :class:`.links.Links`)."""
        self._links.on_connected(conn)

    def on_closed(self, conn: control.ControlConnection, reason: control.Closed) -> None:
        """A connection closed: its link, if it has one, breaks."""
        self._links.on_closed(conn, reason)

    def on_event(self, conn: control.ControlConnection, op: str, body: dict[str, Any]) -> None:
        """The initiator of a link says both halves of its data path worked
        (link_up): the link is up here once ours had, too. Any other event
        is logged and ignored."""
        if op == LINK_UP:
            with self._state.lock:
                link = self._state.links.get(conn.peer_cluster_id)
            if link is not None and link.conn is conn and link.half_up and not link.broken:
                link.up = True
            return
        log.warning("aiokvcache: unexpected event %r from cluster %d", op, conn.peer_cluster_id)

    async def handle_request(
        self, conn: control.ControlConnection, op: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Serve a peer's request (cache metadata, invalidations)."""
        st = self._state
        if st.finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "finalized")
        with st.lock:
            link = st.links.get(conn.peer_cluster_id)
        if link is None or link.conn is not conn:
            raise make_error(LLMStatusCode.LLM_NOT_YET_LINK, "not linked")
        request = parse_request(op, body)
        if request.op in LOOKUPS:
            # No await from here to the answer: a lookup's response is queued
            # before any invalidation of what it names (both leave this loop in
            # order on one connection), so the peer never installs metadata it
            # was told is gone.
            return self._serve_lookup(link, request)
        answer = await self._serve(link, request)
        return answer.encode()

    async def _serve(self, link: Link, request: Request[Any]) -> Message:
        """Serve a request that is not a lookup."""
        match request:
            case Finalizing():
                # The peer's engine is about to go: break the link now, so the
                # transport errors that follow read as a shutdown, not a failure.
                log.info("aiokvcache: cluster %d is finalizing", link.cluster_id)
                self._links.break_link(link, PEER_FINALIZING)
                return Served()
            case Unlink():
                # A plain unlink: our side goes, and our transfers on the link
                # are released, before the peer's call returns: it may then
                # treat the link as quiescent (LLM-DataDist's disconnect waits
                # so too).
                await self._links.settled(self._links.drop_link(link, "unlinked by peer"), link.ep)
                # The peer's own jobs on the link were over before it asked (see
                # Linker.unlink_all): nothing it posted can reach our memory.
                self._links.quiesced(link)
                return Served()
            case Alive():
                return Served()  # the answer is the point (Links._heartbeat)
            case ProbeInfo():
                return self._prober.probe_info()
            case ProbeBack(timeout=timeout, nonce=nonce, slot=slot):
                answer = await self._probe_back(link, min(timeout, PROBE_MAX_S), nonce, slot)
                problem = answer.problem
                if not problem and not link.conn.initiator:
                    if link.conn.peer_confirms_up:
                        # The initiator's half runs beside ours: up once it
                        # says both worked (link_up, see on_event).
                        link.half_up = True
                    else:
                        # An initiator that asks only once its own half worked.
                        link.up = True
                return answer
            case Invalidate(cache_id=cache_id):
                await self._retirement.drop_remote(link, cache_id)
                return Served()
        raise TypeError(f"no server for {request!r}")

    async def _probe_back(self, link: Link, timeout: float, nonce: bytes, slot: int) -> ProbeResult:
        """Our half of a link's data-path check, as the peer asked: a put
        probe when it sent the nonce it puts into our ``slot`` (we put ours,
        then look for its nonce), else a read-back probe."""
        if not nonce:
            return ProbeResult((await self._prober.half(link, timeout))[0])
        wrong = self._prober.bad_nonce_slot(slot, nonce)
        if wrong:  # before our put: a bad request gets nothing of ours
            return ProbeResult(f"the initiator's put to it: {wrong}")
        if link.put_probing:
            # A link's set-up asks once; a peer that asks again meanwhile
            # would only hold more of our polls.
            return ProbeResult("a put probe is already running on this link")
        link.put_probing = True
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            mine = new_nonce()
            problem, theirs = await self._prober.half(link, timeout, mine)
            if problem:
                return ProbeResult(f"its put to the initiator: {problem}")
            left = max(deadline - asyncio.get_running_loop().time(), 0.001)
            problem = await self._prober.nonce_arrived(link, slot, nonce, left)
            if problem:
                return ProbeResult(f"the initiator's put to it: {problem}")
            return ProbeResult("", mine, theirs)
        finally:
            link.put_probing = False

    def _serve_lookup(self, link: Link, request: Request[Any]) -> dict[str, Any]:
        """Serve a metadata lookup; every cache it names is recorded as
        exposed to ``link`` in the same critical section (see state.py)."""
        st = self._state
        match request:
            case CacheById(cache_id=cache_id):
                return CacheMeta(metadata(st, self._by_id(link, cache_id))).encode()
            case CacheByKey(key=key):
                rec, index = self._by_key(link, key)
                return KeyedCacheMeta(metadata(st, rec), index).encode()
            case BlocksByKey(key=bkey):
                return CacheMeta(metadata(st, self._by_blocks_key(link, bkey))).encode()
            case CacheByAddr(addrs=addrs):
                found = self._by_addrs(link, addrs)
                return CacheMetas(tuple(metadata(st, rec) for rec in found)).encode()
            case Caches():
                found = self._served_all(link)
                return CacheMetas(tuple(metadata(st, rec) for rec in found)).encode()
        raise TypeError(f"no lookup {request!r}")

    def _by_id(self, link: Link, cache_id: int) -> LocalCache:
        st = self._state
        with st.lock:
            rec = st.cache_table.served(cache_id, st.options.enable_remote_cache_accessible)
            rec.exposed.add(link)
        return rec

    def _by_key(self, link: Link, key: CacheKey) -> tuple[LocalCache, int]:
        st = self._state
        with st.lock:
            bound = st.cache_table.keys.get(key)
            if bound is None:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no cache is bound to {key!r}"
                )
            rec = st.cache_table.served(bound[0], st.options.enable_remote_cache_accessible)
            rec.exposed.add(link)
        return rec, bound[1]

    def _by_blocks_key(self, link: Link, bkey: BlocksCacheKey) -> LocalCache:
        st = self._state
        with st.lock:
            bound_id = st.cache_table.blocks_keys.get(bkey)
            if bound_id is None:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"no blocks cache is bound to {bkey!r}",
                )
            rec = st.cache_table.served(bound_id, st.options.enable_remote_cache_accessible)
            rec.exposed.add(link)
        return rec

    def _served_all(self, link: Link) -> list[LocalCache]:
        """The newest caches a peer may use (at most MAX_CACHES_PER_ANSWER,
        among the newest 8 x that many records: never a scan of every
        cache under the lock, whatever a peer asks how often)."""
        st = self._state
        if not st.options.enable_remote_cache_accessible:
            return []
        found: list[LocalCache] = []
        with st.lock:
            # Ids grow with registration, and the registry's dict keeps that order.
            newest = itertools.islice(
                reversed(st.cache_table.caches.values()), 8 * MAX_CACHES_PER_ANSWER
            )
            for rec in newest:
                if rec.valid and rec.remote_accessible:
                    rec.exposed.add(link)
                    found.append(rec)
                    if len(found) == MAX_CACHES_PER_ANSWER:
                        break
        return found

    def _by_addrs(self, link: Link, addrs: tuple[int, ...]) -> list[LocalCache]:
        st = self._state
        access = st.options.enable_remote_cache_accessible
        found: dict[int, LocalCache] = {}
        with st.lock:
            for a in addrs:
                hit = st.cache_table.cache_at(a)  # O(log n): never a scan under the lock
                if hit is not None and hit.cache_id not in found:
                    found[hit.cache_id] = st.cache_table.served(hit.cache_id, access)
                    hit.exposed.add(link)
        return list(found.values())
