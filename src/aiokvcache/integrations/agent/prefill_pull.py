"""The prefill side of a pull: finished requests' blocks held for the decode
side's claims, driven by :class:`.handoff.PullHolds` and a timer on the
agent's loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .handoff import Answer, PullHolds
from .links import PeerLinks
from .results import Results
from .wire import Claim, Done, Free, Grant, Refused, Renew

__all__ = ["PullServer"]

log = logging.getLogger("aiokvcache.vllm")


def _wall_ms() -> int:
    """This host's wall clock in ms: what grant keys' expiry is written in
    (a prefill's scheduler and workers share the host)."""
    return int(time.time() * 1000)


class PullServer:
    """P, pull: answers claims, ``done`` and ``free`` and reports a request
    sent once its last reader is done or its lease ran out. Runs on the
    agent's loop thread only.

    ``secret``: this worker's grant-key secret. ``max_pending``: requests
    claimed before the engine handed them over, at once. ``heads``: the KV
    heads each of this worker's blocks holds (a claim that reads them as
    another number would read other blocks' bytes: refused).
    """

    def __init__(
        self,
        secret: bytes,
        *,
        max_pending: int,
        heads: int = 1,
        links: PeerLinks,
        results: Results,
        stats: dict[str, int],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> None:
        #: The state machine: which requests are held, for whom.
        self.holds = PullHolds(secret, max_pending=max_pending)
        self.heads = heads
        self._links = links
        self._results = results
        self._stats = stats
        self._spawn = spawn
        self._timer: asyncio.TimerHandle | None = None

    def pending(self) -> int:
        """Requests held (or claimed before their hand-over)."""
        return len(self.holds)

    def key(self, req_id: str, blocks: Sequence[int], until_ms: int) -> str:
        """The grant key of ``req_id`` over ``blocks``, valid until ``until_ms``."""
        return self.holds.key(req_id, [int(b) for b in blocks], until_ms)

    def hold(self, rid: str, lease: float, blocks: list[int], until_ms: int) -> None:
        """The engine handed ``rid`` over: hold its ``blocks`` (see ``TransferAgent.hold``)."""
        log.debug("hold %s (%d blocks) for %.1f s", rid, len(blocks), lease)
        now = asyncio.get_running_loop().time()
        if self.holds.hold(rid, blocks, lease, until_ms, now):
            self._results.sent(rid)  # its readers were done before the hand-over
        self._tick()

    def on_claim(self, src: int, m: Claim) -> None:
        log.debug("claim %s/%s from cluster %d", m.rid, m.nonce, src)
        now = asyncio.get_running_loop().time()
        if m.heads != self.heads:
            # The decode took this worker for one of another tensor-parallel
            # size (its params said so, or nothing): its units are not ours.
            why = f"the claim reads blocks of {m.heads!r} KV heads; this worker's hold {self.heads}"
            self._answer(Answer(src, m.rid, m.nonce, "refused", why))
            return
        answer = self.holds.claim(
            src,
            m.rid,
            m.nonce,
            m.key,
            m.ttl,
            m.first,
            m.last,
            m.n,
            m.digest,
            m.until_ms,
            now,
            _wall_ms(),
            m.readers,
        )
        self._answer(answer)
        self._tick()

    def _answer(self, a: Answer) -> None:
        if a.kind == "grant":
            self._stats["grants"] += 1
            self._spawn(self._links.send(a.to, Grant(a.rid, a.nonce)))
        else:
            self._stats["refusals"] += 1
            log.info("aiokvcache: claim of %s by cluster %d refused: %s", a.rid, a.to, a.why)
            self._spawn(self._links.send(a.to, Refused(a.rid, a.nonce, a.why[:256])))

    def on_done(self, src: int, m: Done) -> None:
        if self.holds.done(src, m.rid, m.nonce):
            self._results.sent(m.rid)

    def on_free(self, src: int, m: Free) -> None:
        now = asyncio.get_running_loop().time()
        if self.holds.free(src, m.rid, m.key, m.n, m.digest, m.until_ms, now, _wall_ms()):
            log.debug("free %s by cluster %d", m.rid, src)
            self._results.sent(m.rid)
        self._tick()

    def on_renew(self, src: int, m: Renew) -> None:
        now = asyncio.get_running_loop().time()
        if self.holds.renew(src, m.rid, m.key, m.n, m.digest, m.until_ms, now, _wall_ms()):
            log.debug("renew %s by cluster %d", m.rid, src)
        self._tick()

    def _tick(self) -> None:
        """Release what ran out; arm the timer for the next deadline (each
        costs O(log n): deadlines are a heap in :class:`PullHolds`)."""
        loop = asyncio.get_running_loop()
        before = self.holds.expired
        released = self.holds.tick(loop.time(), _wall_ms())
        expired = self.holds.expired - before
        if expired:
            self._stats["leases_expired"] += expired
            self._results.leases_expired(expired)
            log.warning("aiokvcache: %d lease(s) expired unread, blocks released", expired)
        for rid in released:
            self._results.sent(rid)
        when = self.holds.next_deadline()
        timer = self._timer
        if when is None or (timer is not None and timer.when() <= when + 0.001):
            return  # the armed timer comes first (or nothing is due)
        if timer is not None:
            timer.cancel()
        self._timer = loop.call_at(when + 0.001, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._tick()

    def stop(self) -> None:
        """Disarm the timer (the agent is shutting down)."""
        if self._timer is not None:
            self._timer.cancel()
