"""A peer process for tests/test_memory_safety.py and tests/test_linked_peer_limits.py: an LLMDataDist driven op by op.

``python tests/support/rv_peer.py TRANSPORT [--cluster-id N] [--listen IP:PORT|none]``

Prints one JSON hello line (``address``, ``pid``, ``cluster_id``), then
answers each JSON request line on stdin with one JSON line (``{"error": ...}``
when the request failed) until ``{"op": "exit"}`` or end of input.

Ops (the public API unless marked otherwise):

* ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed``): uint8 tensors of
  ``[1, bytes]`` filled from ``seed``; answers ``cache_id``, ``addrs``.
* ``free`` (``name``), ``stats``.
* ``link`` (``address``, ``cluster_id``, ``timeout_ms``): ``status``.
* ``push`` / ``pull`` (``cluster_id``, ``cache_id``, ``src`` / ``dst``,
  ``timeout``): ``status`` (a name, ``EXCEPTION`` for a non-LLM error).
* ``faulthandler``: ``faulthandler.enable()`` now, as an application may do
  at any time after it created its LLMDataDist.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
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


async def status_of(aw: Any) -> dict[str, Any]:
    try:
        await aw
    except kv.LLMException as exc:
        return {"status": exc.status_code.name, "message": str(exc)[:300]}
    except Exception as exc:
        return {"status": "EXCEPTION", "message": f"{type(exc).__name__}: {exc}"[:300]}
    return {"status": "LLM_SUCCESS", "message": ""}


def info(address: str, cluster_id: int) -> kv.LLMClusterInfo:
    host, port = address.rsplit(":", 1)
    ci = kv.LLMClusterInfo()
    ci.remote_cluster_id = cluster_id
    ci.append_remote_ip_info(host, int(port))
    return ci


async def main(args: argparse.Namespace) -> None:
    cfg = kv.LLMConfig()
    cfg.transport = args.transport
    if args.listen != "none":
        cfg.listen_ip_info = args.listen
    role = kv.LLMRole.DECODER if args.listen != "none" else kv.LLMRole.PROMPT
    dd = kv.LLMDataDist(role, args.cluster_id)
    await dd.init(cfg.generate_options())
    cm = dd.cache_manager
    caches: dict[str, kv.Cache] = {}
    say({"address": dd.listen_address, "pid": os.getpid(), "cluster_id": args.cluster_id})

    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "alloc":
            tensors, nbytes = int(req["tensors"]), int(req["bytes"])
            desc = kv.CacheDesc(tensors, [1, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)
            cache = cm.allocate_cache(desc)
            rng = np.random.default_rng(int(req.get("seed", 0)))
            for t in cache.tensors:
                t[...] = rng.integers(1, 256, t.shape, dtype=np.uint8)  # no zero byte
            caches[str(req["name"])] = cache
            return {"cache_id": cache.cache_id, "addrs": cache.tensor_addrs}
        if op == "free":
            cm.deallocate_cache(caches.pop(str(req["name"])))
            return {"freed": True}
        if op == "stats":
            return {k: int(v) for k, v in cm.stats().items()}
        if op == "link":
            ci = info(str(req["address"]), int(req["cluster_id"]))
            rc, _ = await dd.link_clusters([ci], timeout=int(req.get("timeout_ms", 5000)))
            return {"status": rc.name}
        if op in ("push", "pull"):
            key = kv.CacheKeyByIdAndIndex(int(req["cluster_id"]), int(req["cache_id"]), 0)
            tmo = float(req.get("timeout", 5))
            if op == "push":
                return await status_of(cm.push_cache(key, caches[str(req["src"])], timeout=tmo))
            return await status_of(cm.pull_cache(key, caches[str(req["dst"])], timeout=tmo))
        if op == "faulthandler":
            faulthandler.enable()
            return {"enabled": faulthandler.is_enabled()}
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
        await dd.finalize()


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
    p.add_argument("--lifetime", type=float, default=180)
    a = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watchdog(a.lifetime)
    asyncio.run(main(a))
