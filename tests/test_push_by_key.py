"""[ours] ``push_cache`` to a ``CacheKey`` the peer bound: the push flow by
request key, resolved on the peer exactly as ``pull_cache`` resolves one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiokvcache import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
    Placement,
)
from aiokvcache.testing import Pair, fill

S = LLMStatusCode


def desc(batch: int = 3, layers: int = 4, tokens: int = 64) -> CacheDesc:
    return CacheDesc(2 * layers, [batch, tokens, 64], DataType.DT_FLOAT16, Placement.HOST)


@pytest.mark.parametrize("tokens", [2, 64], ids=["inline-size", "jobs-size"])
async def test_push_by_key_lands_in_the_bound_slot(pair: Pair, tokens: int) -> None:
    # The decoder (cluster 2) binds request 42 to slot 2 and request 7 to slot 0.
    keys = [CacheKey(2, 7), CacheKey(2, 2**64 - 1), CacheKey(2, 42)]
    dst = pair.d.allocate_cache(desc(tokens=tokens), keys)
    for t in dst.tensors:
        t[...] = 0
    src = pair.p.allocate_cache(desc(tokens=tokens))
    fill(src, 11)
    await pair.p.push_cache(CacheKey(2, 42), src, src_batch_index=1)
    await pair.p.push_cache(
        CacheKey(prompt_cluster_id=2, req_id=7),
        src,
        src_batch_index=2,
        src_layer_range=range(1, 2),
        dst_layer_range=range(3, 4),
    )
    for i, t in enumerate(dst.tensors):
        got, want = np.asarray(t), np.asarray(src.tensors[i])
        assert np.array_equal(got[2], want[1]), f"tensor {i}, slot 2"
        assert not got[1].any(), f"tensor {i}: slot 1 written"
        # Slot 0 got source layer 1 (tensors 2, 3) into layer 3 (tensors 6, 7) only.
        if i in (6, 7):
            assert np.array_equal(got[0], np.asarray(src.tensors[i - 4])[2])
        else:
            assert not got[0].any(), f"tensor {i}: slot 0 written"
    # By id and index still works, unchanged, into the same cache.
    await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 1), src, src_batch_index=0)
    assert np.array_equal(np.asarray(dst.tensors[0])[1], np.asarray(src.tensors[0])[0])


async def test_push_by_key_follows_a_rebound_key_and_notifies(pair: Pair) -> None:
    src = pair.p.allocate_cache(desc(batch=1))
    fill(src, 12)
    first = pair.d.allocate_cache(desc(batch=1), [CacheKey(2, 5)])
    await pair.p.push_cache(CacheKey(2, 5), src)
    pair.d.remove_cache_key(CacheKey(2, 5))
    with pytest.raises(LLMException) as ei:
        await pair.p.push_cache(CacheKey(2, 5), src)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    # Bound again to another cache's slot 1: the next push goes there, with its tag.
    second = pair.d.allocate_cache(desc(batch=2), [CacheKey(2, 6), CacheKey(2, 5)])
    waiter = asyncio.create_task(pair.d.wait_for_layers("req-5", range(4), timeout=10))
    await pair.p.push_cache(CacheKey(2, 5), src, tag="req-5")
    await waiter
    for i in range(8):
        want = np.asarray(src.tensors[i])[0]
        assert np.array_equal(np.asarray(first.tensors[i])[0], want)
        assert np.array_equal(np.asarray(second.tensors[i])[1], want)


async def test_push_by_key_errors_match_pull_cache(pair: Pair) -> None:
    dst = pair.d.allocate_cache(desc(), [CacheKey(2, 1)])
    src = pair.p.allocate_cache(desc())
    mine = pair.p.allocate_cache(desc())
    submitted = pair.p.stats()["jobs_submitted"]

    async def codes(key: CacheKey) -> tuple[LLMStatusCode, LLMStatusCode]:
        with pytest.raises(LLMException) as push_err:
            await pair.p.push_cache(key, src)
        with pytest.raises(LLMException) as pull_err:
            await pair.p.pull_cache(key, mine)
        return push_err.value.status_code, pull_err.value.status_code

    assert await codes(CacheKey(2, 999)) == (S.LLM_KV_CACHE_NOT_EXIST,) * 2  # unknown key
    assert await codes(CacheKey(2, 2**64 - 1)) == (S.LLM_PARAM_INVALID,) * 2  # placeholder
    assert await codes(CacheKey(7, 1)) == (S.LLM_NOT_YET_LINK,) * 2  # unlinked cluster
    for wrong in (BlocksCacheKey(2), (2, dst.cache_id, 0), "CacheKey(2, 1)", None):
        with pytest.raises(TypeError, match="dst_cache_key"):
            await pair.p.push_cache(wrong, src)  # type: ignore[arg-type]
    assert pair.p.stats()["jobs_submitted"] == submitted
