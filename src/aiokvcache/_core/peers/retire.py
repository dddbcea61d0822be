"""Retiring caches: ours when the owner frees them, a peer's when it says so.

Our cache (:meth:`Retirement.retire_local`) is out of every lookup before
the owner's call returns; its memory goes only once our own uses of it are
over and every link its metadata went out on is proven quiescent, or is
quarantined when one was cut off instead (see docs/design.md, "Retiring a
cache" and "Quarantine"). A peer's cache (:meth:`Retirement.drop_remote`)
stops being used, and the peer hears so only once our jobs on it are over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..._loader import native
from ..memory.catalog import retire_remote
from ..memory.state import Lease, Link, LocalCache, State
from ..model.cachedesc import invalidate_cache
from ..model.errors import LLMException, LLMStatusCode, make_error
from ..wire.messages import Invalidate, ask
from .links import Links
from .servicethread import ServiceThread, until

__all__ = ["RETIRE_TIMEOUT_S", "Retirement"]

log = logging.getLogger("aiokvcache")

# How long a retiring cache waits for a linked peer to confirm that it will
# not use the cache any more; a peer that does not is cut off (its link
# dropped, the memory waiting for our endpoint to it to close).
RETIRE_TIMEOUT_S = 5.0


class Retirement:
    """Retires our caches and the peers' (service loop, except :meth:`retire_local`)."""

    def __init__(self, state: State, thread: ServiceThread, links: Links) -> None:
        self._state = state
        self._thread = thread
        self._links = links

    # ------------------------------------------------------- a peer's cache

    async def drop_remote(self, link: Link, cache_id: int) -> None:
        """The peer retires a cache: stop our jobs on it, wait for them, then confirm."""
        st = self._state
        with st.lock:
            link.retired.add(cache_id)
            rc = link.remote.pop(cache_id, None)
            if rc is None:
                return
            rc.valid = False  # no job starts on it from here on
            leases = list(rc.leases)
        st.cancel_leases(leases)
        await until(lambda: st.leases_over(leases))
        # A job of ours released unproven may still move bytes until its
        # endpoint closed: the owner must not hear "done" before.
        await until(lambda: st.used_quiet(rc))
        retire_remote(st, rc)

    # ----------------------------------------------------------- our cache

    def retire_local(self, rec: LocalCache) -> None:
        """Our cache ``rec`` goes (any thread): stop using it, then free it safely.

        Before this returns, the cache is out of every lookup, no use of it
        can start, and its retirement word says so: a peer's transfer that
        starts after this returns fails with KV_CACHE_NOT_EXIST. The memory
        is released later, by :meth:`_release_later`.
        """
        st = self._state
        with st.lock:
            # One retirement per cache, whatever threads race to release it.
            if not rec.valid or st.cache_table.caches.get(rec.cache_id) is not rec:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"cache {rec.cache_id} was already released",
                )
            st.cache_table.drop(rec)  # out of every lookup, no new use of it
            leases = list(rec.leases)
            st.ctl.guard_retire(rec.guard_slot)
        owners = invalidate_cache(rec.cache)
        # Our own transfers on it stop now; the memory waits for them below.
        st.cancel_leases(leases)
        self._thread.spawn(self._release_later(rec, leases, owners))

    async def _release_later(self, rec: LocalCache, leases: list[Lease], owners: Any) -> None:
        """Free a retired cache once nothing can write it any more.

        First every use of ours is over (jobs released, copies done). Then
        every link its metadata went out on — current or long dropped — is
        proven quiescent: a live peer confirms the invalidation (it released
        its jobs on the cache first); a peer that confirmed an unlink already
        counts. Any other (frozen, cut off, gone, replaced) is cut off, and
        the memory is quarantined instead of freed (:meth:`_quarantine`):
        nothing on our side can prove such a peer done. Reuse never follows
        from a timer alone. If the wait is interrupted (finalize), the memory
        goes only once the engine has fully closed; otherwise it is kept
        (leaked, never reused).
        """
        st = self._state
        waited = proven = False
        try:
            await until(lambda: st.leases_over(leases))
            # A job of ours released unproven (its peer froze) may still move
            # bytes of the cache until its endpoint's close completes.
            await until(lambda: st.used_quiet(rec))
            proven = await self._quiesce_exposure(rec)
            waited = True
        finally:
            if waited and not proven and not st.engine.closed:
                self._quarantine(rec, owners)
            elif waited or st.engine.closed:
                for rid, _, _ in rec.regions:
                    # A closed engine freed every region already.
                    with contextlib.suppress(native.EngineClosedError):
                        st.engine.mem_release(rid)
                st.ctl.guard_free(rec.guard_slot)
                del owners  # user buffers may go now
            else:
                log.warning(
                    "aiokvcache: cache %d's memory is kept: its retirement was interrupted "
                    "before every peer was proven done with it",
                    rec.cache_id,
                )

    def _quarantine(self, rec: LocalCache, owners: Any) -> None:
        """Retire ``rec`` whose memory a cut-off peer may still write.

        Our endpoint's close proves nothing about the peer's side: UCX's TCP
        transport keeps receiving on a connection the peer opened until the
        peer closes it, and a thawed peer first sends what it had posted. So
        the addresses are never handed out again before finalize: allocated
        memory gives its pages back and keeps an inert mapping at its
        addresses (``Engine.mem_quarantine``); registered user buffers stay
        registered and referenced until finalize.
        """
        st = self._state
        if rec.allocated:
            try:
                for rid, _, _ in rec.regions:
                    st.engine.mem_quarantine(rid)
            except native.NativeError as exc:
                log.warning("aiokvcache: cache %d's memory is kept: %s", rec.cache_id, exc)
        else:
            log.warning(
                "aiokvcache: cache %d's buffers stay registered until finalize: a peer that "
                "held its metadata was cut off before it confirmed it is done with it",
                rec.cache_id,
            )
            st.held_until_close.append(owners)
        st.ctl.guard_free(rec.guard_slot)

    async def _quiesce_exposure(self, rec: LocalCache) -> bool:
        """Every link that ever saw ``rec``'s metadata is quiescent: True
        when each proved it (confirmed), False when one was cut off."""
        st = self._state
        with st.lock:
            seen = list(rec.exposed)
            exposed = [lk for lk in seen if not lk.quiescent]
            rec.exposed.clear()
            current = {lk for lk in exposed if st.links.get(lk.cluster_id) is lk and not lk.broken}
        asked = [lk for lk in exposed if lk in current]
        confirmed = await asyncio.gather(*(self._invalidate_at(lk, rec.cache_id) for lk in asked))
        done = {lk for lk, ok in zip(asked, confirmed, strict=True) if ok}
        for lk in exposed:
            if lk not in done and not lk.quiescent:
                self._cut_off(lk, f"it did not confirm that cache {rec.cache_id} is gone")
        return not any(lk.cut_off for lk in seen)

    def _cut_off(self, link: Link, why: str) -> None:
        """Drop ``link`` without the peer's confirmation.

        Nothing on our side proves the peer done: closing our endpoint stops
        our own traffic, but UCX's TCP transport keeps applying what arrives
        on a connection the peer opened until the peer closes it. The link
        stays in the exposure of every cache it saw, so each of them is
        quarantined, not freed, when it retires (see :meth:`_quarantine`);
        no retirement waits for it.
        """
        st = self._state
        with st.lock:
            current = st.links.get(link.cluster_id) is link
            link.cut_off = link.quiescent = True
        if current and not link.broken:
            log.warning("aiokvcache: cutting off cluster %d: %s", link.cluster_id, why)
        self._links.drop_link(link, f"cut off: {why}")
        if not link.conn.closed:
            self._thread.spawn(link.conn.close(f"cut off: {why}"))

    async def _invalidate_at(self, link: Link, cache_id: int) -> bool:
        try:
            await ask(link.conn, Invalidate(cache_id), timeout=RETIRE_TIMEOUT_S)
        except LLMException as exc:
            log.info(
                "aiokvcache: cluster %d did not confirm invalidation: %s", link.cluster_id, exc
            )
            return False
        return True
