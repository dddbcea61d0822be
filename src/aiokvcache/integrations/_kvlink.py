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
tagged pushes; tags are JSON lists starting with ``"aiokv"``). Every message
is taken as coming from the link aiokvcache attributed it to, never from what
its payload says; the prefill side's state machines are in :mod:`._handoff`.

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

  P grants only with the request's grant key (a MAC, by a secret only P's
  own scheduler knows, of the request id and its block list: only requests
  its scheduler handed over, only for their blocks, even before its engine
  told this worker), and holds the blocks for every granted claim until that
  claim's ``done`` or D's own deadline, and never reports them sent before
  its engine handed the request over: a lease that expires on P never frees
  blocks D may still read.

*Push* (P writes D's blocks as each layer is computed)::

    D -> P  ["aiokv","reg",xid,part,parts,runs,first,ttl]
            D's block ids for transfer xid (for P's blocks first, first + 1...),
            and D's deadline: P's pushes end within ttl seconds
    P       push_blocks(..., tag=["aiokv","kv",xid]) per layer, as layers are saved
    P -> D  ["aiokv","pushed",xid]      every layer of xid landed
         or ["aiokv","pushfail",xid,why]
    D -> P  ["aiokv","cancel",xid]      D gave up (P stops and goes quiescent)

  A transfer is bound to the link its first registration part came on:
  parts and cancels from any other link are dropped. P reports ``pushed``
  only once every layer's last push completed; a failed layer ends the
  transfer at once. P bounds its pushes by the registration's ttl (D's
  deadline less a margin) and its own ``timeout``; D waits ``timeout``, and
  on an abort or a failure tells P to stop and waits for its word that its
  pushes are quiescent (a ``pushfail``) or for that deadline. So by the time
  D gives its blocks back to the engine P's pushes have ended (aiokvcache's
  quiescence rule), except for a P that is frozen and resumes later, bounded
  as the library bounds late writes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from ..cache_manager import CacheManager
from ._handoff import Answer, ProtocolError, PullHolds, Registration, blocks_digest, grant_key

__all__ = [
    "KVLayout",
    "Peer",
    "TransferAgent",
    "TransferResults",
    "block_runs",
    "blocks_digest",
    "cluster_id_for",
    "grant_key",
]

log = logging.getLogger("aiokvcache.vllm")

#: Extra time a grant (pull) or D's wait (push) lasts beyond ``timeout``.
GRACE_S = 5.0
#: Block-id runs per registration notification (keeps each tag under 4 KiB).
RUNS_PER_PART = 200
#: Transfers a peer may start on this side before its engine knows them
#: (push registrations; pull claims wait in :class:`PullHolds`, bounded alike).
MAX_UNKNOWN = 4096
#: Push transfers that ended, remembered so that a late registration is
#: answered at once.
MAX_ENDED = 65536
#: Block ids registrations of transfers not computed here may hold, in
#: multiples of this side's block count.
MAX_UNKNOWN_BLOCKS = 4
#: Load failures by reason (the keys of :meth:`TransferAgent.take_metrics`).
FAILURE_REASONS = ("timeout", "refused", "link", "prefill", "layout", "aborted", "other")


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


def block_runs(ids: Sequence[int]) -> list[list[int]]:
    """``[start, count]`` runs of consecutive ids, in order."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([int(b), 1])
    return runs


def _spans(src: Sequence[int], dst: Sequence[int]) -> int:
    """How many contiguous spans moving ``src[i]`` to ``dst[i]`` takes (a span
    breaks wherever either side does)."""
    n = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            n += 1
    return n


def _wall_ms() -> int:
    """This host's wall clock in ms: what grant keys' expiry is written in
    (a prefill's scheduler and workers share the host)."""
    return int(time.time() * 1000)


def _tag(*parts: Any) -> str:
    return json.dumps(["aiokv", *parts], separators=(",", ":"))


@dataclass(frozen=True)
class KVLayout:
    """A paged KV cache as aiokvcache sees it.

    ``addrs`` holds ``num_layers * tensors_per_layer`` host addresses, layer
    by layer; in each tensor block ``b`` is bytes ``[b*block_bytes,
    (b+1)*block_bytes)``. ``block_size`` is in tokens.
    """

    num_layers: int
    tensors_per_layer: int
    num_blocks: int
    block_bytes: int
    block_size: int
    addrs: tuple[int, ...]
    dtype: str = "?"

    def __post_init__(self) -> None:
        if len(self.addrs) != self.num_layers * self.tensors_per_layer:
            raise ValueError(
                f"addrs has {len(self.addrs)} entries, expected "
                f"{self.num_layers} layers x {self.tensors_per_layer} tensors"
            )
        if min(self.num_layers, self.tensors_per_layer, self.num_blocks) < 1:
            raise ValueError("a KV layout needs at least one layer, tensor and block")
        if self.block_bytes < 1 or self.block_size < 1:
            raise ValueError("block_bytes and block_size must be positive")

    def digest(self) -> str:
        """What both sides must agree on (not the block count nor addresses)."""
        key = "/".join(
            map(str, (self.num_layers, self.tensors_per_layer, self.block_bytes, self.block_size))
        )
        key += f"/{self.dtype}"
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Peer:
    """Where a remote worker's aiokvcache engine listens."""

    host: str
    port: int
    cluster_id: int


@dataclass
class TransferResults:
    """One snapshot of what ended since the last one."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


class _TransferFailed(Exception):
    def __init__(self, message: str, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason


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


@dataclass
class _Metrics:
    """What :meth:`TransferAgent.take_metrics` hands out (since its last call)."""

    seconds: list[float] = field(default_factory=list)  # one entry per load
    bytes: list[int] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    leases_expired: int = 0


class TransferAgent:
    """One aiokvcache engine on a daemon thread, serving one engine worker.

    Thread-safe: every public method may be called from any thread and
    returns without waiting for the network (:meth:`start` and :meth:`close`
    excepted).
    """

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
        self.cluster_id = cluster_id
        self.layout = layout
        self.timeout = float(timeout)
        self.grace = float(grace)
        self._host, self._port, self._transport = host, port, transport
        self._auth = auth_token
        self._link_timeout = link_timeout
        self._lock = threading.Lock()
        self._unpin = unpin
        self._cpus = _allowed_cpus()
        #: D: seconds each of the last 1000 successful loads took, from the
        #: engine's hand-over to the last byte (push: includes P's compute).
        self.load_seconds: collections.deque[float] = collections.deque(maxlen=1000)
        #: D, with ``record_digests``: request id -> :meth:`block_digest` of what it loaded.
        self.digests: dict[str, str] | None = {} if record_digests else None
        self._results = TransferResults()
        self._metrics = _Metrics()
        #: P, pull: this worker's grant-key secret, for its own scheduler
        #: only (see :func:`grant_key`).
        self.grant_secret = secrets.token_bytes(32)
        # P, pull: the loop thread's alone (hold() posts to it).
        self._holds = PullHolds(self.grant_secret, max_pending=MAX_UNKNOWN)
        self._hold_timer: asyncio.TimerHandle | None = None
        self._pushes: dict[str, _PushState] = {}
        self._remote_xids: set[str] = set()  # pushes only a peer's registration made
        self._remote_ids = 0  # block ids those registrations hold
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._waits: dict[tuple[str, str], tuple[int, asyncio.Future[Any]]] = {}
        self._recvs: dict[str, asyncio.Task[None]] = {}  # D: request id -> its load
        self._closing = False
        self._aborted: set[str] = set()  # D: loads cancelled because the engine aborted them
        self._links: dict[int, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Counters: what this side loaded, sent and refused.
        self.stats: dict[str, int] = dict.fromkeys(
            (
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
            ),
            0,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dd: LLMDataDist | None = None
        self._cm: CacheManager | None = None
        self._cache: Any = None
        self.address: str | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> str:
        """Start the loop thread and the engine; returns ``"host:port"``."""
        started = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            if self._unpin:
                # vLLM's CPU worker pins its threads (ours would inherit it) to
                # the model's core: run ours, and the engine threads started from
                # here, on every core the process may use.
                with contextlib.suppress(OSError, AttributeError):
                    os.sched_setaffinity(0, self._cpus)
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                box["address"] = loop.run_until_complete(self._init())
            except BaseException as exc:  # reported to start()'s caller
                box["error"] = exc
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=main, name="aiokvcache-vllm", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"aiokvcache did not start within {timeout} s")
        if "error" in box:
            raise RuntimeError(f"aiokvcache failed to start: {box['error']}") from box["error"]
        self.address = box["address"]
        return str(self.address)

    async def _init(self) -> str:
        cfg = LLMConfig()
        cfg.listen_ip_info = f"{self._host}:{self._port}"
        cfg.transport = self._transport
        cfg.enable_remote_cache_accessible = True
        if self._auth:
            cfg.auth_token = self._auth
        dd = LLMDataDist(LLMRole.MIX, self.cluster_id)
        await dd.init(cfg.generate_options())
        self._dd, self._cm = dd, dd.cache_manager
        lay = self.layout
        desc = CacheDesc(
            lay.num_layers * lay.tensors_per_layer,
            [lay.num_blocks, lay.block_bytes],
            DataType.DT_UINT8,
            Placement.HOST,
        )
        self._cache = self._cm.register_blocks_cache(
            desc, list(lay.addrs), BlocksCacheKey(self.cluster_id), remote_accessible=True
        )
        self._spawn(self._listen())
        addr = dd.listen_address
        assert addr is not None
        return addr

    async def _shutdown(self) -> None:
        self._closing = True
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._dd is not None:
            await self._dd.finalize()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: in-flight transfers are cancelled (and quiescent) first."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the aiokvcache agent is not running")
        loop.call_soon_threadsafe(fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------ results

    def take_results(self) -> TransferResults:
        """What ended since the last call."""
        with self._lock:
            out, self._results = self._results, TransferResults()
        return out

    def take_metrics(self) -> dict[str, Any]:
        """What happened since the last call. D: one entry per successful load
        in ``seconds`` (hand-over to last byte), ``bytes`` and ``descriptors``
        (block runs times tensors), and ``failures`` by reason
        (:data:`FAILURE_REASONS`); P: ``leases_expired`` (held blocks nobody
        read in time)."""
        with self._lock:
            m, self._metrics = self._metrics, _Metrics()
        return {
            "seconds": m.seconds,
            "bytes": m.bytes,
            "descriptors": m.descriptors,
            "failures": dict(m.failures),
            "leases_expired": m.leases_expired,
        }

    def _report_sent(self, rid: str) -> None:
        with self._lock:
            self._results.finished_sending.add(rid)

    # ------------------------------------------------------------ P, pull

    def grant_key(self, req_id: str, blocks: Sequence[int], until_ms: int) -> str:
        """P: the grant key of ``req_id`` over ``blocks``, valid until
        ``until_ms`` (what its scheduler computes from :attr:`grant_secret`)."""
        return self._holds.key(req_id, [int(b) for b in blocks], until_ms)

    def hold(self, req_id: str, lease: float, blocks: Sequence[int], until_ms: int) -> None:
        """P: ``req_id`` finished; its ``blocks`` stay put until every granted
        reader is done, or ``lease`` s pass with none. ``until_ms``: when its
        grant key expires (as the scheduler made it)."""
        self._post(self._hold, req_id, float(lease), [int(b) for b in blocks], int(until_ms))

    def _hold(self, rid: str, lease: float, blocks: list[int], until_ms: int) -> None:
        log.debug("hold %s (%d blocks) for %.1f s", rid, len(blocks), lease)
        now = asyncio.get_running_loop().time()
        if self._holds.hold(rid, blocks, lease, until_ms, now):
            self._report_sent(rid)  # its readers were done before the hand-over
        self._tick_holds()

    def _on_claim(self, src: int, args: list[Any]) -> None:
        rid, nonce, key = str(args[0]), str(args[1]), args[2]
        ttl, first, last, n, digest, until = args[3:9]
        log.debug("claim %s/%s from cluster %d", rid, nonce, src)
        now = asyncio.get_running_loop().time()
        answer = self._holds.claim(
            src, rid, nonce, key, ttl, first, last, n, digest, until, now, _wall_ms()
        )
        self._answer_claim(answer)
        self._tick_holds()

    def _answer_claim(self, a: Answer) -> None:
        if a.kind == "grant":
            self.stats["grants"] += 1
            self._spawn(self._send(a.to, _tag("grant", a.rid, a.nonce)))
        else:
            self.stats["refusals"] += 1
            log.info("aiokvcache: claim of %s by cluster %d refused: %s", a.rid, a.to, a.why)
            self._spawn(self._send(a.to, _tag("refused", a.rid, a.nonce, a.why[:256])))

    def _on_done(self, src: int, rid: str, nonce: str) -> None:
        if self._holds.done(src, rid, nonce):
            self._report_sent(rid)

    def _on_free(self, src: int, args: list[Any]) -> None:
        rid, key, n, digest, until = str(args[0]), args[1], args[2], args[3], args[4]
        now = asyncio.get_running_loop().time()
        if self._holds.free(src, rid, key, n, digest, until, now, _wall_ms()):
            log.debug("free %s by cluster %d", rid, src)
            self._report_sent(rid)
        self._tick_holds()

    def _tick_holds(self) -> None:
        """Release what ran out; arm the timer for the next deadline (each
        costs O(log n): deadlines are a heap in :class:`PullHolds`)."""
        loop = asyncio.get_running_loop()
        before = self._holds.expired
        released = self._holds.tick(loop.time(), _wall_ms())
        expired = self._holds.expired - before
        if expired:
            self.stats["leases_expired"] += expired
            with self._lock:
                self._metrics.leases_expired += expired
            log.warning("aiokvcache: %d lease(s) expired unread, blocks released", expired)
        for rid in released:
            self._report_sent(rid)
        when = self._holds.next_deadline()
        timer = self._hold_timer
        if when is None or (timer is not None and timer.when() <= when + 0.001):
            return  # the armed timer comes first (or nothing is due)
        if timer is not None:
            timer.cancel()
        self._hold_timer = loop.call_at(when + 0.001, self._on_hold_timer)

    def _on_hold_timer(self) -> None:
        self._hold_timer = None
        self._tick_holds()

    # ------------------------------------------------------------ P, push

    def push_step(
        self,
        xid: str,
        req_id: str,
        blocks: Sequence[int],
        block_size: int,
        end: int,
        final: bool,
    ) -> None:
        """P: this engine step computes ``xid``'s tokens up to ``end``
        (``final``: its last prefill chunk); ``blocks`` are all its block ids."""
        self._post(self._push_step, xid, req_id, list(blocks), block_size, end, final)

    def layer_saved(self, xids: Sequence[str], layer: int) -> None:
        """P: layer ``layer`` of this step's tokens of each of ``xids`` is in
        their blocks (one post for the whole batch: this runs once per layer)."""
        self._post(self._layer_saved, list(xids), layer)

    def push_release(self, xid: str, req_id: str, aborted: bool = False) -> None:
        """P: the engine finished request ``req_id`` (transfer ``xid``) and waits
        for it to be reported sent (``aborted``: it ended before its prefill
        did: stop pushing)."""
        self._post(self._push_release, xid, req_id, aborted)

    def _push_state(self, xid: str, remote: bool) -> _PushState | None:
        st = self._pushes.get(xid)
        if st is None:
            if remote and len(self._remote_xids) >= MAX_UNKNOWN:
                return None  # a peer registering for transfers nobody computes
            st = self._pushes[xid] = _PushState(xid, remote=remote)
            if remote:
                self._remote_xids.add(xid)
                # Registered, never computed here: dropped after a while.
                self._spawn(self._reap_push(st))
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

    def _push_step(
        self, xid: str, req_id: str, blocks: list[int], bs: int, end: int, final: bool
    ) -> None:
        st = self._push_state(xid, remote=False)
        assert st is not None
        st.req_id, st.blocks, st.block_size, st.step_end = req_id, blocks, bs, end
        if final:
            st.final_end = end

    def _layer_saved(self, xids: list[str], layer: int) -> None:
        for xid in xids:
            st = self._pushes.get(xid)
            if st is None or st.ended:
                continue
            st.saved[layer] = st.step_end
            if st.reg_ids is not None:
                self._push_layer(st, layer)

    def _push_release(self, xid: str, req_id: str, aborted: bool) -> None:
        st = self._pushes.get(xid)
        if st is None:
            # Never stepped here (finished before it was scheduled): nothing
            # was pushed, so its blocks go back at once.
            self._report_sent(req_id)
            self._remember_ended(xid)
            return
        st.req_id = req_id  # a registration may have made st before any step
        st.released = True
        self._unremote(st)
        if not st.ended and (aborted or st.final_end is None):
            # Aborted, or finished before its last chunk was stepped here:
            # nothing more will be computed.
            self._end_push(st, "the prefill request ended before its prefill did")
        elif not st.ended and st.reg_ids is None:
            # Computed; the decode side registers now (prefill first), or
            # never: the blocks wait timeout + grace from here, not longer.
            self._spawn(self._reap_push(st))
        self._maybe_report(st)

    def _on_register(self, src: int, args: list[Any]) -> None:
        xid = str(args[0])
        if xid in self._ended and xid not in self._pushes:
            # Too late (the request ended here): tell D now, not at its deadline.
            self._spawn(self._send(src, _tag("pushfail", xid, "the prefill request ended")))
            return
        st = self._push_state(xid, remote=True)
        if st is None or st.ended or st.reg_ids is not None:
            return
        if st.registration is None:
            st.registration = Registration(self.layout.num_blocks, RUNS_PER_PART)
        reg = st.registration
        before = reg.count
        try:
            first, ttl = args[4], args[5]
            if not (type(first) is int and 0 <= first < self.layout.num_blocks):
                raise ProtocolError(f"a registration's first block index {first!r}")
            if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl > 0):
                raise ProtocolError(f"a registration's deadline {ttl!r}")
            ids = reg.add(src, args[1], args[2], args[3])
            if st.remote:
                self._remote_ids += reg.count - before
                if self._remote_ids > MAX_UNKNOWN_BLOCKS * self.layout.num_blocks:
                    raise ProtocolError("too many blocks registered for transfers not computed")
        except ProtocolError as exc:
            if reg.src in (None, src):
                # The registrant's own message does not hold: end the transfer.
                st.reg_cluster = src
                self._end_push(st, f"bad registration: {exc}")
            else:
                self.stats["dropped_messages"] += 1
                log.warning("aiokvcache: push %s: %s", xid, exc)
            return
        if ids is None:
            return
        st.reg_cluster, st.first = src, first
        if not ids:
            # D needs none of it (a local prefix hit, or it was aborted).
            log.debug("push %s: the decode side takes nothing", xid)
            st.ended = True
            self._maybe_report(st)
            return
        st.reg_ids = ids
        # P's pushes end by D's deadline (carried in the registration) or its own.
        st.deadline = time.monotonic() + min(self.timeout, float(ttl))
        self._spawn(self._push_deadline(st))
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
        assert self._cm is not None and st.reg_ids is not None and st.reg_cluster is not None
        j0 = max(i0, st.first)
        try:
            if i1 - st.first > len(st.reg_ids) or i1 > len(st.blocks):
                raise _TransferFailed(
                    f"{len(st.reg_ids)} destination blocks registered from block "
                    f"{st.first}, {i1 - st.first} needed"
                )
            if j0 < i1:
                left = None if st.deadline is None else max(0.001, st.deadline - time.monotonic())
                n = self.layout.tensors_per_layer
                await self._cm.push_blocks(
                    BlocksCacheKey(st.reg_cluster),
                    self._cache,
                    st.blocks[j0:i1],
                    st.reg_ids[j0 - st.first : i1 - st.first],
                    src_layer_range=layers,
                    dst_layer_range=layers,
                    tensor_num_per_layer=n,
                    tag=_tag("kv", st.xid),
                    timeout=left,
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._end_push(st, f"layers {layers.start}-{layers.stop - 1}: {exc}")
            return
        for layer in layers:
            st.landed[layer] = max(st.landed.get(layer, 0), end)
        self._check_pushed(st)

    def _check_pushed(self, st: _PushState) -> None:
        """Report ``pushed`` once every layer's pushes up to the prompt's end
        completed (not merely started)."""
        if st.ended or st.final_end is None or st.reg_ids is None:
            return
        if any(st.landed.get(layer, 0) < st.final_end for layer in range(self.layout.num_layers)):
            return
        st.ended = True
        assert st.reg_cluster is not None
        self.stats["pushes_sent"] += 1
        self._spawn(self._send(st.reg_cluster, _tag("pushed", st.xid)))
        self._maybe_report(st)

    def _end_push(self, st: _PushState, why: str) -> None:
        """End ``st`` now (nothing reports it pushed after this), then cancel
        its pushes, wait until they are quiescent and tell D."""
        if st.ended:
            return
        st.ended = True
        self.stats["push_failures"] += 1
        log.warning("aiokvcache: push %s failed: %s", st.xid, why)
        st.quiescing = True
        self._spawn(self._quiesce_push(st, why))

    async def _quiesce_push(self, st: _PushState, why: str) -> None:
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
            await self._send(st.reg_cluster, _tag("pushfail", st.xid, why[:512]))

    def _maybe_report(self, st: _PushState) -> None:
        """Report the request sent, once: ended, released by the engine, and
        no push of it running."""
        if st.reported or not (st.ended and st.released and st.req_id is not None):
            return
        me = asyncio.current_task()
        if st.quiescing or any(not t.done() and t is not me for t in st.tails.values()):
            return  # _quiesce_push or the last push reports it
        st.reported = True
        self._report_sent(st.req_id)
        self._forget_push(st)

    def _forget_push(self, st: _PushState) -> None:
        self._unremote(st)
        if self._pushes.get(st.xid) is st:
            del self._pushes[st.xid]
        self._remember_ended(st.xid)

    def _remember_ended(self, xid: str) -> None:
        self._ended[xid] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    async def _push_deadline(self, st: _PushState) -> None:
        assert st.deadline is not None
        await asyncio.sleep(max(0.0, st.deadline - time.monotonic()))
        if not st.ended:
            self._end_push(st, f"not pushed within {self.timeout:g} s")

    async def _reap_push(self, st: _PushState) -> None:
        """A transfer only a peer's registration made (the engine never
        computed it here), or one the engine finished that nobody registered
        for, ends after timeout + grace."""
        await asyncio.sleep(self.timeout + self.grace)
        if self._pushes.get(st.xid) is not st:
            return
        if st.req_id is None:
            self._end_push(st, "the prefill instance never computed it")
            self._forget_push(st)
        elif not st.ended and st.reg_ids is None and st.released:
            st.ended = True
            log.warning("aiokvcache: push %s: no decode instance registered for it", st.xid)
            self._maybe_report(st)

    def _on_cancel(self, src: int, xid: str) -> None:
        st = self._pushes.get(xid)
        if st is None or st.ended:
            return
        bound = st.registration.src if st.registration is not None else None
        if bound != src:
            self.stats["dropped_messages"] += 1
            log.warning("aiokvcache: cluster %d cancelled push %s it did not register", src, xid)
            return
        self._end_push(st, "the decode side cancelled it")

    # ------------------------------------------------------------ D

    def pull(
        self,
        req_id: str,
        peer: Peer,
        remote_req_id: str,
        remote_ids: Sequence[int],
        local_ids: Sequence[int],
        digest: str | None = None,
        *,
        key: str = "",
        until_ms: int = 0,
        first: int = 0,
    ) -> None:
        """D: read blocks ``remote_ids[first:first + len(local_ids)]`` of ``peer``'s
        request ``remote_req_id`` (``remote_ids``: all its block ids; ``key`` and
        ``until_ms``: its grant key and the key's expiry, from its params) into
        ``local_ids``; ``req_id`` is then reported received, or failed (with
        ``local_ids`` as invalid blocks), within ``timeout``."""
        pull = self._pull(
            peer,
            remote_req_id,
            list(remote_ids),
            int(first),
            list(local_ids),
            digest,
            (key, int(until_ms)),
        )
        self._post(self._start_recv, req_id, local_ids, pull)

    def expect_push(
        self, req_id: str, peer: Peer, xid: str, local_ids: Sequence[int], first: int = 0
    ) -> None:
        """D: register ``local_ids`` with ``peer`` for transfer ``xid`` (for the
        request's blocks ``first``, ``first + 1``... on the prefill side) and
        wait for its pushes."""
        self._post(
            self._start_recv,
            req_id,
            local_ids,
            self._expect_push(peer, xid, list(local_ids), int(first)),
        )

    def cancel_recv(self, req_id: str) -> None:
        """D: the engine aborted ``req_id``: stop its load; it is reported
        received (its blocks may go back) once nothing writes into them: a
        pull once it is quiescent, a push once the prefill confirmed its
        pushes stopped (or their deadline passed)."""
        self._post(self._cancel_recv, req_id)

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
        msg = _tag("free", remote_req_id, key, len(ids), blocks_digest(ids), int(until_ms))
        self._post(lambda: self._spawn(self._free_remote(peer, msg)))

    def drop_push(self, peer: Peer, xid: str) -> None:
        """D: this side will not take transfer ``xid``'s pushes (a local prefix
        hit, an abort before the load began): ``peer`` stops and frees."""
        self._post(lambda: self._spawn(self._drop_push(peer, xid)))

    async def _free_remote(self, peer: Peer, msg: str) -> None:
        with contextlib.suppress(Exception):
            await self._send_to(peer, msg, self._link_timeout)

    async def _drop_push(self, peer: Peer, xid: str) -> None:
        # An empty registration: nothing to push; P ends the transfer.
        with contextlib.suppress(Exception):
            await self._send_to(peer, _tag("reg", xid, 0, 1, [], 0, 1.0), self._link_timeout)

    def _cancel_recv(self, req_id: str) -> None:
        task = self._recvs.get(req_id)
        if task is not None and not task.done():
            self._aborted.add(req_id)
            task.cancel()

    def _start_recv(
        self, req_id: str, local_ids: Sequence[int], coro: Coroutine[Any, Any, int]
    ) -> None:
        ids = list(local_ids)
        task = self._spawn(self._recv(req_id, ids, coro))
        self._recvs[req_id] = task
        task.add_done_callback(lambda t: self._recv_done(t, req_id, ids, coro))

    def _recv_done(
        self,
        task: asyncio.Task[None],
        req_id: str,
        local_ids: list[int],
        coro: Coroutine[Any, Any, int],
    ) -> None:
        if self._recvs.get(req_id) is task:
            del self._recvs[req_id]
        coro.close()  # one cancelled before it ever ran was never awaited
        if task.cancelled() and req_id in self._aborted:
            # The engine aborted it and nothing writes into its blocks any
            # more (see cancel_recv): they may go back.
            self._aborted.discard(req_id)
            self.stats["loads_aborted"] += 1
            self._fail_load(req_id, local_ids, "aborted", "the engine aborted the request")

    async def _recv(
        self, req_id: str, local_ids: list[int], coro: Coroutine[Any, Any, int]
    ) -> None:
        t0 = time.perf_counter()
        try:
            spans = await coro
        except _TransferFailed as exc:
            self._fail_load(req_id, local_ids, exc.reason, str(exc))
            return
        except Exception as exc:
            self._fail_load(req_id, local_ids, "other", str(exc))
            return
        took = time.perf_counter() - t0
        self.stats["blocks_loaded"] += len(local_ids)
        self.load_seconds.append(took)
        if self.digests is not None:
            self.digests[req_id] = self.block_digest(local_ids)
        lay = self.layout
        with self._lock:
            self._results.finished_recving.add(req_id)
            m = self._metrics
            tensors = lay.num_layers * lay.tensors_per_layer
            m.seconds.append(took)
            m.bytes.append(len(local_ids) * lay.block_bytes * tensors)
            m.descriptors.append(spans * tensors)

    def _fail_load(self, req_id: str, local_ids: list[int], reason: str, why: str) -> None:
        if reason != "aborted":
            log.warning("aiokvcache: request %s: KV load failed: %s", req_id, why)
            self.stats["load_failures"] += 1
        with self._lock:
            self._metrics.failures[reason] += 1
            if reason != "aborted":
                self._results.failed_recving.add(req_id)
                self._results.invalid_block_ids.update(local_ids)
            self._results.finished_recving.add(req_id)

    async def _pull(
        self,
        peer: Peer,
        rid: str,
        remote_all: list[int],
        first: int,
        local_ids: list[int],
        digest: str | None,
        grant: tuple[str, int],
    ) -> int:
        """Claim, read, tell P done; returns the contiguous spans read."""
        if digest is not None and digest != self.layout.digest():
            raise _TransferFailed("the prefill instance's KV layout differs from ours", "layout")
        last = first + len(local_ids)
        if not local_ids or not 0 <= first < last <= len(remote_all):
            raise _TransferFailed(
                f"blocks [{first}, {last}) of a request of {len(remote_all)} remote blocks",
                "layout",
            )
        assert self._cm is not None
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
                claim = _tag(
                    "claim",
                    rid,
                    nonce,
                    key,
                    ttl,
                    first,
                    last,
                    len(remote_all),
                    blocks_digest(remote_all),
                    until,
                )
                claimed = True
                await self._send_to(peer, claim, deadline - time.monotonic())
                answer = await fut
                log.debug("pull %s: %s", rid, answer)
                if answer != "grant":
                    raise _TransferFailed(f"the prefill instance refused: {answer}", "refused")
                await self._cm.pull_blocks(
                    BlocksCacheKey(peer.cluster_id),
                    self._cache,
                    remote_all[first:last],
                    local_ids,
                    tensor_num_per_layer=self.layout.tensors_per_layer,
                    timeout=max(0.001, deadline - time.monotonic()),
                )
            self.stats["pulls"] += 1
        except TimeoutError:
            raise _TransferFailed(f"not loaded within {self.timeout} s", "timeout") from None
        except LLMException as exc:
            raise _TransferFailed(str(exc), "link") from exc
        finally:
            self._waits.pop(("grant", nonce), None)
            if claimed:  # quiescent by now: P may free them (at its last claim's done)
                self._spawn(self._send(peer.cluster_id, _tag("done", rid, nonce)))
        return _spans(remote_all[first:last], local_ids)

    async def _expect_push(self, peer: Peer, xid: str, local_ids: list[int], first: int) -> int:
        """Register, wait for ``pushed``; returns the contiguous spans written.

        P's pushes are bounded by the deadline the registration carries (what
        is left of D's ``timeout`` less a margin for the message's way and P's
        cancel: ``min(grace, timeout / 4)``), D waits ``timeout``: by the time
        D gives its blocks back, P's pushes have ended. An abort or a failure
        before that tells P to stop and waits for its word that its pushes
        are quiescent (or for that deadline)."""
        deadline = time.monotonic() + self.timeout
        margin = min(self.grace, self.timeout / 4)
        fut = self._expect(("pushed", xid), peer.cluster_id)
        registered = finished = False
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.timeout):
                runs = block_runs(local_ids)
                step = RUNS_PER_PART
                parts = [runs[i : i + step] for i in range(0, len(runs), step)] or [[]]
                for i, part in enumerate(parts):
                    registered = True
                    left = deadline - time.monotonic() - margin
                    if left <= 0:
                        raise TimeoutError
                    msg = _tag("reg", xid, i, len(parts), part, first, left)
                    await self._send_to(peer, msg, deadline - time.monotonic())
                # Shielded: an abort must leave it for P's answer to the cancel.
                answer = await asyncio.shield(fut)
            finished = True
            if answer != "pushed":
                raise _TransferFailed(f"the prefill instance failed: {answer}", "prefill")
            self.stats["pushes_received"] += 1
        except TimeoutError:
            raise _TransferFailed(f"not pushed within {self.timeout:g} s", "timeout") from None
        finally:
            aborted = False
            if registered and not finished:
                # Timed out or aborted: P stops; its word that it stopped (a
                # pushfail, once its pushes are quiescent) ends the wait, or
                # its deadline, which the registration bounded. An abort that
                # comes meanwhile does not end the wait (it is reported as
                # one after it); a shutdown does (the agent's listener, which
                # would take P's word, is gone, and finalize ends the link).
                self._spawn(self._send(peer.cluster_id, _tag("cancel", xid)))
                while not fut.done() and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        await asyncio.wait_for(asyncio.shield(fut), left)
                    except asyncio.CancelledError:
                        aborted = True
                    except Exception:
                        break
            self._waits.pop(("pushed", xid), None)
            if aborted:
                raise asyncio.CancelledError
        return len(block_runs(local_ids))

    def _expect(self, key: tuple[str, str], src: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waits[key] = (src, fut)
        return fut

    def _answer(self, src: int, key: tuple[str, str], value: Any) -> None:
        entry = self._waits.get(key)
        if entry is None:
            return
        want, fut = entry
        if src != want:
            self.stats["dropped_messages"] += 1
            log.warning("aiokvcache: cluster %d answered for cluster %d: dropped", src, want)
            return
        if not fut.done():
            fut.set_result(value)

    async def _link(self, peer: Peer) -> None:
        task = self._links.get(peer.cluster_id)
        if task is None or (task.done() and task.exception() is not None):
            task = self._links[peer.cluster_id] = self._spawn(self._do_link(peer))
        await asyncio.shield(task)

    async def _do_link(self, peer: Peer) -> None:
        assert self._dd is not None
        info = LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_remote_ip_info(peer.host, int(peer.port))
        _, (st,) = await self._dd.link_clusters([info], timeout=int(self._link_timeout * 1000))
        if st not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise _TransferFailed(f"cannot link to {peer.host}:{peer.port}: {st.name}", "link")

    async def _send_to(self, peer: Peer, tag: str, timeout: float) -> None:
        """Link (once) and send ``tag``, within ``timeout``. A link that went
        away since (the peer restarted, unlinked, or was declared dead) is
        made again, once, rather than failing this transfer."""
        assert self._cm is not None
        end = time.monotonic() + timeout
        for attempt in (0, 1):
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(self._link(peer), left)
                left = end - time.monotonic()
                await self._cm.notify(
                    peer.cluster_id, tag, timeout=max(0.001, min(self._link_timeout, left))
                )
                return
            except LLMException as exc:
                gone = exc.status_code in (
                    LLMStatusCode.LLM_NOT_YET_LINK,
                    LLMStatusCode.LLM_LINK_FAILED,
                )
                if attempt or not gone:
                    raise _TransferFailed(f"cannot reach the peer: {exc}", "link") from exc
                await self._forget_link(peer.cluster_id)

    async def _send(self, cluster_id: int, tag: str) -> None:
        """A reply or a notice that need not arrive (the peer's deadlines cover it)."""
        assert self._cm is not None
        try:
            await self._cm.notify(cluster_id, tag, timeout=self._link_timeout)
        except Exception as exc:
            log.info("aiokvcache: notification to cluster %d lost: %s", cluster_id, exc)

    async def _forget_link(self, cluster_id: int) -> None:
        """Drop our side of a link that went away, so that it is made afresh."""
        self._links.pop(cluster_id, None)
        if self._dd is not None:
            info = LLMClusterInfo()
            info.remote_cluster_id = cluster_id
            with contextlib.suppress(Exception):
                await self._dd.unlink_clusters([info], force=True)

    # ------------------------------------------------------------ notifications

    async def _listen(self) -> None:
        assert self._cm is not None
        async for note in self._cm.notifications():
            tag = note.tag
            if not isinstance(tag, str) or not tag.startswith('["aiokv"'):
                continue
            try:
                msg = json.loads(tag)
                self._dispatch(note.src_cluster_id, str(msg[1]), list(msg[2:]))
            except Exception as exc:
                self.stats["dropped_messages"] += 1
                log.warning("aiokvcache: dropped a connector message %.100r: %s", tag, exc)

    def _dispatch(self, src: int, kind: str, args: list[Any]) -> None:
        if kind == "kv":
            self.stats["layers_received"] += 1
        elif kind == "claim":
            self._on_claim(src, args)
        elif kind == "done":
            self._on_done(src, str(args[0]), str(args[1]))
        elif kind == "free":
            self._on_free(src, args)
        elif kind == "grant":
            self._answer(src, ("grant", str(args[1])), "grant")
        elif kind == "refused":
            self._answer(src, ("grant", str(args[1])), str(args[2]) if len(args) > 2 else "refused")
        elif kind == "reg":
            self._on_register(src, args)
        elif kind == "pushed":
            self._answer(src, ("pushed", str(args[0])), "pushed")
        elif kind == "pushfail":
            why = str(args[1]) if len(args) > 1 else "failed"
            self._answer(src, ("pushed", str(args[0])), why)
        elif kind == "cancel":
            self._on_cancel(src, str(args[0]))
        else:
            raise ProtocolError(f"unknown message {kind!r}")

    # ------------------------------------------------------------ stats

    def block_digest(self, block_ids: Sequence[int]) -> str:
        """A hash of blocks ``block_ids``, every layer, in order (for checks)."""
        lay = self.layout
        h = hashlib.blake2b(digest_size=16)
        for addr in lay.addrs:
            for b in block_ids:
                h.update(ctypes.string_at(addr + int(b) * lay.block_bytes, lay.block_bytes))
        return h.hexdigest()

    def pending(self) -> int:
        """Transfers this side still drives (P pushes, D waits) or holds."""
        return len(self._holds) + len(self._pushes) + len(self._waits)
