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
tagged pushes; tags are JSON lists starting with ``"aiokv"``):

*Pull* (D reads P's blocks, vLLM NixlConnector's default flow)::

    D -> P  ["aiokv","claim",rid]       may I read request rid's blocks?
    P -> D  ["aiokv","grant",rid]       yes; they are held for timeout + grace more
         or ["aiokv","expired",rid]     no: their lease ran out, they may be reused
    D       pull_blocks(...)            quiescent when it returns or raises
    D -> P  ["aiokv","done",rid]        P may free them now

  D never reads without a grant, and a grant outlasts D's own deadline, so a
  lease that expires on P can never free blocks that D is still reading.

*Push* (P writes D's blocks as each layer is computed)::

    D -> P  ["aiokv","reg",xid,part,parts,runs]   D's block ids for transfer xid
    P       push_blocks(..., tag=["aiokv","kv",xid]) per layer, as layers are saved
    P -> D  ["aiokv","pushed",xid]      every push of xid landed
         or ["aiokv","pushfail",xid,why]
    D -> P  ["aiokv","cancel",xid]      D gave up (P stops and goes quiescent)

  P bounds its pushes by ``timeout`` from the registration; D waits
  ``timeout + grace``, so by the time D gives its blocks back to the engine
  P's pushes have ended (aiokvcache's quiescence rule), except for a P that
  is frozen and resumes later, bounded as the library bounds late writes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from ..cache_manager import CacheManager

__all__ = ["KVLayout", "Peer", "TransferAgent", "TransferResults", "block_runs", "cluster_id_for"]

log = logging.getLogger("aiokvcache.vllm")

#: Extra time a grant (pull) or D's wait (push) lasts beyond ``timeout``.
GRACE_S = 5.0
#: Block-id runs per registration notification (keeps each tag under 4 KiB).
RUNS_PER_PART = 200
#: Released request ids remembered, so that a late claim for one is refused.
MAX_RELEASED = 65536


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


def _unruns(runs: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for start, count in runs:
        out.extend(range(int(start), int(start) + int(count)))
    return out


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
    pass


@dataclass
class _Hold:
    """P, pull mode: a finished request's blocks, held for D to read."""

    deadline: float
    known: bool = False  # the engine's scheduler handed it over (hold())
    done: bool = False  # D finished reading


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
    pushed: dict[int, int] = field(default_factory=dict)  # layer -> tokens pushed
    tails: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    reg_cluster: int | None = None
    reg_ids: list[int] | None = None
    reg_parts: dict[int, list[list[int]]] = field(default_factory=dict)
    deadline: float | None = None
    ended: bool = False  # pushed or failed: nothing more will be written
    released: bool = False  # the engine is done with the request (may report it)


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
        self._holds: dict[str, _Hold] = {}
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pushes: dict[str, _PushState] = {}
        self._waits: dict[tuple[str, str], asyncio.Future[Any]] = {}  # (kind, id) -> future
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
                "pushes_sent",
                "push_failures",
                "grants",
                "refusals",
                "leases_expired",
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
        """What ended since the last call (P: lease expiries reaped here too)."""
        now = time.monotonic()
        with self._lock:
            for rid, h in list(self._holds.items()):
                if h.known and (h.done or h.deadline <= now):
                    if not h.done:
                        self.stats["leases_expired"] += 1
                        log.warning("aiokvcache: request %s: lease expired, blocks released", rid)
                    self._release(rid)
                elif not h.known and h.deadline <= now:
                    del self._holds[rid]  # a claim whose hold never came
            out, self._results = self._results, TransferResults()
        return out

    def _release(self, rid: str) -> None:
        """Report ``rid`` sent (lock held)."""
        self._holds.pop(rid, None)
        self._results.finished_sending.add(rid)
        self._released[rid] = None
        while len(self._released) > MAX_RELEASED:
            self._released.popitem(last=False)

    # ------------------------------------------------------------ P, pull

    def hold(self, req_id: str, lease: float) -> None:
        """P: ``req_id`` finished; its blocks stay put until D read them or ``lease`` s pass."""
        deadline = time.monotonic() + lease
        log.debug("hold %s for %.1f s", req_id, lease)
        with self._lock:
            h = self._holds.get(req_id)
            if h is None:
                self._holds[req_id] = _Hold(deadline, known=True)
            else:  # D claimed (or even finished) before the engine told us
                h.known = True
                h.deadline = max(h.deadline, deadline)

    def _on_claim(self, src: int, rid: str) -> None:
        now = time.monotonic()
        log.debug("claim %s from cluster %d", rid, src)
        with self._lock:
            if rid in self._released:
                granted = False
            else:
                h = self._holds.get(rid)
                if h is None:
                    # The engine has not told this worker yet: the blocks are
                    # held by its scheduler until we report them, so grant.
                    h = self._holds[rid] = _Hold(now)
                h.deadline = max(h.deadline, now + self.timeout + self.grace)
                granted = True
        self.stats["grants" if granted else "refusals"] += 1
        self._spawn(self._send(src, _tag("grant" if granted else "expired", rid)))

    def _on_done(self, rid: str) -> None:
        with self._lock:
            h = self._holds.get(rid)
            if h is not None:
                h.done = True

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

    def _push_state(self, xid: str) -> _PushState:
        st = self._pushes.get(xid)
        if st is None:
            st = self._pushes[xid] = _PushState(xid)
            # Unregistered transfers are dropped after a while (D died first).
            self._spawn(self._reap_push(xid))
        return st

    def _push_step(
        self, xid: str, req_id: str, blocks: list[int], bs: int, end: int, final: bool
    ) -> None:
        st = self._push_state(xid)
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
            with self._lock:
                self._release(req_id)
            return
        st.released = True
        if aborted and not st.ended:
            self._spawn(self._fail_push(st, "the prefill request was aborted"))
        self._maybe_report(st)

    def _on_register(self, src: int, xid: str, part: int, parts: int, runs: list[Any]) -> None:
        st = self._push_state(xid)
        if st.ended or st.reg_ids is not None:
            return
        st.reg_parts[part] = runs
        if len(st.reg_parts) < parts:
            return
        st.reg_cluster = src
        st.reg_ids = _unruns(r for i in range(parts) for r in st.reg_parts[i])
        st.reg_parts.clear()
        st.deadline = time.monotonic() + self.timeout
        self._spawn(self._push_deadline(st))
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
        st.tails[layer] = self._spawn(self._push_range(st, layer, i0, i1, prev))

    async def _push_range(
        self, st: _PushState, layer: int, i0: int, i1: int, prev: asyncio.Task[None] | None
    ) -> None:
        if prev is not None:
            # One layer's pushes in order: a re-pushed partial block must
            # not be overtaken by its older copy.
            await asyncio.gather(prev, return_exceptions=True)
        if st.ended:
            return
        assert self._cm is not None and st.reg_ids is not None and st.reg_cluster is not None
        try:
            if i1 > len(st.reg_ids) or i1 > len(st.blocks):
                raise _TransferFailed(
                    f"{len(st.reg_ids)} destination blocks registered, {i1} needed"
                )
            left = None if st.deadline is None else max(0.001, st.deadline - time.monotonic())
            n = self.layout.tensors_per_layer
            await self._cm.push_blocks(
                BlocksCacheKey(st.reg_cluster),
                self._cache,
                st.blocks[i0:i1],
                st.reg_ids[i0:i1],
                src_layer_range=range(layer, layer + 1),
                dst_layer_range=range(layer, layer + 1),
                tensor_num_per_layer=n,
                tag=_tag("kv", st.xid),
                timeout=left,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not st.ended:
                self._spawn(self._fail_push(st, f"layer {layer}: {exc}"))
            return
        self._check_pushed(st)

    def _check_pushed(self, st: _PushState) -> None:
        if st.ended or st.final_end is None or st.reg_ids is None:
            return
        layers = self.layout.num_layers
        if any(st.pushed.get(layer, 0) < st.final_end for layer in range(layers)):
            return
        me = asyncio.current_task()
        if any(not t.done() and t is not me for t in st.tails.values()):
            return
        st.ended = True
        assert st.reg_cluster is not None
        self.stats["pushes_sent"] += 1
        self._spawn(self._send(st.reg_cluster, _tag("pushed", st.xid)))
        self._maybe_report(st)

    async def _fail_push(self, st: _PushState, why: str) -> None:
        """End ``st``: cancel its pushes, wait until they are quiescent, tell D."""
        if st.ended:
            return
        st.ended = True
        self.stats["push_failures"] += 1
        log.warning("aiokvcache: push %s failed: %s", st.xid, why)
        tails = [t for t in st.tails.values() if not t.done()]
        for t in tails:
            t.cancel()
        await asyncio.gather(*tails, return_exceptions=True)
        if st.reg_cluster is not None:
            await self._send(st.reg_cluster, _tag("pushfail", st.xid, why[:512]))
        self._maybe_report(st)

    def _maybe_report(self, st: _PushState) -> None:
        if st.ended and st.released and st.req_id is not None:
            with self._lock:
                self._release(st.req_id)
            self._pushes.pop(st.xid, None)

    async def _push_deadline(self, st: _PushState) -> None:
        assert st.deadline is not None
        await asyncio.sleep(max(0.0, st.deadline - time.monotonic()))
        if not st.ended:
            await self._fail_push(st, f"not pushed within {self.timeout} s")

    async def _reap_push(self, xid: str) -> None:
        """A transfer nobody registered for ends after timeout + grace."""
        await asyncio.sleep(self.timeout + self.grace)
        st = self._pushes.get(xid)
        if st is not None and st.reg_ids is None and not st.ended:
            st.ended = True
            log.warning("aiokvcache: push %s: no decode instance registered for it", xid)
            self._maybe_report(st)
            if st.req_id is None:
                self._pushes.pop(xid, None)

    def _on_cancel(self, xid: str) -> None:
        st = self._pushes.get(xid)
        if st is not None and not st.ended:
            self._spawn(self._fail_push(st, "the decode side cancelled it"))

    # ------------------------------------------------------------ D

    def pull(
        self,
        req_id: str,
        peer: Peer,
        remote_req_id: str,
        remote_ids: Sequence[int],
        local_ids: Sequence[int],
        digest: str | None = None,
    ) -> None:
        """D: read ``remote_ids`` of ``peer`` into ``local_ids``; ``req_id`` is then
        reported received, or failed (with ``local_ids`` as invalid blocks)."""
        self._post(
            self._start_recv,
            req_id,
            local_ids,
            self._pull(peer, remote_req_id, list(remote_ids), list(local_ids), digest),
        )

    def expect_push(self, req_id: str, peer: Peer, xid: str, local_ids: Sequence[int]) -> None:
        """D: register ``local_ids`` with ``peer`` for transfer ``xid`` and wait for its pushes."""
        self._post(
            self._start_recv, req_id, local_ids, self._expect_push(peer, xid, list(local_ids))
        )

    def _start_recv(
        self, req_id: str, local_ids: Sequence[int], coro: Coroutine[Any, Any, None]
    ) -> None:
        self._spawn(self._recv(req_id, list(local_ids), coro))

    async def _recv(
        self, req_id: str, local_ids: list[int], coro: Coroutine[Any, Any, None]
    ) -> None:
        t0 = time.perf_counter()
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("aiokvcache: request %s: KV load failed: %s", req_id, exc)
            self.stats["load_failures"] += 1
            with self._lock:
                self._results.failed_recving.add(req_id)
                self._results.finished_recving.add(req_id)
                self._results.invalid_block_ids.update(local_ids)
            return
        self.stats["blocks_loaded"] += len(local_ids)
        self.load_seconds.append(time.perf_counter() - t0)
        if self.digests is not None:
            self.digests[req_id] = self.block_digest(local_ids)
        with self._lock:
            self._results.finished_recving.add(req_id)

    async def _pull(
        self, peer: Peer, rid: str, remote_ids: list[int], local_ids: list[int], digest: str | None
    ) -> None:
        if digest is not None and digest != self.layout.digest():
            raise _TransferFailed("the prefill instance's KV layout differs from ours")
        if len(remote_ids) != len(local_ids):
            raise _TransferFailed(
                f"{len(remote_ids)} remote blocks for {len(local_ids)} local ones"
            )
        assert self._cm is not None
        start = time.monotonic()
        granted = False
        log.debug("pull %s from cluster %d: start", rid, peer.cluster_id)
        try:
            await self._link(peer)
            log.debug("pull %s: linked after %.3f s", rid, time.monotonic() - start)
            fut = self._expect(("grant", rid))
            await self._send(peer.cluster_id, _tag("claim", rid), must=True)
            answer = await asyncio.wait_for(fut, self.timeout)
            log.debug("pull %s: %s after %.3f s", rid, answer, time.monotonic() - start)
            if answer != "grant":
                raise _TransferFailed("the prefill instance's lease on its blocks expired")
            granted = True
            if local_ids:
                await self._cm.pull_blocks(
                    BlocksCacheKey(peer.cluster_id),
                    self._cache,
                    remote_ids,
                    local_ids,
                    tensor_num_per_layer=self.layout.tensors_per_layer,
                    timeout=max(0.001, self.timeout - (time.monotonic() - start)),
                )
            self.stats["pulls"] += 1
        except TimeoutError:
            raise _TransferFailed(f"not loaded within {self.timeout} s") from None
        finally:
            self._waits.pop(("grant", rid), None)
            if granted:  # the pull is quiescent by now: P may free them
                await self._send(peer.cluster_id, _tag("done", rid))

    async def _expect_push(self, peer: Peer, xid: str, local_ids: list[int]) -> None:
        fut = self._expect(("pushed", xid))
        try:
            await self._link(peer)
            runs = block_runs(local_ids)
            parts = [runs[i : i + RUNS_PER_PART] for i in range(0, len(runs), RUNS_PER_PART)] or [
                []
            ]
            for i, part in enumerate(parts):
                await self._send(peer.cluster_id, _tag("reg", xid, i, len(parts), part), must=True)
            try:
                answer = await asyncio.wait_for(fut, self.timeout + self.grace)
            except TimeoutError:
                await self._send(peer.cluster_id, _tag("cancel", xid))
                raise _TransferFailed(f"not pushed within {self.timeout} s") from None
            if answer != "pushed":
                raise _TransferFailed(f"the prefill instance failed: {answer}")
            self.stats["pushes_received"] += 1
        finally:
            self._waits.pop(("pushed", xid), None)

    def _expect(self, key: tuple[str, str]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waits[key] = fut
        return fut

    def _answer(self, key: tuple[str, str], value: Any) -> None:
        fut = self._waits.get(key)
        if fut is not None and not fut.done():
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
            raise _TransferFailed(f"cannot link to {peer.host}:{peer.port}: {st.name}")

    async def _send(self, cluster_id: int, tag: str, must: bool = False) -> None:
        assert self._cm is not None
        try:
            await self._cm.notify(cluster_id, tag, timeout=self._link_timeout)
        except Exception as exc:
            if must:
                self._relink(cluster_id)
                raise _TransferFailed(f"cannot reach the peer: {exc}") from exc
            log.info("aiokvcache: notification to cluster %d lost: %s", cluster_id, exc)

    def _relink(self, cluster_id: int) -> None:
        """Forget a link that failed, so the next transfer links afresh."""
        self._links.pop(cluster_id, None)
        if self._dd is not None:
            info = LLMClusterInfo()
            info.remote_cluster_id = cluster_id
            dd = self._dd
            self._spawn(dd.unlink_clusters([info], force=True))

    # ------------------------------------------------------------ notifications

    async def _listen(self) -> None:
        assert self._cm is not None
        async for note in self._cm.notifications():
            tag = note.tag
            if not isinstance(tag, str) or not tag.startswith('["aiokv"'):
                continue
            try:
                msg = json.loads(tag)
                self._dispatch(note.src_cluster_id, msg[1], msg[2:])
            except Exception:
                log.warning("aiokvcache: dropped a malformed connector message %.100r", tag)

    def _dispatch(self, src: int, kind: str, args: list[Any]) -> None:
        if kind == "kv":
            self.stats["layers_received"] += 1
        elif kind == "claim":
            self._on_claim(src, str(args[0]))
        elif kind == "done":
            self._on_done(str(args[0]))
        elif kind in ("grant", "expired"):
            self._answer(("grant", str(args[0])), kind)
        elif kind == "reg":
            self._on_register(src, str(args[0]), int(args[1]), int(args[2]), list(args[3]))
        elif kind == "pushed":
            self._answer(("pushed", str(args[0])), "pushed")
        elif kind == "pushfail":
            self._answer(("pushed", str(args[0])), str(args[1]) if len(args) > 1 else "failed")
        elif kind == "cancel":
            self._on_cancel(str(args[0]))

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
        with self._lock:
            holds = len(self._holds)
        return holds + len(self._pushes) + len(self._waits)
