"""A decode process whose event loop is blocked still serves its peers.

LLM-DataDist serves peers from native threads and its samples rely on it:
the decoder sits in a blocking barrier while the prompt side links and
pushes. Here the decode process (the harness peer's ``blocked`` mode)
blocks its loop — ``time.sleep``, then a pure-Python busy loop — while this
process links, pushes, pulls, and the decoder deallocates a cache from
another thread. Every call must complete while the decoder is still blocked
(the block lasts far longer than any call may take: a call that needed the
decoder's loop would take the whole block), with the bytes right.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache.testing import cluster_info, options
from support.harness import AsyncPeer
from support.peer_ops_blocked_loop import (
    BLOCKED_PULL_KEY,
    BLOCKED_SHAPE,
    BLOCKED_TENSORS,
    blocked_pattern,
)

T = TypeVar("T")
BLOCK_S = 8.0
CALL_BOUND_S = BLOCK_S / 2


async def timed(aw: Awaitable[T], what: str) -> T:
    start = time.monotonic()
    result = await aw
    took = time.monotonic() - start
    assert took < CALL_BOUND_S, f"{what} took {took:.2f}s: it waited for the blocked loop"
    return result


@pytest.mark.parametrize("how", ["sleep", "busy"])
async def test_blocked_decoder_is_served(transport: str, how: str) -> None:
    desc = kv.CacheDesc(BLOCKED_TENSORS, BLOCKED_SHAPE, kv.DataType.DT_FLOAT16, kv.Placement.HOST)
    async with (
        # The LLMConfig default layer deadline (1 s).
        AsyncPeer(
            "decoder", transport, "--sync-kv-timeout=1000", ops=["blocked_loop"], lifetime=120
        ) as peer,
        kv.LLMDataDist(kv.LLMRole.PROMPT, 1) as prompt,
    ):
        await prompt.init(options(transport))
        cm = prompt.cache_manager
        await peer.send({"op": "block", "how": how, "seconds": BLOCK_S})
        assert await peer.read_json() == {"blocking": True}

        ret, _ = await timed(
            prompt.link_clusters([cluster_info(peer.address, 2)], timeout=3000), "link_clusters"
        )
        assert ret == kv.LLMStatusCode.LLM_SUCCESS
        src = cm.allocate_cache(desc)
        rng = np.random.default_rng(3)
        for t in src.tensors:
            t.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
        push = kv.CacheKeyByIdAndIndex(2, peer.hello["push"], 0)
        await timed(cm.push_cache(push, src, timeout=3), "push_cache")
        gone = kv.CacheKeyByIdAndIndex(2, peer.hello["gone"], 0)
        await timed(cm.push_cache(gone, src, timeout=3), "push_cache to the doomed cache")

        back = cm.allocate_cache(desc)
        await timed(cm.pull_cache(BLOCKED_PULL_KEY, back, timeout=3), "pull_cache")
        for i, t in enumerate(back.tensors):
            assert np.array_equal(t.view(np.uint8).reshape(-1), blocked_pattern(i, t.nbytes))

        # The decoder deallocates from another thread: it asks us to
        # invalidate, we acknowledge, its memory goes, all while blocked.
        await peer.send({"op": "dealloc"})
        assert await timed(peer.read_json(), "deallocation") == {"released": True}
        with pytest.raises(kv.LLMException) as ei:
            await timed(cm.push_cache(gone, src, timeout=3), "push_cache to the freed cache")
        assert ei.value.status_code == kv.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        calls_done = time.time()

        end = await peer.read_json(timeout=60)
        assert calls_done < end["unblocked_at"], "the calls outlived the decoder's block"
        assert end["sha"] == hashlib.sha256(b"".join(t.tobytes() for t in src.tensors)).hexdigest()
