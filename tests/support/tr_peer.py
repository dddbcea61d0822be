"""A peer process for tests/test_trust.py: an LLMDataDist driven op by op.

``python tests/support/tr_peer.py TRANSPORT [--cluster-id N] [--listen IP:PORT|none]
[--auth-token T] [--peer-timeout MS] [--sync-kv-timeout MS] [--lifetime S]``

Prints one JSON hello line (``address``, ``pid``, ``cluster_id``, ``worker``:
the hex of its engine's UCX worker address, ``rss_kb``), then answers each
JSON request line on stdin with one JSON line (``{"error": ...}`` when the
request failed) until ``{"op": "exit"}`` or end of input. Bytes travel in
JSON as ``{"__b": HEX}``.

Ops (the public API unless marked *internal*):

* ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed``; ``blocks`` and
  ``blocks_key`` [cluster, model] for a blocks cache of ``blocks`` blocks of
  ``bytes``; ``keys``: [[cluster, req_id], ...] CacheKeys of the slots):
  answers ``cache_id``, ``addrs``, ``sha``.
* ``register_private`` (``name``, ``tensors``, ``bytes``): a cache over
  NumPy memory with ``remote_accessible=False``.
* ``hash`` (``name``), ``free`` (``name``), ``stats``, ``rss``, ``links``
  (``{cluster id: broken}``, *internal* test view ``LLMDataDist._links``).
* ``link`` / ``unlink`` (``address``, ``cluster_id``, ``timeout_ms``, ``force``).
* ``link_go`` (``address``, ``cluster_id``, ``fifo``): answers
  ``{"ready": true}``, waits until one byte can be read from the named FIFO,
  links, then answers the link's status (two peers released together).
* ``push`` / ``pull`` (``cluster_id``, ``cache_id``, ``index``, ``src`` /
  ``dst``, ``timeout``, ``tag``): ``status`` (a name, ``EXCEPTION`` for a
  non-LLM error), ``message``.
* ``pull_free`` (``cluster_id``, ``cache_id``, ``dst``): starts a pull into
  ``dst``, and while its jobs are live deallocates ``dst``; answers
  ``regions`` (the engine's count right after) at once.
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
* ``evil`` (``op``, ``meta``: the body to answer that lookup with, or null
  to restore): *internal* — replaces the peer handler's ``_serve_lookup``.
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

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

import aiokvcache as kv


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


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


def cache_sha(cache: kv.Cache) -> str:
    h = hashlib.sha256()
    for t in cache.tensors:
        h.update(t.tobytes())
    return h.hexdigest()


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


async def status_of(aw: Any) -> dict[str, Any]:
    try:
        await aw
    except kv.LLMException as exc:
        return {"status": exc.status_code.name, "message": str(exc)[:500]}
    except Exception as exc:
        return {"status": "EXCEPTION", "message": f"{type(exc).__name__}: {exc}"[:500]}
    return {"status": "LLM_SUCCESS", "message": ""}


def info(address: str, cluster_id: int) -> kv.LLMClusterInfo:
    host, port = address.rsplit(":", 1)
    ci = kv.LLMClusterInfo()
    ci.remote_cluster_id = cluster_id
    ci.append_remote_ip_info(host, int(port))
    return ci


# ------------------------------------------------------------------ internals
# The one place this program reaches inside the library: the runtime of an
# LLMDataDist (its engine, state, peer service). Only the *internal* ops use it.


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


# ------------------------------------------------------------------ main


async def main(args: argparse.Namespace) -> None:
    cfg = kv.LLMConfig()
    cfg.transport = args.transport
    cfg.sync_kv_timeout = args.sync_kv_timeout
    if args.listen != "none":
        cfg.listen_ip_info = args.listen
    if args.auth_token:
        cfg.auth_token = args.auth_token
    if args.peer_timeout is not None:
        cfg.peer_timeout = args.peer_timeout
    if args.no_prefault:
        cfg.prefault = False  # nor does it install a same-host peer's caches at link time
    role = kv.LLMRole.DECODER if args.listen != "none" else kv.LLMRole.PROMPT
    dd = kv.LLMDataDist(role, args.cluster_id)
    await dd.init(cfg.generate_options())
    cm = dd.cache_manager
    caches: dict[str, kv.Cache] = {}
    keep: list[Any] = []
    tasks: set[asyncio.Task[Any]] = set()
    rt = runtime(dd)
    say(
        {
            "address": dd.listen_address,
            "pid": os.getpid(),
            "cluster_id": args.cluster_id,
            "worker": bytes(rt.engine.worker_address).hex(),
            "rss_kb": rss_kb(),
        }
    )

    def u8(tensors: int, nbytes: int, blocks: int = 1) -> kv.CacheDesc:
        return kv.CacheDesc(tensors, [blocks, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)

    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "alloc":
            tensors, nbytes = int(req["tensors"]), int(req["bytes"])
            if req.get("blocks"):
                bk = req.get("blocks_key")
                bkey = kv.BlocksCacheKey(int(bk[0]), int(bk[1])) if bk else None
                cache = cm.allocate_blocks_cache(u8(tensors, nbytes, int(req["blocks"])), bkey)
            else:
                keys = [kv.CacheKey(int(c), req_id=int(r)) for c, r in req.get("keys", [])]
                cache = cm.allocate_cache(u8(tensors, nbytes), keys)
            rng = np.random.default_rng(int(req.get("seed", 0)))
            for t in cache.tensors:
                t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
            caches[str(req["name"])] = cache
            return {
                "cache_id": cache.cache_id,
                "addrs": cache.tensor_addrs,
                "sha": cache_sha(cache),
            }
        if op == "register_private":
            tensors, nbytes = int(req["tensors"]), int(req["bytes"])
            arrays = [np.zeros((1, nbytes), np.uint8) for _ in range(tensors)]
            cache = cm.register_cache(u8(tensors, nbytes), arrays, remote_accessible=False)
            caches[str(req["name"])] = cache
            return {"cache_id": cache.cache_id, "addrs": cache.tensor_addrs}
        if op == "hash":
            return {"sha": cache_sha(caches[str(req["name"])])}
        if op == "free":
            cache = caches.pop(str(req["name"]))
            if cache.is_blocks_cache:
                cm.deallocate_blocks_cache(cache)
            else:
                cm.deallocate_cache(cache)
            return {"freed": True}
        if op == "stats":
            return {k: int(v) for k, v in cm.stats().items()}
        if op == "rss":
            return {"rss_kb": rss_kb()}
        if op == "links":
            return {"links": {str(c): bool(lk.broken) for c, lk in dd._links.items()}}
        if op in ("link", "unlink"):
            ci = info(str(req["address"]), int(req["cluster_id"]))
            tmo = int(req.get("timeout_ms", 3000))
            if op == "link":
                rc, per = await dd.link_clusters([ci], timeout=tmo)
            else:
                rc, per = await dd.unlink_clusters([ci], timeout=tmo, force=bool(req.get("force")))
            return {"status": rc.name, "per": [s.name for s in per]}
        if op == "link_go":
            ci = info(str(req["address"]), int(req["cluster_id"]))
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
            rc, per = await dd.link_clusters([ci], timeout=int(req.get("timeout_ms", 3000)))
            return {"status": rc.name, "per": [s.name for s in per]}
        if op == "push":
            key = kv.CacheKeyByIdAndIndex(
                int(req["cluster_id"]), int(req["cache_id"]), int(req.get("index", 0))
            )
            return await status_of(
                cm.push_cache(
                    key,
                    caches[str(req["src"])],
                    timeout=float(req.get("timeout", 5)),
                    tag=req.get("tag"),
                )
            )
        if op == "pull":
            key = kv.CacheKeyByIdAndIndex(
                int(req["cluster_id"]), int(req["cache_id"]), int(req.get("index", 0))
            )
            return await status_of(
                cm.pull_cache(key, caches[str(req["dst"])], timeout=float(req.get("timeout", 5)))
            )
        if op == "pull_free":
            key = kv.CacheKeyByIdAndIndex(int(req["cluster_id"]), int(req["cache_id"]), 0)
            dst = caches.pop(str(req["dst"]))
            task = asyncio.ensure_future(status_of(cm.pull_cache(key, dst, timeout=120)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0)  # the pull's jobs are submitted and leased now
            assert not task.done()
            cm.unregister_cache(dst.cache_id)  # a register_private cache
            return {"regions": int(cm.stats()["regions"])}
        if op == "notify":
            return await status_of(cm.notify(int(req["cluster_id"]), str(req["tag"]), timeout=5))
        if op == "forge":
            from aiokvcache._loader import native

            st = rt.state
            link = st.link_for(int(req["cluster_id"]))
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
        if op == "block":
            until = str(req["until"])
            say({"blocking": True})
            while not os.path.exists(until):  # noqa: ASYNC240 - blocking on purpose
                time.sleep(0.01)  # noqa: ASYNC251 - the loop is blocked, as in a model step
            return {"unblocked": True}
        if op == "hog":
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
        if op == "evil":
            handler = rt.service.handler
            real = type(handler)._serve_lookup.__get__(handler)
            if req.get("meta") is None:
                handler._serve_lookup = real
                return {"restored": True}
            evil_op, meta = str(req["op_name"]), from_json(req["meta"])

            def serve(link: Any, request: Any) -> dict[str, Any]:
                if request.op == evil_op:
                    return meta  # type: ignore[no-any-return]
                return real(link, request)  # type: ignore[no-any-return]

            handler._serve_lookup = serve
            return {"armed": evil_op}
        if op == "meta":
            from aiokvcache._core.memory.catalog import metadata

            st = rt.state
            with st.lock:
                rec = st.registry.caches[caches[str(req["name"])].cache_id]
            return {"meta": to_json(metadata(st, rec))}
        if op == "probe_flood":
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
        if op == "by_addr":
            svc = rt.service
            link = rt.state.link_for(int(req["cluster_id"]))
            res = await status_of(
                rt.on_service(svc.lookups.remotes_by_addr(link, [int(a) for a in req["addrs"]]))
            )
            with rt.state.lock:
                res["cache_ids"] = sorted(link.remote)
            return res
        return {"error": f"unknown op {op!r}"}

    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            if not line.strip():
                continue
            req = json.loads(line)
            if req.get("op") == "exit":
                break
            try:
                reply = await handle(req)
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            say(reply)
    finally:
        for t in list(tasks):
            t.cancel()
        await dd.finalize()
        del keep


def _watchdog(seconds: float) -> None:
    def run() -> None:
        time.sleep(seconds)
        os._exit(124)

    threading.Thread(target=run, name="lifetime", daemon=True).start()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("transport")
    p.add_argument("--cluster-id", type=int, default=2)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--peer-timeout", type=int, default=None)
    p.add_argument("--no-prefault", action="store_true")
    p.add_argument("--sync-kv-timeout", type=int, default=60_000)
    p.add_argument("--lifetime", type=float, default=300)
    a = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watchdog(a.lifetime)
    asyncio.run(main(a))
