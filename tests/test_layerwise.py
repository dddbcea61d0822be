"""transfer_cache_async / CacheTask, receiver notifications, and the layer-wise example.

The API tests run on asyncio and on trio (``kv_pair``), over shm and TCP. The
synchronizer runs in the caller's context (its contextvars), a cancel stops
sending at once, and a run that ends with a task in flight still ends (a child
program, under each library).
"""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiokvcache._core.transfer.notify as cm_module
from aiokvcache import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    CacheTask,
    DataType,
    LayerSynchronizer,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aiokvcache.testing import (
    Child,
    Pair,
    assert_still,
    blocks_desc,
    fill,
    make_pair,
    same,
    snapshot,
)
from support.child_script import run_child

pytestmark = pytest.mark.anyio

S = LLMStatusCode
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def pair(kv_pair: Pair) -> Pair:
    """The plugin's linked pair, on the test's backend."""
    return kv_pair


class Gate(LayerSynchronizer):
    """Layer *i* is ready once ``open(i)`` was called; returns ``verdict.get(i, True)``."""

    def __init__(self, layers: int, verdict: dict[int, Any] | None = None) -> None:
        self.events = [anyio.Event() for _ in range(layers)]
        self.verdict = verdict or {}
        self.calls: list[tuple[int, int | None]] = []

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        await self.events[layer_index].wait()
        return bool(self.verdict.get(layer_index, True))

    def open(self, *layers: int) -> None:
        for i in layers or range(len(self.events)):
            self.events[i].set()


class Plain(LayerSynchronizer):
    """A plain (not async) synchronizer: True except at ``false_at``."""

    def __init__(self, false_at: int | None = None) -> None:
        self.false_at = false_at
        self.calls: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append(layer_index)
        return layer_index != self.false_at


def kv_desc(layers: int = 4, batch: int = 2, tokens: int = 16, dim: int = 32) -> CacheDesc:
    return CacheDesc(2 * layers, [batch, tokens, dim], DataType.DT_FLOAT16, Placement.HOST)


def t(cache: Any, i: int) -> np.ndarray:
    return np.asarray(cache.tensors[i])


def layer_landed(dst: Any, src: Any, layer: int, db: int = 0, sb: int = 0) -> bool:
    return all(np.array_equal(t(dst, k)[db], t(src, k)[sb]) for k in (2 * layer, 2 * layer + 1))


def layer_empty(dst: Any, layer: int) -> bool:
    return not (t(dst, 2 * layer).any() or t(dst, 2 * layer + 1).any())


# --------------------------------------------------------------- pipelining


async def test_pipelined_layer_by_layer(pair: Pair) -> None:
    """Each layer goes as soon as the synchronizer lets it, and not before."""
    layers = 4
    dst = pair.d.allocate_cache(kv_desc(layers))
    src = pair.p.allocate_cache(kv_desc(layers))
    fill(src, 1)
    gate = Gate(layers)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id, 1), tag="req")
    task = await pair.p.transfer_cache_async(src, gate, [cfg])
    assert isinstance(task, CacheTask)
    for i in range(layers):
        await anyio.sleep(0.01)
        assert not task.done()
        assert layer_empty(dst, i), f"layer {i} was sent before it was ready"
        gate.open(i)
        await pair.d.wait_for_layers("req", [i], timeout=5)
        assert layer_landed(dst, src, i, db=1)  # its bytes are there when the layer is seen
    await task
    assert await task.synchronize() == S.LLM_SUCCESS
    assert await task.get_results() == [S.LLM_SUCCESS]
    assert gate.calls == [(i, None) for i in range(layers)]
    assert not t(dst, 0)[0].any()  # batch 0 untouched


async def test_notifications_in_layer_order(pair: Pair) -> None:
    """The receiver drives the sender: layer i+1 is released when layer i is seen."""
    layers = 5
    dst = pair.d.allocate_cache(kv_desc(layers))
    src = pair.p.allocate_cache(kv_desc(layers))
    fill(src, 2)
    gate = Gate(layers)
    seen: list[int] = []

    async def receiver() -> None:
        async for note in pair.d.notifications():
            assert layer_landed(dst, src, note.layer)
            assert (note.tag, note.src_cluster_id, note.cache_id, note.batch_index) == (
                b"r",
                1,
                dst.cache_id,
                0,
            )
            seen.append(note.layer)
            if note.layer + 1 == layers:
                return
            gate.open(note.layer + 1)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await anyio.lowlevel.checkpoint()
            cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id), tag=b"r")
            task = await pair.p.transfer_cache_async(src, gate, [cfg])
            gate.open(0)
    await task
    assert seen == list(range(layers))


async def test_plain_synchronizer_and_several_configs(pair: Pair) -> None:
    layers = 4
    a = pair.d.allocate_cache(kv_desc(layers))
    b = pair.d.allocate_cache(kv_desc(layers))
    src = pair.p.allocate_cache(kv_desc(layers))
    fill(src, 3)
    sync = Plain()
    configs = [
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, a.cache_id, 1), src_batch_index=1),
        TransferWithCacheKeyConfig(
            CacheKeyByIdAndIndex(2, b.cache_id), range(1, 3), range(2, 4), tag="b"
        ),
    ]
    task = await pair.p.transfer_cache_async(src, sync, configs)
    await task
    assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_SUCCESS]
    assert sync.calls == [0, 1, 2, 3]
    assert all(layer_landed(a, src, i, db=1, sb=1) for i in range(layers))
    for k in range(4, 8):  # b's layers 2, 3 = src layers 1, 2
        assert np.array_equal(t(b, k)[0], t(src, k - 2)[0])
    assert layer_empty(b, 0) and layer_empty(b, 1)
    await pair.d.wait_for_layers("b", [2, 3], timeout=5)
    empty = await pair.p.transfer_cache_async(src, sync, [])
    await empty
    assert await empty.get_results() == []


async def test_transfer_config_raw_addresses(pair: Pair) -> None:
    desc = kv_desc(layers=4, batch=3)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(kv_desc(layers=4))
    fill(src, 4)
    slot = desc.size // 3
    addrs = dst.tensor_addrs
    # src layers 1, 2 → batch slot 2 of dst layers 3, 0.
    cfg = TransferConfig(
        2,
        [addrs[6] + 2 * slot, addrs[7] + 2 * slot, addrs[0] + 2 * slot, addrs[1] + 2 * slot],
        range(1, 3),
        src_batch_index=1,
        tag="raw",
    )
    notes: list[Any] = []

    async def listen() -> None:
        async for note in pair.d.notifications():
            notes.append(note)
            if len(notes) == 2:
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            await anyio.lowlevel.checkpoint()
            task = await pair.p.transfer_cache_async(src, Plain(), [cfg])
            await task
    assert np.array_equal(t(dst, 6)[2], t(src, 2)[1]) and np.array_equal(t(dst, 7)[2], t(src, 3)[1])
    assert np.array_equal(t(dst, 0)[2], t(src, 4)[1]) and np.array_equal(t(dst, 1)[2], t(src, 5)[1])
    assert sorted((n.layer, n.batch_index, n.cache_id) for n in notes) == [
        (0, 2, dst.cache_id),
        (3, 2, dst.cache_id),
    ]
    # Bad addresses: found out before anything moves.
    private = pair.d.register_cache(
        desc, [np.zeros(desc.shape, np.float16) for _ in range(8)], remote_accessible=False
    )
    before, submitted = snapshot(dst), pair.submitted()
    for bad_addrs, match in (
        ([addrs[0]], "expected 2 dst_addrs"),
        ([addrs[0] + desc.size - 16, addrs[1]], "run past the end"),
        ([0x1000, addrs[1]], "not inside"),
        ([private.tensor_addrs[0], private.tensor_addrs[1]], "not inside"),
    ):
        with pytest.raises(LLMException, match=match) as ei:
            await pair.p.transfer_cache_async(
                src, Plain(), [TransferConfig(2, bad_addrs, range(1))]
            )
        assert ei.value.status_code == S.LLM_PARAM_INVALID
    assert same(before, dst) and pair.submitted() == submitted


async def test_blocks_variants(pair: Pair) -> None:
    layers = 3
    bdesc = blocks_desc(layers=layers)  # 16 blocks of 64 B per tensor
    remote = pair.d.allocate_blocks_cache(bdesc, BlocksCacheKey(2, 1))
    bsrc = pair.p.allocate_blocks_cache(bdesc)
    fill(bsrc, 5)
    s_ids, d_ids = [0, 1, 2, 9], [7, 3, 4, 5]
    # blocks → blocks by key, layers 0..1 → 1..2, tagged: notes carry the block ids.
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 1), range(0, 2), range(1, 3), tag="bk")
    task = await pair.p.transfer_cache_async(bsrc, Plain(), [cfg], s_ids, np.array(d_ids))
    await task
    for k in range(2, 6):
        assert np.array_equal(t(remote, k)[d_ids], t(bsrc, k - 2)[s_ids])
    assert layer_empty(remote, 0)
    await pair.d.wait_for_layers("bk", [1, 2], timeout=5)
    # blocks → blocks by raw addresses (the remote tensors' base addresses).
    raddrs = remote.tensor_addrs
    cfg2 = TransferConfig(2, raddrs[4:6], range(2, 3))
    await await_task(pair.p.transfer_cache_async(bsrc, Plain(), [cfg2], [5, 6], [14, 15]))
    assert np.array_equal(t(remote, 5)[[14, 15]], t(bsrc, 5)[[5, 6]])
    # cache slot → blocks: 10 tokens x 8 fp16 = 160 B = 3 blocks (last partly used).
    cdesc = CacheDesc(2 * layers, [2, 10, 8], DataType.DT_FLOAT16, Placement.HOST)
    csrc = pair.p.allocate_cache(cdesc)
    fill(csrc, 6)
    cfg3 = TransferWithCacheKeyConfig(BlocksCacheKey(2, 1), tag="c2b")
    await await_task(pair.p.transfer_cache_async(csrc, Plain(), [cfg3], None, [10, 11, 12]))
    for k in range(2 * layers):
        assert np.array_equal(t(remote, k)[[10, 11, 12]].reshape(-1)[:80], t(csrc, k)[0].ravel())
    cfg4 = TransferConfig(2, raddrs[:2], range(1), src_batch_index=1)
    await await_task(
        pair.p.transfer_cache_async(
            csrc, Plain(), [cfg4], None, [0, 1, 2], dst_block_memory_size=64
        )
    )
    assert np.array_equal(t(remote, 1)[[0, 1, 2]].reshape(-1)[:80], t(csrc, 1)[1].ravel())


async def await_task(coro: Any) -> None:
    task = await coro
    await task


async def test_validation_moves_nothing(pair: Pair) -> None:
    bdesc = blocks_desc()
    remote = pair.d.allocate_blocks_cache(bdesc, BlocksCacheKey(2, 1))
    pair.d.allocate_blocks_cache(blocks_desc(tokens=2), BlocksCacheKey(2, 2))
    dst = pair.d.allocate_cache(kv_desc(3))
    bsrc = pair.p.allocate_blocks_cache(bdesc)
    csrc = pair.p.allocate_cache(kv_desc(3))
    fill(bsrc, 7)
    fill(csrc, 7)
    before, submitted = (snapshot(remote), snapshot(dst)), pair.submitted()
    bkey = TransferWithCacheKeyConfig(BlocksCacheKey(2, 1))
    ckey = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    raw = TransferConfig(2, remote.tensor_addrs)
    go = pair.p.transfer_cache_async
    P = S.LLM_PARAM_INVALID
    cases: list[tuple[Any, ...]] = [
        (bsrc, [bkey], None, [1]),  # blocks src without src_block_indices
        (bsrc, [bkey], [1], None),  # blocks → cache
        (bsrc, [ckey], [1], [1]),  # blocks → contiguous cache
        (bsrc, [bkey], [1, 2], [1]),  # lengths differ
        (bsrc, [bkey], [16], [1]),  # src id out of range
        (bsrc, [bkey], [1], [16]),  # dst id out of range (remote)
        (bsrc, [bkey], [1, 2], [3, 3]),  # duplicate destination
        (bsrc, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 2))], [1], [1]),  # block sizes
        (bsrc, [bkey], [1], [1], 128),  # dst_block_memory_size != block size
        (csrc, [bkey], [1], [1]),  # src_block_indices on a contiguous cache
        (csrc, [ckey], None, None, 64),  # dst_block_memory_size without blocks
        (csrc, [bkey], None, [1, 2]),  # slot of 1024 B does not fill 2 blocks of 64 B
        (csrc, [raw], None, list(range(16))),  # raw addresses, no dst_block_memory_size
        (csrc, [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id, 2))], None, None),
        (csrc, [TransferConfig(2, [1, 2], range(3, 4))], None, None),  # src layer range
        (
            csrc,
            [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id), None, range(2, 5))],
            None,
            None,
        ),
    ]
    for src, configs, s_ids, d_ids, *rest in cases:
        with pytest.raises(LLMException) as ei:
            await go(src, Plain(), configs, s_ids, d_ids, *rest)
        assert ei.value.status_code == P, (configs, s_ids, d_ids, ei.value)
    odd = pair.p.allocate_cache(CacheDesc(3, [1, 8], DataType.DT_UINT8, Placement.HOST))
    with pytest.raises(LLMException, match="even number"):
        await go(odd, Plain(), [])
    with pytest.raises(TypeError, match="layer_synchronizer"):
        await go(csrc, object(), [ckey])
    with pytest.raises(TypeError, match="transfer_configs"):
        await go(csrc, Plain(), ckey)
    with pytest.raises(TypeError, match=r"transfer_configs\[1\]"):
        await go(csrc, Plain(), [ckey, "x"])
    with pytest.raises(TypeError, match="dst_block_indices"):
        await go(bsrc, Plain(), [bkey], [1], [1.5])
    with pytest.raises(LLMException) as ei:
        await go(csrc, Plain(), [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(3, 1))])
    assert ei.value.status_code == S.LLM_NOT_YET_LINK
    with pytest.raises(LLMException) as ei:
        await go(csrc, Plain(), [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, 999))])
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    assert same(before[0], remote) and same(before[1], dst)
    assert pair.submitted() == submitted


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


@pytest.mark.timeout(60)
async def test_the_layer_synchronizer_sees_the_callers_contextvars(kv_pair: Pair) -> None:
    """Request ids and tracing spans live in contextvars: under trio the
    pipeline ran in the run's initial context, so the synchronizer lost them."""
    desc = CacheDesc(4, [1, 4096], DataType.DT_UINT8, Placement.HOST)
    dst = kv_pair.d.allocate_cache(desc)
    src = kv_pair.p.allocate_cache(desc)
    seen: list[str] = []

    class Sync:
        async def synchronize_layer(self, layer: int, timeout: int | None) -> bool:
            seen.append(REQUEST_ID.get())
            return True

    token = REQUEST_ID.set("req-42")
    try:
        cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
        with anyio.fail_after(10):
            task = await kv_pair.p.transfer_cache_async(src, Sync(), [cfg])
            await task
    finally:
        REQUEST_ID.reset(token)
    assert seen == ["req-42", "req-42"], seen


# ---------------------------------------------------- stop, cancel, timeout


async def test_synchronizer_false_stops_at_layer_k(pair: Pair) -> None:
    layers, k = 6, 3
    a, b, c = (pair.d.allocate_cache(kv_desc(layers)) for _ in range(3))
    src = pair.p.allocate_cache(kv_desc(layers))
    fill(src, 8)
    sync = Plain(false_at=k)
    configs = [
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, a.cache_id)),  # all layers
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, b.cache_id), range(0, 2)),
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, c.cache_id), range(4, 6)),
    ]
    task = await pair.p.transfer_cache_async(src, sync, configs)
    with pytest.raises(LLMException, match="returned False for layer 3") as ei:
        await task
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    assert await task.get_results() == [S.LLM_PARAM_INVALID, S.LLM_SUCCESS, None]
    assert await task.synchronize() == S.LLM_PARAM_INVALID
    assert sync.calls == [0, 1, 2, 3]  # nothing after k asked for, nothing after k sent
    assert all(layer_landed(a, src, i) for i in range(k))
    assert all(layer_empty(a, i) for i in range(k, layers))
    assert all(layer_landed(b, src, i) for i in range(2))
    assert all(layer_empty(c, i) for i in range(layers))
    await assert_still(a, 0.05)


async def test_synchronizer_raising(pair: Pair) -> None:
    dst = pair.d.allocate_cache(kv_desc(3))
    src = pair.p.allocate_cache(kv_desc(3))
    fill(src, 9)

    class Broken(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            if layer_index == 1:
                raise RuntimeError("model crashed")
            return True

    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    task = await pair.p.transfer_cache_async(src, Broken(), [cfg])
    with pytest.raises(RuntimeError, match="model crashed"):
        await task
    assert await task.get_results() == [S.LLM_FAILED]
    assert layer_landed(dst, src, 0) and layer_empty(dst, 1) and layer_empty(dst, 2)


async def test_cancel_midway_is_quiescent(transport: str, anyio_backend: str) -> None:
    # A 64 KiB window: 8 MiB layers take many round trips.
    pr = await make_pair(transport, max_inflight_bytes=64 * 1024)
    try:
        layers = 4
        desc = CacheDesc(2 * layers, [1, 8 << 20], DataType.DT_UINT8, Placement.HOST)
        dst = pr.d.allocate_cache(desc)
        src = pr.p.allocate_cache(desc)
        fill(src, 10)
        gate = Gate(layers)
        cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
        task = await pr.p.transfer_cache_async(src, gate, [cfg])
        gate.open(0, 1)  # layers 0 and 1 go; layer 2 is never ready
        await anyio.sleep(0.003)
        assert task.cancel()
        if anyio_backend == "asyncio":
            with pytest.raises(asyncio.CancelledError):
                await task
        else:  # a trio cancellation belongs to a scope: awaiting it raises LLM_FAILED
            with pytest.raises(LLMException, match="cancelled") as ei:
                await task
            assert ei.value.status_code == S.LLM_FAILED
        assert task.cancelled() and task.done()
        await assert_still(dst)
        assert layer_empty(dst, 2) and layer_empty(dst, 3)
        assert await task.get_results() == [S.LLM_FAILED]
        assert pr.p.stats()["live_jobs"] == 0
        # Cancelling the coroutine that awaits a task cancels the task too.
        gate2 = Gate(layers)
        task2 = await pr.p.transfer_cache_async(src, gate2, [cfg])
        gate2.open(0)

        outcome = []

        async def waiter() -> None:
            try:
                await task2
            except anyio.get_cancelled_exc_class():
                outcome.append((task2.done(), pr.p.stats()["live_jobs"]))  # quiescent by now
                raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.003)
            tg.cancel_scope.cancel()
        assert outcome == [(True, 0)]
        assert task2.cancelled()
        await assert_still(dst)
        # Usable afterwards.
        task3 = await pr.p.transfer_cache_async(src, Plain(), [cfg])
        await task3
        assert all(layer_landed(dst, src, i) for i in range(layers))
    finally:
        await pr.close()


@pytest.mark.timeout(60)
async def test_cancel_right_after_transfer_cache_async_sends_nothing(kv_pair: Pair) -> None:
    """``CacheTask.cancel()`` stops sending: under trio a cancel made before
    the pipeline first ran was seen only after every layer was submitted."""
    layers = 4
    desc = CacheDesc(2 * layers, [1, 64 << 10], DataType.DT_UINT8, Placement.HOST)
    dst = kv_pair.d.allocate_cache(desc)
    src = kv_pair.p.allocate_cache(desc)
    src.tensors[0][...] = 1

    class Plain:
        def synchronize_layer(self, layer: int, timeout: int | None) -> bool:
            return True

    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    before = kv_pair.p.stats()["jobs_submitted"]
    task = await kv_pair.p.transfer_cache_async(src, Plain(), [cfg])
    assert task.cancel()  # before anything was sent
    with anyio.fail_after(10):
        try:
            await task
        except BaseException as exc:  # CancelledError (asyncio), LLMException (trio)
            if not isinstance(exc, (Exception, anyio.get_cancelled_exc_class())):
                raise
    sent = kv_pair.p.stats()["jobs_submitted"] - before
    assert sent == 0, f"{sent} layers were submitted after task.cancel()"


async def test_synchronize_get_results_and_task_timeout(pair: Pair) -> None:
    dst = pair.d.allocate_cache(kv_desc(2))
    src = pair.p.allocate_cache(kv_desc(2))
    fill(src, 11)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    gate = Gate(2)
    task = await pair.p.transfer_cache_async(src, gate, [cfg, cfg])
    assert await task.synchronize(10) == S.LLM_TIMEOUT  # the task goes on
    assert await task.get_results(timeout_in_millis=0) == [S.LLM_TIMEOUT, S.LLM_TIMEOUT]
    with pytest.raises(ValueError, match="timeout_in_millis"):
        await task.synchronize(-1)
    with pytest.raises(TypeError, match="timeout_in_millis"):
        await task.get_results("1")  # type: ignore[arg-type]
    assert not task.done()
    gate.open()
    assert await task.synchronize() == S.LLM_SUCCESS
    assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_SUCCESS]
    await task
    # timeout= bounds the whole task.
    task = await pair.p.transfer_cache_async(src, Gate(2), [cfg], timeout=0.1)
    with pytest.raises(LLMTimeoutError, match="timed out"):
        await task
    assert await task.get_results() == [S.LLM_TIMEOUT]
    assert "CacheTask(done" in repr(task)


async def test_failing_destination_does_not_stop_the_others(pair: Pair) -> None:
    layers = 3
    a = pair.d.allocate_cache(kv_desc(layers))
    b = pair.d.allocate_cache(kv_desc(layers))
    src = pair.p.allocate_cache(kv_desc(layers))
    fill(src, 12)
    gate = Gate(layers)
    configs = [
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, a.cache_id), tag="a"),
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, b.cache_id), tag="b"),
    ]
    task = await pair.p.transfer_cache_async(src, gate, configs)
    gate.open(0)
    await pair.d.wait_for_layers("a", [0], timeout=5)
    await pair.d.wait_for_layers("b", [0], timeout=5)
    pair.d.deallocate_cache(b)
    link = pair.prompt._links[2]
    for _ in range(500):  # the prompt learns of it
        if b.cache_id not in link.remote:
            break
        await anyio.sleep(0.01)
    gate.open()
    with pytest.raises(LLMException) as ei:
        await task
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST]
    assert all(layer_landed(a, src, i) for i in range(layers))


# ----------------------------------------------------- receiver bookkeeping


async def test_bounded_receiver_state(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cm_module, "MAX_TAG_RECORDS", 3)
    monkeypatch.setattr(cm_module, "MAX_QUEUED_NOTIFICATIONS", 2)
    desc = kv_desc(layers=2)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    key = CacheKeyByIdAndIndex(2, dst.cache_id)

    async def landed(count: int) -> None:
        for _ in range(500):
            if pair.d.stats()["notifications_received"] >= count:
                await anyio.sleep(0.01)  # the loop dispatches what arrived
                return
            await anyio.sleep(0.01)
        raise AssertionError("notifications did not arrive")

    # A waited-for tag is never dropped, however many others come after it.
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pair.d.wait_for_layers, "keep", [0, 1], 10)
            await anyio.lowlevel.checkpoint()
            await _many_tags(pair, key, src, landed)
    assert pair.d.stats()["tag_records"] == 1  # a record is dropped once its wait returned
    pair.d.discard_tag("t4")
    assert pair.d.stats()["tag_records"] == 0
    # A subscriber that does not read: its queue is capped, oldest dropped.
    agen = pair.d.notifications()
    got: list[Any] = []

    async def first() -> None:
        got.append(await agen.__anext__())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.lowlevel.checkpoint()
            await pair.p.push_cache(key, src, src_layer_range=range(1), tag="q0")
    assert got[0].tag == "q0"
    for i in range(1, 4):
        await pair.p.push_cache(key, src, src_layer_range=range(1), tag=f"q{i}")
    await landed(12)
    assert pair.d.stats()["dropped_notifications"] == 1
    assert [(await agen.__anext__()).tag for _ in range(2)] == ["q2", "q3"]
    await agen.aclose()
    for i in range(4):
        pair.d.discard_tag(f"q{i}")
    assert pair.d.stats()["tag_records"] == 0


async def _many_tags(pair: Pair, key: Any, src: Any, landed: Any) -> None:
    """Push "keep" layer 0, six tags nobody waits for, then "keep" layer 1."""
    await pair.p.push_cache(key, src, src_layer_range=range(1), tag="keep")
    for i in range(6):  # records nobody waits for: capped, oldest dropped first
        await pair.p.push_cache(key, src, src_layer_range=range(1), tag=f"t{i}")
    await landed(7)
    stats = pair.d.stats()
    assert stats["tag_records"] == 3  # the one waited for + the two newest
    assert stats["dropped_tag_records"] == 4
    await pair.d.wait_for_layers("t5", [0], timeout=1)  # the newest is there
    with pytest.raises(LLMTimeoutError):
        await pair.d.wait_for_layers("t0", [0], timeout=0.05)  # the oldest was dropped
    await pair.p.push_cache(key, src, src_layer_range=range(1, 2), tag="keep")


# ----------------------------------------------------------------- example


def test_example_layerwise_pd(transport: str) -> None:
    """examples/layerwise_pd.py as two processes: decode first, then prefill."""
    script = str(ROOT / "examples" / "layerwise_pd.py")
    argv = [sys.executable, script, "--role", "decode", "--protocol", "--transport", transport]
    with Child(argv, cwd=ROOT) as decode:
        line = decode.read_line("READY ", timeout=30)
        prefill = subprocess.run(
            [
                sys.executable,
                script,
                "--role",
                "prefill",
                "--peer",
                line.split()[1],
                "--transport",
                transport,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert prefill.returncode == 0, prefill.stdout + prefill.stderr
        assert "prefill: all 8 layers sent" in prefill.stdout
        out = decode.communicate("done", timeout=30)
        assert decode.returncode == 0, out
        assert "decode: all 8 layers verified" in out


async def test_finalize_during_a_task(transport: str) -> None:
    pr = await make_pair(transport)
    try:
        dst = pr.d.allocate_cache(kv_desc(3))
        src = pr.p.allocate_cache(kv_desc(3))
        gate = Gate(3)
        cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
        task = await pr.p.transfer_cache_async(src, gate, [cfg])
        gate.open(0)
        await anyio.sleep(0.01)
        await pr.prompt.finalize()
        with pytest.raises(LLMException) as ei:
            await task
        assert ei.value.status_code == S.LLM_ENGINE_FINALIZED
        assert await task.get_results() == [S.LLM_ENGINE_FINALIZED]
    finally:
        await pr.close()


# ------------------------------------------------------------ the run's end

END_OF_RUN = """
import anyio
from aiokvcache import CacheDesc, CacheKeyByIdAndIndex, DataType, Placement
from aiokvcache import TransferWithCacheKeyConfig
from aiokvcache.testing import make_pair

DESC = CacheDesc(8, [1, 32 << 20], DataType.DT_UINT8, Placement.HOST)


class Sync:
    async def synchronize_layer(self, layer, timeout):
        if layer == 0:
            return True  # layer 0 goes; layer 1 is "being computed" when the run ends
        await anyio.sleep_forever()


async def main():
    pr = await make_pair("{transport}", max_inflight_bytes=64 * 1024, direct_copy=False)
    dst = pr.d.allocate_cache(DESC)
    src = pr.p.allocate_cache(DESC)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    await pr.p.transfer_cache_async(src, Sync(), [cfg])
    await anyio.sleep(0)
    print("main returns", flush=True)
    # No finalize: the run's end cancels what is left (asyncio: its tasks;
    # trio: the instance's system tasks).


anyio.run(main, backend="{backend}")
print("run ended", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_a_run_ending_with_a_layerwise_task_in_flight_ends(
    tmp_path: Path, transport: str, library: str
) -> None:
    """The run's end cancels the pipeline (docs/design.md): under trio its
    cancel path waited for a release only the cancelled watcher could report."""
    code = END_OF_RUN.format(transport=transport, backend=library)
    done = run_child(code, tmp_path, 20)
    assert done is not None, "the run never ended (the pipeline waits for a dead watcher)"
    assert "run ended" in done.stdout, done.stdout[-2000:]
