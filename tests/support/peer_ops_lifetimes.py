"""Ops of the peer program (:mod:`aiokvcache.testing.peer`) for
tests/test_lifetimes.py: a peer that pushes into caches being retired.
Loaded after ``peer_ops_transfers.py`` (its ``push`` and ``pull``).

In place of the built-in ones:

* ``alloc`` also takes ``fill`` (a byte value, without ``seed``);
* ``free`` and ``unlink`` also answer ``at`` (``time.monotonic()`` when done);
* ``link`` waits 5 s (``timeout_ms``) by default.

And:

* ``rloop`` (``loop``, ``cluster_id``, ``cache_id``, ``src``, ``seconds``,
  ``kind``: push or pull): pushes (pulls) back to back in the background,
  recording every call, until a link failure ends it;
* ``rloop_join`` (``loop``, ``at``: a ``time.monotonic()`` instant,
  ``before_at``: ``at`` by default) answers a summary of the calls that
  ended before ``before_at`` and of those that started after ``at`` (counts
  per status, the first few as ``[start, end, status]``): a record of every
  call would not fit one line.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokvcache.testing.peer import Handler, PeerNode, cache_sha

#: The statuses that end an rloop: the link is gone.
_LINK_GONE = ("LLM_LINK_FAILED", "LLM_NOT_YET_LINK", "LLM_ENGINE_FINALIZED")


def register(ops: dict[str, Handler], node: PeerNode) -> None:
    alloc, free, link, unlink = ops["alloc"], ops["free"], ops["link"], ops["unlink"]

    async def alloc_filled(req: dict[str, Any]) -> dict[str, Any]:
        got = await alloc(req)
        if req.get("seed") is None and req.get("fill") is not None:
            cache = node.caches[str(req["name"])]
            for t in cache.tensors:
                t[...] = int(req["fill"])
            got["sha"] = cache_sha(cache)
        return got

    async def free_at(req: dict[str, Any]) -> dict[str, Any]:
        return {**await free(req), "at": time.monotonic()}

    async def link_5s(req: dict[str, Any]) -> dict[str, Any]:
        return await link({"timeout_ms": 5000, **req})

    async def unlink_at(req: dict[str, Any]) -> dict[str, Any]:
        return {**await unlink(req), "at": time.monotonic()}

    async def calls(req: dict[str, Any]) -> list[list[Any]]:
        transfer = ops[str(req.get("kind", "push"))]
        end = time.monotonic() + float(req.get("seconds", 5))
        done: list[list[Any]] = []
        while time.monotonic() < end:
            res = await transfer(req)
            done.append([res["start"], res["end"], res["status"]])
            if res["status"] in _LINK_GONE:
                break
            await asyncio.sleep(0)
        return done

    async def rloop(req: dict[str, Any]) -> dict[str, Any]:
        node.loops["rloop:" + str(req["loop"])] = asyncio.create_task(calls(req))
        return {"started": True}

    async def rloop_join(req: dict[str, Any]) -> dict[str, Any]:
        done: list[list[Any]] = await node.loops.pop("rloop:" + str(req["loop"]))
        at = float(req.get("at", 0.0))
        # "before": ended before "before_at" (default "at"), e.g. before a
        # concurrent call began: those must be untouched by it.
        before = [c for c in done if c[1] < float(req.get("before_at", at))]
        after = [c for c in done if c[0] > at]
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

    ops.update(
        alloc=alloc_filled,
        free=free_at,
        link=link_5s,
        unlink=unlink_at,
        rloop=rloop,
        rloop_join=rloop_join,
    )
