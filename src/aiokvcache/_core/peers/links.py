"""The live links: made from a finished handshake, watched, broken, dropped.

A link is made when a control connection finishes its handshake
(:meth:`Links.on_connected`, on either side), watched by a heartbeat task,
broken when its peer falls silent, its endpoint fails or its connection
closes, and dropped (out of :attr:`.state.State.links`, its endpoint and
keys released) when it is unlinked, replaced or cut off. Everything runs on
the service loop except :meth:`Links.endpoint_failed` and the lock-guarded
table updates, which any thread may do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..._loader import native
from ..memory.catalog import forget_link
from ..memory.state import Link, State
from ..model.errors import LLMException, LLMStatusCode, make_error
from ..wire import control
from ..wire.messages import Alive, BadReply, Finalizing, ask
from .servicethread import ServiceThread, until

__all__ = ["FORCE_UNLINKED", "PEER_FINALIZING", "Links"]

log = logging.getLogger("aiokvcache")

#: The reason a link breaks when its peer announced that it finalizes.
PEER_FINALIZING = "the peer finalized"
#: The close reason of a forced unlink: the peer keeps its (broken) link
#: until it unlinks too, as in LLM-DataDist.
FORCE_UNLINKED = "force-unlinked"


class Links:
    """The lifecycle of every link in :attr:`.state.State.links`."""

    def __init__(self, state: State, thread: ServiceThread) -> None:
        self._state = state
        self._thread = thread

    def linked(self, cid: int) -> bool:
        """True while we hold a live link to ``cid``."""
        with self._state.lock:
            link = self._state.links.get(cid)
        return link is not None and not link.broken

    # -------------------------------------------------------- making links

    def on_connected(self, conn: control.ControlConnection) -> None:
        """A control connection finished its handshake: make it a link.

        When both sides link at the same moment, each side may see the
        other's connection while its own is still being set up. Both apply
        one rule, so they keep the same connection: the one initiated by the
        lower cluster id wins; the other is refused (ALREADY_LINK) or
        replaced, and its initiator then waits for the winner to be up.
        """
        st = self._state
        if st.finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "peer is finalizing")
        cid = conn.peer_cluster_id
        if cid == st.cluster_id:
            raise make_error(LLMStatusCode.LLM_LINK_FAILED, "the peer claims our own cluster id")
        with st.lock:
            existing = st.links.get(cid)
        if existing is not None:
            if not existing.broken:
                if existing.up or not self._wins(conn, existing):
                    raise make_error(
                        LLMStatusCode.LLM_ALREADY_LINK, f"cluster {cid} is already linked"
                    )
                self._thread.spawn(existing.conn.close("replaced by a simultaneous link"))
            self.drop_link(existing, "replaced by a new link")
        link = Link(cid, conn, self._connect_endpoint(conn))
        with st.lock:
            st.links[cid] = link
        if st.options.peer_timeout_ms:
            self._thread.loop.create_task(self._heartbeat(link), name=f"aiokvcache.heartbeat.{cid}")
        log.info("aiokvcache: cluster %d linked with cluster %d", st.cluster_id, cid)

    def _connect_endpoint(self, conn: control.ControlConnection) -> int:
        """Our UCX endpoint to the peer of ``conn``, its notifications keyed."""
        st = self._state
        cid = conn.peer_cluster_id
        # UCX peer-failure handling only for RDMA: UCX refuses it on shared
        # memory, and over TCP it cost 3.5x in bandwidth here (0.35 vs 1.23
        # GB/s); TCP errors still fail the operations (LINK_FAILED), and a
        # dead peer's control connection breaks the link on any transport.
        peer_errors = st.options.transport == "rdma"
        try:
            # Notifications we send carry the key the peer gave us; those
            # that carry ours are attributed to this link (ext/engine.hpp).
            # One call: the progress thread makes the endpoint and keys it.
            ep: int = st.engine.connect(
                conn.peer_worker_address,
                peer_errors,
                conn.peer_note_key,
                conn.local_note_key,
                cid,
            )
        except native.NativeError as exc:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cannot reach cluster {cid}'s transfer engine: {exc}",
            ) from exc
        return ep

    def _wins(self, conn: control.ControlConnection, existing: Link) -> bool:
        """Simultaneous set-up: does ``conn`` replace ``existing`` (not up yet)?"""
        me, peer = self._state.cluster_id, conn.peer_cluster_id

        def initiator(c: control.ControlConnection) -> int:
            return me if c.initiator else peer

        new, old = initiator(conn), initiator(existing.conn)
        return new != old and new < old

    # ----------------------------------------------------------- watching

    async def _heartbeat(self, link: Link) -> None:
        """Break the link when its peer has been silent for ``peer_timeout``.

        A frozen host or a cut cable closes no socket: without this, only a
        transfer's own deadline would notice, and a re-link would be told
        ALREADY_LINK. The keep-alives are native: each engine's progress
        thread sends every linked peer one each quarter of ``peer_timeout``
        and notes when the peer's last arrived (``Engine.silent_s``). A peer
        whose Python threads are starved of the CPU or of the GIL (a serving
        engine stepping on the same cores) is still heard; one whose process
        stopped is not. This task only reads the time, and a silence it sees
        is confirmed after the progress thread has run again (our own process
        may have been the one starved), then on the control connection
        (:meth:`_answers`): silent means nothing at all arrived.
        """
        timeout = self._state.options.peer_timeout_ms / 1000
        engine = self._state.engine
        while True:
            await asyncio.sleep(timeout / 4)
            if not self._heartbeat_current(link):
                return
            try:
                silent = engine.silent_s(link.ep)
                if silent > timeout:
                    # Once more, after a keep-alive that asks for an answer:
                    # what arrived while we were not scheduled counts.
                    engine.keepalive_now(link.ep)
                    await asyncio.sleep(min(0.1, timeout / 4))
                    silent = engine.silent_s(link.ep)
            except native.NativeError:
                return  # the engine is closing
            if silent < 0:
                return  # the endpoint is gone: the link is being dropped
            if silent <= timeout or await self._answers(link, timeout / 2):
                continue
            if not self._heartbeat_current(link):
                return
            log.warning(
                "aiokvcache: cluster %d silent for %.1f s: link broken", link.cluster_id, silent
            )
            self.break_link(link, f"peer silent for {timeout:.1f} s")
            await link.conn.close(f"peer silent for {timeout:.1f} s")
            return

    async def _answers(self, link: Link, within: float) -> bool:
        """Whether the peer answers on the link's control connection within
        ``within`` seconds (at least 0.2). The keep-alives share the data
        path with the transfers' bytes: on a congested link (a TCP
        connection with a full send queue, small socket buffers) they wait
        behind them while bytes still arrive, and a link that moves bytes
        is not dead. Only the plain answer counts: a frozen peer gives none,
        and one that refuses (finalized, or no longer holding the link) has
        no link to keep.
        """
        if not self._heartbeat_current(link):
            return False
        try:
            await ask(link.conn, Alive(), max(0.2, within))
        except (LLMException, BadReply):
            return False
        log.info(
            "aiokvcache: cluster %d's data path is silent, its control connection answers: "
            "link kept",
            link.cluster_id,
        )
        return True

    def _heartbeat_current(self, link: Link) -> bool:
        """``link`` is still the cluster's link, unbroken, its connection open."""
        with self._state.lock:
            current = self._state.links.get(link.cluster_id) is link and not link.broken
        return current and not link.conn.closed

    def on_closed(self, conn: control.ControlConnection, reason: control.Closed) -> None:
        """The control connection closed: the link is broken (or was unlinked)."""
        st = self._state
        with st.lock:
            link = st.links.get(conn.peer_cluster_id)
        if link is None or link.conn is not conn:
            return
        # What the peer said when it closed (its BYE), if it closed.
        said = reason.detail if reason.kind is control.CloseReason.PEER_CLOSED else None
        if said == "unlinked":
            self.drop_link(link, "unlinked by peer")
            return
        if st.finalized:
            level = logging.DEBUG
        elif said in ("finalized", FORCE_UNLINKED) or link.reason == PEER_FINALIZING:
            level = logging.INFO
        else:
            level = logging.WARNING
        log.log(level, "aiokvcache: link to cluster %d closed: %s", link.cluster_id, reason)
        self.break_link(link, f"control connection closed ({reason})")
        forget_link(st, link)

    def endpoint_failed(self, ep: int, reason: str) -> None:
        """The engine reported an endpoint error (from any thread)."""
        with self._state.lock:
            links = [lk for lk in self._state.links.values() if lk.ep == ep and not lk.broken]
            for link in links:
                link.broken = True
                link.reason = reason
        for link in links:
            # INFO: the control connection's close (logged below) says
            # whether this was a failure or the peer shutting down.
            log.info("aiokvcache: link to cluster %d broke: %s", link.cluster_id, reason)
            # The control connection may still be up; close it so the peer
            # learns of it too.
            self._thread.spawn(link.conn.close(reason))

    # ------------------------------------------------------ ending links

    def break_link(self, link: Link, reason: str) -> None:
        """Mark a link broken and fail its endpoint (every job on it ends)."""
        with self._state.lock:
            if link.broken:
                return
            link.broken = True
            link.reason = reason
        with contextlib.suppress(native.EngineClosedError):
            self._state.engine.fail_endpoint(link.ep)

    def drop_link(self, link: Link, reason: str) -> list[int]:
        """Forget a link: fail its transfers, release its endpoint and keys.

        Returns the ids of our jobs that were still live on it (cancelled
        now; the engine releases them shortly).
        """
        with self._state.lock:
            if self._state.links.get(link.cluster_id) is link:
                del self._state.links[link.cluster_id]
        self.break_link(link, reason)
        forget_link(self._state, link)
        live: list[int] = []
        with contextlib.suppress(native.EngineClosedError):
            live = list(self._state.engine.disconnect(link.ep))
        return live

    async def settled(self, ids: list[int], ep: int) -> None:
        """Our jobs ``ids`` are released, and none released unproven on
        ``ep`` can move bytes any more (its close completed)."""
        engine = self._state.engine
        await until(lambda: self._released_now(ids))
        await until(lambda: not engine.endpoint_unproven(ep))

    def _released_now(self, ids: list[int]) -> bool:
        engine = self._state.engine
        return not ids or engine.closed or bool(engine.wait_released(ids, 0.0))

    def quiesced(self, link: Link) -> None:
        """Nothing the peer posted on ``link`` can reach our memory any more:
        no retirement waits for it."""
        st = self._state
        with st.lock:
            link.quiescent = True
            for rec in st.cache_table.caches.values():
                rec.exposed.discard(link)

    async def announce_finalizing(self) -> None:
        """Tell every linked peer we are going, so its errors read as a shutdown."""
        with self._state.lock:
            links = [lk for lk in self._state.links.values() if not lk.broken]
        if links:
            await asyncio.gather(
                *(ask(lk.conn, Finalizing(), 1.0) for lk in links),
                return_exceptions=True,
            )

    async def close_all(self) -> None:
        """Forget every link and close its connection (finalize)."""
        with self._state.lock:
            links = list(self._state.links.values())
            self._state.links.clear()
        for link in links:
            with contextlib.suppress(Exception):
                await link.conn.close("finalized")
