"""A peer process for tests/test_lifetimes.py: an LLMDataDist driven op by op.

``python tests/support/lt_peer.py TRANSPORT [--role prefill|decoder]
[--cluster-id N] [--listen] [--copy-lanes N] [--peer-timeout MS]
[--sync-kv-timeout MS]``

Prints one JSON hello line (``address``, ``pid``, ``cluster_id``), then
answers each JSON request line on stdin with one JSON line
(``{"error": ...}`` when the request failed) until ``{"op": "exit"}`` or end
of input. Only the public API (``import aiokvcache as kv``).

Ops:

* ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed`` or ``fill``: a byte
  value): uint8 tensors of ``[1, bytes]``; answers ``cache_id``, ``addrs``,
  ``sha``.
* ``hash`` (``name``), ``free`` (``name``), ``stats``.
* ``link`` / ``unlink`` (``address``, ``cluster_id``, ``force``).
* ``push`` / ``pull`` (``cluster_id``, ``cache_id``, ``src`` / ``dst``,
  ``timeout``): ``status``, ``start``, ``end`` (``time.monotonic()``).
* ``rloop`` (``loop``, ``cluster_id``, ``cache_id``, ``src``, ``seconds``,
  ``op``: push or pull): pushes (pulls) back to back in the background,
  recording every call; ``rloop_join`` (``loop``, ``at``: a
  ``time.monotonic()`` instant) answers a summary of the calls that ended
  before ``at`` and of those that started after it (counts per status, the
  first few as ``[start, end, status]``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

import aiokvcache as kv


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def cache_sha(cache: kv.Cache) -> str:
    h = hashlib.sha256()
    for t in cache.tensors:
        h.update(t.tobytes())
    return h.hexdigest()


async def status_of(aw: Any) -> tuple[str, str]:
    try:
        await aw
    except kv.LLMException as exc:
        return exc.status_code.name, str(exc)[:300]
    except Exception as exc:
        return "EXCEPTION", f"{type(exc).__name__}: {exc}"[:300]
    return "LLM_SUCCESS", ""


async def main(args: argparse.Namespace) -> None:
    cfg = kv.LLMConfig()
    cfg.transport = args.transport
    if args.listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    if args.copy_lanes is not None:
        cfg.copy_lanes = args.copy_lanes
    if args.peer_timeout is not None:
        cfg.peer_timeout = args.peer_timeout
    cfg.sync_kv_timeout = args.sync_kv_timeout
    role = kv.LLMRole.PROMPT if args.role == "prefill" else kv.LLMRole.DECODER
    dd = kv.LLMDataDist(role, args.cluster_id)
    await dd.init(cfg.generate_options())
    cm = dd.cache_manager
    caches: dict[str, kv.Cache] = {}
    loops: dict[str, asyncio.Task[list[list[Any]]]] = {}
    say({"address": dd.listen_address, "pid": os.getpid(), "cluster_id": args.cluster_id})

    def info(req: dict[str, Any]) -> kv.LLMClusterInfo:
        host, port = str(req["address"]).rsplit(":", 1)
        ci = kv.LLMClusterInfo()
        ci.remote_cluster_id = int(req["cluster_id"])
        ci.append_remote_ip_info(host, int(port))
        return ci

    def transfer(req: dict[str, Any], op: str) -> Any:
        key = kv.CacheKeyByIdAndIndex(int(req["cluster_id"]), int(req["cache_id"]), 0)
        tmo = float(req.get("timeout", 5))
        if op == "push":
            return cm.push_cache(key, caches[str(req["src"])], timeout=tmo)
        return cm.pull_cache(key, caches[str(req["dst"])], timeout=tmo)

    async def rloop(req: dict[str, Any], calls: list[list[Any]]) -> list[list[Any]]:
        end = time.monotonic() + float(req.get("seconds", 5))
        op = str(req.get("kind", "push"))
        while time.monotonic() < end:
            start = time.monotonic()
            status, _ = await status_of(transfer(req, op))
            calls.append([start, time.monotonic(), status])
            if status in ("LLM_LINK_FAILED", "LLM_NOT_YET_LINK", "LLM_ENGINE_FINALIZED"):
                break
            await asyncio.sleep(0)
        return calls

    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "alloc":
            desc = kv.CacheDesc(
                int(req["tensors"]), [1, int(req["bytes"])], kv.DataType.DT_UINT8, kv.Placement.HOST
            )
            cache = cm.allocate_cache(desc)
            if req.get("seed") is not None:
                rng = np.random.default_rng(int(req["seed"]))
                for t in cache.tensors:
                    t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
            elif req.get("fill") is not None:
                for t in cache.tensors:
                    t[...] = int(req["fill"])
            caches[str(req["name"])] = cache
            return {
                "cache_id": cache.cache_id,
                "addrs": cache.tensor_addrs,
                "sha": cache_sha(cache),
            }
        if op == "hash":
            return {"sha": cache_sha(caches[str(req["name"])])}
        if op == "free":
            cm.deallocate_cache(caches.pop(str(req["name"])))
            return {"freed": True, "at": time.monotonic()}
        if op == "stats":
            return {k: int(v) for k, v in cm.stats().items()}
        if op == "link":
            rc, per = await dd.link_clusters([info(req)], timeout=int(req.get("timeout_ms", 5000)))
            return {"status": rc.name, "per": [s.name for s in per]}
        if op == "unlink":
            rc, per = await dd.unlink_clusters(
                [info(req)], timeout=int(req.get("timeout_ms", 3000)), force=bool(req.get("force"))
            )
            return {"status": rc.name, "per": [s.name for s in per], "at": time.monotonic()}
        if op in ("push", "pull"):
            start = time.monotonic()
            status, message = await status_of(transfer(req, op))
            return {"status": status, "message": message, "start": start, "end": time.monotonic()}
        if op == "rloop":
            calls: list[list[Any]] = []
            loops[str(req["loop"])] = asyncio.create_task(rloop(req, calls))
            return {"started": True}
        if op == "rloop_join":
            # Summarized around the instant "at": a record of every call
            # would not fit one line.
            calls = await loops.pop(str(req["loop"]))
            at = float(req.get("at", 0.0))
            # "before": ended before "before_at" (default "at"), e.g. before
            # a concurrent call began: those must be untouched by it.
            before = [c for c in calls if c[1] < float(req.get("before_at", at))]
            after = [c for c in calls if c[0] > at]
            counts: dict[str, int] = {}
            for c in after:
                counts[c[2]] = counts.get(c[2], 0) + 1
            return {
                "before": len(before),
                "before_ok": sum(c[2] == "LLM_SUCCESS" for c in before),
                "last_before": before[-3:],
                "after": len(after),
                "after_counts": counts,
                "first_after": after[:5],
                "first_ok_after": [c for c in after if c[2] == "LLM_SUCCESS"][:3],
            }
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
        for task in loops.values():
            task.cancel()
        await dd.finalize()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("transport")
    p.add_argument("--role", default="prefill", choices=("prefill", "decoder"))
    p.add_argument("--cluster-id", type=int, default=1)
    p.add_argument("--listen", action="store_true")
    p.add_argument("--copy-lanes", type=int, default=None)
    p.add_argument("--peer-timeout", type=int, default=None)
    p.add_argument("--sync-kv-timeout", type=int, default=60_000)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(main(p.parse_args()))
