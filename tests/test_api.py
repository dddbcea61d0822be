"""LLMDataDist / CacheManager in one process: two instances linked to each other.

Every test runs on asyncio and on trio (anyio's pytest plugin, ``kv_pair``
from aiokvcache's), over shared memory and TCP.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiokvcache import (
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
    testing,
)
from aiokvcache.testing import (
    Pair,
    assert_still,
    cluster_info,
    fill,
    make_pair,
    options,
    same,
    snapshot,
)
from support.guards import engine_of

pytestmark = pytest.mark.anyio

S = LLMStatusCode
MiB = 1 << 20


@pytest.fixture
def pair(kv_pair: Pair) -> Pair:
    """The plugin's linked pair, on the test's backend."""
    return kv_pair


def kv_desc(layers: int = 4, batch: int = 2, tokens: int = 16, dim: int = 64) -> CacheDesc:
    return CacheDesc(2 * layers, [batch, tokens, dim], DataType.DT_FLOAT16, Placement.HOST)


def digest(cache: Cache) -> list[str]:
    return [hashlib.sha256(t.tobytes()).hexdigest() for t in cache.tensors]


# ------------------------------------------------------------- lifecycle


async def test_lifecycle_rules() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 5)
    with pytest.raises(RuntimeError):
        dd.cache_manager  # noqa: B018
    await dd.init(options("shm"))
    with pytest.raises(LLMException) as ei:
        await dd.init(options("shm"))
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    cm = dd.cache_manager
    cache = cm.allocate_cache(kv_desc())
    assert cache.cache_id == 1
    await dd.finalize()
    await dd.finalize()  # idempotent
    with pytest.raises(LLMException) as ei:
        cm.allocate_cache(kv_desc())
    assert ei.value.status_code == S.LLM_ENGINE_FINALIZED
    with pytest.raises(LLMException) as ei:
        _ = cache.tensors
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_constructor_and_init_validation() -> None:
    with pytest.raises(TypeError):
        LLMDataDist("prompt", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(TypeError):
        await dd.init({"llm.SyncKvCacheWaitTime": 5})  # type: ignore[dict-item]
    with pytest.raises(LLMException) as ei:
        await dd.init({"llm.SyncKvCacheWaitTime": "soon"})
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    assert "llm.SyncKvCacheWaitTime" in str(ei.value)
    with pytest.raises(LLMException) as ei:
        await dd.init({"aiokvcache.transport": "rdma"})  # no verbs in this UCX build
    assert ei.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    await dd.finalize()


async def test_async_with_and_listen_address() -> None:
    async with LLMDataDist(LLMRole.DECODER, 9) as dd:
        await dd.init(options("tcp", listen=True))
        assert dd.listen_address is not None
        assert int(dd.listen_address.rsplit(":", 1)[1]) > 0
    with pytest.raises(LLMException) as ei:
        dd.cache_manager.allocate_cache(kv_desc())
    assert ei.value.status_code == S.LLM_ENGINE_FINALIZED


# ----------------------------------------------------------------- links


async def test_link_rules(pair: Pair, transport: str, caplog: pytest.LogCaptureFixture) -> None:
    rc, per = await pair.prompt.link_clusters([cluster_info(pair.decoder)])
    assert per == [S.LLM_ALREADY_LINK] and rc == S.LLM_ALREADY_LINK
    # Wrong cluster id at that address (from a third instance).
    third = LLMDataDist(LLMRole.PROMPT, 3)
    await third.init(options(transport))
    caplog.set_level(logging.WARNING, "aiokvcache")
    rc, per = await third.link_clusters([cluster_info(pair.decoder, cluster_id=77)])
    assert per == [S.LLM_LINK_FAILED]
    assert "it is cluster 2" in caplog.text  # failed for the right reason
    await third.finalize()
    # Nobody listening.
    info = LLMClusterInfo()
    info.remote_cluster_id = 99
    info.append_remote_ip_info("127.0.0.1", 1)
    t0 = anyio.current_time()
    rc, per = await pair.prompt.link_clusters([info], timeout=1000)
    assert per == [S.LLM_LINK_FAILED] and anyio.current_time() - t0 < 3
    with pytest.raises(TypeError):
        await pair.prompt.link_clusters(info)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await pair.prompt.link_clusters([info], timeout=0)


async def test_link_is_symmetric(pair: Pair) -> None:
    src = pair.d.allocate_cache(kv_desc())
    dst = pair.p.allocate_cache(kv_desc())
    fill(src, 1)
    # The decoder did not call link_clusters, yet it can push to the prompt.
    await pair.d.push_cache(CacheKeyByIdAndIndex(1, dst.cache_id, 0), src)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(src.tensors, dst.tensors, strict=True))


async def test_unlink(pair: Pair) -> None:
    dst = pair.d.allocate_cache(kv_desc())
    src = pair.p.allocate_cache(kv_desc())
    rc, per = await pair.prompt.unlink_clusters([cluster_info(pair.decoder)])
    assert per == [S.LLM_SUCCESS]
    with pytest.raises(LLMException) as ei:
        await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src)
    assert ei.value.status_code == S.LLM_NOT_YET_LINK
    rc, per = await pair.prompt.unlink_clusters([cluster_info(pair.decoder)])
    assert per == [S.LLM_SUCCESS] and rc == S.LLM_SUCCESS  # as LLM-DataDist: nothing to unlink
    # The decoder sees it too, and a fresh link works again.
    for _ in range(100):
        if 1 not in pair.decoder._links:
            break
        await anyio.sleep(0.01)
    assert 1 not in pair.decoder._links
    _rc, per = await pair.prompt.link_clusters([cluster_info(pair.decoder)])
    assert per == [S.LLM_SUCCESS]
    await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src)


async def test_auth_token(transport: str) -> None:
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    await decoder.init(options(transport, listen=True, auth_token="s3cret"))
    good = LLMDataDist(LLMRole.PROMPT, 1)
    await good.init(options(transport, auth_token="s3cret"))
    bad = LLMDataDist(LLMRole.PROMPT, 3)
    await bad.init(options(transport, auth_token="guess"))
    none = LLMDataDist(LLMRole.PROMPT, 4)
    await none.init(options(transport))
    try:
        assert (await good.link_clusters([cluster_info(decoder)]))[1] == [S.LLM_SUCCESS]
        assert (await bad.link_clusters([cluster_info(decoder)]))[1] == [S.LLM_LINK_FAILED]
        assert (await none.link_clusters([cluster_info(decoder)]))[1] == [S.LLM_LINK_FAILED]
        assert 3 not in decoder._links and 4 not in decoder._links
    finally:
        for dd in (good, bad, none, decoder):
            await dd.finalize()


# ----------------------------------------------------- local bookkeeping


async def test_allocate_and_register_rules(pair: Pair) -> None:
    cm = pair.p
    with pytest.raises(TypeError):
        cm.allocate_cache("desc")
    with pytest.raises(LLMException) as ei:
        cm.allocate_cache(CacheDesc(2, [4, 4], DataType.DT_FLOAT))  # DEVICE by default
    assert ei.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    desc = kv_desc(batch=2)
    with pytest.raises(LLMException) as ei:
        cm.allocate_cache(desc, [CacheKey(1, 1), CacheKey(1, 2), CacheKey(1, 3)])
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "batch size" in str(ei.value)
    with pytest.raises(LLMException) as ei:
        cm.allocate_cache(desc, [CacheKey(1, 1), CacheKey(1, 1)])
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "twice" in str(ei.value)
    a = cm.allocate_cache(desc, [CacheKey(1, 1)])
    with pytest.raises(LLMException) as ei:
        cm.allocate_cache(desc, [CacheKey(1, 1)])
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "already bound" in str(ei.value)
    cm.remove_cache_key(CacheKey(1, 1))
    b = cm.allocate_cache(desc, [CacheKey(1, 1)])
    # Ids come from one counter, shared with register_cache.
    arrays = [np.zeros(desc.shape, np.float16) for _ in range(desc.num_tensors)]
    c = cm.register_cache(desc, arrays)
    assert (a.cache_id, b.cache_id, c.cache_id) == (1, 2, 3)
    assert c.tensors[0].ctypes.data == arrays[0].ctypes.data
    with pytest.raises(LLMException) as ei:
        cm.register_cache(desc, arrays[:-1])
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "num_tensors" in str(ei.value)
    with pytest.raises(LLMException) as ei:
        cm.register_cache(desc, [0] * desc.num_tensors)
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "addrs[0]" in str(ei.value)
    with pytest.raises(LLMException) as ei:
        cm.register_cache(desc, [np.zeros(7, np.uint8)] * desc.num_tensors)
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "bytes" in str(ei.value)
    strided = np.zeros((desc.shape[0], desc.shape[1], desc.shape[2] * 2), np.float16)[..., ::2]
    with pytest.raises(LLMException) as ei:
        cm.register_cache(desc, [strided] * desc.num_tensors)
    assert "contiguous" in str(ei.value)
    ro = np.zeros(desc.shape, np.float16)
    ro.flags.writeable = False
    with pytest.raises(LLMException) as ei:
        cm.register_cache(desc, [ro] * desc.num_tensors)
    assert "writable" in str(ei.value)
    with pytest.raises(TypeError):
        cm.register_cache(desc, [object()] * desc.num_tensors)
    with pytest.raises(LLMException) as ei:
        cm.deallocate_cache(c)
    assert "unregister_cache" in str(ei.value)
    cm.unregister_cache(c.cache_id)
    with pytest.raises(LLMException) as ei:
        cm.unregister_cache(c.cache_id)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    cm.deallocate_cache(a)
    with pytest.raises(LLMException) as ei:
        cm.deallocate_cache(a)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_register_torch_tensors_via_dlpack(pair: Pair) -> None:
    torch = pytest.importorskip("torch")
    desc = kv_desc(layers=1)
    ts = [torch.zeros(desc.shape, dtype=torch.float16) for _ in range(2)]
    cache = pair.d.register_cache(desc, ts)
    src = pair.p.allocate_cache(desc)
    fill(src, 3)
    await pair.p.push_cache(CacheKeyByIdAndIndex(2, cache.cache_id, 1), src, src_batch_index=1)
    assert np.array_equal(ts[0].numpy()[1], src.tensors[0][1])


async def test_copy_cache(pair: Pair) -> None:
    desc = kv_desc(batch=3)
    a = pair.p.allocate_cache(desc)
    b = pair.p.allocate_cache(desc)
    fill(a, 4)
    await pair.p.copy_cache(b, a, dst_batch_index=2, src_batch_index=0)
    assert all(np.array_equal(x[0], y[2]) for x, y in zip(a.tensors, b.tensors, strict=True))
    assert not any(y[:2].any() for y in b.tensors)
    slot = desc.size // 3
    await pair.p.copy_cache(b, a, 0, 1, offset=slot // 2, size=16)
    raw_a = a.tensors[0].view(np.uint8).reshape(3, -1)
    raw_b = b.tensors[0].view(np.uint8).reshape(3, -1)
    assert np.array_equal(
        raw_b[0, slot // 2 : slot // 2 + 16], raw_a[1, slot // 2 : slot // 2 + 16]
    )
    assert not raw_b[0, : slot // 2].any()
    with pytest.raises(LLMException) as ei:
        await pair.p.copy_cache(b, a, offset=slot, size=1)
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        await pair.p.copy_cache(b, a, src_batch_index=3)
    with pytest.raises(TypeError):
        await pair.p.copy_cache(b, "a")


# ------------------------------------------------------- push validation


async def test_push_validation_moves_nothing(pair: Pair) -> None:
    desc = kv_desc(layers=4, batch=2)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    fill(src, 5)
    before = snapshot(dst)
    # The link's data-path probe submitted jobs of its own; none may follow.
    submitted = pair.p.stats()["jobs_submitted"]
    key = CacheKeyByIdAndIndex(2, dst.cache_id, 0)
    push = pair.p.push_cache

    async def code_of(**kw: Any) -> LLMStatusCode:
        args: dict[str, Any] = {"dst_cache_key": key, "src_cache": src}
        args.update(kw)
        with pytest.raises(LLMException) as ei:
            await push(**args)
        return ei.value.status_code

    with pytest.raises(TypeError, match="dst_cache_key"):
        await push((2, dst.cache_id, 0), src)
    with pytest.raises(TypeError, match="src_cache"):
        await push(key, "src")
    with pytest.raises(TypeError, match="src_batch_index"):
        await push(key, src, src_batch_index=0.5)
    with pytest.raises(TypeError, match="src_layer_range"):
        await push(key, src, src_layer_range=[0, 1])
    with pytest.raises(TypeError, match="timeout"):
        await push(key, src, timeout="1s")
    with pytest.raises(ValueError, match="timeout"):
        await push(key, src, timeout=-1)
    with pytest.raises(TypeError, match="tag"):
        await push(key, src, tag=5)
    with pytest.raises(ValueError, match="tensor_num_per_layer"):
        await push(key, src, tensor_num_per_layer=0)
    assert await code_of(size=128) == S.LLM_PARAM_INVALID
    assert await code_of(tensor_num_per_layer=3) == S.LLM_PARAM_INVALID
    assert await code_of(tensor_num_per_layer=9) == S.LLM_PARAM_INVALID
    assert await code_of(src_layer_range=range(0, 4, 2)) == S.LLM_PARAM_INVALID
    assert await code_of(src_layer_range=range(2, 2)) == S.LLM_PARAM_INVALID
    assert await code_of(src_layer_range=range(0, 5)) == S.LLM_PARAM_INVALID
    assert (
        await code_of(src_layer_range=range(0, 2), dst_layer_range=range(0, 3))
        == S.LLM_PARAM_INVALID
    )
    assert (
        await code_of(src_layer_range=range(0, 2), dst_layer_range=range(3, 5))
        == S.LLM_PARAM_INVALID
    )
    assert await code_of(src_batch_index=2) == S.LLM_PARAM_INVALID
    assert (
        await code_of(dst_cache_key=CacheKeyByIdAndIndex(2, dst.cache_id, 2)) == S.LLM_PARAM_INVALID
    )
    assert await code_of(dst_cache_key=CacheKeyByIdAndIndex(2, 999, 0)) == S.LLM_KV_CACHE_NOT_EXIST
    assert (
        await code_of(dst_cache_key=CacheKeyByIdAndIndex(7, dst.cache_id, 0)) == S.LLM_NOT_YET_LINK
    )
    big = pair.p.allocate_cache(kv_desc(layers=4, batch=2, tokens=32))
    assert await code_of(src_cache=big) == S.LLM_PARAM_INVALID  # slot does not fit
    other = LLMDataDist(LLMRole.PROMPT, 3)
    await other.init(options("shm"))
    foreign = other.cache_manager.allocate_cache(desc)
    assert await code_of(src_cache=foreign) == S.LLM_KV_CACHE_NOT_EXIST
    await other.finalize()
    assert same(before, dst)
    assert pair.p.stats()["jobs_submitted"] == submitted


async def test_push_remote_not_accessible(pair: Pair) -> None:
    desc = kv_desc(layers=1)
    dst = pair.d.register_cache(
        desc, [np.zeros(desc.shape, np.float16) for _ in range(2)], remote_accessible=False
    )
    src = pair.p.allocate_cache(desc)
    with pytest.raises(LLMException) as ei:
        await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src)
    assert ei.value.status_code == S.LLM_FEATURE_NOT_ENABLED


# ----------------------------------------------------------- push bytes


async def test_push_layers_and_slots_exact(pair: Pair) -> None:
    desc = kv_desc(layers=6, batch=3)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    fill(src, 6)
    fill(dst, 7)
    before = snapshot(dst)
    await pair.p.push_cache(
        CacheKeyByIdAndIndex(2, dst.cache_id, 2),
        src,
        src_batch_index=1,
        src_layer_range=range(1, 4),
        dst_layer_range=range(2, 5),
    )
    for t in range(desc.num_tensors):
        layer = t // 2
        expect = before[t].copy()
        if 2 <= layer < 5:
            expect[2] = src.tensors[t - 2][1]  # dst layer l came from src layer l-1
        assert np.array_equal(dst.tensors[t], expect), f"tensor {t}"


async def test_push_with_batch_dim_not_first(pair: Pair) -> None:
    desc = CacheDesc(4, [8, 3, 32], DataType.DT_BF16, Placement.HOST, batch_dim_index=1)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    for t in src.tensors:
        t[...] = np.arange(t.size, dtype=np.uint16).reshape(t.shape)
    await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src, src_batch_index=2)
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        assert np.array_equal(d[:, 0], s[:, 2])
        assert not d[:, 1:].any()


async def test_push_tensor_num_per_layer(pair: Pair) -> None:
    desc = CacheDesc(6, [1, 256], DataType.DT_INT32, Placement.HOST)  # 2 layers of K,V,X
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    fill(src, 8)
    await pair.p.push_cache(
        CacheKeyByIdAndIndex(2, dst.cache_id),
        src,
        src_layer_range=range(1, 2),
        tensor_num_per_layer=3,
    )
    assert [np.array_equal(a, b) for a, b in zip(src.tensors, dst.tensors, strict=True)] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]


async def test_many_concurrent_pushes(pair: Pair) -> None:
    desc = kv_desc(layers=4, batch=1, tokens=8)
    pairs = []
    for _ in range(24):
        s = pair.p.allocate_cache(desc)
        d = pair.d.allocate_cache(desc)
        fill(s, s.cache_id)
        pairs.append((s, d))

    async def one(s: Cache, d: Cache) -> None:
        for _ in range(5):
            await pair.p.push_cache(CacheKeyByIdAndIndex(2, d.cache_id), s)

    async with anyio.create_task_group() as tg:
        for s, d in pairs:
            tg.start_soon(one, s, d)
    assert all(digest(s) == digest(d) for s, d in pairs)


# ------------------------------------------------------------------ pull


async def test_pull_by_key_and_by_id(pair: Pair) -> None:
    desc = kv_desc(layers=3, batch=2)
    owner = pair.p.allocate_cache(desc, [CacheKey(1, 100), CacheKey(1, 101)])
    fill(owner, 9)
    dst = pair.d.allocate_cache(desc)
    await pair.d.pull_cache(CacheKey(1, 101), dst, batch_index=0)
    assert all(np.array_equal(o[1], d[0]) for o, d in zip(owner.tensors, dst.tensors, strict=True))
    assert not any(d[1].any() for d in dst.tensors)
    await pair.d.pull_cache(
        CacheKeyByIdAndIndex(1, owner.cache_id, 0), dst, batch_index=1, src_layer_range=range(2, 3)
    )
    assert np.array_equal(dst.tensors[4][1], owner.tensors[4][0])
    assert not dst.tensors[0][1].any()
    # Partial size: only the first bytes of each slot.
    part = pair.d.allocate_cache(desc)
    await pair.d.pull_cache(CacheKey(1, 100), part, size=64)
    raw = part.tensors[0].view(np.uint8).reshape(2, -1)
    assert np.array_equal(raw[0, :64], owner.tensors[0].view(np.uint8).reshape(2, -1)[0, :64])
    assert not raw[0, 64:].any()


async def test_pull_validation(pair: Pair) -> None:
    desc = kv_desc(layers=1)
    pair.p.allocate_cache(desc, [CacheKey(1, 5)])
    dst = pair.d.allocate_cache(desc)
    with pytest.raises(TypeError, match="cache_key"):
        await pair.d.pull_cache("key", dst)
    with pytest.raises(LLMException) as ei:
        await pair.d.pull_cache(CacheKey(1, 2**64 - 1), dst)  # neither req_id nor prefix_id
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        await pair.d.pull_cache(CacheKey(1, 6), dst)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(LLMException) as ei:
        await pair.d.pull_cache(CacheKey(1, 5), dst, size=0)
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        await pair.d.pull_cache(CacheKey(1, 5), dst, size=desc.size)  # > slot
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as ei:
        await pair.d.pull_cache(CacheKey(1, 5), dst, batch_index=2)
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    assert not any(t.any() for t in dst.tensors)


# --------------------------------------------- stale metadata, failures


async def test_push_after_peer_deallocates(pair: Pair) -> None:
    desc = kv_desc(layers=2)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    key = CacheKeyByIdAndIndex(2, dst.cache_id)
    await pair.p.push_cache(key, src)  # metadata now cached at the prompt
    pair.d.deallocate_cache(dst)
    code = None
    for _ in range(200):
        try:
            await pair.p.push_cache(key, src)
        except LLMException as exc:
            code = exc.status_code
            break
        await anyio.sleep(0.01)
    assert code == S.LLM_KV_CACHE_NOT_EXIST
    # The decoder's memory went back only after the prompt let go of it.
    for _ in range(200):
        if pair.d.stats()["regions"] == 0:
            break
        await anyio.sleep(0.01)
    assert pair.d.stats()["regions"] == 0


async def test_peer_finalize_fails_pushes_with_link_failed(pair: Pair) -> None:
    desc = kv_desc(layers=2)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    await pair.decoder.finalize()
    code = None
    for _ in range(200):
        try:
            await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src)
        except LLMException as exc:
            code = exc.status_code
            break
        await anyio.sleep(0.01)
    assert code == S.LLM_LINK_FAILED


async def slow_pair(transport: str) -> Pair:
    # A 64 KiB in-flight window: a 64 MiB push takes many round trips (with
    # direct copies off, which bypass the window).
    return await make_pair(
        transport, max_inflight_bytes=64 * 1024, direct_copy=False, sync_kv_timeout=60_000
    )


def big_desc() -> CacheDesc:
    # 256 MiB: long enough that a 1 ms timeout or cancel always lands mid-way.
    return CacheDesc(8, [1, 32 * MiB], DataType.DT_UINT8, Placement.HOST)


async def test_timeout_cancel_quiescent_and_reusable(transport: str) -> None:
    pr = await slow_pair(transport)
    try:
        dst = pr.d.allocate_cache(big_desc())
        src = pr.p.allocate_cache(big_desc())
        for i, t in enumerate(src.tensors):
            t[...] = i + 1
        key = CacheKeyByIdAndIndex(2, dst.cache_id)
        await pr.p.push_cache(key, src, src_layer_range=range(0, 1))  # warm the metadata
        with pytest.raises(LLMTimeoutError) as ei:
            await pr.p.push_cache(key, src, timeout=0.001)
        assert isinstance(ei.value, TimeoutError)
        assert "landed" in str(ei.value)
        await assert_still(dst)
        outcome = []

        async def push() -> None:
            try:
                await pr.p.push_cache(key, src)
            except anyio.get_cancelled_exc_class():
                outcome.append("cancelled")
                # Quiescent when the cancellation reaches us.
                outcome.append(pr.p.stats()["live_jobs"])
                raise
            outcome.append("landed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(push)
            await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        assert outcome == ["cancelled", 0]
        await assert_still(dst)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.001):
                await pr.p.push_cache(key, src)
        await assert_still(dst)
        assert pr.p.stats()["live_jobs"] == 0
        await pr.p.push_cache(key, src)  # usable afterwards
        assert digest(src) == digest(dst)
    finally:
        await pr.prompt.finalize()
        await pr.decoder.finalize()


async def test_sync_kv_timeout_per_layer(transport: str) -> None:
    pr = await make_pair(
        transport, max_inflight_bytes=64 * 1024, sync_kv_timeout=1, direct_copy=False
    )
    try:
        dst = pr.d.allocate_cache(big_desc())
        src = pr.p.allocate_cache(big_desc())
        with pytest.raises(LLMTimeoutError) as ei:
            await pr.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src)
        assert ei.value.status_code == S.LLM_TIMEOUT
        await assert_still(dst)
    finally:
        await pr.prompt.finalize()
        await pr.decoder.finalize()


async def test_finalize_fails_in_flight_push(transport: str) -> None:
    pr = await slow_pair(transport)
    try:
        dst = pr.d.allocate_cache(big_desc())
        src = pr.p.allocate_cache(big_desc())
        key = CacheKeyByIdAndIndex(2, dst.cache_id)
        await pr.p.push_cache(key, src, src_layer_range=range(1))  # metadata in hand
        results: list[BaseException | None] = []

        async def push() -> None:
            try:
                await pr.p.push_cache(key, src)
            except LLMException as exc:
                results.append(exc)
            else:
                results.append(None)

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(push)
            await anyio.sleep(0.005)
            assert len(results) < 8
            await pr.prompt.finalize()
        failed = [r for r in results if r is not None]
        assert failed
        for r in failed:
            assert isinstance(r, LLMException) and r.status_code == S.LLM_ENGINE_FINALIZED, r
    finally:
        await pr.prompt.finalize()
        await pr.decoder.finalize()


# ---------------------------------------------------------- notifications


async def test_tagged_push_notifies_receiver(pair: Pair) -> None:
    desc = kv_desc(layers=4)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    fill(src, 11)
    seen = []
    all_seen = anyio.Event()

    async def listen() -> None:
        async for note in pair.d.notifications():
            # The layer's bytes are there when its notification is seen.
            t = 2 * note.layer
            assert np.array_equal(dst.tensors[t][note.batch_index], src.tensors[t][0])
            seen.append(note)
            if len(seen) == 4:
                all_seen.set()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(listen)
        await anyio.lowlevel.checkpoint()
        await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 1), src, tag="req-1")
        await pair.d.wait_for_layers("req-1", range(4), timeout=5)
        with anyio.fail_after(5):
            await all_seen.wait()
    assert sorted(n.layer for n in seen) == [0, 1, 2, 3]
    assert {(n.tag, n.src_cluster_id, n.cache_id, n.batch_index) for n in seen} == {
        ("req-1", 1, dst.cache_id, 1)
    }
    with pytest.raises(LLMTimeoutError):
        await pair.d.wait_for_layers("req-1", [0], timeout=0.05)  # record dropped
    await pair.p.push_cache(
        CacheKeyByIdAndIndex(2, dst.cache_id), src, tag=b"r2", src_layer_range=range(1)
    )
    for _ in range(100):
        if pair.d.stats()["tag_records"]:
            break
        await anyio.sleep(0.01)
    pair.d.discard_tag(b"r2")
    assert pair.d.stats()["tag_records"] == 0


async def test_garbage_at_control_server_is_survived(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    assert pair.decoder.listen_address is not None
    host, port = pair.decoder.listen_address.rsplit(":", 1)
    caplog.set_level(logging.WARNING, "aiokvcache")
    for junk in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x05hello", b"GET / HTTP/1.1\r\n\r\n"):
        async with await anyio.connect_tcp(host, int(port)) as conn:
            await conn.send(junk)
            with anyio.fail_after(10):
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while True:
                        await conn.receive()  # until the server closes it
    desc = kv_desc(layers=1)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    fill(src, 12)
    await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(src.tensors, dst.tensors, strict=True))


async def test_link_tries_every_address(pair: Pair, transport: str) -> None:
    third = LLMDataDist(LLMRole.PROMPT, 3)
    await third.init(options(transport))
    try:
        info = LLMClusterInfo()
        info.remote_cluster_id = 2
        info.append_remote_ip_info("127.0.0.1", 1)  # nobody listens there
        assert pair.decoder.listen_address is not None
        host, port = pair.decoder.listen_address.rsplit(":", 1)
        info.append_remote_ip_info(host, int(port))
        rc, per = await third.link_clusters([info], timeout=5000)
        assert per == [S.LLM_SUCCESS] and rc == S.LLM_SUCCESS
    finally:
        await third.finalize()


async def test_data_plane_on_a_named_interface() -> None:
    # The loopback interface, named: UCX listens, advertises and connects only there.
    async with testing.pair("tcp", net_devices="lo") as pr:
        desc = kv_desc(layers=2, batch=1)
        dst = pr.d.allocate_cache(desc)
        src = pr.p.allocate_cache(desc)
        fill(src, 3)
        await pr.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id), src, timeout=10)
        assert same(snapshot(src), dst)
        for dd in (pr.prompt, pr.decoder):
            lanes = [w for w in engine_of(dd).info().split() if w.startswith("tcp/")]
            assert lanes and set(lanes) == {"tcp/lo"}, lanes
