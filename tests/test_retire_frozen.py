"""Deallocating while a peer that holds the cache's metadata is frozen.

The owner asks the frozen pusher to invalidate; it cannot answer, so the
owner cuts it off. Over TCP the frozen peer may still deliver what it had
sent when it thaws, whatever our side closed, so the memory is quarantined:
its pages go back while the peer is still frozen, its addresses are never
handed out again before finalize (test_lifetimes.py shows late puts landing
there).
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiokvcache as kv
from aiokvcache._core.peers.retire import RETIRE_TIMEOUT_S
from aiokvcache.testing import options
from support.harness import AsyncPeer

TENSORS, BYTES = 2, 1 << 20


async def regions_after(dd: kv.LLMDataDist, want: int, seconds: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if dd.cache_manager.stats()["regions"] == want:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


async def test_memory_waits_for_a_frozen_pusher_to_be_cut_off() -> None:
    async with kv.LLMDataDist(kv.LLMRole.DECODER, 2) as owner:
        await owner.init(options("tcp", listen=True))
        cm = owner.cache_manager
        desc = kv.CacheDesc(TENSORS, [1, BYTES], kv.DataType.DT_UINT8, kv.Placement.HOST)
        dst = cm.allocate_cache(desc)
        async with AsyncPeer("prefill", "tcp", lifetime=120) as peer:
            ln = await peer.call(
                "link", address=owner.listen_address, cluster_id=2, timeout_ms=5000
            )
            assert ln["per"] == ["LLM_SUCCESS"], ln
            await peer.call("alloc", name="src", tensors=TENSORS, bytes=BYTES, seed=1)
            res = await peer.call("push", cluster_id=2, cache_id=dst.cache_id, src="src")
            assert res["status"] == "LLM_SUCCESS", res  # the peer holds our metadata now
            before = cm.stats()["regions"]
            peer.signal(signal.SIGSTOP)
            try:
                cm.deallocate_cache(dst)
                # Unconfirmed (frozen), then cut off and quarantined: the
                # pages go back now, the peer still frozen.
                took = await regions_after(owner, before - 1, RETIRE_TIMEOUT_S + 10)
                assert took is not None, "memory not released while the peer is frozen"
                link = owner._links.get(1)
                assert link is None or link.broken, "the frozen peer was not cut off"
                assert cm.stats()["quarantined_bytes"] >= TENSORS * BYTES, cm.stats()
                print(f"quarantined {took:.2f} s after the call")
            finally:
                peer.signal(signal.SIGCONT)
