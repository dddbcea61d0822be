"""Linking and unlinking on the user's request, and the listener peers link to.

``link_clusters`` becomes :meth:`Linker.link_all`: a control connection to
each cluster, then the check of both halves of its data path; a link is up
(and SUCCESS) only after both. ``unlink_clusters`` becomes
:meth:`Linker.unlink_all`. Everything here runs on the service loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ... import _telemetry
from ..._loader import native
from ..memory.state import Link, State
from ..model.errors import LLMException, LLMStatusCode, make_error
from ..model.types import LLMClusterInfo
from ..wire import control
from ..wire.messages import LINK_UP, BadReply, ProbeBack, ProbeResult, Unlink, ask
from ..wire.peerstatus import LinkRefused
from .discovery import Registry
from .links import FORCE_UNLINKED, Links
from .probe import Prober, new_nonce, offers_put_probe
from .servicethread import ServiceThread, until

__all__ = ["Linker"]

log = logging.getLogger("aiokvcache")

# Pause before asking again a peer that still holds a link we dropped.
_RELINK_PAUSE_S = 0.05


class Linker:
    """Sets links up and tears them down on the user's request; owns the listener."""

    def __init__(
        self,
        state: State,
        thread: ServiceThread,
        links: Links,
        prober: Prober,
        handler: control.Handler,
        on_up: Callable[[Link], None] | None = None,
    ) -> None:
        self._state = state
        self._on_up = on_up  # a link we made is up (service loop)
        self._thread = thread
        self._links = links
        self._prober = prober
        self._handler = handler
        self._server: control.ControlServer | None = None
        self._listen_spec: tuple[str, int] | None = None  # as asked, host not resolved
        #: Where clusters given without remote_ip_info are looked up (etcd), or None.
        self.registry: Registry | None = None

    # ------------------------------------------------------------ listener

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The bound (host, port) of the control server, if it listens."""
        return None if self._server is None else self._server.address

    async def listen(self, host: str, port: int) -> None:
        """Start the control server (service loop)."""
        server = control.ControlServer(self._state.local, self._handler)
        server.handshake_timeout = self._state.options.handshake_timeout_ms / 1000
        server.max_connections = self._state.options.max_connections
        try:
            await server.start(host, port)
        except LLMException as exc:
            # Its message already names the address.
            raise make_error(LLMStatusCode.LLM_PARAM_INVALID, exc.message) from exc
        self._server = server
        self._listen_spec = (host, port)

    async def relisten(self, spec: tuple[str, int] | None) -> None:
        """switch_role's listener: stop it (``None``), keep it (the same
        address), or move it to ``spec``, as LLM-DataDist's link manager does."""
        if self._server is not None and spec == self._listen_spec:
            return
        if self._server is not None:
            server, self._server, self._listen_spec = self._server, None, None
            await server.close()
        if spec is not None:
            await self.listen(*spec)

    def set_role(self, role: int) -> None:
        """Announce ``role`` in later handshakes."""
        self._state.local = dataclasses.replace(self._state.local, role=role)
        if self._server is not None:
            self._server.set_local(self._state.local)

    async def close_server(self) -> None:
        """Stop listening (finalize); errors are ignored."""
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.close()

    # ------------------------------------------------------------- linking

    async def link_all(
        self, infos: Sequence[LLMClusterInfo], timeout_ms: int
    ) -> list[LLMStatusCode]:
        """Link every cluster concurrently; one status each."""
        return list(await asyncio.gather(*(self._link_one(c, timeout_ms) for c in infos)))

    async def _link_one(self, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        st = self._state
        cid = info.remote_cluster_id
        assert cid is not None
        loop = asyncio.get_running_loop()
        budget = timeout_ms / 1000
        if st.options.link_total_time_s > 0:  # LLM-DataDist's cap on all attempts
            budget = min(budget, float(st.options.link_total_time_s))
        deadline = loop.time() + budget
        with st.lock:
            existing = st.links.get(cid)
        if existing is not None and not existing.broken and not existing.up:
            # The peer is setting up a link to us right now: it is ours too
            # once its data path is checked.
            return await self._await_up(cid, deadline)
        if existing is not None and not existing.broken and not await self._alive(existing):
            # Our side had not noticed yet (a cut cable, a frozen host).
            self._links.break_link(existing, "no answer to a liveness check")
            self._thread.spawn(existing.conn.close("no answer to a liveness check"))
        addresses = list(info.remote_ip_info)
        if not addresses and self.registry is not None:
            addresses, why = await self.registry.resolve(cid)
            if not addresses:
                log.warning("aiokvcache: link to cluster %d: %s", cid, why)
                return LLMStatusCode.LLM_LINK_FAILED
        refused = self._claim(addresses, cid)
        if refused is not None:
            return refused
        began = time.monotonic()
        status = LLMStatusCode.LLM_FAILED
        try:
            status = await self._attempts(cid, addresses, deadline)
            return status
        finally:
            with st.lock:
                st.linking.discard(cid)
            observe = _telemetry.link_observer
            if observe is not None:
                name = status.name.removeprefix("LLM_").lower()
                observe(cid, name, time.monotonic() - began)

    def _claim(self, addresses: list[tuple[str, int]], cid: int) -> LLMStatusCode | None:
        """Mark ``cid`` as being linked by us; or why we do not link it."""
        st = self._state
        with st.lock:
            existing = st.links.get(cid)
            if existing is not None and not existing.broken:
                return LLMStatusCode.LLM_ALREADY_LINK
            if cid in st.linking:
                return LLMStatusCode.LLM_PROCESSING_LINK
            if not addresses:
                log.warning("aiokvcache: link to cluster %d: no remote_ip_info", cid)
                return LLMStatusCode.LLM_PARAM_INVALID
            st.linking.add(cid)
        return None

    async def _attempts(
        self, cid: int, addresses: list[tuple[str, int]], deadline: float
    ) -> LLMStatusCode:
        """Try every address of the cluster, ``link_retry_count`` rounds, until
        one links or ``deadline`` passes."""
        loop = asyncio.get_running_loop()
        attempts = max(1, self._state.options.link_retry_count)
        status = LLMStatusCode.LLM_LINK_FAILED
        for attempt in range(attempts):
            # Every address of the cluster in turn, each with a fair share
            # of what is left, so one silent address cannot eat it all.
            for i, (host, port) in enumerate(addresses):
                left = (deadline - loop.time()) / (len(addresses) - i)
                if left <= 0:
                    break
                got = await self._attempt(cid, host, port, left, deadline)
                if not isinstance(got, tuple):
                    return got
                status, reason = got
                log.warning(
                    "aiokvcache: link to cluster %d at %s:%d failed (attempt %d/%d): %s",
                    cid,
                    host,
                    port,
                    attempt + 1,
                    attempts,
                    reason,
                )
            if attempt + 1 < attempts:  # a short pause before the next try
                await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
        return status

    async def _attempt(
        self, cid: int, host: str, port: int, left: float, deadline: float
    ) -> LLMStatusCode | tuple[LLMStatusCode, str]:
        """Link ``cid`` at one address: the call's final status, or the
        (status, reason) of a failure to go on from."""
        loop = asyncio.get_running_loop()
        share_end = loop.time() + left  # this address's fair share of the call
        status, reason = await self._try_link(cid, host, port, left)
        if status == LLMStatusCode.LLM_ALREADY_LINK and self._links.linked(cid):
            # Both sides linked at once and the peer's link won
            # (see Links.on_connected): ours once it is up.
            return await self._await_up(cid, deadline)
        held = ""  # why the peer last said it still holds a link to us
        while status == LLMStatusCode.LLM_ALREADY_LINK and not self._links.linked(cid):
            # The peer still holds the link we dropped: its close is
            # on the way (or its heartbeat will notice). Ask again.
            held = reason
            left = min(deadline, share_end) - loop.time() - _RELINK_PAUSE_S
            if left <= 0:
                break
            await asyncio.sleep(_RELINK_PAUSE_S)
            status, reason = await self._try_link(cid, host, port, left)
        if status == LLMStatusCode.LLM_ALREADY_LINK and self._links.linked(cid):
            return await self._await_up(cid, deadline)
        if held and status in (LLMStatusCode.LLM_ALREADY_LINK, LLMStatusCode.LLM_TIMEOUT):
            # Only the peer says a link exists (ours is none), to the end of
            # the call (its last ask may have met the deadline): a failure.
            return LLMStatusCode.LLM_LINK_FAILED, f"{held} (it still held an earlier link)"
        if status in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_PARAM_INVALID):
            return status
        return status, reason

    async def _await_up(self, cid: int, deadline: float) -> LLMStatusCode:
        """Wait until the link to ``cid`` that the peer is setting up is up."""
        loop = asyncio.get_running_loop()

        def settled() -> bool:
            with self._state.lock:
                link = self._state.links.get(cid)
            return link is None or link.broken or link.up

        await until(settled, max(0.0, deadline - loop.time()))
        with self._state.lock:
            link = self._state.links.get(cid)
        if link is not None and not link.broken and link.up:
            return LLMStatusCode.LLM_SUCCESS
        if link is None or link.broken:
            return LLMStatusCode.LLM_LINK_FAILED
        return LLMStatusCode.LLM_TIMEOUT

    async def _alive(self, link: Link) -> bool:
        """Does the linked peer still answer? A keep-alive that asks for an echo,
        answered by the peer's progress thread (not its Python threads, which a
        busy engine on the same cores may starve): alive once it is heard after
        the question left, within ``min(1 s, peer_timeout)``."""
        engine = self._state.engine
        timeout = min(1.0, (self._state.options.peer_timeout_ms or 1000) / 1000)
        start = time.monotonic()
        try:
            engine.keepalive_now(link.ep)
            while (elapsed := time.monotonic() - start) < timeout:
                silent = engine.silent_s(link.ep)
                if silent < 0:
                    return False  # its endpoint is gone
                if silent < elapsed:
                    return True
                await asyncio.sleep(0.005)
        except native.NativeError:
            return False
        return False

    async def _try_link(
        self, cid: int, host: str, port: int, timeout: float
    ) -> tuple[LLMStatusCode, str]:
        """One connection attempt: (status, reason); the link exists on SUCCESS.

        A link is up only once its data path moved bytes both ways: each
        side puts a nonce into the other's memory over its own endpoint, and
        the nonce is found there (by the other side with a put probe, by the
        putting side's read-back with an older peer; see :mod:`.probe`).
        Either half failing drops the link and says which half it was.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            # The handshake checks the peer's cluster id before it tells the
            # peer anything (expected_cluster_id).
            conn = await control.connect(
                host, port, self._state.local, self._handler, timeout, expected_cluster_id=cid
            )
        except LinkRefused as exc:
            if exc.peer_status == LLMStatusCode.LLM_ALREADY_LINK:
                # Its word, after its id (and proof) checked out: it still
                # holds a link to us. What we make of it is _attempt's call.
                return LLMStatusCode.LLM_ALREADY_LINK, str(exc)
            return exc.status_code, str(exc)
        except LLMException as exc:
            return exc.status_code, str(exc)
        with self._state.lock:
            link = self._state.links.get(cid)
        if link is None or link.conn is not conn:
            if link is not None and not link.broken:
                # The peer's own link to us replaced ours (both sides linked
                # at once, see Links.on_connected): that one is ours too.
                return LLMStatusCode.LLM_ALREADY_LINK, "the peer's link won"
            return LLMStatusCode.LLM_LINK_FAILED, "the link went away during its set-up"
        try:
            return await self._check_data_path(cid, link, conn, deadline)
        except BaseException:
            # Cancelled (the caller's timeout, task.cancel()): no half link
            # stays behind to answer later calls with "being set up".
            if not link.up:
                self._links.drop_link(link, "link set-up cancelled")
                self._thread.spawn(conn.close("link set-up cancelled"))
            raise

    async def _check_data_path(
        self, cid: int, link: Link, conn: control.ControlConnection, deadline: float
    ) -> tuple[LLMStatusCode, str]:
        """Both halves of a new link's data path; the link is up after SUCCESS.

        The two halves run at once: the peer's (probe_back) is asked for
        first, ours runs in this task meanwhile. Each runs on its own side's
        endpoint, whose first job waits until the endpoint's wire-up was
        answered (``Engine::connect``), and neither needs the other's (one
        after the other they were half a link's wall time). Ours runs here,
        not in a child task, so that a cancel drops the half link at once
        (``_try_link``); once both worked we tell the peer (link_up), whose
        link is up only then.

        With a peer that offers put probes (its handshake said so, see
        :mod:`.probe`), each half is one put: probe_back carries the nonce
        we put into its slot, it answers once it found that nonce and its
        own put to us is done, and we then find its nonce in our slot.
        """
        loop = asyncio.get_running_loop()
        left = max(deadline - loop.time(), 0.05)
        nonce, slot = b"", 0
        if offers_put_probe(conn.peer_probe) and type(conn.peer_probe.get("addr")) is int:
            nonce, slot = new_nonce(), int(conn.peer_probe["addr"])
        # The peer's half gets a little less than what is left, so that its
        # answer can travel back before our deadline; we wait no longer.
        theirs = max(left - min(0.25, left / 4), 0.01)
        back_task = asyncio.ensure_future(ask(conn, ProbeBack(theirs, nonce, slot), timeout=left))
        try:
            # Two turns of the loop: the request is queued, then the
            # connection's writer sends it, before our half's first steps.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            problem, _ = await self._prober.half(link, left, nonce)
            if problem:
                raise make_error(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"data path from us to cluster {cid} does not work: {problem}",
                )
            await self._peer_half(cid, link, back_task, nonce, deadline)
        except LLMException as exc:
            self._links.drop_link(link, f"data path check failed: {exc.message}")
            await conn.close("data path check failed")
            with self._state.lock:
                current = self._state.links.get(cid)
            if current is not None and current is not link and not current.broken:
                # The peer's simultaneous link replaced ours while we probed
                # it (see Links.on_connected): that one is ours too.
                return LLMStatusCode.LLM_ALREADY_LINK, "the peer's link won"
            return exc.status_code, exc.message
        finally:
            _settle(back_task)
        link.up = True
        conn.send_event(LINK_UP, {})
        if self._on_up is not None:
            self._on_up(link)
        return LLMStatusCode.LLM_SUCCESS, ""

    async def _peer_half(
        self,
        cid: int,
        link: Link,
        back_task: asyncio.Future[ProbeResult],
        mine: bytes,
        deadline: float,
    ) -> None:
        """The peer's half of the data-path check (its probe_back answer and,
        after a put probe of our nonce ``mine``, its nonce in our slot);
        LLMException when it failed."""
        try:
            # Shielded: a cancel reaches us here at once, not after the
            # request's own teardown (the caller's finally ends it).
            back = await asyncio.shield(back_task)
        except BadReply as exc:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cluster {cid} answered the data path check badly: {exc}",
            ) from None
        if back.problem:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"data path check failed on cluster {cid}'s side: {back.problem}",
            )
        if mine:
            if back.nonce == mine:
                # Our own nonce, which our probe's source slot holds: found
                # there without the peer moving a byte.
                raise make_error(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"cluster {cid} answered the data path check with our own nonce",
                )
            left = max(deadline - asyncio.get_running_loop().time(), 0.05)
            seen = await self._prober.nonce_arrived(link, back.slot, back.nonce, left)
            if seen:
                raise make_error(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"data path from cluster {cid} to us does not work: {seen}",
                )

    # ----------------------------------------------------------- unlinking

    async def unlink_all(
        self, cluster_ids: Sequence[int], timeout_ms: int, force: bool
    ) -> list[LLMStatusCode]:
        """Unlink each cluster in turn; one status each.

        As in LLM-DataDist: a cluster with no link is SUCCESS; a plain
        unlink waits until our transfers on the link are released, then
        tells the peer, which drops its side too and answers once its own
        are released (the link is then proven quiescent on both sides);
        ``force`` tears down our side only — the peer's link
        breaks (its transfers fail) but stays until it unlinks, so both
        sides may force-unlink in any order.
        """
        results: list[LLMStatusCode] = []
        for cid in cluster_ids:
            with self._state.lock:
                link = self._state.links.get(cid)
            if link is None:
                results.append(LLMStatusCode.LLM_SUCCESS)
                continue
            reason = FORCE_UNLINKED if force else "unlinked"
            live = self._links.drop_link(link, reason)
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    if not force:
                        # Our jobs on the link are over before we ask: the
                        # peer counts the link quiescent once it answers.
                        await self._links.settled(live, link.ep)
                        with contextlib.suppress(LLMException):
                            await ask(link.conn, Unlink(), timeout=timeout_ms / 1000)
                            self._links.quiesced(link)
                    await link.conn.close(reason)
            except TimeoutError:
                results.append(
                    LLMStatusCode.LLM_UNLINK_FAILED if not force else LLMStatusCode.LLM_SUCCESS
                )
                continue
            results.append(LLMStatusCode.LLM_SUCCESS)
        return results


def _settle(task: asyncio.Future[Any]) -> None:
    """End a probe_back request we no longer wait for (cancelled, or its
    outcome read so that no error goes unretrieved)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
