"""Ops of the peer program (:mod:`aiokvcache.testing.peer`): ``push`` and
``pull`` as the suite's process tests of lifetimes, memory safety and trust
ask for them, in place of the built-in ones.

``push`` / ``pull`` (``cluster_id``, ``cache_id``, ``index``, ``src`` /
``dst``; ``timeout``: the call's, in seconds, 5 by default; ``tag``: the
push's) answer ``status`` (an ``LLMStatusCode`` name, ``EXCEPTION`` for
another error), ``message`` (``""`` when it succeeded), ``start``, ``end``
(``time.monotonic()``) and ``seconds``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiokvcache.testing.peer import Handler, PeerNode, key_of, timed_status


async def _answer(aw: Awaitable[Any]) -> dict[str, Any]:
    return {"message": "", **await timed_status(aw)}


def register(ops: dict[str, Handler], node: PeerNode) -> None:
    def timeout(req: dict[str, Any]) -> float:
        return float(req.get("timeout", 5))

    async def push(req: dict[str, Any]) -> dict[str, Any]:
        src = node.caches[str(req["src"])]
        cm = node.dd.cache_manager
        return await _answer(
            cm.push_cache(key_of(req), src, timeout=timeout(req), tag=req.get("tag"))
        )

    async def pull(req: dict[str, Any]) -> dict[str, Any]:
        dst = node.caches[str(req["dst"])]
        cm = node.dd.cache_manager
        return await _answer(cm.pull_cache(key_of(req), dst, timeout=timeout(req)))

    ops.update(push=push, pull=pull)
