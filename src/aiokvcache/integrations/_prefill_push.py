"""The prefill side of a push: each layer written into the decode side's
registered blocks as soon as the engine saved it, and the transfer's end
(``pushed`` or ``pushfail``) told to the decode side."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from .. import BlocksCacheKey
from ._calls import Tally, counting
from ._handoff import ProtocolError, Registration
from ._kvtypes import RUNS_PER_PART, KVLayout, TransferFailed
from ._links import Links
from ._results import Results
from ._wire import Cancel, Layer, Pushed, PushFail, Reg

__all__ = ["MAX_ENDED", "MAX_UNKNOWN_BLOCKS", "PushSender"]

log = logging.getLogger("aiokvcache.vllm")

#: Push transfers that ended, remembered so that a late registration is
#: answered at once.
MAX_ENDED = 65536
#: Block ids registrations of transfers not computed here may hold, in
#: multiples of this side's block count.
MAX_UNKNOWN_BLOCKS = 4


@dataclass
class _PushState:
    """P, push mode: one transfer ``xid``, fed step by step by the engine."""

    xid: str
    req_id: str | None = None
    blocks: list[int] = field(default_factory=list)
    block_size: int = 0
    step_end: int = 0  # token end of the step being computed
    final_end: int | None = None  # prompt length, once its last chunk is scheduled
    saved: dict[int, int] = field(default_factory=dict)  # layer -> tokens saved
    pushed: dict[int, int] = field(default_factory=dict)  # layer -> tokens whose push started
    landed: dict[int, int] = field(default_factory=dict)  # layer -> tokens whose push completed
    tails: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    registration: Registration | None = None
    reg_cluster: int | None = None
    reg_ids: list[int] | None = None  # D's blocks for the request's blocks first, first + 1...
    first: int = 0
    deadline: float | None = None
    ended: bool = False  # pushed or failed: nothing more will be written
    released: bool = False  # the engine is done with the request (may report it)
    remote: bool = False  # created by a peer's registration, not by the engine
    quiescing: bool = False  # its pushes are being cancelled
    reported: bool = False  # reported sent (once)
    tally: Tally | None = None  # what its push calls moved (their records)


class PushSender:
    """P, push: the transfers the engine steps and the decode side registers
    for. Runs on the agent's loop thread only.

    A transfer is bound to the link its first registration part came on.
    ``pushed`` goes only once every layer's last push completed; a failed
    layer ends the transfer at once. Pushes end by the registration's
    deadline and ``timeout``. A request is reported sent once, when it ended,
    the engine released it and none of its pushes runs. ``max_unknown``:
    transfers a peer's registrations may create before the engine knows them.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        timeout: float,
        grace: float,
        max_unknown: int,
        links: Links,
        results: Results,
        stats: dict[str, int],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> None:
        self.layout = layout
        self.timeout = timeout
        self.grace = grace
        self.max_unknown = max_unknown
        self._links = links
        self._results = results
        self._stats = stats
        self._spawn = spawn
        #: Transfer id -> its state, while it runs or waits for its report.
        self.transfers: dict[str, _PushState] = {}
        self._remote_xids: set[str] = set()  # transfers only a peer's registration made
        self._remote_ids = 0  # block ids those registrations hold
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()

    def pending(self) -> int:
        """Transfers this side drives."""
        return len(self.transfers)

    # ------------------------------------------------------------ the engine's inputs

    def step(
        self, xid: str, req_id: str, blocks: list[int], bs: int, end: int, final: bool
    ) -> None:
        """This engine step computes ``xid``'s tokens up to ``end`` (see
        ``TransferAgent.push_step``)."""
        st = self._state(xid, remote=False)
        assert st is not None
        st.req_id, st.blocks, st.block_size, st.step_end = req_id, blocks, bs, end
        if final:
            st.final_end = end

    def layer_saved(self, xids: list[str], layer: int) -> None:
        """Layer ``layer`` of this step's tokens of each of ``xids`` is in their blocks."""
        for xid in xids:
            st = self.transfers.get(xid)
            if st is None or st.ended:
                continue
            st.saved[layer] = st.step_end
            if st.reg_ids is not None:
                self._push_layer(st, layer)

    def release(self, xid: str, req_id: str, aborted: bool) -> None:
        """The engine finished ``req_id`` (see ``TransferAgent.push_release``)."""
        st = self.transfers.get(xid)
        if st is None:
            # Never stepped here (finished before it was scheduled): nothing
            # was pushed, so its blocks go back at once.
            self._results.sent(req_id)
            self._remember_ended(xid)
            return
        st.req_id = req_id  # a registration may have made st before any step
        st.released = True
        self._unremote(st)
        if not st.ended and (aborted or st.final_end is None):
            # Aborted, or finished before its last chunk was stepped here:
            # nothing more will be computed.
            self._end(st, "the prefill request ended before its prefill did")
        elif not st.ended and st.reg_ids is None:
            # Computed; the decode side registers now (prefill first), or
            # never: the blocks wait timeout + grace from here, not longer.
            self._spawn(self._reap(st))
        self._maybe_report(st)

    # ------------------------------------------------------------ the decode side's messages

    def on_register(self, src: int, m: Reg) -> None:
        if m.xid in self._ended and m.xid not in self.transfers:
            # Too late (the request ended here): tell D now, not at its deadline.
            self._spawn(self._links.send(src, PushFail(m.xid, "the prefill request ended")))
            return
        st = self._state(m.xid, remote=True)
        if st is None or st.ended or st.reg_ids is not None:
            return
        if st.registration is None:
            st.registration = Registration(self.layout.num_blocks, RUNS_PER_PART)
        try:
            ids = self._add_part(st, st.registration, src, m)
        except ProtocolError as exc:
            if st.registration.src in (None, src):
                # The registrant's own message does not hold: end the transfer.
                st.reg_cluster = src
                self._end(st, f"bad registration: {exc}")
            else:
                self._stats["dropped_messages"] += 1
                log.warning("aiokvcache: push %s: %s", m.xid, exc)
            return
        if ids is None:
            return
        st.reg_cluster, st.first = src, m.first
        if not ids:
            # D needs none of it (a local prefix hit, or it was aborted).
            log.debug("push %s: the decode side takes nothing", m.xid)
            st.ended = True
            self._maybe_report(st)
            return
        st.reg_ids = ids
        # P's pushes end by D's deadline (carried in the registration) or its own.
        st.deadline = time.monotonic() + min(self.timeout, float(m.ttl))
        self._spawn(self._deadline(st))
        self._start_pushes(st)

    def _add_part(self, st: _PushState, reg: Registration, src: int, m: Reg) -> list[int] | None:
        """Check and add one registration part; the whole id list once the
        last part is in. Raises :class:`ProtocolError` for one that does not hold."""
        before = reg.count
        first, ttl = m.first, m.ttl
        if not (type(first) is int and 0 <= first < self.layout.num_blocks):
            raise ProtocolError(f"a registration's first block index {first!r}")
        if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl > 0):
            raise ProtocolError(f"a registration's deadline {ttl!r}")
        ids = reg.add(src, m.part, m.parts, m.runs)
        if st.remote:
            self._remote_ids += reg.count - before
            if self._remote_ids > MAX_UNKNOWN_BLOCKS * self.layout.num_blocks:
                raise ProtocolError("too many blocks registered for transfers not computed")
        return ids

    def _start_pushes(self, st: _PushState) -> None:
        """``st`` is registered: push what the engine saved so far."""
        layers = range(self.layout.num_layers)
        end = st.final_end
        if end is not None and not st.pushed and all(st.saved.get(x, 0) >= end for x in layers):
            # The prefill is done (prefill first): every layer in one call,
            # one notification, instead of one per layer.
            task = self._spawn(self._push_range(st, layers, 0, -(-end // st.block_size), end, None))
            for x in layers:
                st.pushed[x] = end
                st.tails[x] = task
        else:
            for layer in sorted(st.saved):
                self._push_layer(st, layer)
        self._check_pushed(st)

    def on_cancel(self, src: int, m: Cancel) -> None:
        st = self.transfers.get(m.xid)
        if st is None or st.ended:
            return
        bound = st.registration.src if st.registration is not None else None
        if bound != src:
            self._stats["dropped_messages"] += 1
            log.warning("aiokvcache: cluster %d cancelled push %s it did not register", src, m.xid)
            return
        self._end(st, "the decode side cancelled it")

    # ------------------------------------------------------------ transfers

    def _state(self, xid: str, remote: bool) -> _PushState | None:
        st = self.transfers.get(xid)
        if st is None:
            if remote and len(self._remote_xids) >= self.max_unknown:
                return None  # a peer registering for transfers nobody computes
            st = self.transfers[xid] = _PushState(xid, remote=remote)
            if remote:
                self._remote_xids.add(xid)
                # Registered, never computed here: dropped after a while.
                self._spawn(self._reap(st))
        elif not remote:
            self._unremote(st)
        return st

    def _unremote(self, st: _PushState) -> None:
        """``st`` is the engine's now (or gone): its registration no longer
        counts against what peers may make this side hold."""
        if st.remote:
            st.remote = False
            self._remote_xids.discard(st.xid)
            if st.registration is not None:
                self._remote_ids -= st.registration.count

    def _push_layer(self, st: _PushState, layer: int) -> None:
        a, b = st.pushed.get(layer, 0), st.saved.get(layer, 0)
        if b <= a or st.ended:
            return
        st.pushed[layer] = b
        bs = st.block_size
        i0, i1 = a // bs, -(-b // bs)
        prev = st.tails.get(layer)
        st.tails[layer] = self._spawn(
            self._push_range(st, range(layer, layer + 1), i0, i1, b, prev)
        )

    async def _push_range(
        self,
        st: _PushState,
        layers: range,
        i0: int,
        i1: int,
        end: int,
        prev: asyncio.Task[None] | None,
    ) -> None:
        """Push blocks ``[i0, i1)`` of the request's list, ``layers``: those from
        the decode side's first registered index on (before it, D has the
        tokens in its own prefix cache)."""
        if prev is not None:
            # One layer's pushes in order: a re-pushed partial block must
            # not be overtaken by its older copy.
            await asyncio.gather(prev, return_exceptions=True)
        if st.ended:
            return
        assert self._links.cm is not None and st.reg_ids is not None
        assert st.reg_cluster is not None
        try:
            await self._write(st, layers, i0, i1)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._end(st, f"layers {layers.start}-{layers.stop - 1}: {exc}")
            return
        for layer in layers:
            st.landed[layer] = max(st.landed.get(layer, 0), end)
        self._check_pushed(st)

    async def _write(self, st: _PushState, layers: range, i0: int, i1: int) -> None:
        cm = self._links.cm
        assert cm is not None and st.reg_ids is not None and st.reg_cluster is not None
        j0 = max(i0, st.first)
        if i1 - st.first > len(st.reg_ids) or i1 > len(st.blocks):
            raise TransferFailed(
                f"{len(st.reg_ids)} destination blocks registered from block "
                f"{st.first}, {i1 - st.first} needed"
            )
        if j0 < i1:
            left = None if st.deadline is None else max(0.001, st.deadline - time.monotonic())
            if st.tally is None:
                st.tally = Tally(self._results.called)
            with counting(st.tally):
                await cm.push_blocks(
                    BlocksCacheKey(st.reg_cluster),
                    self._links.cache,
                    st.blocks[j0:i1],
                    st.reg_ids[j0 - st.first : i1 - st.first],
                    src_layer_range=layers,
                    dst_layer_range=layers,
                    tensor_num_per_layer=self.layout.tensors_per_layer,
                    tag=Layer(st.xid).encode(),
                    timeout=left,
                )

    def _check_pushed(self, st: _PushState) -> None:
        """Report ``pushed`` once every layer's pushes up to the prompt's end
        completed (not merely started)."""
        if st.ended or st.final_end is None or st.reg_ids is None:
            return
        if any(st.landed.get(layer, 0) < st.final_end for layer in range(self.layout.num_layers)):
            return
        st.ended = True
        assert st.reg_cluster is not None
        self._stats["pushes_sent"] += 1
        moved = st.tally or Tally(self._results.called)
        pushed = Pushed(st.xid, moved.nbytes, moved.segments)
        self._spawn(self._links.send(st.reg_cluster, pushed))
        self._maybe_report(st)

    def _end(self, st: _PushState, why: str) -> None:
        """End ``st`` now (nothing reports it pushed after this), then cancel
        its pushes, wait until they are quiescent and tell D."""
        if st.ended:
            return
        st.ended = True
        self._stats["push_failures"] += 1
        log.warning("aiokvcache: push %s failed: %s", st.xid, why)
        st.quiescing = True
        self._spawn(self._quiesce(st, why))

    async def _quiesce(self, st: _PushState, why: str) -> None:
        try:
            tails = [
                t for t in st.tails.values() if not t.done() and t is not asyncio.current_task()
            ]
            for t in tails:
                t.cancel()
            await asyncio.gather(*tails, return_exceptions=True)
        finally:
            st.quiescing = False
        self._maybe_report(st)  # its blocks may go back: nothing writes from them any more
        if st.reg_cluster is not None:
            await self._links.send(st.reg_cluster, PushFail(st.xid, why[:512]))

    def _maybe_report(self, st: _PushState) -> None:
        """Report the request sent, once: ended, released by the engine, and
        no push of it running."""
        if st.reported or not (st.ended and st.released and st.req_id is not None):
            return
        me = asyncio.current_task()
        if st.quiescing or any(not t.done() and t is not me for t in st.tails.values()):
            return  # _quiesce or the last push reports it
        st.reported = True
        self._results.sent(st.req_id)
        self._forget(st)

    def _forget(self, st: _PushState) -> None:
        self._unremote(st)
        if self.transfers.get(st.xid) is st:
            del self.transfers[st.xid]
        self._remember_ended(st.xid)

    def _remember_ended(self, xid: str) -> None:
        self._ended[xid] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    async def _deadline(self, st: _PushState) -> None:
        assert st.deadline is not None
        await asyncio.sleep(max(0.0, st.deadline - time.monotonic()))
        if not st.ended:
            self._end(st, f"not pushed within {self.timeout:g} s")

    async def _reap(self, st: _PushState) -> None:
        """A transfer only a peer's registration made (the engine never
        computed it here), or one the engine finished that nobody registered
        for, ends after timeout + grace."""
        await asyncio.sleep(self.timeout + self.grace)
        if self.transfers.get(st.xid) is not st:
            return
        if st.req_id is None:
            self._end(st, "the prefill instance never computed it")
            self._forget(st)
        elif not st.ended and st.reg_ids is None and st.released:
            st.ended = True
            log.warning("aiokvcache: push %s: no decode instance registered for it", st.xid)
            self._maybe_report(st)
