"""The prefill side of a push: each layer written into the decode side's
registered blocks as soon as the engine saved it, and each load's end
(``pushed`` or ``pushfail``) told to the decode side that registered it."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ... import BlocksCacheKey
from .calls import Tally, counting
from .handoff import MAX_READERS, BadMessage, Registration, push_key, push_key_ok
from .kvtypes import NULL_BLOCK, RUNS_PER_PART, KVLayout, TransferFailed, head_units
from .links import PeerLinks
from .results import Results
from .wire import Cancel, Layer, Pushed, PushFail, Reg

__all__ = ["MAX_ENDED", "MAX_LOADS", "MAX_UNKNOWN_BLOCKS", "PushSender"]

log = logging.getLogger("aiokvcache.vllm")

#: Push transfers that ended, remembered so that a late registration is
#: answered at once.
MAX_ENDED = 65536
#: Block ids registrations of transfers not computed here may hold, in
#: multiples of this side's block count.
MAX_UNKNOWN_BLOCKS = 4
#: Loads one decode worker may have of one transfer (vLLM's ``n > 1``
#: children, a proxy's retries); a transfer takes loads of at most
#: ``MAX_READERS`` decode workers (a decode of a larger tensor-parallel size).
MAX_LOADS = 16
#: Loads of one transfer one peer may have that are not accepted yet (their
#: parts still coming, or their key not checkable yet: decode first, before
#: the engine stepped the request), so that no peer can take every place.
MAX_PENDING_PER_PEER = 2
#: The longest load nonce accepted.
MAX_NONCE = 64


@dataclass
class _Load:
    """One decode load of a transfer: the blocks it registered on one link,
    under its own nonce, and the pushes into them."""

    src: int
    nonce: str
    registration: Registration
    link: Any = None  # the link its parts came on (pushes go only over it)
    reg_ids: list[int] | None = None  # D's blocks for the request's blocks first, first + 1...
    key: Any = None  # the push key it registered with, until checked
    waiting_key: bool = False  # registered with a key this side cannot check yet
    first: int = 0
    ttl: float = 0.0
    arrived: float = 0.0  # when its last part came: its deadline counts from then
    deadline: float | None = None
    pushed: dict[int, int] = field(default_factory=dict)  # layer -> tokens whose push started
    landed: dict[int, int] = field(default_factory=dict)  # layer -> tokens whose push completed
    tails: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    accepted: bool = False  # its key and layout held: it may be pushed to
    ended: bool = False  # pushed or failed: nothing more will be written
    quiescing: bool = False  # its pushes are being cancelled
    tally: Tally | None = None  # what its push calls moved (their records)
    # What of each block it takes (another tensor-parallel size): this side's
    # heads [p_head, p_head + count) into D's heads from d_head of d_heads;
    # None: whole blocks.
    heads: tuple[int, int, int, int] | None = None
    readers: int = 1  # decode workers that register for the transfer here (each its heads)
    # Each KV cache group's registered positions: (first, count), its ids one
    # group after another in reg_ids.
    spans: list[tuple[int, int]] | None = None
    tokens: int | None = None  # the tokens D takes the request to hold (None: not said)

    def running(self) -> bool:
        me = asyncio.current_task()
        return self.quiescing or any(not t.done() and t is not me for t in self.tails.values())

    def add_part(self, m: Reg, layout: KVLayout) -> tuple[list[int] | None, int]:
        """Check and add one registration part: the whole id list once the
        last part is in (else None), and how many ids it added; its KV
        layout, heads and readers checked against ``layout``, this side's. Raises
        :class:`BadMessage` for one that does not hold."""
        before = self.registration.count
        first, ttl, num_blocks = m.first, m.ttl, layout.num_blocks
        if not (type(first) is int and 0 <= first < num_blocks):
            raise BadMessage(f"a registration's first block index {first!r}")
        if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl > 0):
            raise BadMessage(f"a registration's deadline {ttl!r}")
        tokens = m.tokens
        if not (tokens is None or (type(tokens) is int and 0 < tokens < 1 << 40)):
            raise BadMessage(f"a registration's token count {str(tokens)[:40]}")
        shape = (*_shape(m, layout), _spans(m, len(layout.windows)), tokens)  # every part says it
        if self.registration.parts is not None and shape != (
            self.heads,
            self.readers,
            self.spans,
            self.tokens,
        ):
            raise BadMessage("the registration's parts disagree on their heads or groups")
        self.heads, self.readers, self.spans, self.tokens = shape
        ids = self.registration.add(self.src, m.part, m.parts, m.runs)
        return ids, self.registration.count - before

    def moves(
        self, layout: KVLayout, i0: int, i1: int, groups: list[list[int]], bounds: list[int]
    ) -> tuple[list[int], list[int]]:
        """For the request's block positions ``[i0, i1)`` (``groups``: this
        side's blocks of each KV cache group; ``bounds``: the first position
        of each a push moves, see :meth:`PushSender.bounds`): the units of
        this side's and of D's a push to this load moves, whole blocks or its
        heads of each; in each group none before its first registered
        position (D has them in its prefix cache, or out of its window).
        :class:`TransferFailed` when it registered too few."""
        assert self.reg_ids is not None and self.spans is not None
        src: list[int] = []
        dst: list[int] = []
        off = 0
        for g, (f, n) in enumerate(self.spans):
            mine = groups[g]
            if i1 > f + n or i1 > len(mine) or off + n > len(self.reg_ids):
                raise TransferFailed(
                    f"{n} destination blocks registered from block {f}, {i1 - f} needed"
                )
            j0 = max(i0, f, bounds[g])
            if j0 >= i1:  # nothing of this group in [i0, i1)
                off += n
                continue
            if layout.windows[g] and NULL_BLOCK in mine[j0:i1]:  # freed: out of its window
                raise TransferFailed(f"window blocks [{j0}, {i1}): the prefill freed one")
            src += mine[j0:i1]
            dst += self.reg_ids[off + j0 - f : off + i1 - f]
            off += n
        if self.heads is None:
            return layout.units(src), layout.units(dst)
        p_head, count, d_heads, d_head = self.heads
        return layout.units(src, p_head, count), head_units(dst, d_heads, d_head, count)

    def miscount(self, n: int, bounds: list[int], computed: int) -> str:
        """Why its registered blocks are not exactly the request's ``n`` in
        each group (from its first on, and no window position before what
        this side pushes), or D takes more tokens than the ``computed``
        ones, or "": what nothing wrote must not be told pushed."""
        assert self.reg_ids is not None and self.spans is not None
        if self.tokens is not None and self.tokens > computed:
            return f"the decode loads {self.tokens} tokens, the prefill computed {computed}"
        if sum(c for _, c in self.spans) != len(self.reg_ids):
            return f"{len(self.reg_ids)} blocks registered, its groups say otherwise"
        for g, (f, c) in enumerate(self.spans):
            if f + c != n or f < bounds[g]:
                return f"{c} blocks registered from block {f}, the request has {n}" + (
                    f" (its window from block {bounds[g]})" if bounds[g] else ""
                )
        return ""


@dataclass
class _PushState:
    """P, push mode: one transfer ``xid``, fed step by step by the engine,
    and the loads registered for it."""

    xid: str
    req_id: str | None = None
    groups: list[list[int]] = field(default_factory=list)  # its blocks, per KV cache group
    prompt: int = 0  # its prompt's tokens
    block_size: int = 0
    step_end: int = 0  # token end of the step being computed
    final_end: int | None = None  # prompt length, once its last chunk is scheduled
    saved: dict[int, int] = field(default_factory=dict)  # layer -> tokens saved
    loads: dict[tuple[int, str], _Load] = field(default_factory=dict)  # (src, nonce) ->
    client_key: str | None = None  # decode-first: the key the client gave both requests
    closed: bool = False  # takes no more loads
    released: bool = False  # the engine is done with the request (may report it)
    remote: bool = False  # created by a peer's registration, not by the engine
    creator: int | None = None  # the peer whose registration created it (remote)
    reported: bool = False  # reported sent (once)

    def bounds(self, windows: tuple[int, ...]) -> list[int]:
        """The first block position of each KV cache group (``windows``: each
        one's sliding window in tokens, 0 for full attention) a push moves:
        0 for full attention; for a window of ``w`` tokens the first one the
        decode's next token attends to, the one vLLM keeps from when the
        prompt is computed until the request ends (it frees the earlier ones
        while the request runs: they are never pushed)."""
        bs = self.block_size or 1
        return [max(0, (self.prompt - w + 1) // bs) if w else 0 for w in windows]

    def takes(self, src: int) -> bool:
        """Whether a new load of cluster ``src`` has a place (see ``MAX_LOADS``)."""
        mine = [x for x in self.loads.values() if x.src == src]
        pending = sum(1 for x in mine if not x.accepted)
        clusters = {x.src for x in self.loads.values()} | {src}
        return (
            len(mine) < MAX_LOADS
            and pending < MAX_PENDING_PER_PEER
            and (len(clusters) <= MAX_READERS)
        )

    def close_if_done(self) -> None:
        """Take no more loads once :meth:`closable`."""
        self.closed = self.closed or self.closable()

    def running(self) -> list[asyncio.Task[None]]:
        """Its pushes that run now."""
        return [t for ld in self.loads.values() for t in ld.tails.values() if not t.done()]

    def closable(self) -> bool:
        """Released, every load it has ended, and loads of as many decode
        workers as its loads said read it (each its heads) were accepted
        and ended: it takes no more."""
        loads = self.loads.values()
        if not self.released or not all(ld.ended for ld in loads):
            return False
        done = {ld.src for ld in loads if ld.accepted}
        return bool(done) and len(done) >= max(ld.readers for ld in loads if ld.accepted)

    def settled(self) -> bool:
        """Every load ended and none of its pushes runs."""
        return all(ld.ended and not ld.running() for ld in self.loads.values())

    def forget_progress(self) -> list[asyncio.Task[None]]:
        """Preempted: what was saved is gone (the recompute saves it again);
        loads still running forget what they were pushed. Returns every push
        still running, an ended load's too (its cancel may still settle):
        each reads the request's blocks."""
        self.saved.clear()
        self.step_end, self.final_end = 0, None
        tails: list[asyncio.Task[None]] = []
        for ld in self.loads.values():
            tails += [t for t in ld.tails.values() if not t.done()]
            if not ld.ended:  # an ended one had every layer, or failed: nothing to redo
                ld.pushed.clear()
                ld.landed.clear()
                ld.tails.clear()
        return tails


def _shape(m: Reg, layout: KVLayout) -> tuple[tuple[int, int, int, int] | None, int]:
    """What of each block a registration's load takes (see ``_Load.heads``)
    and its readers; :class:`BadMessage` for a registration whose KV layout
    or heads do not fit this side's."""
    readers = m.readers
    if not (type(readers) is int and 1 <= readers <= MAX_READERS):
        raise BadMessage(f"readers {readers!r} not in [1, {MAX_READERS}]")
    differs = "the decode instance's KV layout differs from the prefill's"
    h = m.heads
    if h is None:  # whole blocks: both sides hold the same heads a block
        if m.layout != layout.digest(per_rank=True):
            raise BadMessage(differs)
        return None, readers
    if not (isinstance(h, list) and len(h) == 5 and all(type(x) is int for x in h)):
        raise BadMessage(f"a registration's heads {h!r}")
    if not layout.total_heads or m.layout != layout.digest():
        raise BadMessage(differs)
    p_heads, p_head, count, d_heads, d_head = h
    if p_heads != layout.heads:
        raise BadMessage(
            f"the registration takes this worker's blocks to hold {p_heads} KV heads; "
            f"they hold {layout.heads}"
        )
    if not (0 <= p_head and 1 <= count and p_head + count <= p_heads):
        raise BadMessage(f"heads [{p_head}, {p_head + count}) of a block of {p_heads}")
    if not (0 < d_heads <= layout.total_heads and 0 <= d_head and d_head + count <= d_heads):
        raise BadMessage(f"heads [{d_head}, {d_head + count}) of a decode block of {d_heads}")
    return (p_head, count, d_heads, d_head), readers


def _spans(m: Reg, groups: int) -> list[tuple[int, int]] | None:
    """A registration part's KV cache groups' positions: ``(first, count)``
    each (``m.groups``; None: one group, its ids from ``m.first``, the count
    set once all parts are in). :class:`BadMessage` for any other shape, or
    a model of another number of groups."""
    g = m.groups
    if g is None:
        if groups != 1:
            raise BadMessage(f"a registration without its {groups} KV cache groups' positions")
        return None
    if not (
        isinstance(g, list)
        and len(g) == groups
        and all(isinstance(x, list) and len(x) == 2 for x in g)
        and all(type(v) is int and 0 <= v < 1 << 40 for x in g for v in x)
    ):
        raise BadMessage(f"a registration's KV cache groups {str(g)[:80]}")
    return [(f, n) for f, n in g]


class _Recent(collections.OrderedDict[Any, None]):
    """The last ``MAX_ENDED`` keys added."""

    def add(self, key: Any) -> None:
        self[key] = None
        while len(self) > MAX_ENDED:
            self.popitem(last=False)


class _PeerBudget:
    """What each peer's registrations may make this side hold before the
    engine knows their transfers: at most ``transfers`` such transfers and
    ``blocks`` block ids per peer (a peer cannot spend another's)."""

    def __init__(self, transfers: int, blocks: int) -> None:
        self.transfers, self.blocks = transfers, blocks
        self._made: dict[int, int] = {}
        self._ids: dict[int, int] = {}

    def make(self, src: int) -> bool:
        """``src`` creates one more such transfer: False past its budget."""
        if self._made.get(src, 0) >= self.transfers:
            return False
        self._made[src] = self._made.get(src, 0) + 1
        return True

    def unmake(self, src: int | None) -> None:
        if src is not None:
            _uncount(self._made, src, 1)

    def add_blocks(self, src: int, n: int) -> None:
        held = self._ids.get(src, 0) + n
        self._ids[src] = held
        if held > self.blocks:
            raise BadMessage("too many blocks registered for transfers not computed")

    def remove_blocks(self, src: int, n: int) -> None:
        _uncount(self._ids, src, n)


def _uncount(counts: dict[int, int], src: int, n: int) -> None:
    left = counts.get(src, 0) - n
    if left > 0:
        counts[src] = left
    else:
        counts.pop(src, None)


class PushSender:
    """P, push: the transfers the engine steps and the loads the decode side
    registers for them. Runs on the agent's loop thread only.

    A load is one registration: its own nonce, bound to the link its first
    part came on, accepted only with the transfer's push key and the same KV
    layout as this side's. ``pushed`` goes to a load only once every layer's
    last push to it completed; a failed layer ends that load at once. A
    load's pushes end by its registration's deadline and ``timeout``, or when
    its link is gone. A request is reported sent once, when the engine
    released it, it takes no more loads and none of its pushes runs.
    ``max_unknown``: transfers a peer's registrations may create before the
    engine knows them.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        timeout: float,
        grace: float,
        max_unknown: int,
        secret: bytes,
        links: PeerLinks,
        results: Results,
        stats: dict[str, int],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> None:
        self.layout = layout
        self.timeout = timeout
        self.grace = grace
        self.max_unknown = max_unknown
        self._secret = secret
        self._links = links
        self._results = results
        self._stats = stats
        self._spawn = spawn
        #: Transfer id -> its state, while it runs or waits for its report.
        self.transfers: dict[str, _PushState] = {}
        self._remote_xids: set[str] = set()  # transfers only a peer's registration made
        self._budget = _PeerBudget(max_unknown, MAX_UNKNOWN_BLOCKS * layout.num_blocks)
        self._ended = _Recent()  # transfers that ended
        self._cancelled = _Recent()  # (cluster, xid, nonce) of loads cancelled before a part came

    def pending(self) -> int:
        """Transfers this side drives."""
        return len(self.transfers)

    def key(self, xid: str) -> str:
        """The push key of transfer ``xid`` (what this worker's scheduler computes)."""
        return push_key(self._secret, xid)

    # ------------------------------------------------------------ the engine's inputs

    def step(
        self,
        xid: str,
        req_id: str,
        blocks: list[int],
        bs: int,
        end: int,
        final: bool,
        client_key: str | None = None,
        groups: list[list[int]] | None = None,
        prompt: int = 0,
    ) -> None:
        """This engine step computes ``xid``'s tokens up to ``end`` (see
        ``TransferAgent.push_step``)."""
        st = self._state(xid, remote=False)
        assert st is not None
        st.req_id, st.groups, st.block_size, st.step_end = req_id, groups or [blocks], bs, end
        st.prompt = prompt or st.prompt or (end if final else 0)
        if final:
            st.final_end = end
        if client_key:
            st.client_key = str(client_key)
        for ld in list(st.loads.values()):
            if ld.waiting_key:  # its key can be checked now
                self._accept(st, ld)

    def layer_saved(self, xids: list[str], layer: int) -> None:
        """Layer ``layer`` of this step's tokens of each of ``xids`` is in their blocks."""
        for xid in xids:
            st = self.transfers.get(xid)
            if st is None:
                continue
            st.saved[layer] = st.step_end
            for ld in list(st.loads.values()):
                if ld.reg_ids is not None:
                    self._push_layer(st, ld, layer)

    def release(
        self, xid: str, req_id: str, aborted: bool, groups: list[list[int]] | None = None
    ) -> None:
        """The engine finished ``req_id`` (see ``TransferAgent.push_release``)."""
        st = self.transfers.get(xid)
        if st is None:
            # Never stepped here (finished before it was scheduled): nothing
            # was pushed, so its blocks go back at once.
            self._results.sent(req_id)
            self._ended.add(xid)
            return
        st.req_id = req_id  # a registration may have made st before any step
        st.released = True
        st.groups = groups or st.groups
        self._unremote(st)
        if aborted or st.final_end is None:
            # Aborted, or finished before its last chunk was stepped here:
            # nothing more will be computed.
            st.closed = True
            for ld in st.loads.values():
                self._end(st, ld, "the prefill request ended before its prefill did")
        else:
            st.close_if_done()
            if not st.closed:
                # Computed; the decode side registers now (prefill first),
                # or never: the blocks wait timeout + grace from here, not
                # longer (loads registered by then run to their deadlines).
                self._spawn(self._reap(st))
        self._maybe_report(st)

    async def settle(self, xids: list[str]) -> None:
        """Every push of these transfers running now has ended when this returns."""
        running = [t for x in xids if (st := self.transfers.get(x)) for t in st.running()]
        await asyncio.gather(*running, return_exceptions=True)

    async def preempt(self, xids: list[str]) -> None:
        """The engine preempted these transfers' requests and frees their
        blocks: every push from them is cancelled and quiescent when this
        returns, and what was saved is forgotten (the recompute saves, and
        pushes, every layer again). Their loads stay registered."""
        tails = [t for x in xids if (st := self.transfers.get(x)) for t in st.forget_progress()]
        for t in tails:
            t.cancel()
        await asyncio.gather(*tails, return_exceptions=True)

    # ------------------------------------------------------------ the decode side's messages

    def on_register(self, src: int, m: Reg, link: Any = None) -> None:
        """A registration part from ``src``, which came on ``link`` (the link's
        endpoint, see :meth:`PeerLinks.current`): the load is pushed to only over
        that link, never over one made anew since the part arrived."""
        nonce = m.nonce
        if not nonce or len(nonce) > MAX_NONCE:
            self._stats["dropped_messages"] += 1
            log.warning("aiokvcache: push %s from cluster %d: nonce %.80r", m.xid, src, nonce)
            return
        st = self.transfers.get(m.xid)
        if (src, m.xid, nonce) in self._cancelled:
            self._fail_load(src, m.xid, nonce, "cancelled")
            return
        if st is None and m.xid in self._ended:
            # Too late (the request ended here): tell D now, not at its deadline.
            self._fail_load(src, m.xid, nonce, "the prefill request ended")
            return
        st = self._state(m.xid, remote=True, src=src)
        if st is None:
            self._fail_load(src, m.xid, nonce, "too many transfers registered before their prefill")
            return
        ld = st.loads.get((src, nonce))
        if ld is None:
            if st.closed:
                self._fail_load(src, m.xid, nonce, "the prefill request ended")
                return
            if not st.takes(src):
                self._fail_load(src, m.xid, nonce, "too many loads of one transfer")
                return
            reg = Registration(self.layout.num_blocks, RUNS_PER_PART)
            ld = st.loads[src, nonce] = _Load(src, nonce, reg, link)
        if ld.ended or ld.reg_ids is not None or ld.waiting_key:
            return  # a duplicate
        if link != ld.link:
            self._refuse(st, ld, "registration parts came on two links")
            return
        try:
            ids = self._add_part(st, ld, m)
        except BadMessage as exc:
            self._refuse(st, ld, f"bad registration: {exc}")
            return
        if ids is None:
            return
        ld.first, ld.ttl, ld.reg_ids = m.first, float(m.ttl), ids
        ld.spans = ld.spans or [(m.first, len(ids))]
        ld.arrived = time.monotonic()
        ld.key, ld.waiting_key = m.key, True
        self._accept(st, ld)

    def _accept(self, st: _PushState, ld: _Load) -> None:
        """``ld`` is registered: check its key (now, or once the engine told
        this side the client's key), then push to it."""
        verdict = push_key_ok(self._secret, st.xid, ld.key, st.client_key, st.req_id is not None)
        if verdict is None:
            return  # decode first, the engine has not stepped it yet
        ld.key, ld.waiting_key = None, False
        if not verdict:
            self._refuse(st, ld, "wrong push key")
            return
        ld.accepted = True
        assert ld.reg_ids is not None
        if not ld.reg_ids:
            # D needs none of it (a local prefix hit, or it was aborted).
            log.debug("push %s: load %s takes nothing", st.xid, ld.nonce)
            ld.ended = True
            st.close_if_done()
            self._maybe_report(st)
            return
        # The load's pushes end by D's deadline (carried in the registration,
        # counted from when it came, not from when its key could be checked)
        # or this side's.
        ld.deadline = ld.arrived + min(self.timeout, ld.ttl)
        self._spawn(self._deadline(st, ld))
        self._start_pushes(st, ld)

    def _add_part(self, st: _PushState, ld: _Load, m: Reg) -> list[int] | None:
        """One registration part (see :meth:`_Load.add_part`), counted against
        its peer's budget while the engine does not know the transfer."""
        ids, added = ld.add_part(m, self.layout)
        if st.remote:
            self._budget.add_blocks(ld.src, added)
        return ids

    def _start_pushes(self, st: _PushState, ld: _Load) -> None:
        """``ld`` is registered: push what the engine saved so far."""
        layers = range(self.layout.num_layers)
        end = st.final_end
        if end is not None and not ld.pushed and all(st.saved.get(x, 0) >= end for x in layers):
            # The prefill is done (prefill first): every layer in one call,
            # one notification, instead of one per layer.
            task = self._spawn(
                self._push_range(st, ld, layers, 0, -(-end // st.block_size), end, None)
            )
            for x in layers:
                ld.pushed[x] = end
                ld.tails[x] = task
        else:
            for layer in sorted(st.saved):
                self._push_layer(st, ld, layer)
        self._check_pushed(st, ld)

    def on_cancel(self, src: int, m: Cancel) -> None:
        st = self.transfers.get(m.xid)
        ld = None if st is None else st.loads.get((src, m.nonce))
        if st is None or ld is None:
            # No such load (its registration was cut off before a part came,
            # or its pushes ended): nothing is pushed to it; a later part of
            # it is refused.
            self._cancelled.add((src, m.xid, str(m.nonce)))
            self._fail_load(src, m.xid, m.nonce, "no such load (cancelled)")
            return
        self._end(st, ld, "the decode side cancelled it")

    # ------------------------------------------------------------ transfers

    def _state(self, xid: str, remote: bool, src: int | None = None) -> _PushState | None:
        st = self.transfers.get(xid)
        if st is None:
            if remote and src is not None and not self._budget.make(src):
                return None  # a peer registering for transfers nobody computes
            st = self.transfers[xid] = _PushState(xid, remote=remote, creator=src)
            if remote:
                self._remote_xids.add(xid)
                # Registered, never computed here: dropped after a while.
                self._spawn(self._reap(st))
        elif not remote:
            self._unremote(st)
        return st

    def _unremote(self, st: _PushState) -> None:
        """``st`` is the engine's now (or gone): its registrations no longer
        count against what peers may make this side hold."""
        if st.remote:
            st.remote = False
            self._remote_xids.discard(st.xid)
            self._budget.unmake(st.creator)
            for ld in st.loads.values():
                self._budget.remove_blocks(ld.src, ld.registration.count)

    def _push_layer(self, st: _PushState, ld: _Load, layer: int) -> None:
        a, b = ld.pushed.get(layer, 0), st.saved.get(layer, 0)
        if b <= a or ld.ended:
            return
        ld.pushed[layer] = b
        bs = st.block_size
        i0, i1 = a // bs, -(-b // bs)
        prev = ld.tails.get(layer)
        ld.tails[layer] = self._spawn(
            self._push_range(st, ld, range(layer, layer + 1), i0, i1, b, prev)
        )

    async def _push_range(
        self,
        st: _PushState,
        ld: _Load,
        layers: range,
        i0: int,
        i1: int,
        end: int,
        prev: asyncio.Task[None] | None,
    ) -> None:
        """Push blocks ``[i0, i1)`` of the request's list, ``layers``, to ``ld``:
        those from its first registered index on (before it, D has the
        tokens in its own prefix cache)."""
        if prev is not None:
            # One layer's pushes in order: a re-pushed partial block must
            # not be overtaken by its older copy.
            await asyncio.gather(prev, return_exceptions=True)
        if ld.ended:
            return
        try:
            await self._write(st, ld, layers, i0, i1)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._end(st, ld, f"layers {layers.start}-{layers.stop - 1}: {exc}")
            return
        for layer in layers:
            ld.landed[layer] = max(ld.landed.get(layer, 0), end)
        self._check_pushed(st, ld)

    async def _write(self, st: _PushState, ld: _Load, layers: range, i0: int, i1: int) -> None:
        cm = self._links.cm
        assert cm is not None and ld.reg_ids is not None
        if self._links.current(ld.src) != ld.link:
            # The decode instance that registered is gone (a restart with the
            # same cluster id links anew): never write into its successor.
            raise TransferFailed("the link the load was registered on is gone")
        src, dst = ld.moves(self.layout, i0, i1, st.groups, st.bounds(self.layout.windows))
        if src:
            left = None if ld.deadline is None else max(0.001, ld.deadline - time.monotonic())
            ld.tally = ld.tally or Tally(self._results.called)
            with counting(ld.tally):
                await cm.push_blocks(
                    BlocksCacheKey(ld.src),
                    self._links.cache,
                    src,
                    dst,
                    src_layer_range=layers,
                    dst_layer_range=layers,
                    tensor_num_per_layer=self.layout.tensors_per_layer,
                    tag=Layer(st.xid).encode(),
                    timeout=left,
                )

    def _check_pushed(self, st: _PushState, ld: _Load) -> None:
        """Tell ``ld`` ``pushed`` once every layer's pushes up to the prompt's
        end completed (not merely started)."""
        if ld.ended or st.final_end is None or ld.reg_ids is None or ld.waiting_key:
            return
        if any(ld.landed.get(layer, 0) < st.final_end for layer in range(self.layout.num_layers)):
            return
        n = -(-st.final_end // st.block_size)
        wrong = ld.miscount(n, st.bounds(self.layout.windows), st.final_end)
        if wrong:
            self._end(st, ld, wrong)
            return
        ld.ended = True
        self._stats["pushes_sent"] += 1
        moved = ld.tally or Tally(self._results.called)
        self._spawn(
            self._links.send(ld.src, Pushed(st.xid, ld.nonce, moved.nbytes, moved.segments))
        )
        st.close_if_done()
        self._maybe_report(st)

    def _end(self, st: _PushState, ld: _Load, why: str) -> None:
        """End load ``ld`` now (nothing tells it pushed after this), then
        cancel its pushes, wait until they are quiescent and tell D."""
        if ld.ended:
            return
        ld.ended = True
        ld.key, ld.waiting_key = None, False
        self._stats["push_failures"] += 1
        log.warning("aiokvcache: push %s to load %s failed: %s", st.xid, ld.nonce, why)
        ld.quiescing = True
        self._spawn(self._quiesce(st, ld, why))

    async def _quiesce(self, st: _PushState, ld: _Load, why: str) -> None:
        try:
            tails = [
                t for t in ld.tails.values() if not t.done() and t is not asyncio.current_task()
            ]
            for t in tails:
                t.cancel()
            await asyncio.gather(*tails, return_exceptions=True)
        finally:
            ld.quiescing = False
        st.close_if_done()
        self._maybe_report(st)  # its blocks may go back: nothing writes from them any more
        await self._links.send(ld.src, PushFail(st.xid, ld.nonce, why[:512]))

    def _refuse(self, st: _PushState, ld: _Load, why: str) -> None:
        """A registration that does not hold (its parts, its layout, its key):
        forgotten (it never was pushed to, and holds no place among the
        transfer's loads) and answered."""
        self._stats["refusals"] += 1
        log.warning(
            "aiokvcache: push %s: load %s of cluster %d refused: %s", st.xid, ld.nonce, ld.src, why
        )
        if st.loads.get((ld.src, ld.nonce)) is ld:
            del st.loads[ld.src, ld.nonce]
            if st.remote:
                self._budget.remove_blocks(ld.src, ld.registration.count)
        ld.ended = True
        self._fail_load(ld.src, st.xid, ld.nonce, why[:512])

    def _fail_load(self, src: int, xid: str, nonce: str, why: str) -> None:
        """Answer a registration this side takes no load for."""
        self._spawn(self._links.send(src, PushFail(xid, nonce, why)))

    def _maybe_report(self, st: _PushState) -> None:
        """Report the request sent, once: released by the engine, closed to
        new loads, and no push of it running."""
        if st.reported or not (st.closed and st.released and st.req_id is not None):
            return
        if not st.settled():
            return  # _quiesce or the last push reports it
        st.reported = True
        self._results.sent(st.req_id)
        self._forget(st)

    def _forget(self, st: _PushState) -> None:
        self._unremote(st)
        if self.transfers.get(st.xid) is st:
            del self.transfers[st.xid]
        self._ended.add(st.xid)

    async def _deadline(self, st: _PushState, ld: _Load) -> None:
        assert ld.deadline is not None
        await asyncio.sleep(max(0.0, ld.deadline - time.monotonic()))
        if not ld.ended:
            self._end(st, ld, f"not pushed within {min(self.timeout, ld.ttl):g} s")

    async def _reap(self, st: _PushState) -> None:
        """A transfer only a peer's registrations made (the engine never
        computed it here), or one the engine finished that nobody registered
        for, ends after timeout + grace."""
        await asyncio.sleep(self.timeout + self.grace)
        if self.transfers.get(st.xid) is not st:
            return
        if st.req_id is None or (st.released and not st.closed):
            st.closed = True
            for ld in list(st.loads.values()):
                if st.req_id is None:
                    self._end(st, ld, "the prefill instance never computed it")
                elif not ld.accepted:
                    self._refuse(st, ld, "not registered in time")
            if st.req_id is None:
                self._forget(st)
            else:
                self._maybe_report(st)
