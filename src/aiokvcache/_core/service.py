"""The peer service: one thread per ``LLMDataDist`` that owns the control plane.

It runs its own asyncio loop with the control server, every control
connection (accepted and initiated), handshakes, the cache-metadata requests
peers send us and those we send them, invalidations and their
acknowledgements. So peers are served while the owner's event loop is blocked
in a syscall, a synchronous model step or a barrier, as LLM-DataDist serves
them from native threads. The data plane needs no Python on the passive side
at all (one-sided UCX, driven by the engine's progress thread).

The owner reaches the service through :meth:`PeerService.call` (a coroutine
run on the service loop, awaited from the owner's loop through
``asyncio.wrap_future``: the owner's future is completed on the owner's loop)
and :meth:`PeerService.spawn` (fire and track). The service never touches the
bridge and never completes a future of the owner's loop itself. Shared tables
follow :mod:`.state`'s locking rule.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from .._bridge import OP_GET, OP_PUT
from .._loader import native
from . import control
from .catalog import forget_link, install_remote, metadata, retire_remote
from .ctlregion import PROBE_BYTES
from .errors import LLMException, LLMStatusCode, make_error, param_invalid
from .state import Lease, Link, LocalCache, State
from .types import BlocksCacheKey, CacheKey, LLMClusterInfo

__all__ = ["SERVICE_ERRORS", "SERVICE_ERROR_COUNT", "PeerService", "overall", "until"]

log = logging.getLogger("aiokvcache")

T = TypeVar("T")

# How long a retiring cache waits for a linked peer to confirm that it will
# not use the cache any more; a peer that does not is cut off (its link
# dropped, the memory waiting for our endpoint to it to close).
RETIRE_TIMEOUT_S = 5.0
METADATA_TIMEOUT_S = 10.0
MAX_ADDRS_PER_REQUEST = 4096
_PEER_FINALIZING = "the peer finalized"
# The close reason of a forced unlink: the peer keeps its (broken) link
# until it unlinks too, as in LLM-DataDist.
_FORCE_UNLINKED = "force-unlinked"
# Native releases and endpoint closes are polled (never waited for in an
# executor thread a hostile peer could tie up), from this interval up to
# _POLL_MAX_S.
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.02
# The data-path probe of a new link: a nonce put to the peer and read back.
_NONCE_BYTES = 16
# The longest probe a peer may ask of us (probe_back); longer asks are cut.
PROBE_MAX_S = 30.0
# Pause before asking again a peer that still holds a link we dropped.
_RELINK_PAUSE_S = 0.05

#: The latest errors that reached a service loop's exception handler, and
#: how many there were in all (tests assert none; bounded for long runs).
SERVICE_ERRORS: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
SERVICE_ERROR_COUNT = [0]


def overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
    """The last non-success status of ``results``, else SUCCESS (as
    LLM-DataDist's link manager reports it)."""
    for r in reversed(results):
        if r != LLMStatusCode.LLM_SUCCESS:
            return r
    return LLMStatusCode.LLM_SUCCESS


async def until(done: Callable[[], bool], timeout: float | None = None) -> bool:
    """Poll ``done()`` on the running loop until it is true (True) or
    ``timeout`` seconds pass (False): backing off from _POLL_MIN_S to
    _POLL_MAX_S, so a short wait is short and a long one costs little."""
    loop = asyncio.get_running_loop()
    end = None if timeout is None else loop.time() + timeout
    pause = _POLL_MIN_S
    while not done():
        if end is not None and loop.time() >= end:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)
    return True


class PeerService:
    """The service thread, its loop, and everything that runs there."""

    def __init__(self, state: State) -> None:
        self._state = state
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        self._server: control.ControlServer | None = None
        self._listen_spec: tuple[str, int] | None = None  # as asked, host not resolved
        self._tasks: set[asyncio.Task[Any]] = set()
        self._fetching: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._thread = threading.Thread(
            target=self._main, name=f"aiokvcache-service-{state.cluster_id}", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------- the thread

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @staticmethod
    def _on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        SERVICE_ERRORS.append(context)
        SERVICE_ERROR_COUNT[0] += 1
        loop.default_exception_handler(context)

    def in_service(self) -> bool:
        """True when called on the service thread."""
        return threading.current_thread() is self._thread

    def call(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Run ``coro`` on the service loop; await the result on the calling loop.

        Cancelling the returned future cancels the coroutine's task.
        """
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the service loop in the background (from any thread)."""
        return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)

    async def _tracked(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokvcache: background task failed")
            return None
        finally:
            self._tasks.discard(task)

    def stop(self) -> None:
        """Stop the loop (pending tasks are cancelled) and join the thread."""
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if not self.in_service():
            self._thread.join(timeout=10)

    # ------------------------------------------------------------- listener

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The bound (host, port) of the control server, if it listens."""
        return None if self._server is None else self._server.address

    async def listen(self, host: str, port: int) -> None:
        """Start the control server (service loop)."""
        server = control.ControlServer(self._state.local, self)
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

    # ----------------------------------------------------------------- links

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
            self.break_link(existing, "no answer to a liveness check")
            self.spawn(existing.conn.close("no answer to a liveness check"))
        with st.lock:
            existing = st.links.get(cid)
            if existing is not None and not existing.broken:
                return LLMStatusCode.LLM_ALREADY_LINK
            if cid in st.linking:
                return LLMStatusCode.LLM_PROCESSING_LINK
            if not info.remote_ip_info:
                log.warning("aiokvcache: link to cluster %d: no remote_ip_info", cid)
                return LLMStatusCode.LLM_PARAM_INVALID
            st.linking.add(cid)
        addresses = list(info.remote_ip_info)
        attempts = max(1, st.options.link_retry_count)
        try:
            status = LLMStatusCode.LLM_LINK_FAILED
            for attempt in range(attempts):
                # Every address of the cluster in turn, each with a fair share
                # of what is left, so one silent address cannot eat it all.
                for i, (host, port) in enumerate(addresses):
                    left = (deadline - loop.time()) / (len(addresses) - i)
                    if left <= 0:
                        break
                    status, reason = await self._try_link(cid, host, port, left)
                    if status == LLMStatusCode.LLM_ALREADY_LINK and self._linked(cid):
                        # Both sides linked at once and the peer's link won
                        # (see on_connected): ours once it is up.
                        return await self._await_up(cid, deadline)
                    while status == LLMStatusCode.LLM_ALREADY_LINK and not self._linked(cid):
                        # The peer still holds the link we dropped: its close is
                        # on the way (or its heartbeat will notice). Ask again.
                        left = deadline - loop.time() - _RELINK_PAUSE_S
                        if left <= 0:
                            break
                        await asyncio.sleep(_RELINK_PAUSE_S)
                        status, reason = await self._try_link(cid, host, port, left)
                    if status == LLMStatusCode.LLM_ALREADY_LINK and self._linked(cid):
                        return await self._await_up(cid, deadline)
                    if status in (
                        LLMStatusCode.LLM_SUCCESS,
                        LLMStatusCode.LLM_ALREADY_LINK,
                        LLMStatusCode.LLM_PARAM_INVALID,
                    ):
                        return status
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
        finally:
            with st.lock:
                st.linking.discard(cid)

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

    def _linked(self, cid: int) -> bool:
        """True while we hold a live link to ``cid``."""
        with self._state.lock:
            link = self._state.links.get(cid)
        return link is not None and not link.broken

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

        A link is up only once its data path moved bytes both ways: we put a
        nonce into the peer's memory and read it back over our endpoint, and
        the peer does the same over its endpoint to us. Either half failing
        drops the link and says which half it was.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            # The handshake checks the peer's cluster id before it tells the
            # peer anything (expected_cluster_id).
            conn = await control.connect(
                host, port, self._state.local, self, timeout, expected_cluster_id=cid
            )
        except LLMException as exc:
            return exc.status_code, str(exc)
        with self._state.lock:
            link = self._state.links.get(cid)
        if link is None or link.conn is not conn:
            if link is not None and not link.broken:
                # The peer's own link to us replaced ours (both sides linked
                # at once, see on_connected): that one is ours too.
                return LLMStatusCode.LLM_ALREADY_LINK, "the peer's link won"
            return LLMStatusCode.LLM_LINK_FAILED, "the link went away during its set-up"
        try:
            return await self._check_data_path(cid, link, conn, deadline)
        except BaseException:
            # Cancelled (the caller's timeout, task.cancel()): no half link
            # stays behind to answer later calls with "being set up".
            if not link.up:
                self.drop_link(link, "link set-up cancelled")
                self.spawn(conn.close("link set-up cancelled"))
            raise

    async def _check_data_path(
        self, cid: int, link: Link, conn: control.ControlConnection, deadline: float
    ) -> tuple[LLMStatusCode, str]:
        """Both halves of a new link's data path; the link is up after SUCCESS."""
        loop = asyncio.get_running_loop()
        try:
            left = max(deadline - loop.time(), 0.05)
            problem = await self.probe(link, left)
            if problem:
                raise make_error(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"data path from us to cluster {cid} does not work: {problem}",
                )
            left = max(deadline - loop.time(), 0.05)
            back = await conn.request("probe_back", {"timeout": left}, timeout=left + 1.0)
            if back.get("problem"):
                raise make_error(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"data path from cluster {cid} to us does not work: {back['problem']}",
                )
        except LLMException as exc:
            self.drop_link(link, f"data path check failed: {exc.message}")
            await conn.close("data path check failed")
            with self._state.lock:
                current = self._state.links.get(cid)
            if current is not None and current is not link and not current.broken:
                # The peer's simultaneous link replaced ours while we probed
                # it (see on_connected): that one is ours too.
                return LLMStatusCode.LLM_ALREADY_LINK, "the peer's link won"
            return exc.status_code, exc.message
        link.up = True
        return LLMStatusCode.LLM_SUCCESS, ""

    def _probe_info(self) -> dict[str, Any]:
        """A probe slot of ours for the peer, and the key to our control region."""
        ctl = self._state.ctl
        return {
            "addr": ctl.probe_slot(),
            "len": PROBE_BYTES,
            "base": ctl.base,
            "span": ctl.size,
            "rkey": ctl.rkey,
        }

    def _install_ctl(self, link: Link, info: dict[str, Any]) -> tuple[int, int]:
        """Check the peer's probe_info; unpack its control-region key once per
        link. Returns (the peer's probe slot address, our rkey id for it)."""
        fields = [info.get(k) for k in ("addr", "len", "base", "span")]
        packed = info.get("rkey")
        if not all(type(v) is int for v in fields) or not isinstance(packed, bytes):
            raise ValueError("the peer sent a bad probe buffer")
        addr, length, base, span = (int(v) for v in fields)  # type: ignore[arg-type]
        if not (
            length == PROBE_BYTES
            and 0 < base
            and 0 < span <= 1 << 30
            and base <= addr
            and addr + PROBE_BYTES <= base + span < 2**64
        ):
            raise ValueError("the peer sent a bad probe buffer")
        if link.ctl_rkey is None:
            rkey = self._state.engine.rkey_unpack(link.ep, packed, base, span)
            with self._state.lock:
                if link.ctl_rkey is None:
                    link.ctl_rkey, link.ctl_span = rkey, (base, span)
                    rkey = -1
            if rkey != -1:  # a concurrent probe installed it first
                with contextlib.suppress(native.NativeError):
                    self._state.engine.rkey_release(rkey)
        elif (base, span) != link.ctl_span:
            raise ValueError("the peer's control region moved")
        assert link.ctl_rkey is not None
        return addr, link.ctl_rkey

    async def probe(self, link: Link, timeout: float) -> str:
        """Move a nonce to the peer and back over our endpoint; '' or what failed.

        Both sides' buffers are probe slots in the two control regions, which
        live as long as their engines: a put or get that outlives this probe
        (a frozen peer) can never land in memory that was reused. Our jobs
        hold a lease on our control region like any transfer's on a cache.
        """
        st = self._state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout  # the whole probe, every step
        try:
            info = await link.conn.request("probe_info", {}, timeout=timeout)
            peer_slot, rkey = self._install_ctl(link, info)
        except (LLMException, ValueError, native.NativeError) as exc:
            return f"no probe buffer from the peer ({exc})"
        local = st.ctl.probe_slot()
        nonce = secrets.token_bytes(_NONCE_BYTES)
        st.ctl.write(local, nonce + bytes(_NONCE_BYTES))
        ms = max(1, int(min(timeout, PROBE_MAX_S) * 1000))
        put = [[local, peer_slot, _NONCE_BYTES, rkey]]
        get = [[local + _NONCE_BYTES, peer_slot, _NONCE_BYTES, rkey]]
        for what, op, rows in (("put", OP_PUT, put), ("get", OP_GET, get)):
            left = max(deadline - loop.time(), 0.001)
            problem = await self._probe_job(link, what, op, rows, ms, left)
            if problem:
                return problem
        if st.ctl.read(local + _NONCE_BYTES, _NONCE_BYTES) != nonce:
            return "the bytes did not make the round trip (a put or get failed)"
        return ""

    async def _probe_job(
        self, link: Link, what: str, op: int, rows: list[list[int]], ms: int, timeout: float
    ) -> str:
        """One probe job, under a lease on our control region; '' or what failed."""
        st = self._state
        segs = np.array(rows, dtype=np.uint64)
        try:
            lease = st.lease((st.ctl,), lambda: [st.engine.submit(op, link.ep, segs, b"", ms)])
        except (native.NativeError, LLMException) as exc:
            return f"the probe's {what} could not start ({exc})"
        try:
            if not await until(lambda: st.leases_over((lease,)), timeout):
                return f"the probe's {what} did not end in time"
        finally:
            if st.leases_over((lease,)):
                st.end_lease(lease)
            else:  # the engine ends it (its deadline passed): then give it back
                self.spawn(self._end_when_over(lease))
        return ""

    async def _end_when_over(self, lease: Lease) -> None:
        await until(lambda: self._state.leases_over((lease,)))
        self._state.end_lease(lease)

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
            reason = _FORCE_UNLINKED if force else "unlinked"
            live = self.drop_link(link, reason)
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    if not force:
                        # Our jobs on the link are over before we ask: the
                        # peer counts the link quiescent once it answers.
                        await self._settled(live, link.ep)
                        with contextlib.suppress(LLMException):
                            await link.conn.request("unlink", {}, timeout=timeout_ms / 1000)
                            self._quiesced(link)
                    await link.conn.close(reason)
            except TimeoutError:
                results.append(
                    LLMStatusCode.LLM_UNLINK_FAILED if not force else LLMStatusCode.LLM_SUCCESS
                )
                continue
            results.append(LLMStatusCode.LLM_SUCCESS)
        return results

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

    def _quiesced(self, link: Link) -> None:
        """Nothing the peer posted on ``link`` can reach our memory any more:
        no retirement waits for it."""
        st = self._state
        with st.lock:
            link.quiescent = True
            for rec in st.registry.caches.values():
                rec.exposed.discard(link)

    def break_link(self, link: Link, reason: str) -> None:
        """Mark a link broken and fail its endpoint (every job on it ends)."""
        with self._state.lock:
            if link.broken:
                return
            link.broken = True
            link.reason = reason
        with contextlib.suppress(native.EngineClosedError):
            self._state.engine.fail_endpoint(link.ep)

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
            self.spawn(link.conn.close(reason))

    async def announce_finalizing(self) -> None:
        """Tell every linked peer we are going, so its errors read as a shutdown."""
        with self._state.lock:
            links = [lk for lk in self._state.links.values() if not lk.broken]
        if links:
            await asyncio.gather(
                *(lk.conn.request("finalizing", {}, timeout=1.0) for lk in links),
                return_exceptions=True,
            )

    async def close(self) -> None:
        """Close the server and every connection; cancel background work."""
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.close()
        with self._state.lock:
            links = list(self._state.links.values())
            self._state.links.clear()
        for link in links:
            with contextlib.suppress(Exception):
                await link.conn.close("finalized")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------- control.Handler side

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
                self.spawn(existing.conn.close("replaced by a simultaneous link"))
            self.drop_link(existing, "replaced by a new link")
        # UCX peer-failure handling only for RDMA: UCX refuses it on shared
        # memory, and over TCP it cost 3.5x in bandwidth here (0.35 vs 1.23
        # GB/s); TCP errors still fail the operations (LINK_FAILED), and a
        # dead peer's control connection breaks the link on any transport.
        peer_errors = st.options.transport == "rdma"
        try:
            ep = st.engine.connect(conn.peer_worker_address, peer_errors)
        except native.NativeError as exc:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cannot reach cluster {cid}'s transfer engine: {exc}",
            ) from exc
        try:
            # Notifications we send carry the key the peer gave us; those
            # that carry ours are attributed to this link (ext/engine.hpp).
            st.engine.set_note_keys(ep, conn.peer_note_key, conn.local_note_key, cid)
        except native.NativeError as exc:
            with contextlib.suppress(native.NativeError):
                st.engine.disconnect(ep)
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED, f"cluster {cid} sent a bad notification key: {exc}"
            ) from exc
        link = Link(cid, conn, ep)
        with st.lock:
            st.links[cid] = link
        if st.options.peer_timeout_ms:
            self._loop.create_task(self._heartbeat(link), name=f"aiokvcache.heartbeat.{cid}")
        log.info("aiokvcache: cluster %d linked with cluster %d", st.cluster_id, cid)

    def _wins(self, conn: control.ControlConnection, existing: Link) -> bool:
        """Simultaneous set-up: does ``conn`` replace ``existing`` (not up yet)?"""
        me, peer = self._state.cluster_id, conn.peer_cluster_id

        def initiator(c: control.ControlConnection) -> int:
            return me if c.initiator else peer

        new, old = initiator(conn), initiator(existing.conn)
        return new != old and new < old

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
        may have been the one starved).
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
            if silent <= timeout:
                continue
            if not self._heartbeat_current(link):
                return
            log.warning(
                "aiokvcache: cluster %d silent for %.1f s: link broken", link.cluster_id, silent
            )
            self.break_link(link, f"peer silent for {timeout:.1f} s")
            await link.conn.close(f"peer silent for {timeout:.1f} s")
            return

    def _heartbeat_current(self, link: Link) -> bool:
        """``link`` is still the cluster's link, unbroken, its connection open."""
        with self._state.lock:
            current = self._state.links.get(link.cluster_id) is link and not link.broken
        return current and not link.conn.closed

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
        if op == "finalizing":
            # The peer's engine is about to go: break the link now, so the
            # transport errors that follow read as a shutdown, not a failure.
            log.info("aiokvcache: cluster %d is finalizing", link.cluster_id)
            self.break_link(link, _PEER_FINALIZING)
            return {}
        if op == "unlink":
            # A plain unlink: our side goes, and our transfers on the link are
            # released, before the peer's call returns: it may then treat the
            # link as quiescent (LLM-DataDist's disconnect waits so too).
            await self._settled(self.drop_link(link, "unlinked by peer"), link.ep)
            # The peer's own jobs on the link were over before it asked (see
            # unlink_all): nothing it posted can reach our memory any more.
            self._quiesced(link)
            return {}
        if op == "probe_info":
            return self._probe_info()
        if op == "probe_back":
            tmo = body.get("timeout")
            if not isinstance(tmo, float) or not tmo > 0:
                raise param_invalid("probe_back: timeout must be a float > 0")
            problem = await self.probe(link, min(tmo, PROBE_MAX_S))
            if not problem:
                link.up = True  # both halves of the data path work
            return {"problem": problem}
        if op == "invalidate":
            cid = body.get("cache_id")
            if not isinstance(cid, int):
                raise param_invalid("invalidate: cache_id must be int")
            await self._drop_remote(link, cid)
            return {}
        # No await from here to the answer: a lookup's response is queued
        # before any invalidation of what it names (both leave this loop in
        # order on one connection), so the peer never installs metadata it
        # was told is gone.
        return self._serve_lookup(link, op, body)

    async def _settled(self, ids: list[int], ep: int) -> None:
        """Our jobs ``ids`` are released, and none released unproven on
        ``ep`` can move bytes any more (its close completed)."""
        engine = self._state.engine
        await until(lambda: self._released_now(ids))
        await until(lambda: not engine.endpoint_unproven(ep))

    def _released_now(self, ids: list[int]) -> bool:
        engine = self._state.engine
        return not ids or engine.closed or bool(engine.wait_released(ids, 0.0))

    def _serve_lookup(self, link: Link, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Serve a metadata lookup; every cache it names is recorded as
        exposed to ``link`` in the same critical section (see state.py)."""
        st = self._state
        reg = st.registry
        access = st.options.enable_remote_cache_accessible
        if op == "cache_by_id":
            cid = body.get("cache_id")
            if not isinstance(cid, int):
                raise param_invalid("cache_by_id: cache_id must be int")
            with st.lock:
                rec = reg.served(cid, access)
                rec.exposed.add(link)
            return metadata(st, rec)
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
            with st.lock:
                bound = reg.keys.get(key)
                if bound is None:
                    raise make_error(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no cache is bound to {key!r}"
                    )
                rec = reg.served(bound[0], access)
                rec.exposed.add(link)
            out = metadata(st, rec)
            out["batch_index"] = bound[1]
            return out
        if op == "blocks_by_key":
            try:
                bkey = BlocksCacheKey(body["cluster_id"], body["model_id"])
            except (KeyError, TypeError, ValueError) as exc:
                raise param_invalid(f"blocks_by_key: bad key: {exc}") from None
            with st.lock:
                bound_id = reg.blocks_keys.get(bkey)
                if bound_id is None:
                    raise make_error(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                        f"no blocks cache is bound to {bkey!r}",
                    )
                rec = reg.served(bound_id, access)
                rec.exposed.add(link)
            return metadata(st, rec)
        if op == "cache_by_addr":
            addrs = body.get("addrs")
            if (
                not isinstance(addrs, list)
                or len(addrs) > MAX_ADDRS_PER_REQUEST
                or not all(isinstance(a, int) for a in addrs)
            ):
                raise param_invalid("cache_by_addr: addrs must be a list of ints")
            found: dict[int, LocalCache] = {}
            with st.lock:
                for a in addrs:
                    hit = reg.cache_at(a)  # O(log n): never a scan under the lock
                    if hit is not None and hit.cache_id not in found:
                        found[hit.cache_id] = reg.served(hit.cache_id, access)
                        hit.exposed.add(link)
            return {"caches": [metadata(st, rec) for rec in found.values()]}
        raise param_invalid(f"unknown request {op!r}")

    def on_event(self, conn: control.ControlConnection, op: str, body: dict[str, Any]) -> None:
        """Peers send no events in this protocol version; log and ignore."""
        log.warning("aiokvcache: unexpected event %r from cluster %d", op, conn.peer_cluster_id)

    def on_closed(self, conn: control.ControlConnection, reason: str) -> None:
        """The control connection closed: the link is broken (or was unlinked)."""
        st = self._state
        with st.lock:
            link = st.links.get(conn.peer_cluster_id)
        if link is None or link.conn is not conn:
            return
        if reason == "peer closed: unlinked":
            self.drop_link(link, "unlinked by peer")
            return
        if st.finalized:
            level = logging.DEBUG
        elif (
            reason in ("peer closed: finalized", f"peer closed: {_FORCE_UNLINKED}")
            or link.reason == _PEER_FINALIZING
        ):
            level = logging.INFO
        else:
            level = logging.WARNING
        log.log(level, "aiokvcache: link to cluster %d closed: %s", link.cluster_id, reason)
        self.break_link(link, f"control connection closed ({reason})")
        forget_link(st, link)

    # --------------------------------------------- remote metadata (ours)

    async def remote_by_id(self, link: Link, cache_id: int) -> Any:
        """The peer's cache ``cache_id``, fetched once per link (concurrent asks share it)."""
        with self._state.lock:
            rc = link.remote.get(cache_id)
        if rc is not None:
            return rc
        key = (id(link), cache_id)
        fut = self._fetching.get(key)
        if fut is None:
            fut = self._loop.create_future()
            self._fetching[key] = fut
            self._loop.create_task(self._fetch(link, cache_id, key, fut))
        return await asyncio.shield(fut)

    async def _ensure_ctl(self, link: Link) -> None:
        """Our key to the peer's control region, before any of its metadata
        is installed: every remote cache record then has its retirement
        guard (a lookup can come before the link's probe installed the key)."""
        if link.ctl_rkey is not None:
            return
        info = await link.conn.request("probe_info", {}, timeout=METADATA_TIMEOUT_S)
        try:
            self._install_ctl(link, info)
        except (ValueError, native.NativeError) as exc:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cluster {link.cluster_id} sent a bad control region: {exc}",
            ) from None

    async def _fetch(
        self, link: Link, cache_id: int, key: tuple[int, int], fut: asyncio.Future[Any]
    ) -> None:
        try:
            await self._ensure_ctl(link)
            meta = await link.conn.request(
                "cache_by_id", {"cache_id": cache_id}, timeout=METADATA_TIMEOUT_S
            )
            rc = install_remote(self._state, link, meta)
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
            self._fetching.pop(key, None)

    async def remote_by_key(self, link: Link, key: CacheKey) -> tuple[Any, int]:
        """The peer's cache and batch index bound to ``key`` (asked every time)."""
        await self._ensure_ctl(link)
        meta = await link.conn.request(
            "cache_by_key",
            {
                "cluster_id": key.cluster_id,
                "req_id": key.req_id,
                "model_id": key.model_id,
                "prefix_id": key.prefix_id,
            },
            timeout=METADATA_TIMEOUT_S,
        )
        sb = meta.get("batch_index")
        if type(sb) is not int or not 0 <= sb < 2**63:
            raise make_error(LLMStatusCode.LLM_FAILED, "peer sent no valid batch_index")
        return install_remote(self._state, link, meta), sb

    async def remote_blocks(self, link: Link, key: BlocksCacheKey) -> Any:
        """The peer's blocks cache bound to ``key`` (asked every time: keys rebind)."""
        await self._ensure_ctl(link)
        meta = await link.conn.request(
            "blocks_by_key",
            {"cluster_id": key.cluster_id, "model_id": key.model_id},
            timeout=METADATA_TIMEOUT_S,
        )
        remote = install_remote(self._state, link, meta)
        if not remote.is_blocks:
            raise make_error(
                LLMStatusCode.LLM_FAILED, f"cluster {link.cluster_id} sent a non-blocks cache"
            )
        return remote

    async def remotes_by_addr(self, link: Link, addrs: list[int]) -> None:
        """Ask the peer which caches hold ``addrs``; record every one it names."""
        await self._ensure_ctl(link)
        for k in range(0, len(addrs), MAX_ADDRS_PER_REQUEST):
            resp = await link.conn.request(
                "cache_by_addr",
                {"addrs": addrs[k : k + MAX_ADDRS_PER_REQUEST]},
                timeout=METADATA_TIMEOUT_S,
            )
            caches = resp.get("caches")
            if not isinstance(caches, list):
                raise make_error(
                    LLMStatusCode.LLM_FAILED, f"cluster {link.cluster_id} sent a bad cache_by_addr"
                )
            for meta in caches:
                if not isinstance(meta, dict):
                    raise make_error(
                        LLMStatusCode.LLM_FAILED,
                        f"cluster {link.cluster_id} sent bad cache metadata",
                    )
                install_remote(self._state, link, meta)

    # ---------------------------------------------------------- retirement

    async def _over(self, leases: list[Lease]) -> None:
        """Cancel the native jobs of ``leases`` and wait until every use is over."""
        st = self._state
        st.cancel_leases(leases)
        await until(lambda: st.leases_over(leases))

    async def _drop_remote(self, link: Link, cache_id: int) -> None:
        """The peer retires a cache: stop our jobs on it, wait for them, then confirm."""
        st = self._state
        with st.lock:
            rc = link.remote.pop(cache_id, None)
            if rc is None:
                return
            rc.valid = False  # no job starts on it from here on
            leases = list(rc.leases)
        await self._over(leases)
        # A job of ours released unproven may still move bytes until its
        # endpoint closed: the owner must not hear "done" before.
        await until(lambda: st.used_quiet(rc))
        retire_remote(st, rc)

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
            if not rec.valid or st.registry.caches.get(rec.cache_id) is not rec:
                raise make_error(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"cache {rec.cache_id} was already released",
                )
            st.registry.drop(rec)  # out of every lookup, no new use of it
            leases = list(rec.leases)
            st.ctl.guard_retire(rec.guard_slot)
        owners = rec.cache._owner
        rec.cache._invalidate()
        # Our own transfers on it stop now; the memory waits for them below.
        st.cancel_leases(leases)
        self.spawn(self._release_later(rec, leases, owners))

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
        self.drop_link(link, f"cut off: {why}")
        if not link.conn.closed:
            self.spawn(link.conn.close(f"cut off: {why}"))

    async def _invalidate_at(self, link: Link, cache_id: int) -> bool:
        try:
            await link.conn.request("invalidate", {"cache_id": cache_id}, timeout=RETIRE_TIMEOUT_S)
        except LLMException as exc:
            log.info(
                "aiokvcache: cluster %d did not confirm invalidation: %s", link.cluster_id, exc
            )
            return False
        return True
