"""A prefill process here, a decode process killed with SIGKILL mid-push (asyncio and trio)."""

from __future__ import annotations

import sys

import anyio
import numpy as np
import pytest

from aiokvcache import (
    CacheKeyByIdAndIndex,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from aiokvcache.bench import Shape
from aiokvcache.testing import JsonChild, cluster_info, options

pytestmark = pytest.mark.anyio


async def test_decoder_killed_mid_push(transport: str) -> None:
    shape = Shape(layers=16, batch=1, tokens=4096, heads=8, head_dim=64, dtype="float16")
    decode_args = ["--layers=16", "--tokens=4096", "--heads=8", "--head-dim=64"]
    # The decode side of `python -m aiokvcache bench`.
    decode = [sys.executable, "-m", "aiokvcache._benchpeer", *decode_args]
    async with JsonChild([*decode, f"--transport={transport}"], label="decode") as peer:
        # A small window and no direct copies make the push long enough to
        # be caught mid-way, on either transport.
        opts = options(
            transport, max_inflight_bytes=256 * 1024, direct_copy=False, sync_kv_timeout=60_000
        )
        async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
            await dd.init(opts)
            info = cluster_info(peer.address, 2)
            assert (await dd.link_clusters([info], timeout=5000))[0] == LLMStatusCode.LLM_SUCCESS
            src = dd.cache_manager.allocate_cache(shape.desc)
            for t in src.tensors:
                t[...] = np.float16(1.5)
            key = CacheKeyByIdAndIndex(2, peer.hello["cache_id"])
            results: list[BaseException | None] = []

            async def push() -> None:
                try:
                    await dd.cache_manager.push_cache(key, src, tag="x")
                except Exception as exc:
                    results.append(exc)
                else:
                    results.append(None)

            with anyio.fail_after(15):
                async with anyio.create_task_group() as tg:
                    for _ in range(8):
                        tg.start_soon(push)
                    await anyio.sleep(0.05)
                    assert len(results) < 8
                    await peer.kill()  # SIGKILL, then reaped
                    t0 = anyio.current_time()
            assert anyio.current_time() - t0 < 10
            failures = [r for r in results if isinstance(r, BaseException)]
            assert failures, "no push noticed the dead peer"
            for r in failures:
                assert isinstance(r, LLMException), repr(r)
                assert r.status_code == LLMStatusCode.LLM_LINK_FAILED, repr(r)
            assert dd.cache_manager.stats()["live_jobs"] == 0
            # Later pushes fail fast too.
            with pytest.raises(LLMException) as ei:
                await dd.cache_manager.push_cache(key, src)
            assert ei.value.status_code == LLMStatusCode.LLM_LINK_FAILED
