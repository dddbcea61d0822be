"""The decode side of a transfer: loads (pulls, or waits for a prefill's
pushes) into the engine's blocks, each reported received or failed once
nothing writes into those blocks any more."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from ... import BlocksCacheKey, LLMException
from .calls import Tally, counting, current
from .handoff import blocks_digest
from .kvtypes import (
    RUNS_PER_PART,
    HeadSpan,
    KVLayout,
    Peer,
    Source,
    TransferFailed,
    block_digest,
    block_runs,
    head_units,
)
from .links import PeerLinks
from .results import Results
from .wire import Cancel, Claim, Done, Free, Grant, Pushed, PushFail, Refused, Reg, Renew

__all__ = ["DecodeLoads"]

log = logging.getLogger("aiokvcache.vllm")

#: How often a load waiting for the prefill's word that its pushes stopped
#: looks whether the link to it is still there.
_LINK_CHECK_S = 0.25


def _span(picks: list[int]) -> str:
    return f"[{min(picks)}, {max(picks)}]" if picks else "[]"


async def _all(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` at once (one load's part from each prefill worker); the
    first to fail cancels the others, and its error is raised once every
    one ended (each is quiescent when it does)."""
    todo = list(coros)
    if len(todo) == 1:
        await todo[0]
        return
    try:
        async with asyncio.TaskGroup() as tg:
            for c in todo:
                tg.create_task(c)
    except BaseExceptionGroup as eg:
        failed: list[BaseException] = [e for e in eg.exceptions if isinstance(e, TransferFailed)]
        raise (failed or list(eg.exceptions))[0] from None


def _count_pushed(layout: KVLayout, m: Pushed, local_ids: list[int], span: HeadSpan | None) -> None:
    """A push load's bytes and segments: what P's push calls' records say
    they moved (a P that does not send them: this side's blocks, or the
    heads ``span`` of each, one segment per contiguous run and tensor)."""
    tally = current()
    if tally is None:
        return
    if m.nbytes >= 0 and m.segments >= 0:
        tally.nbytes += m.nbytes
        tally.segments += m.segments
        return
    tensors = layout.num_layers * layout.tensors_per_layer
    per_block = layout.unit_bytes * span.count if span is not None else layout.block_bytes
    tally.nbytes += len(local_ids) * per_block * tensors
    tally.segments += len(block_runs(local_ids)) * tensors


def _reg_shape(layout: KVLayout, span: HeadSpan | None) -> tuple[str, list[int] | None]:
    """A registration's layout digest and heads (see :class:`.wire.Reg`):
    whole blocks of as many heads as ``layout``'s, or ``span``'s heads."""
    if span is None:
        return layout.digest(per_rank=True), None
    heads = [span.remote_heads, span.remote_head, span.count, layout.heads]
    return layout.digest(), [*heads, span.local_head]


class DecodeLoads:
    """D: the engine's loads, each a task on the agent's loop thread (which
    alone calls this class), and the peers' answers they wait for, each bound
    to the peer it was asked of."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        timeout: float,
        grace: float,
        links: PeerLinks,
        results: Results,
        stats: dict[str, int],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        record_digests: bool = False,
    ) -> None:
        self.layout = layout
        self.timeout = timeout
        self.grace = grace
        self._links = links
        self._results = results
        self._stats = stats
        self._spawn = spawn
        #: Seconds each of the last 1000 successful loads took.
        self.load_seconds: collections.deque[float] = collections.deque(maxlen=1000)
        #: With ``record_digests``: request id -> block digest of what it loaded.
        self.digests: dict[str, str] | None = {} if record_digests else None
        #: Loads cancelled because the engine aborted them, not yet reported.
        self.aborted: set[str] = set()
        self._waits: dict[tuple[str, ...], tuple[int, asyncio.Future[Any]]] = {}
        self._recvs: dict[str, asyncio.Task[None]] = {}  # request id -> its load
        self._closing = False
        #: Pull: request id -> the prefill and the renewal its hold gets while
        #: the engine holds the request and has not started its load.
        #: Request id -> the prefill workers whose holds are renewed (cluster -> peer, renewal).
        self.renewing: dict[str, dict[int, tuple[Peer, Renew]]] = {}
        self._renewer: asyncio.Task[None] | None = None

    def pending(self) -> int:
        """Answers this side waits for."""
        return len(self._waits)

    def stop(self) -> None:
        """The agent shuts down: no peer's answer will come any more."""
        self._closing = True
        self.renewing.clear()

    # ------------------------------------------------------------ loads

    def start(self, req_id: str, local_ids: Sequence[int], coro: Coroutine[Any, Any, None]) -> None:
        """Run load ``coro`` of ``req_id`` into ``local_ids``; report it when it
        ends, with what its transfer calls moved."""
        ids = list(local_ids)
        task = self._spawn(self._recv(req_id, ids, coro))
        self._recvs[req_id] = task
        task.add_done_callback(lambda t: self._recv_done(t, req_id, ids, coro))

    def cancel(self, req_id: str) -> None:
        """The engine aborted ``req_id``: stop its load (see ``TransferAgent.cancel_recv``)."""
        task = self._recvs.get(req_id)
        if task is not None and not task.done():
            self.aborted.add(req_id)
            task.cancel()

    def _recv_done(
        self,
        task: asyncio.Task[None],
        req_id: str,
        local_ids: list[int],
        coro: Coroutine[Any, Any, None],
    ) -> None:
        if self._recvs.get(req_id) is task:
            del self._recvs[req_id]
        coro.close()  # one cancelled before it ever ran was never awaited
        aborted = req_id in self.aborted
        self.aborted.discard(req_id)  # (a load that failed as it was aborted: reported failed)
        if task.cancelled() and aborted:
            # The engine aborted it and nothing writes into its blocks any
            # more (see cancel): they may go back.
            self._stats["loads_aborted"] += 1
            self._fail(req_id, local_ids, "aborted", "the engine aborted the request")

    async def _recv(
        self, req_id: str, local_ids: list[int], coro: Coroutine[Any, Any, None]
    ) -> None:
        t0 = time.perf_counter()
        tally = Tally(self._results.called)
        try:
            with counting(tally):  # a pull's calls count here; a push's come in Pushed
                await coro
        except TransferFailed as exc:
            self._fail(req_id, local_ids, exc.reason, str(exc))
            return
        except Exception as exc:
            self._fail(req_id, local_ids, "other", str(exc))
            return
        took = time.perf_counter() - t0
        self._stats["blocks_loaded"] += len(local_ids)
        self.load_seconds.append(took)
        if self.digests is not None:
            self.digests[req_id] = block_digest(self.layout, local_ids)
        self._results.loaded(req_id, took, tally.nbytes, tally.segments)

    def _fail(self, req_id: str, local_ids: list[int], reason: str, why: str) -> None:
        if reason != "aborted":
            log.warning("aiokvcache: request %s: KV load failed: %s", req_id, why)
            self._stats["load_failures"] += 1
        self._results.failed(req_id, local_ids, reason)

    # ------------------------------------------------------------ pull

    async def pull_all(
        self,
        sources: list[Source],
        rid: str,
        remote_all: list[int],
        picks: list[int],
        local_ids: list[int],
        digest: str | None,
        until_ms: int,
    ) -> None:
        """One load from each of ``sources`` (a prefill of another
        tensor-parallel size: each prefill worker its heads), all at once.
        The first to fail cancels the others, and raises once every one is
        quiescent."""

        await _all(
            self.pull(
                s.peer,
                rid,
                remote_all,
                picks,
                local_ids,
                digest,
                (s.key, until_ms),
                s.span,
                s.readers,
            )
            for s in sources
        )

    async def pull(
        self,
        peer: Peer,
        rid: str,
        remote_all: list[int],
        picks: list[int],
        local_ids: list[int],
        digest: str | None,
        grant: tuple[str, int],
        span: HeadSpan | None = None,
        readers: int = 1,
    ) -> None:
        """Claim, read ``remote_all[i] for i in picks`` into ``local_ids`` (the
        heads ``span`` says, else whole blocks of as many heads as ours), tell
        P done. ``readers``: how many decode workers read these blocks from P
        (P holds them until each is done)."""
        if digest is not None and digest != self.layout.digest():
            raise TransferFailed("the prefill instance's KV layout differs from ours", "layout")
        n = len(remote_all)
        if not local_ids or len(picks) != len(local_ids) or not 0 <= min(picks) <= max(picks) < n:
            raise TransferFailed(
                f"{len(local_ids)} blocks to read at indexes {_span(picks)} of a request of "
                f"{n} remote blocks",
                "layout",
            )
        first, last = min(picks), max(picks) + 1
        assert self._links.cm is not None
        deadline = time.monotonic() + self.timeout
        nonce = secrets.token_hex(8)
        key, until = grant
        claimed = False
        log.debug("pull %s from cluster %d: start", rid, peer.cluster_id)
        try:
            # Everything (link, claim, grant, read) within timeout; the read
            # cancelled by it is quiescent before this raises.
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.timeout):
                fut = self._expect(("grant", nonce), peer.cluster_id)
                ttl = deadline - time.monotonic()
                n, digest_all = len(remote_all), blocks_digest(remote_all)
                heads = span.remote_heads if span is not None else self.layout.heads
                claim = Claim(
                    rid, nonce, key, ttl, first, last, n, digest_all, until, readers, heads
                )
                claimed = True
                await self._links.send_to(peer, claim, deadline - time.monotonic())
                remote = [remote_all[i] for i in picks]
                await self._read(peer, rid, await fut, remote, local_ids, deadline, span)
            self._stats["pulls"] += 1
        except TimeoutError:
            raise TransferFailed(f"not loaded within {self.timeout} s", "timeout") from None
        except LLMException as exc:
            raise TransferFailed(str(exc), "link") from exc
        finally:
            self._waits.pop(("grant", nonce), None)
            if claimed:  # quiescent by now: P may free them (at its last claim's done)
                self._spawn(self._links.send(peer.cluster_id, Done(rid, nonce)))

    async def _read(
        self,
        peer: Peer,
        rid: str,
        answer: str,
        remote: list[int],
        local_ids: list[int],
        deadline: float,
        span: HeadSpan | None,
    ) -> None:
        """P answered the claim with ``answer``: read ``remote`` into ``local_ids``."""
        assert self._links.cm is not None
        log.debug("pull %s: %s", rid, answer)
        if answer != "grant":
            raise TransferFailed(f"the prefill instance refused: {answer}", "refused")
        lay = self.layout
        if span is None:
            span = HeadSpan(lay.heads, 0, 0, lay.heads)
        await self._links.cm.pull_blocks(
            BlocksCacheKey(peer.cluster_id),
            self._links.cache,
            head_units(remote, span.remote_heads, span.remote_head, span.count),
            lay.units(local_ids, span.local_head, span.count),
            tensor_num_per_layer=self.layout.tensors_per_layer,
            timeout=max(0.001, deadline - time.monotonic()),
        )

    def renew_start(self, req_id: str, peer: Peer, msg: Renew, every: float) -> None:
        """The engine holds ``req_id``'s params and will load it: keep the
        prefill's hold alive, one ``msg`` every ``every`` seconds, until
        :meth:`renew_stop` or the key's expiry (the prefill's maximum)."""
        self.renewing.setdefault(req_id, {})[peer.cluster_id] = (peer, msg)
        if self._renewer is None or self._renewer.done():
            self._renewer = self._spawn(self._renew_all(every))

    def renew_stop(self, req_id: str) -> None:
        """Its load started (the claim holds the blocks now) or it ended."""
        self.renewing.pop(req_id, None)

    async def _renew_all(self, every: float) -> None:
        while self.renewing and not self._closing:
            await asyncio.sleep(every)
            wall_ms = time.time() * 1000
            for rid, targets in list(self.renewing.items()):
                for cid, (peer, msg) in list(targets.items()):
                    if not isinstance(msg.until_ms, int) or wall_ms >= msg.until_ms:
                        del targets[cid]  # past the prefill's maximum
                        continue
                    self._spawn(self._notice(peer, msg))
                if not targets:
                    self.renewing.pop(rid, None)

    def free_remote(self, peer: Peer, msg: Free) -> None:
        """Tell ``peer`` this side will not read its request."""
        self._spawn(self._notice(peer, msg))

    # ------------------------------------------------------------ push

    async def expect_push_all(
        self,
        sources: list[tuple[Source, str]],
        local_ids: list[int],
        first: int,
        layout: str | None,
        groups: list[list[int]] | None = None,
        tokens: int | None = None,
    ) -> None:
        """One push load from each of ``sources`` (each a prefill worker and
        its transfer id: a prefill of another tensor-parallel size pushes
        from each worker its heads), all at once. The first to fail cancels
        the others, and raises once every one is quiescent. ``groups`` and
        ``tokens``: see :class:`.wire.Reg`."""
        await _all(
            self.expect_push(
                s.peer, xid, local_ids, first, s.key, layout, (s.span, s.readers, groups, tokens)
            )
            for s, xid in sources
        )

    async def expect_push(
        self,
        peer: Peer,
        xid: str,
        local_ids: list[int],
        first: int,
        key: str = "",
        layout: str | None = None,
        shape: tuple[HeadSpan | None, int, list[list[int]] | None, int | None] = (
            None,
            1,
            None,
            None,
        ),
    ) -> None:
        """Register, wait for ``pushed``.

        The load has its own nonce (one transfer may feed several loads:
        vLLM's ``n > 1`` children, a retry); the registration carries it,
        the transfer's push ``key`` from the request's params, this side's KV
        layout and P's deadline (what is left of D's ``timeout`` once linked,
        less a margin for the message's way and P's cancel:
        ``min(grace, timeout / 4)``). D waits ``timeout``. A load that ends
        any other way (a timeout, an abort, P's failure) gives its blocks back
        only once P answered that its pushes to it are quiescent, or once the
        link to P was unlinked with P's confirmation (or cut off): never on a
        clock alone, since P's Python may be starved past any deadline.
        ``shape``: the heads of each block P pushes (a prefill of another
        tensor-parallel size), the decode workers P pushes them to, each KV
        cache group's positions and the tokens loaded (see :class:`.wire.Reg`)."""
        if layout is not None and layout != self.layout.digest():
            raise TransferFailed("the prefill instance's KV layout differs from ours", "layout")
        nonce = secrets.token_hex(8)
        deadline = time.monotonic() + self.timeout
        fut = self._expect(("pushed", xid, nonce), peer.cluster_id)
        registered = finished = False
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.timeout):
                # Linked first: the deadline the registration carries counts
                # from its send, not from before a link set-up.
                await self._links.link(peer)
                registered = True
                await self._register(peer, xid, nonce, key, local_ids, first, deadline, shape)
                # Shielded: an abort must leave it for P's answer to the cancel.
                answer = await asyncio.shield(fut)
            finished = True
            if not isinstance(answer, Pushed):
                raise TransferFailed(f"the prefill instance failed: {answer}", "prefill")
            self._stats["pushes_received"] += 1
            _count_pushed(self.layout, answer, local_ids, shape[0])
        except TimeoutError:
            raise TransferFailed(f"not pushed within {self.timeout:g} s", "timeout") from None
        finally:
            aborted = False
            if registered and not finished:
                aborted = await self._stop_pushes(peer, xid, nonce, fut, deadline)
            self._waits.pop(("pushed", xid, nonce), None)
            if aborted:
                raise asyncio.CancelledError

    async def _register(
        self,
        peer: Peer,
        xid: str,
        nonce: str,
        key: str,
        local_ids: list[int],
        first: int,
        deadline: float,
        shape: tuple[HeadSpan | None, int, list[list[int]] | None, int | None],
    ) -> None:
        """Send ``local_ids`` to ``peer`` for load ``nonce`` of transfer ``xid``,
        in parts (``shape``: the heads P pushes, and its readers)."""
        margin = min(self.grace, self.timeout / 4)
        runs = block_runs(local_ids)
        step = RUNS_PER_PART
        parts = [runs[i : i + step] for i in range(0, len(runs), step)] or [[]]
        digest, heads = _reg_shape(self.layout, shape[0])
        for i, part in enumerate(parts):
            left = deadline - time.monotonic() - margin
            if left <= 0:
                raise TimeoutError
            msg = Reg(xid, i, len(parts), part, first, left, nonce, key, digest, heads, *shape[1:])
            await self._links.send_to(peer, msg, deadline - time.monotonic())

    async def _stop_pushes(
        self, peer: Peer, xid: str, nonce: str, fut: asyncio.Future[Any], deadline: float
    ) -> bool:
        """Timed out, aborted or failed before P's answer: P stops; its word
        that it stopped (a ``pushfail`` once its pushes to this load are
        quiescent, or a ``pushed``) ends the wait. P bounds its pushes by the
        registration's deadline, so its word comes by then unless its Python
        is starved or it is frozen: past that deadline and ``grace`` this
        side unlinks P, which its engine confirms only once its transfers
        on the link were released (or the link is cut off). An abort that
        comes meanwhile does not end the wait (it is reported as one after
        it, whence the result: whether one came); a shutdown does (the
        agent's listener, which would take P's word, is gone, and finalize
        ends the link)."""
        self._spawn(self._links.send(peer.cluster_id, Cancel(xid, nonce)))
        aborted = False
        while not fut.done() and not self._closing:
            left = deadline + self.grace - time.monotonic()
            if left <= 0 or not self._links.alive(peer.cluster_id):
                # No word from P in time, or its link is gone (the peer dead,
                # silent for peer_timeout, or unlinked): unlinked, confirmed.
                log.warning(
                    "aiokvcache: push %s: cluster %d did not confirm its pushes stopped: "
                    "unlinking it",
                    xid,
                    peer.cluster_id,
                )
                unlink = asyncio.ensure_future(self._links.quiesce(peer.cluster_id))
                while not unlink.done():
                    try:
                        await asyncio.shield(unlink)
                    except asyncio.CancelledError:
                        aborted = True
                break
            try:
                await asyncio.wait_for(asyncio.shield(fut), min(left, _LINK_CHECK_S))
            except asyncio.CancelledError:
                aborted = True
            except Exception:
                continue
        return aborted

    def drop_push(
        self, peer: Peer, xid: str, key: str = "", span: HeadSpan | None = None, readers: int = 1
    ) -> None:
        """Tell ``peer`` this side will not take transfer ``xid``'s pushes
        (``span``, ``readers``: as the load would have registered)."""
        # An empty registration, with the request's push key: nothing to
        # push to this load; P reports the request sent once it takes no more.
        digest, heads = _reg_shape(self.layout, span)
        msg = Reg(xid, 0, 1, [], 0, 1.0, secrets.token_hex(8), key, digest, heads, readers)
        self._spawn(self._notice(peer, msg))

    async def _notice(self, peer: Peer, msg: Free | Reg | Renew) -> None:
        with contextlib.suppress(Exception):
            await self._links.send_to(peer, msg, self._links.link_timeout)

    # ------------------------------------------------------------ answers

    def _expect(self, key: tuple[str, ...], src: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waits[key] = (src, fut)
        return fut

    def on_grant(self, src: int, m: Grant) -> None:
        self._answer(src, ("grant", m.nonce), "grant")

    def on_refused(self, src: int, m: Refused) -> None:
        self._answer(src, ("grant", m.nonce), m.why)

    def on_pushed(self, src: int, m: Pushed) -> None:
        self._answer(src, ("pushed", m.xid, m.nonce), m)

    def on_pushfail(self, src: int, m: PushFail) -> None:
        self._answer(src, ("pushed", m.xid, m.nonce), m.why)

    def _answer(self, src: int, key: tuple[str, ...], value: Any) -> None:
        entry = self._waits.get(key)
        if entry is None:
            return
        want, fut = entry
        if src != want:
            self._stats["dropped_messages"] += 1
            log.warning("aiokvcache: cluster %d answered for cluster %d: dropped", src, want)
            return
        if not fut.done():
            fut.set_result(value)
