"""Blocks (paged) caches: allocate/register, push/pull_blocks, copy/swap_blocks
(on asyncio and trio, over shm and TCP)."""

from __future__ import annotations

import hashlib
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiokvcache import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiokvcache._core.transfer import notify
from aiokvcache._core.transfer import planner as blocks
from aiokvcache.testing import (
    Pair,
    assert_still,
    blocks_desc,
    cluster_info,
    fill,
    make_pair,
    options,
    same,
    snapshot,
    status_of,
)
from support.harness import AsyncPeer

pytestmark = pytest.mark.anyio

S = LLMStatusCode


@pytest.fixture
def pair(kv_pair: Pair) -> Pair:
    """The plugin's linked pair, on the test's backend."""
    return kv_pair


def kv(cache: Any, t: int) -> np.ndarray:
    return np.asarray(cache.tensors[t])


# ------------------------------------------------------------ pure helpers


def test_block_ids_forms_and_errors() -> None:
    for value in ([3, 1, 2], (3, 1, 2), np.array([3, 1, 2], np.uint32), np.array([3, 1, 2])):
        assert blocks.block_ids("b", value).tolist() == [3, 1, 2]
    assert blocks.block_ids("b", range(2, 5)).tolist() == [2, 3, 4]
    assert blocks.block_ids("b", []).size == 0
    assert blocks.block_ids("b", np.array([2**63 - 1], np.uint64)).tolist() == [2**63 - 1]
    for bad in ([1.0, 2.0], ["a"], np.array([True]), 3, {1, 2}, np.array([1.5]), [1, None]):
        with pytest.raises(TypeError, match="b"):
            blocks.block_ids("b", bad)
    for bad in ([-1], np.array([[1, 2]]), [2**64], np.array([2**63], np.uint64)):
        with pytest.raises(ValueError, match="b"):
            blocks.block_ids("b", bad)


def test_runs_become_segments() -> None:
    # Consecutive on both sides: one span; a break on either side splits it.
    ids = np.arange(100_000, dtype=np.int64)
    assert blocks.blocks_plan(ids, ids, 64).segments == 1
    plan = blocks.blocks_plan(np.array([0, 1, 2, 7, 8]), np.array([5, 6, 9, 10, 11]), 16)
    assert plan.local_off.tolist() == [0, 32, 112]
    assert plan.remote_off.tolist() == [80, 144, 160]
    assert plan.length.tolist() == [32, 16, 32]
    rng = np.random.default_rng(0)
    perm = rng.permutation(100_000)
    assert blocks.blocks_plan(ids, perm, 64).segments > 99_000
    rows = blocks.layer_rows(plan, [1000, 2000], [9000, 9500], [7, 8])
    assert rows.shape == (6, 4)
    assert rows[3].tolist() == [2000, 9500 + 80, 32, 8]
    # A batch slot over blocks: the last block partly used, runs merged.
    sp = blocks.slot_blocks_plan(100, 40, np.array([3, 4, 9]), 16, blocks_local=True)
    assert sp.local_off.tolist() == [48, 144]
    assert sp.remote_off.tolist() == [100, 132]
    assert sp.length.tolist() == [32, 8]


def test_unique_and_range_checks() -> None:
    blocks.check_unique("d", np.array([5, 1, 3]), 6)
    with pytest.raises(LLMException, match="block 3 more than once") as ei:
        blocks.check_unique("d", np.array([3, 1, 3]), 6)
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match="more than once"):
        blocks.check_unique("d", np.array([2**40, 2**40]), 2**41)  # the sort path
    with pytest.raises(LLMException, match="block id 6"):
        blocks.check_in_range("d", np.array([0, 6]), 6, "x")


def test_notification_block_lists_roundtrip() -> None:
    for ids in (
        np.array([4, 5, 6, 7, 100]),
        np.array([9, 3, 7, 1]),
        np.arange(100_000),
        np.array([], np.int64),
    ):
        enc = notify.encode_block_ids(ids.astype(np.int64), 4000)
        assert enc is not None
        assert notify.decode_block_ids(enc) == tuple(ids.tolist())
    assert len(notify.encode_block_ids(np.arange(100_000), 4000) or b"") < 16
    scattered = np.random.default_rng(1).permutation(5000).astype(np.int64)
    assert notify.encode_block_ids(scattered, 4000) is None
    assert notify.encode_block_ids(np.array([2**33]), 4000) is None
    for junk in (b"", b"\x01\x00", b"\x07\x00\x00\x00\x00", b"\x02\x00\x00\x00\x00"):
        with pytest.raises(ValueError):
            notify.decode_block_ids(junk)
    with pytest.raises(ValueError, match="too many"):
        notify.decode_block_ids(b"\x02" + np.array([0, 2**31], "<u4").tobytes())


# ------------------------------------------------------------ local rules


async def test_allocate_register_and_keys(pair: Pair) -> None:
    desc = blocks_desc()
    key = BlocksCacheKey(2, 7)
    c = pair.d.allocate_blocks_cache(desc, key)
    assert c.is_blocks_cache and c.cache_desc == desc
    assert c.tensors[0].shape == (16, 4, 8)
    with pytest.raises(LLMException, match="already bound") as ei:
        pair.d.allocate_blocks_cache(desc, key)
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(TypeError, match="blocks_cache_key"):
        pair.d.allocate_blocks_cache(desc, CacheKey(2, req_id=1))
    with pytest.raises(LLMException, match="deallocate_blocks_cache"):
        pair.d.deallocate_cache(c)
    plain = pair.d.allocate_cache(desc)
    with pytest.raises(LLMException, match="not a blocks cache"):
        pair.d.deallocate_blocks_cache(plain)
    # User memory, numpy arrays, keyed.
    bufs = [np.zeros((16, 4, 8), np.float16) for _ in range(desc.num_tensors)]
    reg = pair.d.register_blocks_cache(desc, bufs, BlocksCacheKey(2, 8))
    assert reg.is_blocks_cache
    src = pair.p.allocate_blocks_cache(desc)
    fill(src, 1)
    await pair.p.push_blocks(BlocksCacheKey(2, 8), src, [0, 1], [5, 6])
    assert np.array_equal(bufs[3][5:7], kv(src, 3)[0:2])
    pair.d.deallocate_blocks_cache(reg)  # a registered one too
    # The key is free again once its cache is gone; peers see the new cache.
    pair.d.deallocate_blocks_cache(c)
    c2 = pair.d.allocate_blocks_cache(desc, key)
    await pair.p.push_blocks(key, src, [2], [2])
    assert np.array_equal(kv(c2, 0)[2], kv(src, 0)[2])
    assert (
        await status_of(pair.p.push_blocks(BlocksCacheKey(2, 99), src, [0], [0]))
        == S.LLM_KV_CACHE_NOT_EXIST
    )
    with pytest.raises(LLMException, match="use push_blocks"):
        await pair.p.push_cache(CacheKeyByIdAndIndex(2, plain.cache_id), src)
    with pytest.raises(LLMException, match="use pull_blocks"):
        await pair.p.pull_cache(CacheKeyByIdAndIndex(2, plain.cache_id), src)


# ------------------------------------------------------------ push / pull


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks"),
    [
        ([0, 1, 2, 3], [8, 9, 10, 11]),  # consecutive: one segment per tensor
        ((5, 2, 9, 0), (1, 15, 3, 7)),  # scattered
        (np.array([3, 4, 10, 11, 12], np.int32), np.array([0, 1, 2, 6, 7], np.uint64)),
        (range(10, 16), range(0, 6)),
    ],
)
async def test_push_blocks_exact(pair: Pair, src_blocks: Any, dst_blocks: Any) -> None:
    desc = blocks_desc()
    dst = pair.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
    src = pair.p.allocate_blocks_cache(desc)
    fill(src, 2)
    await pair.p.push_blocks(BlocksCacheKey(2), src, src_blocks, dst_blocks)
    s_ids, d_ids = list(src_blocks), list(dst_blocks)
    others = sorted(set(range(16)) - set(d_ids))
    for t in range(desc.num_tensors):
        assert np.array_equal(kv(dst, t)[d_ids], kv(src, t)[s_ids])
        assert not kv(dst, t)[others].any()


async def test_push_blocks_layer_subsets_and_tensor_num(pair: Pair) -> None:
    desc = blocks_desc(layers=4)
    dst = pair.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
    src = pair.p.allocate_blocks_cache(desc)
    fill(src, 3)
    await pair.p.push_blocks(
        BlocksCacheKey(2),
        src,
        [1, 2],
        [4, 9],
        src_layer_range=range(1, 3),
        dst_layer_range=range(0, 2),
    )
    for t in range(8):
        if t < 4:  # dst layers 0, 1 = src layers 1, 2
            assert np.array_equal(kv(dst, t)[[4, 9]], kv(src, t + 2)[[1, 2]])
        else:
            assert not kv(dst, t).any()
    # One tensor per layer: layer 5 is tensor 5.
    await pair.p.push_blocks(
        BlocksCacheKey(2), src, [0], [0], range(5, 6), range(7, 8), tensor_num_per_layer=1
    )
    assert np.array_equal(kv(dst, 7)[0], kv(src, 5)[0])
    with pytest.raises(LLMException, match="exceeds"):
        await pair.p.push_blocks(BlocksCacheKey(2), src, [0], [0], range(3, 5))
    with pytest.raises(LLMException, match="tensor_num_per_layer=3"):
        await pair.p.push_blocks(BlocksCacheKey(2), src, [0], [0], tensor_num_per_layer=3)


async def test_pull_blocks_exact(pair: Pair) -> None:
    desc = blocks_desc(layers=3)
    remote = pair.d.allocate_blocks_cache(desc, BlocksCacheKey(2, 1))
    fill(remote, 4)
    dst = pair.p.allocate_blocks_cache(desc)
    await pair.p.pull_blocks(BlocksCacheKey(2, 1), dst, [7, 8, 9, 0], [1, 2, 3, 15])
    for t in range(6):
        assert np.array_equal(kv(dst, t)[[1, 2, 3, 15]], kv(remote, t)[[7, 8, 9, 0]])
    await pair.p.pull_blocks(
        BlocksCacheKey(2, 1),
        dst,
        np.array([4]),
        np.array([4]),
        src_layer_range=range(2, 3),
        dst_layer_range=range(0, 1),
    )
    assert np.array_equal(kv(dst, 0)[4], kv(remote, 4)[4])
    assert np.array_equal(kv(dst, 1)[4], kv(remote, 5)[4])
    assert not kv(dst, 2)[4].any()


async def test_pull_blocks_from_contiguous_cache(pair: Pair) -> None:
    # A batch slot of 10 tokens x 8 fp16 = 160 B over blocks of 4 x 8 fp16 = 64 B: 3 blocks.
    cdesc = CacheDesc(4, [2, 10, 8], DataType.DT_FLOAT16, Placement.HOST)
    remote = pair.d.allocate_cache(cdesc, [CacheKey(2, req_id=10), CacheKey(2, req_id=11)])
    fill(remote, 5)
    dst = pair.p.allocate_blocks_cache(blocks_desc(layers=2))
    await pair.p.pull_blocks(CacheKey(2, req_id=11), dst, (), [6, 7, 2])
    for t in range(4):
        flat = kv(dst, t)[[6, 7, 2]].reshape(-1)
        assert np.array_equal(flat[:80], kv(remote, t)[1].reshape(-1))
        assert not flat[80:].any()  # the rest of the last block is untouched
    await pair.p.pull_blocks(CacheKeyByIdAndIndex(2, remote.cache_id, 0), dst, [], [12, 13, 14])
    assert np.array_equal(kv(dst, 3)[[12, 13, 14]].reshape(-1)[:80], kv(remote, 3)[0].reshape(-1))
    before = snapshot(dst)
    for kw, match in (
        ({"dst_blocks": [1, 2]}, "fills 3 blocks"),
        ({"dst_blocks": [1, 2, 3], "src_blocks": [0, 1, 2]}, "src_blocks must be empty"),
        ({"dst_blocks": []}, "can not be empty"),
    ):
        with pytest.raises(LLMException, match=match):
            await pair.p.pull_blocks(CacheKey(2, req_id=11), dst, **kw)
    # Batch dim not first: a slot is not contiguous and cannot be split.
    odd = pair.d.allocate_cache(CacheDesc(2, [10, 2, 8], DataType.DT_FLOAT16, Placement.HOST, 1))
    with pytest.raises(LLMException, match="not contiguous"):
        await pair.p.pull_blocks(
            CacheKeyByIdAndIndex(2, odd.cache_id, 1), dst, [], [1, 2, 3], src_layer_range=range(1)
        )
    assert same(before, dst)


async def test_block_validation_moves_nothing(pair: Pair) -> None:
    desc = blocks_desc()
    key = BlocksCacheKey(2)
    dst = pair.d.allocate_blocks_cache(desc, key)
    src = pair.p.allocate_blocks_cache(desc)
    other = pair.d.allocate_blocks_cache(blocks_desc(tokens=8), BlocksCacheKey(2, 5))
    plain = pair.p.allocate_cache(desc)
    fill(src, 6)
    before = snapshot(dst)
    submitted = pair.submitted()

    async def code(coro: Any) -> LLMStatusCode:
        return await status_of(coro)

    push = pair.p.push_blocks
    P = S.LLM_PARAM_INVALID
    assert await code(push(key, src, [16], [0])) == P  # src id out of range (local)
    assert await code(push(key, src, [0], [16])) == P  # dst id out of range (remote)
    assert await code(push(key, src, [0, 1], [3, 3])) == P  # duplicate destination
    assert await code(push(key, src, [0, 1], [3])) == P  # lengths differ
    assert await code(push(key, src, [], [])) == P  # empty
    assert await code(push(BlocksCacheKey(2, 5), src, [0], [0])) == P  # block sizes differ
    assert await code(push(key, plain, [0], [0])) == P  # not a blocks cache
    assert await code(push(key, src, [0], [1], timeout=1, tag=b"x" * 4096)) == P  # tag too long
    assert await code(pair.p.pull_blocks(key, src, [0, 0], [1, 1])) == P  # duplicate dst
    assert await code(pair.p.pull_blocks(key, src, [0], [99])) == P
    assert await code(pair.p.pull_blocks(key, plain, [0], [1])) == P
    for bad, exc in (([0.5], TypeError), ([-1], ValueError), ("12", TypeError)):
        with pytest.raises(exc, match="dst_blocks"):
            await push(key, src, [0], bad)
    with pytest.raises(TypeError, match="dst_cache_key"):
        await push(CacheKeyByIdAndIndex(2, dst.cache_id), src, [0], [0])
    assert await code(push(BlocksCacheKey(3), src, [0], [0])) == S.LLM_NOT_YET_LINK
    assert same(before, dst) and not kv(other, 0).any()
    assert pair.submitted() == submitted


async def test_blocks_100k(transport: str) -> None:
    """100,000 blocks, scattered and consecutive, exact bytes across the link."""
    pr = await make_pair(transport, sync_kv_timeout=60_000)
    try:
        n = 100_000
        desc = CacheDesc(2, [n, 16], DataType.DT_UINT8, Placement.HOST)
        dst = pr.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
        src = pr.p.allocate_blocks_cache(desc)
        fill(src, 7)
        perm = np.random.default_rng(8).permutation(n)
        notes: list[Any] = []

        async def listen() -> None:
            async for note in pr.d.notifications():
                notes.append(note)
                if len(notes) == 2:
                    return

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(listen)
                await anyio.lowlevel.checkpoint()
                await pr.p.push_blocks(BlocksCacheKey(2), src, np.arange(n), perm, tag="scattered")
                for t in range(2):
                    assert np.array_equal(kv(dst, t)[perm], kv(src, t))
                await pr.p.push_blocks(
                    BlocksCacheKey(2), src, range(n), range(n), tag="consecutive"
                )
                for t in range(2):
                    assert np.array_equal(kv(dst, t), kv(src, t))
                back = pr.p.allocate_blocks_cache(desc)
                await pr.p.pull_blocks(BlocksCacheKey(2), back, perm, np.arange(n))
                assert np.array_equal(kv(back, 1), kv(src, 1)[perm])
        by_tag = {nt.tag: nt for nt in notes}
        assert by_tag["scattered"].batch_index is None  # too long for a notification
        assert by_tag["consecutive"].blocks == tuple(range(n))
    finally:
        await pr.close()


async def test_blocks_notifications(pair: Pair) -> None:
    desc = blocks_desc(layers=4)
    dst = pair.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
    src = pair.p.allocate_blocks_cache(desc)
    fill(src, 9)
    d_ids = [11, 3, 4, 5, 0]
    seen: list[Any] = []

    async def listen() -> None:
        async for note in pair.d.notifications():
            # The layer's bytes are there when its notification is seen.
            for t in (2 * note.layer, 2 * note.layer + 1):
                assert np.array_equal(kv(dst, t)[list(note.blocks)], kv(src, t)[[0, 1, 2, 3, 4]])
            seen.append(note)
            if len(seen) == 4:
                return

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            await anyio.lowlevel.checkpoint()
            await pair.p.push_blocks(BlocksCacheKey(2), src, range(5), d_ids, tag="req-7")
            await pair.d.wait_for_layers("req-7", range(4), timeout=5)
    assert sorted(n.layer for n in seen) == [0, 1, 2, 3]
    assert {(n.tag, n.src_cluster_id, n.cache_id, n.blocks) for n in seen} == {
        ("req-7", 1, dst.cache_id, tuple(d_ids))
    }
    assert pair.d.stats()["tag_records"] == 0


async def test_push_blocks_cancel_and_timeout_quiescent(transport: str) -> None:
    pr = await make_pair(transport, max_inflight_bytes=64 * 1024)
    try:
        desc = CacheDesc(8, [64, 128 * 1024], DataType.DT_UINT8, Placement.HOST)  # 8 MiB tensors
        dst = pr.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
        src = pr.p.allocate_blocks_cache(desc)
        fill(src, 10)
        ids = np.random.default_rng(11).permutation(64)
        await pr.p.push_blocks(BlocksCacheKey(2), src, [0], [0], src_layer_range=range(1))
        outcome = []

        async def push() -> None:
            try:
                await pr.p.push_blocks(BlocksCacheKey(2), src, range(64), ids)
            except anyio.get_cancelled_exc_class():
                outcome.append(pr.p.stats()["live_jobs"])  # quiescent when it reaches us
                raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(push)
            await anyio.sleep(0.003)
            tg.cancel_scope.cancel()
        assert outcome == [0]
        await assert_still(dst)
        with pytest.raises(TimeoutError):
            await pr.p.push_blocks(BlocksCacheKey(2), src, range(64), ids, timeout=0.003)
        await assert_still(dst)
        assert pr.p.stats()["live_jobs"] == 0
        await pr.p.push_blocks(BlocksCacheKey(2), src, range(64), ids)  # usable afterwards
        for t in range(8):
            assert np.array_equal(kv(dst, t)[ids], kv(src, t))
    finally:
        await pr.close()


# ------------------------------------------------------------ copy / swap


async def test_copy_blocks(pair: Pair) -> None:
    cache = pair.p.allocate_blocks_cache(blocks_desc())
    fill(cache, 12)
    before = snapshot(cache)
    await pair.p.copy_blocks(cache, {0: [5, 6], 3: [9]})
    for t in range(6):
        a = kv(cache, t)
        assert np.array_equal(a[5], before[t][0]) and np.array_equal(a[6], before[t][0])
        assert np.array_equal(a[9], before[t][3])
        untouched = [b for b in range(16) if b not in (5, 6, 9)]
        assert np.array_equal(a[untouched], before[t][untouched])
    await pair.p.copy_blocks(cache, {})  # nothing to do
    before = snapshot(cache)
    for info, exc in (
        ({0: [16]}, LLMException),  # out of range
        ({16: [1]}, LLMException),
        ({0: [1], 2: [1]}, LLMException),  # a destination twice
        ({0: [1], 1: [2]}, LLMException),  # a block both source and destination
        ({0: 1}, TypeError),
        ({"0": [1]}, TypeError),
        ([(0, [1])], TypeError),
        ({0: [-1]}, ValueError),
    ):
        with pytest.raises(exc):
            await pair.p.copy_blocks(cache, info)
    with pytest.raises(LLMException, match="not a blocks cache"):
        await pair.p.copy_blocks(pair.p.allocate_cache(blocks_desc()), {0: [1]})
    assert same(before, cache)


async def test_swap_blocks(pair: Pair) -> None:
    desc = blocks_desc()
    a = pair.p.allocate_blocks_cache(desc)
    b = pair.p.allocate_blocks_cache(blocks_desc(blocks=8))
    fill(a, 13)
    await pair.p.swap_blocks(a, b, {0: 7, 15: 0, 4: 3})
    for t in range(6):
        assert np.array_equal(kv(b, t)[[7, 0, 3]], kv(a, t)[[0, 15, 4]])
        assert not kv(b, t)[[1, 2, 4, 5, 6]].any()
    before = snapshot(b)
    for args, exc in (
        ((a, b, {0: 8}), LLMException),  # dst out of range
        ((a, b, {16: 0}), LLMException),  # src out of range
        ((a, b, {0: 1, 2: 1}), LLMException),  # a destination twice
        ((a, a, {0: 1}), LLMException),  # same cache
        ((a, pair.p.allocate_blocks_cache(blocks_desc(tokens=2)), {0: 0}), LLMException),
        ((a, pair.p.allocate_blocks_cache(blocks_desc(layers=2)), {0: 0}), LLMException),
        ((a, pair.p.allocate_cache(desc), {0: 0}), LLMException),
        ((a, b, {0: [1]}), TypeError),
        ((a, b, [(0, 1)]), TypeError),
    ):
        with pytest.raises(exc):
            await pair.p.swap_blocks(*args)
    assert same(before, b)


# ------------------------------------------------------------ across processes


async def digest(peer: AsyncPeer, cache: int, tensor: int, ids: Any) -> str:
    """sha256 of those blocks of the peer's cache, in that order."""
    reply = await peer.call("hash", cache=cache, tensor=tensor, blocks=[int(i) for i in ids])
    return str(reply["sha"])


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


async def test_blocks_across_processes(transport: str) -> None:
    layers, nblocks, bb = 3, 4096, 256
    shape = ("--blocks-shape", str(2 * layers), str(nblocks), str(bb))
    async with AsyncPeer("decoder", transport, *shape, ops=["blocks"]) as peer:
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        try:
            await dd.init(options(transport, sync_kv_timeout=60_000))
            rc, _ = await dd.link_clusters([cluster_info(peer.address, 2)], timeout=10_000)
            assert rc == S.LLM_SUCCESS
            cm = dd.cache_manager
            desc = CacheDesc(2 * layers, [nblocks, bb], DataType.DT_UINT8, Placement.HOST)
            src = cm.allocate_blocks_cache(desc)
            fill(src, 14)
            rng = np.random.default_rng(15)
            scattered_src = rng.permutation(nblocks)[:1000]
            scattered_dst = rng.permutation(nblocks)[:1000]
            consecutive = np.arange(1000, 3000)
            # Scattered, all layers; consecutive, layers 1..2 → 0..1.
            await cm.push_blocks(BlocksCacheKey(2, 0), src, scattered_src, scattered_dst)
            await cm.push_blocks(
                BlocksCacheKey(2, 0),
                src,
                consecutive,
                consecutive + 1000,
                src_layer_range=range(1, 3),
                dst_layer_range=range(0, 2),
            )
            for t in range(2 * layers):
                got = await digest(peer, 0, t, scattered_dst)
                want_ids = scattered_src
                if t < 4:  # dst layers 0, 1 were overwritten by src layers 1, 2 in 2000..3999
                    overlap = np.isin(scattered_dst, consecutive + 1000)
                    expected = np.array(kv(src, t)[scattered_src])
                    expected[overlap] = kv(src, t + 2)[scattered_dst[overlap] - 1000]
                    assert got == sha(expected), t
                    assert await digest(peer, 0, t, consecutive + 1000) == sha(
                        kv(src, t + 2)[consecutive]
                    )
                else:
                    assert got == sha(kv(src, t)[want_ids]), t
            # Pull back from the peer's patterned cache, scattered into consecutive.
            dst = cm.allocate_blocks_cache(desc)
            await cm.pull_blocks(BlocksCacheKey(2, 1), dst, scattered_src, range(1000))
            pattern = np.random.default_rng(99).integers(
                0, 256, (2 * layers, nblocks, bb), dtype=np.uint8
            )
            for t in range(2 * layers):
                assert np.array_equal(kv(dst, t)[:1000], pattern[t][scattered_src])
                assert await digest(peer, 1, t, scattered_src) == sha(pattern[t][scattered_src])
        finally:
            await dd.finalize()


# ------------------------------------------------------------ by key, recorded


async def test_push_blocks_by_key_asks_the_peer_once_and_follows_a_rebind(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BlocksCacheKey leaves its cache only when the cache retires: the
    prompt asks the peer once, then uses its record while it is valid; when
    the owner deallocates the cache and binds the key to a new one, the next
    push lands in the new one (asked again), however soon it comes."""
    from aiokvcache._core.peers import lookups

    asked: list[Any] = []
    real = lookups.Lookups.remote_blocks

    async def counting(self: Any, link: Any, key: BlocksCacheKey) -> Any:
        asked.append(key)
        return await real(self, link, key)

    monkeypatch.setattr(lookups.Lookups, "remote_blocks", counting)
    desc = blocks_desc(layers=2, blocks=8)
    src = pair.p.allocate_blocks_cache(desc)
    key = BlocksCacheKey(2, 3)
    dst = pair.d.allocate_blocks_cache(desc, key)
    for _ in range(10):
        await pair.p.push_blocks(key, src, [0, 1], [4, 5])
    assert len(asked) == 1
    for round_ in range(12):
        fill(src, 100 + round_)
        pair.d.deallocate_blocks_cache(dst)
        dst = pair.d.allocate_blocks_cache(desc, key)  # the key, on a new cache
        if round_ % 3 == 0:
            await anyio.sleep(0.02)  # sometimes the invalidation is in first
        await pair.p.push_blocks(key, src, [0, 1], [4, 5])
        for t in range(desc.num_tensors):
            assert np.array_equal(kv(dst, t)[[4, 5]], kv(src, t)[[0, 1]]), round_
    # Each rebind asked once more; rounds in between used the record.
    await pair.p.push_blocks(key, src, [2], [6])
    assert len(asked) == 13
