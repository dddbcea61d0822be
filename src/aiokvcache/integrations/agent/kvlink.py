"""The engine-independent half of the vLLM connector: one aiokvcache engine on
its own thread, and the prefill (P) and decode (D) sides of a request's
transfer, driven from a serving engine's synchronous threads.

A serving engine calls this module's :class:`TransferAgent` from its own
thread (vLLM's worker main thread). Every call returns at once: it posts to
the agent's event loop with ``call_soon_threadsafe``. The loop thread owns
every aiokvcache call; results come back as plain sets behind one lock, which
:meth:`TransferAgent.take_results` swaps for empty ones (no loop round trip,
nothing polled).

Protocol (notifications that move no bytes, :meth:`CacheManager.notify`, and
tagged pushes; tags are JSON lists starting with ``"aiokv"``, one
:mod:`.wire` message each). Every message is taken as coming from the link
aiokvcache attributed it to, never from what its payload says. The agent
routes each to the side it concerns: :class:`.prefill_pull.PullServer` and
:class:`.prefill_push.PushSender` (P), :class:`.decode.DecodeLoads` (D); the
prefill side's state machines are in :mod:`.handoff`.

*Pull* (D reads P's blocks, vLLM NixlConnector's default flow)::

    D -> P  ["aiokv","claim",rid,nonce,key,ttl,first,last,n,digest]
            may claim ``nonce`` read blocks [first, last) of rid's n blocks
            (whose list hashes to digest) until ttl seconds from now? ``key``:
            the grant key P's scheduler put in the request's params
    P -> D  ["aiokv","grant",rid,nonce]         yes: held until done or ttl
         or ["aiokv","refused",rid,nonce,why]   no (lease expired, wrong key...)
    D       pull_blocks(...)                     quiescent when it returns or raises
    D -> P  ["aiokv","done",rid,nonce]           this claim ended: P frees at zero
    D -> P  ["aiokv","free",rid,key,n,digest]    D will not read (prefix hit, abort)
    D -> P  ["aiokv","renew",rid,key,n,digest,until]  D holds the params and will
            claim: P's hold runs another lease (never past the key's expiry)

  P grants only with the request's grant key (a MAC, by a secret only P's
  own scheduler knows, of the request id and its block list: only requests
  its scheduler handed over, only for their blocks, even before its engine
  told this worker), and holds the blocks for every granted claim until that
  claim's ``done`` or D's own deadline, and never reports them sent before
  its engine handed the request over: a lease that expires on P never frees
  blocks D may still read.

*Push* (P writes D's blocks as each layer is computed)::

    D -> P  ["aiokv","reg",xid,part,parts,runs,first,ttl,nonce,key,layout]
            load ``nonce``'s block ids for transfer xid (for P's blocks first,
            first + 1...), D's deadline (P's pushes to it end within ttl
            seconds), the transfer's push key and D's KV layout digest
    P       push_blocks(..., tag=["aiokv","kv",xid]) per layer, as layers are saved
    P -> D  ["aiokv","pushed",xid,nonce]      every layer landed in that load
         or ["aiokv","pushfail",xid,nonce,why] that load ended without (quiescent)
    D -> P  ["aiokv","cancel",xid,nonce]      D gave that load up

  A transfer feeds every load registered for it (vLLM's ``n > 1``
  children and a proxy's retries carry the same params), each under its own
  nonce, bound to the link its first part came on: P pushes to a load only
  over that link (a decode restarted with the same cluster id links anew
  and gets none of its predecessor's pushes). P accepts a load only with the
  transfer's push key (a MAC of the transfer id by P's worker secret, which
  P's scheduler puts in the request's params, or, decode first, the key the
  client gave both requests) and only for P's own KV layout. P reports
  ``pushed`` only once every layer's last push to that load completed; a
  failed layer ends that load at once. D gives a load's blocks back only on
  P's word: ``pushed``, or ``pushfail`` (sent once the load's pushes are
  quiescent, also after D's ``cancel``); with no word by its deadline and
  ``grace`` (P's Python starved, or P frozen) D unlinks P, which its engine
  confirms only once its transfers on the link were released.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import secrets
from collections.abc import Sequence
from typing import Any

from ... import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from . import calls
from .decode import DecodeLoads
from .handoff import blocks_digest
from .kvtypes import GRACE_S, KVLayout, Peer, Source, TransferFailed, block_digest
from .links import PeerLinks
from .loopthread import LoopThread
from .prefill_pull import PullServer
from .prefill_push import PushSender
from .results import Results, TransferResults
from .wire import (
    PREFIX,
    Cancel,
    Claim,
    Done,
    Free,
    Grant,
    Layer,
    Message,
    Pushed,
    PushFail,
    Refused,
    Reg,
    Renew,
    decode,
    parse,
)

__all__ = ["MAX_UNKNOWN", "TransferAgent", "cluster_id_for"]

log = logging.getLogger("aiokvcache.vllm")

#: Transfers a peer may start on this side before its engine knows them
#: (push registrations; pull claims wait in :class:`PullHolds`, bounded alike).
MAX_UNKNOWN = 4096
#: The agent's counters: what this side loaded, sent and refused.
STATS = (
    "pulls",
    "pushes_received",
    "layers_received",
    "blocks_loaded",
    "load_failures",
    "loads_aborted",
    "pushes_sent",
    "push_failures",
    "grants",
    "refusals",
    "leases_expired",
    "dropped_messages",
)


async def _refused(why: str) -> None:
    raise TransferFailed(why, "layout")


def cluster_id_for(engine_id: str, rank: int) -> int:
    """A stable 62-bit aiokvcache cluster id for one vLLM engine's worker ``rank``."""
    h = hashlib.blake2b(f"{engine_id}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1) | 1


def _allowed_cpus() -> set[int]:
    """The CPUs this process's cgroup allows (not the calling thread's affinity,
    which vLLM narrows to the model's core)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.cpus"):
        try:
            with open(path) as f:
                text = f.read().strip()
            out: set[int] = set()
            for part in text.split(","):
                a, _, b = part.partition("-")
                out.update(range(int(a), int(b or a) + 1))
            if out:
                return out
        except (OSError, ValueError):
            continue
    return set(range(os.cpu_count() or 1))


class TransferAgent(LoopThread):
    """One aiokvcache engine on a daemon thread, serving one engine worker.

    Thread-safe: every public method may be called from any thread and
    returns without waiting for the network (:meth:`start` and :meth:`close`
    excepted). The agent owns the thread, the engine and the links; its
    sides (:attr:`pull_server`, :attr:`push_sender`, :attr:`receiver`) run on
    the loop thread only.
    """

    thread_name = "aiokvcache-vllm"

    def __init__(
        self,
        cluster_id: int,
        layout: KVLayout,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: str = "auto",
        auth_token: str | None = None,
        timeout: float = 30.0,
        grace: float = GRACE_S,
        link_timeout: float = 5.0,
        record_digests: bool = False,
        unpin: bool = True,
    ) -> None:
        if timeout <= 0 or grace < 0 or link_timeout <= 0:
            raise ValueError("timeout and link_timeout must be positive, grace not negative")
        super().__init__()
        self.cluster_id = cluster_id
        self.layout = layout
        self.timeout = float(timeout)
        self.grace = float(grace)
        self._host, self._port, self._transport = host, port, transport
        self._auth = auth_token
        self._unpin = unpin
        self._cpus = _allowed_cpus()
        #: Counters: what this side loaded, sent and refused.
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        self._results = Results()
        #: This worker's engine handles and its links to peers.
        self.links = PeerLinks(link_timeout, self._spawn)
        #: P, pull: this worker's grant-key secret, for its own scheduler
        #: only (see :func:`.handoff.grant_key`).
        self.grant_secret = secrets.token_bytes(32)
        sides: dict[str, Any] = dict(links=self.links, results=self._results, stats=self.stats)
        sides["spawn"] = self._spawn
        self.pull_server = PullServer(
            self.grant_secret, max_pending=MAX_UNKNOWN, heads=layout.heads, **sides
        )
        self.push_sender = PushSender(
            layout,
            timeout=self.timeout,
            grace=self.grace,
            max_unknown=MAX_UNKNOWN,
            secret=self.grant_secret,
            **sides,
        )
        self.receiver = DecodeLoads(
            layout, timeout=self.timeout, grace=self.grace, record_digests=record_digests, **sides
        )

    @property
    def load_seconds(self) -> collections.deque[float]:
        """D: seconds each of the last 1000 successful loads took, from the
        engine's hand-over to the last byte (push: includes P's compute)."""
        return self.receiver.load_seconds

    @property
    def digests(self) -> dict[str, str] | None:
        """D, with ``record_digests``: request id -> :meth:`block_digest` of what it loaded."""
        return self.receiver.digests

    # ------------------------------------------------------------ lifecycle

    def _enter_thread(self) -> None:
        if self._unpin:
            # vLLM's CPU worker pins its threads (ours would inherit it) to
            # the model's core: run ours, and the engine threads started from
            # here, on every core the process may use.
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setaffinity(0, self._cpus)
        calls.attach()  # the loads' and pushes' figures come from their records

    def _exit_thread(self) -> None:
        calls.detach()

    async def _init(self) -> str:
        cfg = LLMConfig()
        cfg.listen_ip_info = f"{self._host}:{self._port}"
        cfg.transport = self._transport
        cfg.enable_remote_cache_accessible = True
        if self._auth:
            cfg.auth_token = self._auth
        dd = LLMDataDist(LLMRole.MIX, self.cluster_id)
        await dd.init(cfg.generate_options())
        links = self.links
        links.dd, links.cm = dd, dd.cache_manager
        lay = self.layout
        desc = CacheDesc(
            lay.num_layers * lay.tensors_per_layer,
            [lay.num_blocks * lay.heads, lay.unit_bytes],
            DataType.DT_UINT8,
            Placement.HOST,
        )
        links.cache = links.cm.register_blocks_cache(
            desc, list(lay.addrs), BlocksCacheKey(self.cluster_id), remote_accessible=True
        )
        self._spawn(self._listen())
        addr = dd.listen_address
        assert addr is not None
        return addr

    async def _shutdown(self) -> None:
        self.receiver.stop()
        self.pull_server.stop()
        await self._cancel_tasks()
        if self.links.dd is not None:
            await self.links.dd.finalize()

    # ------------------------------------------------------------ results

    def take_results(self) -> TransferResults:
        """What ended since the last call."""
        return self._results.take()

    def take_metrics(self) -> dict[str, Any]:
        """What happened since the last call. D: one entry per successful load
        in ``seconds`` (hand-over to last byte), ``bytes`` and ``descriptors``
        (segments: contiguous runs times tensors) as its transfer calls'
        records have them (a push's, from P's records, sent with ``pushed``),
        and ``failures`` by reason (:data:`.results.FAILURE_REASONS`); P:
        ``leases_expired`` (held blocks nobody read in time). Both: ``calls``
        (op -> status -> transfer calls the loads and pushes made) and
        ``phases`` (op -> phase -> seconds summed over them; the phases of
        :mod:`aiokvcache.metrics`)."""
        return self._results.take_metrics()

    # ------------------------------------------------------------ P, pull

    def grant_key(self, req_id: str, blocks: Sequence[int], until_ms: int) -> str:
        """P: the grant key of ``req_id`` over ``blocks``, valid until
        ``until_ms`` (what its scheduler computes from :attr:`grant_secret`)."""
        return self.pull_server.key(req_id, blocks, until_ms)

    def hold(self, req_id: str, lease: float, blocks: Sequence[int], until_ms: int) -> None:
        """P: ``req_id`` finished; its ``blocks`` stay put until every granted
        reader is done, or ``lease`` s pass with none. ``until_ms``: when its
        grant key expires (as the scheduler made it)."""
        self._post(
            self.pull_server.hold, req_id, float(lease), [int(b) for b in blocks], int(until_ms)
        )

    # ------------------------------------------------------------ P, push

    def push_step(
        self,
        xid: str,
        req_id: str,
        blocks: Sequence[int],
        block_size: int,
        end: int,
        final: bool,
        client_key: str | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        prompt: int = 0,
    ) -> None:
        """P: this engine step computes ``xid``'s tokens up to ``end``
        (``final``: its last prefill chunk) of a prompt of ``prompt`` tokens;
        ``blocks`` are all its block ids (``groups``: those of each KV cache
        group, a hybrid model's). ``client_key``: the push key a client gave
        both requests (decode first), which registrations may carry instead
        of :meth:`push_key`."""
        each = [list(g) for g in groups] if groups is not None else None
        self._post(
            self.push_sender.step,
            xid,
            req_id,
            list(blocks),
            block_size,
            end,
            final,
            client_key,
            each,
            prompt,
        )

    def push_settle(self, xids: Sequence[str]) -> None:
        """P: vLLM freed blocks of these transfers' requests out of their
        sliding windows, and the next step may reuse them: blocks until every
        push of them running now ended (none is cancelled; a push started
        later sees the freed blocks and fails its load). Each ends by its
        load's deadline (``timeout``) and its cancel's grace."""
        wait = self.timeout + self.grace + 30.0
        self._wait_on_loop(self.push_sender.settle(list(xids)), xids, wait)

    def push_preempt(self, xids: Sequence[str], timeout: float = 60.0) -> None:
        """P: the engine preempted these transfers' requests and reuses their
        blocks next: blocks until every push from them is cancelled and
        quiescent (the only call here that waits: vLLM asks it before the
        step that overwrites the blocks). A cancel settles within the core's
        graces (seconds); past ``timeout`` this raises ``RuntimeError``: the
        step must not overwrite blocks a push may still read, and a push
        overtaken by its recompute could leave stale KV reported pushed."""
        self._wait_on_loop(self.push_sender.preempt(list(xids)), xids, timeout)

    def _wait_on_loop(self, coro: Any, xids: Sequence[str], timeout: float) -> None:
        """Run ``coro`` on the loop and wait for it here (the engine's thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            return
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            fut.result(timeout)
        except TimeoutError:
            raise RuntimeError(
                f"aiokvcache: the pushes of transfers {list(xids)} did not stop "
                f"within {timeout:g} s"
            ) from None

    def push_key(self, xid: str) -> str:
        """P: the push key of transfer ``xid`` (what its scheduler computes
        from :attr:`grant_secret`): a decode registers for ``xid`` with it."""
        return self.push_sender.key(xid)

    def layer_saved(self, xids: Sequence[str], layer: int) -> None:
        """P: layer ``layer`` of this step's tokens of each of ``xids`` is in
        their blocks (one post for the whole batch: this runs once per layer)."""
        self._post(self.push_sender.layer_saved, list(xids), layer)

    def push_release(
        self,
        xid: str,
        req_id: str,
        aborted: bool = False,
        groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """P: the engine finished request ``req_id`` (transfer ``xid``) and waits
        for it to be reported sent (``aborted``: it ended before its prefill
        did: stop pushing). ``groups``: its blocks of each KV cache group now
        (vLLM frees a sliding window's earlier blocks as the request ends)."""
        each = [list(g) for g in groups] if groups is not None else None
        self._post(self.push_sender.release, xid, req_id, aborted, each)

    # ------------------------------------------------------------ D

    def pull(
        self,
        req_id: str,
        peer: Peer | None,
        remote_req_id: str,
        remote_ids: Sequence[int],
        local_ids: Sequence[int],
        digest: str | None = None,
        *,
        key: str = "",
        until_ms: int = 0,
        first: int = 0,
        picks: Sequence[int] | None = None,
        sources: Sequence[Source] = (),
    ) -> None:
        """D: read blocks ``remote_ids[first:first + len(local_ids)]`` of ``peer``'s
        request ``remote_req_id`` (``remote_ids``: all its block ids; ``key`` and
        ``until_ms``: its grant key and the key's expiry, from its params) into
        ``local_ids``, or, given ``picks``, blocks ``remote_ids[i] for i in
        picks``; ``req_id`` is then reported received, or failed (with
        ``local_ids`` as invalid blocks), within ``timeout``. ``sources``
        (instead of ``peer`` and ``key``): the prefill workers to read from,
        each its heads of every block (a prefill of another tensor-parallel
        size)."""
        if picks is None:
            picks = range(int(first), int(first) + len(local_ids))
        if not sources:
            if peer is None:
                raise ValueError("a pull needs a peer or sources")
            sources = [Source(peer, key)]
        pull = self.receiver.pull_all(
            list(sources),
            remote_req_id,
            list(remote_ids),
            [int(i) for i in picks],
            list(local_ids),
            digest,
            int(until_ms),
        )
        self._post(self.receiver.start, req_id, local_ids, pull)

    def refuse_load(self, req_id: str, local_ids: Sequence[int], why: str) -> None:
        """D: the engine's load of ``req_id`` into ``local_ids`` cannot start
        (its params name no prefill worker for this rank): reported failed,
        its blocks invalid, as any failed load; nothing is asked of a peer."""
        self._post(self.receiver.start, req_id, list(local_ids), _refused(why))

    def expect_push(
        self,
        req_id: str,
        peer: Peer | None,
        xid: str,
        local_ids: Sequence[int],
        first: int = 0,
        *,
        key: str = "",
        layout: str | None = None,
        sources: Sequence[Source] = (),
        groups: Sequence[Sequence[int]] | None = None,
        tokens: int | None = None,
    ) -> None:
        """D: register ``local_ids`` with ``peer`` for transfer ``xid`` (for the
        request's blocks ``first``, ``first + 1``... on the prefill side), with
        the transfer's push ``key`` from the request's params, and wait for
        its pushes; ``layout``: the prefill's KV layout digest, where the
        params carry it. ``sources`` (instead of ``peer`` and ``key``): the
        prefill workers that push, each its heads of every block under
        transfer id ``xid/rank`` (a prefill of another tensor-parallel size).
        ``groups``: ``[first, count]`` of each KV cache group's positions,
        ``local_ids`` one group's after another (a hybrid model); ``tokens``:
        the tokens this side takes the request to hold (the prefill fails a
        load of more than it computed)."""
        if sources:
            each = [(s, f"{xid}/{s.rank}") for s in sources]
        elif peer is not None:
            each = [(Source(peer, key), xid)]
        else:
            raise ValueError("a push load needs a peer or sources")
        spans = [[int(f), int(n)] for f, n in groups] if groups is not None else None
        load = self.receiver.expect_push_all(
            each, list(local_ids), int(first), layout, spans, tokens
        )
        self._post(self.receiver.start, req_id, local_ids, load)

    def cancel_recv(self, req_id: str) -> None:
        """D: the engine aborted ``req_id``: stop its load; it is reported
        received (its blocks may go back) once nothing writes into them: a
        pull once it is quiescent, a push once the prefill confirmed its
        pushes stopped (or their deadline passed)."""
        self._post(self.receiver.cancel, req_id)

    def free_remote(
        self,
        peer: Peer,
        remote_req_id: str,
        key: str,
        until_ms: int,
        remote_ids: Sequence[int],
    ) -> None:
        """D: this side will not read ``peer``'s request (a local prefix hit,
        an abort before the load began): let it free its blocks now."""
        ids = list(remote_ids)
        msg = Free(remote_req_id, key, len(ids), blocks_digest(ids), int(until_ms))
        self._post(self.receiver.free_remote, peer, msg)

    def renew_start(
        self,
        req_id: str,
        peer: Peer,
        remote_req_id: str,
        key: str,
        until_ms: int,
        remote_ids: Sequence[int],
        every: float,
    ) -> None:
        """D, pull: the engine holds ``req_id`` (``peer``'s request
        ``remote_req_id``) and will load it: renew the prefill's hold on it
        every ``every`` seconds until :meth:`renew_stop` or the key's expiry
        (``until_ms``, the prefill's maximum hold)."""
        ids = list(remote_ids)
        msg = Renew(remote_req_id, key, len(ids), blocks_digest(ids), int(until_ms))
        self._post(self.receiver.renew_start, req_id, peer, msg, float(every))

    def renew_stop(self, req_id: str) -> None:
        """D, pull: ``req_id``'s load started (its claim holds the blocks) or it ended."""
        self._post(self.receiver.renew_stop, req_id)

    def drop_push(self, peer: Peer, xid: str, key: str = "", source: Source | None = None) -> None:
        """D: this side will not take transfer ``xid``'s pushes (a local prefix
        hit, an abort before the load began): ``peer`` frees them once it takes
        no more loads (``key``: the transfer's push key, from the params).
        ``source``: the heads and readers the load would have registered
        with (a prefill of another tensor-parallel size)."""
        span, readers = (source.span, source.readers) if source is not None else (None, 1)
        self._post(self.receiver.drop_push, peer, xid, key, span, readers)

    # ------------------------------------------------------------ messages

    async def _listen(self) -> None:
        cm = self.links.cm
        assert cm is not None
        notes = cm.notifications()
        while True:
            try:
                note, ep = await notes.next_with_link()
            except StopAsyncIteration:
                return
            tag = note.tag
            if not isinstance(tag, str) or not tag.startswith(PREFIX):
                continue
            try:
                self._route(note.src_cluster_id, decode(tag), ep)
            except Exception as exc:
                self.stats["dropped_messages"] += 1
                log.warning("aiokvcache: dropped a connector message %.100r: %s", tag, exc)

    def deliver(self, src: int, op: str, args: list[Any], link: Any = None) -> None:
        """Handle message ``op`` with fields ``args`` from cluster ``src``, as
        if it had come from that link (``link``: what :meth:`PeerLinks.current`
        says of it) (loop thread). Raises :class:`BadMessage` for one
        that does not decode."""
        self._route(src, parse(op, args), link)

    def _route(self, src: int, m: Message, link: Any = None) -> None:
        """Hand ``m``, which came on ``link`` from ``src``, to the side it concerns."""
        match m:
            case Layer():
                self.stats["layers_received"] += 1
            case Claim():
                self.pull_server.on_claim(src, m)
            case Done():
                self.pull_server.on_done(src, m)
            case Free():
                self.pull_server.on_free(src, m)
            case Renew():
                self.pull_server.on_renew(src, m)
            case Grant():
                self.receiver.on_grant(src, m)
            case Refused():
                self.receiver.on_refused(src, m)
            case Reg():
                self.push_sender.on_register(src, m, link)
            case Pushed():
                self.receiver.on_pushed(src, m)
            case PushFail():
                self.receiver.on_pushfail(src, m)
            case Cancel():
                self.push_sender.on_cancel(src, m)

    # ------------------------------------------------------------ stats

    def block_digest(self, block_ids: Sequence[int]) -> str:
        """A hash of blocks ``block_ids``, every layer, in order (for checks)."""
        return block_digest(self.layout, block_ids)

    def pending(self) -> int:
        """Transfers this side still drives (P pushes, D waits) or holds."""
        return self.pull_server.pending() + self.push_sender.pending() + self.receiver.pending()
