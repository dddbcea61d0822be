"""Ops of the peer program (:mod:`aiokvcache.testing.peer`) for
tests/test_trust.py and tests/test_liveness.py: a peer that attacks, or is
attacked. Loaded after ``peer_ops_transfers.py`` (its ``push`` and
``pull``). Its hello also has ``worker``: the hex of its engine's UCX worker
address. Bytes travel in JSON as ``{"__b": HEX}``.

Ops (the public API unless marked *internal*), beside the built-in ``hash``,
``stats``, ``rss``, ``link`` and ``unlink``:

* ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed``: 0 by default;
  ``blocks`` and ``blocks_key`` [cluster, model] for a blocks cache of
  ``blocks`` blocks of ``bytes``; ``keys``: [[cluster, req_id], ...]
  CacheKeys of the slots), in place of the built-in one: always filled from
  ``seed``; answers ``cache_id``, ``addrs``, ``sha``.
* ``register_private`` (``name``, ``tensors``, ``bytes``): a cache over
  NumPy memory with ``remote_accessible=False``.
* ``free`` (``name``), in place of the built-in one: a blocks cache too.
* ``links``: ``{cluster id: broken}`` (*internal* test view ``LLMDataDist._links``).
* ``link_go`` (``address``, ``cluster_id``, ``fifo``): answers
  ``{"ready": true}``, waits until one byte can be read from the named FIFO,
  links, then answers the link's status (two peers released together).
* ``pull_free`` (``cluster_id``, ``cache_id``, ``dst``): starts a pull into
  ``dst``, and while its jobs are live unregisters ``dst`` (a
  ``register_private`` cache); answers ``regions`` (the engine's count
  right after) at once.
* ``notify`` (``cluster_id``, ``tag``).
* ``forge`` (``cluster_id``: the link to send on, ``claim``: the cluster id
  written into the payload, ``tag``, ``cache_id``, ``layer``, ``count``,
  ``pad``): *internal* — payload-only jobs submitted straight to the engine
  on that link's endpoint, as ``CacheManager.notify`` does, carrying a
  notification payload built by the library's own encoder; answers
  ``{"sent": count}`` once the engine released them all.
* ``block`` (``until``: a path): answers ``{"blocking": true}``, then blocks
  its event loop (``time.sleep``) until the path exists; answers
  ``{"unblocked": true}``.
* ``hog`` (``seconds``): answers ``{"hogging": true}``, then holds the GIL
  (a pure Python loop under a switch interval longer than ``seconds``) so
  that none of its other Python threads (the event loop's, the service's)
  runs; answers ``{"hogged": seconds it took}``.
* ``evil`` (``op_name``: a lookup op, or ``"*"`` for every lookup;
  ``meta``: the body to answer it with, or null to restore): *internal* —
  replaces the peer handler's ``_serve_lookup``.
* ``evil_probe`` (``slot``: the probe slot to hand out, or null to restore):
  *internal* — what the handshake's identity and ``probe_info`` answer carry
  from now on; answers the real ``slot``.
* ``meta`` (``name``): *internal* — the metadata this peer serves for a cache.
* ``probe_flood`` (``cluster_id``, ``count``): *internal* — arms its peer
  service to hold the next ``count`` ``probe_info`` requests it is asked,
  answer them all at once and SIGSTOP itself right after; sends ``count``
  ``probe_back`` requests (timeout 600 s) on the link; answers
  ``{"sent": count}`` at once.
* ``by_addr`` (``cluster_id``, ``addrs``): *internal* — asks the peer which
  caches hold ``addrs`` (the ``cache_by_addr`` request); answers
  ``cache_ids`` it learned, or ``status`` / ``message``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import numpy as np

import aiokvcache as kv
from aiokvcache._child import say
from aiokvcache.testing import cluster_info, fill
from aiokvcache.testing.peer import PeerNode, cache_sha, timed_status


def to_json(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"__b": bytes(obj).hex()}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__b"}:
            return bytes.fromhex(obj["__b"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


async def status_of(aw: Awaitable[Any]) -> dict[str, Any]:
    """``status`` and ``message`` (``""`` when it succeeded)."""
    res = await timed_status(aw)
    return {"status": res["status"], "message": res.get("message", "")}


# ------------------------------------------------------------------ internals
# The one place this module reaches inside the library: the runtime of an
# LLMDataDist (its engine, state, peer service). Only the *internal* ops use it.


class _Tampered:
    """A probe slot whose wire form is given (``evil_probe``)."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def encode(self) -> Any:
        return self.body


def runtime(dd: kv.LLMDataDist) -> Any:
    return dd._rt


def forged_payload(claim: int, tag: str, cache_id: int, layer: int) -> bytes:
    """A notification payload claiming to come from cluster ``claim``: the
    d2734be wire format, whose receiver took the source from "c" (a receiver
    that ignores "c" reads the same dict as a plain notification)."""
    from aiokvcache._core.wire import control

    return control.encode(
        {"t": tag, "c": claim, "i": cache_id, "b": 0 if layer >= 0 else None, "l": layer}
    )


def u8(tensors: int, nbytes: int, blocks: int = 1) -> kv.CacheDesc:
    return kv.CacheDesc(tensors, [blocks, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


class Trust:
    """The ops, over a :class:`PeerNode`; the pulls ``pull_free`` left running."""

    def __init__(self, node: PeerNode) -> None:
        self.node = node
        self.tasks: set[asyncio.Task[Any]] = set()

    @property
    def cm(self) -> kv.CacheManager:
        return self.node.dd.cache_manager

    @property
    def rt(self) -> Any:
        return runtime(self.node.dd)

    async def alloc(self, req: dict[str, Any]) -> dict[str, Any]:
        tensors, nbytes = int(req["tensors"]), int(req["bytes"])
        if req.get("blocks"):
            bk = req.get("blocks_key")
            bkey = kv.BlocksCacheKey(int(bk[0]), int(bk[1])) if bk else None
            cache = self.cm.allocate_blocks_cache(u8(tensors, nbytes, int(req["blocks"])), bkey)
        else:
            keys = [kv.CacheKey(int(c), req_id=int(r)) for c, r in req.get("keys", [])]
            cache = self.cm.allocate_cache(u8(tensors, nbytes), keys)
        fill(cache, int(req.get("seed", 0)))
        self.node.caches[str(req["name"])] = cache
        return {"cache_id": cache.cache_id, "addrs": cache.tensor_addrs, "sha": cache_sha(cache)}

    async def register_private(self, req: dict[str, Any]) -> dict[str, Any]:
        tensors, nbytes = int(req["tensors"]), int(req["bytes"])
        arrays = [np.zeros((1, nbytes), np.uint8) for _ in range(tensors)]
        cache = self.cm.register_cache(u8(tensors, nbytes), arrays, remote_accessible=False)
        self.node.caches[str(req["name"])] = cache
        return {"cache_id": cache.cache_id, "addrs": cache.tensor_addrs}

    async def free(self, req: dict[str, Any]) -> dict[str, Any]:
        cache = self.node.caches.pop(str(req["name"]))
        if cache.is_blocks_cache:
            self.cm.deallocate_blocks_cache(cache)
        else:
            self.cm.deallocate_cache(cache)
        return {"freed": True}

    async def links(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"links": {str(c): bool(lk.broken) for c, lk in self.node.dd._links.items()}}

    async def link_go(self, req: dict[str, Any]) -> dict[str, Any]:
        info = cluster_info(str(req["address"]), int(req["cluster_id"]))
        fd = os.open(str(req["fifo"]), os.O_RDONLY | os.O_NONBLOCK)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                if os.read(fd, 1) and not ready.done():
                    ready.set_result(None)
            except BlockingIOError:
                pass

        loop.add_reader(fd, readable)
        say({"ready": True})
        try:
            await ready
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        timeout = int(req.get("timeout_ms", 3000))
        rc, per = await self.node.dd.link_clusters([info], timeout=timeout)
        return {"status": rc.name, "per": [s.name for s in per]}

    async def pull_free(self, req: dict[str, Any]) -> dict[str, Any]:
        key = kv.CacheKeyByIdAndIndex(int(req["cluster_id"]), int(req["cache_id"]), 0)
        dst = self.node.caches.pop(str(req["dst"]))
        task = asyncio.ensure_future(status_of(self.cm.pull_cache(key, dst, timeout=120)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        await asyncio.sleep(0)  # the pull's jobs are submitted and leased now
        assert not task.done()
        self.cm.unregister_cache(dst.cache_id)  # a register_private cache
        return {"regions": int(self.cm.stats()["regions"])}

    async def notify(self, req: dict[str, Any]) -> dict[str, Any]:
        return await status_of(self.cm.notify(int(req["cluster_id"]), str(req["tag"]), timeout=5))

    async def forge(self, req: dict[str, Any]) -> dict[str, Any]:
        from aiokvcache._loader import native

        rt = self.rt
        link = rt.state.link_for(int(req["cluster_id"]))
        tag = str(req["tag"]) + "~" * int(req.get("pad", 0))
        payload = forged_payload(
            int(req["claim"]), tag, int(req.get("cache_id", -1)), int(req.get("layer", -1))
        )
        rows = np.zeros((0, 4), np.uint64)
        count = int(req.get("count", 1))
        batch = int(req.get("batch", 2000))
        sent = 0
        while sent < count:
            n = min(batch, count - sent)
            ids = rt.engine.submit_many([(native.OP_PUT, link.ep, rows, payload, 60_000)] * n)
            ok = await asyncio.to_thread(rt.engine.wait_released, ids, 60.0)
            if not ok:
                return {"error": "forged notifications not released in 60 s"}
            sent += n
        return {"sent": sent, "payload_bytes": len(payload)}

    async def block(self, req: dict[str, Any]) -> dict[str, Any]:
        until = str(req["until"])
        say({"blocking": True})
        while not os.path.exists(until):  # noqa: ASYNC240 - blocking on purpose
            time.sleep(0.01)  # noqa: ASYNC251 - the loop is blocked, as in a model step
        return {"unblocked": True}

    async def hog(self, req: dict[str, Any]) -> dict[str, Any]:
        # Hold the GIL for ``seconds``: a long switch interval and a pure
        # Python loop, as a serving engine's step starves our threads.
        seconds = float(req["seconds"])
        say({"hogging": True})
        old = sys.getswitchinterval()
        sys.setswitchinterval(seconds + 30)
        start = time.monotonic()
        try:
            while time.monotonic() - start < seconds:
                pass
        finally:
            sys.setswitchinterval(old)
        return {"hogged": time.monotonic() - start}

    async def evil(self, req: dict[str, Any]) -> dict[str, Any]:
        handler = self.rt.service.handler
        real = type(handler)._serve_lookup.__get__(handler)
        if req.get("meta") is None:
            handler._serve_lookup = real
            return {"restored": True}
        evil_op, meta = str(req["op_name"]), from_json(req["meta"])

        def serve(link: Any, request: Any) -> dict[str, Any]:
            if evil_op in (request.op, "*"):
                return meta  # type: ignore[no-any-return]
            return real(link, request)  # type: ignore[no-any-return]

        handler._serve_lookup = serve
        return {"armed": evil_op}

    async def evil_probe(self, req: dict[str, Any]) -> dict[str, Any]:
        prober = self.rt.service.prober
        vars(prober).pop("probe_info", None)  # the real one again
        real = prober.probe_info().encode()
        if req.get("slot") is not None:
            slot = from_json(req["slot"])
            prober.probe_info = lambda: _Tampered(slot)
        return {"slot": to_json(real)}

    async def meta(self, req: dict[str, Any]) -> dict[str, Any]:
        from aiokvcache._core.memory.catalog import metadata

        st = self.rt.state
        with st.lock:
            rec = st.cache_table.caches[self.node.caches[str(req["name"])].cache_id]
        return {"meta": to_json(metadata(st, rec))}

    async def probe_flood(self, req: dict[str, Any]) -> dict[str, Any]:
        rt = self.rt
        handler = rt.service.handler
        loop = rt.service.thread.loop
        count = int(req["count"])
        held: list[asyncio.Future[None]] = []
        orig = handler.handle_request

        async def hold(conn: Any, op_: str, body: dict[str, Any]) -> dict[str, Any]:
            if op_ != "probe_info" or len(held) >= count:
                return await orig(conn, op_, body)  # type: ignore[no-any-return]
            fut = loop.create_future()
            held.append(fut)
            if len(held) == count:
                # All asked: answer them together, let the writer put
                # the answers on the wire, then freeze the whole process.
                for f in held:
                    if not f.done():
                        f.set_result(None)

                async def freeze() -> None:
                    for _ in range(20):
                        await asyncio.sleep(0)
                    os.kill(os.getpid(), signal.SIGSTOP)

                loop.create_task(freeze())
            await fut
            return await orig(conn, op_, body)  # type: ignore[no-any-return]

        handler.handle_request = hold

        async def fire() -> None:
            link = rt.state.link_for(int(req["cluster_id"]))
            await asyncio.gather(
                *(
                    link.conn.request("probe_back", {"timeout": 600.0}, timeout=700)
                    for _ in range(count)
                ),
                return_exceptions=True,
            )

        rt.service.thread.spawn(fire())
        return {"sent": count}

    async def by_addr(self, req: dict[str, Any]) -> dict[str, Any]:
        rt = self.rt
        link = rt.state.link_for(int(req["cluster_id"]))
        asked = rt.service.lookups.remotes_by_addr(link, [int(a) for a in req["addrs"]])
        res = await status_of(rt.on_service(asked))
        with rt.state.lock:
            res["cache_ids"] = sorted(link.remote)
        return res


_OPS = (
    "alloc", "register_private", "free", "links", "link_go", "pull_free", "notify", "forge",
    "block", "hog", "evil", "evil_probe", "meta", "probe_flood", "by_addr",
)  # fmt: skip


@contextlib.asynccontextmanager
async def start(node: PeerNode) -> AsyncIterator[None]:
    """The ops, and the hello's ``worker``; at the end, the pulls
    ``pull_free`` left running are cancelled."""
    trust = Trust(node)
    node.ops.update({name: getattr(trust, name) for name in _OPS})
    node.hello["worker"] = bytes(trust.rt.engine.worker_address).hex()
    try:
        yield
    finally:
        for task in list(trust.tasks):
            task.cancel()
