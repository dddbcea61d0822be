"""Silent peers: a frozen host closes no socket, yet the link must notice.

Each side pings the other from its service thread every quarter of
``peer_timeout``; silence for ``peer_timeout`` breaks the link, and a
``link_clusters`` to a linked but silent peer replaces the link instead of
answering ``LLM_ALREADY_LINK``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np

import aiokvcache as kv
from aiokvcache.testing import AsyncPeer, cluster_info, options

S = kv.LLMStatusCode
PEER_TIMEOUT_MS = 1000


async def broken_within(dd: kv.LLMDataDist, cluster: int, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        link = dd._links.get(cluster)
        if link is None or link.broken:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"the link to cluster {cluster} was not broken within {seconds} s")


async def push_one(dd: kv.LLMDataDist) -> None:
    desc = kv.CacheDesc(2, [4, 4096], kv.DataType.DT_UINT8, kv.Placement.HOST)
    src = dd.cache_manager.allocate_blocks_cache(desc)
    for t in src.tensors:
        t[...] = np.arange(t.size, dtype=np.uint64).reshape(t.shape).astype(np.uint8)
    try:
        await dd.cache_manager.push_blocks(
            kv.BlocksCacheKey(2, 0), src, [0, 1], [2, 3], tensor_num_per_layer=2, timeout=10
        )
    finally:
        dd.cache_manager.deallocate_blocks_cache(src)


async def test_a_frozen_peer_breaks_the_link_then_relinks(transport: str) -> None:
    async with AsyncPeer("blocks", transport, "2", "4", "4096", lifetime=120) as peer, (
        kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    ) as prompt:
        await prompt.init(options(transport, peer_timeout=PEER_TIMEOUT_MS))
        info = [cluster_info(peer.address, 2)]
        assert (await prompt.link_clusters(info))[0] == S.LLM_SUCCESS
        await push_one(prompt)
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            took = await broken_within(prompt, 2, 10 * PEER_TIMEOUT_MS / 1000)
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        print(f"frozen peer noticed after {took:.2f} s (peer_timeout {PEER_TIMEOUT_MS} ms)")
        ret, per = await prompt.link_clusters(info, timeout=5000)
        assert ret == S.LLM_SUCCESS, per
        await push_one(prompt)


async def test_relinking_a_silent_peer_is_not_already_linked(transport: str) -> None:
    async with AsyncPeer("blocks", transport, "2", "4", "4096", lifetime=120) as peer, (
        kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    ) as prompt:
        # The heartbeat is slow here: the liveness check of link_clusters acts first.
        await prompt.init(options(transport, peer_timeout=60_000))
        info = [cluster_info(peer.address, 2)]
        assert (await prompt.link_clusters(info))[0] == S.LLM_SUCCESS
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            ret, _ = await prompt.link_clusters(info, timeout=1500)
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        assert ret not in (S.LLM_SUCCESS, S.LLM_ALREADY_LINK)
        ret, per = await prompt.link_clusters(info, timeout=5000)
        assert ret == S.LLM_SUCCESS, per
        await push_one(prompt)
