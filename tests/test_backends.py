"""The same awaitables under asyncio and trio: a peer in another process, its
faults (frozen, slowed, killed), cancel scopes and deadlines, and the clear
errors for a loop the instance does not belong to.

Every async test runs on both backends (anyio's plugin) and both transports,
with the fixtures of aiokvcache's pytest plugin (``kv_pair``, ``kv_peer``,
``kv_prompt``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiokvcache import (
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    Placement,
)
from aiokvcache.testing import Pair, PeerProcess, assert_still, fill, make_pair

pytestmark = pytest.mark.anyio

S = LLMStatusCode
LAYERS = 8
TENSOR = 256 * 1024  # bytes per tensor: a layer is 512 KiB (K, V)
DESC = CacheDesc(2 * LAYERS, [1, TENSOR], DataType.DT_UINT8, Placement.HOST)
MAX_UNCONFIRMED = 2 << 20  # the default max_unconfirmed_bytes


def sha(cache: Cache) -> str:
    h = hashlib.sha256()
    for t in cache.tensors:
        h.update(t.tobytes())
    return h.hexdigest()


async def test_two_processes_push_layer_by_layer_then_pull(
    kv_prompt: LLMDataDist, kv_peer: PeerProcess
) -> None:
    cm = kv_prompt.cache_manager
    dst = await kv_peer.alloc("dst", 2 * LAYERS, TENSOR)
    src = cm.allocate_cache(DESC)
    fill(src, 1)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, dst["cache_id"])

    async def push(layer: int) -> None:
        with anyio.fail_after(10):
            await cm.push_cache(key, src, src_layer_range=range(layer, layer + 1), tag="req-1")

    async with anyio.create_task_group() as tg:
        for layer in range(LAYERS):  # each layer goes as soon as it is "computed"
            tg.start_soon(push, layer)
            await anyio.lowlevel.checkpoint()
    assert (await kv_peer.wait_for_layers("req-1", range(LAYERS)))["status"] == "LLM_SUCCESS"
    assert await kv_peer.sha("dst") == sha(src)
    # The other way: the peer's cache, pulled by id.
    theirs = await kv_peer.alloc("theirs", 2 * LAYERS, TENSOR, seed=7)
    back = cm.allocate_cache(DESC)
    with anyio.fail_after(10):
        await cm.pull_cache(CacheKeyByIdAndIndex(kv_peer.cluster_id, theirs["cache_id"]), back)
    assert sha(back) == theirs["sha"]
    assert cm.stats()["live_jobs"] == 0


async def test_pull_from_a_frozen_peer_ends_by_the_deadline_and_lands_at_most_a_window_late(
    kv_prompt: LLMDataDist, kv_peer: PeerProcess, kv_transport: str
) -> None:
    cm = kv_prompt.cache_manager
    big = CacheDesc(4, [1, 16 << 20], DataType.DT_UINT8, Placement.HOST)
    theirs = await kv_peer.alloc("theirs", 4, 16 << 20, seed=3)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, theirs["cache_id"])
    dst = cm.allocate_cache(big)
    await cm.pull_cache(key, dst, src_layer_range=range(1), tensor_num_per_layer=1)  # metadata
    for t in dst.tensors:
        t[...] = 0
    kv_peer.freeze()
    try:
        t0 = anyio.current_time()
        # One-sided over shared memory, a get may complete from a frozen peer;
        # over TCP it waits for the peer and the deadline ends it.
        with anyio.move_on_after(0.5) as scope:
            await cm.pull_cache(key, dst, tensor_num_per_layer=1)
        assert anyio.current_time() - t0 < 5
        assert cm.stats()["live_jobs"] == 0  # quiescent when the scope ended
        if kv_transport == "tcp":
            assert scope.cancelled_caught
    finally:
        kv_peer.thaw()
    if scope.cancelled_caught:
        # The thawed peer answers what it had been asked: over TCP at most one
        # confirmation window of it lands (docs/design.md, "Late writes"), in
        # the first moments after the thaw, and nothing after that.
        await anyio.sleep(0.5)
        late = sum(int(np.count_nonzero(t)) for t in dst.tensors)
        assert late <= MAX_UNCONFIRMED, f"{late} bytes landed after the pull raised"
        await assert_still(dst, 0.3)


async def test_push_to_a_slowed_peer_lands(kv_prompt: LLMDataDist, kv_peer: PeerProcess) -> None:
    cm = kv_prompt.cache_manager
    dst = await kv_peer.alloc("dst", 2 * LAYERS, TENSOR)
    src = cm.allocate_cache(DESC)
    fill(src, 2)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, dst["cache_id"])
    kv_peer.slow(0.25)  # runs 5 ms of every 20
    try:
        with anyio.fail_after(30):
            await cm.push_cache(key, src, tag="slow")
    finally:
        kv_peer.slow(None)
    assert (await kv_peer.wait_for_layers("slow", range(LAYERS)))["status"] == "LLM_SUCCESS"
    assert await kv_peer.sha("dst") == sha(src)


async def test_killed_peer_fails_pushes_with_link_failed(
    kv_prompt: LLMDataDist, kv_peer: PeerProcess
) -> None:
    cm = kv_prompt.cache_manager
    dst = await kv_peer.alloc("dst", 2 * LAYERS, TENSOR)
    src = cm.allocate_cache(DESC)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, dst["cache_id"])
    await cm.push_cache(key, src, timeout=10)
    await kv_peer.kill()
    t0 = anyio.current_time()
    code = None
    with anyio.fail_after(15):
        while code is None:
            try:
                await cm.push_cache(key, src, timeout=5)
            except LLMException as exc:
                code = exc.status_code
    assert code == S.LLM_LINK_FAILED
    assert anyio.current_time() - t0 < 10
    assert cm.stats()["live_jobs"] == 0


@pytest.fixture
def idle_threads_exit_soon(monkeypatch: pytest.MonkeyPatch) -> float:
    """trio's idle worker threads exit after 2 s instead of 10 s (trio
    starts subprocesses from them): still after the peer started."""
    from trio._core import _thread_cache

    monkeypatch.setattr(_thread_cache, "IDLE_TIMEOUT", 2.0)
    return 2.0


async def test_a_peer_outlives_the_thread_that_started_it(
    idle_threads_exit_soon: float, kv_prompt: LLMDataDist, kv_peer: PeerProcess
) -> None:
    """The peer's life is tied to this process, not to the thread that
    forked it: under trio that thread goes idle and exits (PR_SET_PDEATHSIG
    killed the peer then, 10 s into a test)."""
    await anyio.sleep(2 * idle_threads_exit_soon)
    assert kv_peer.returncode is None, "the peer died with the thread that started it"
    dst = await kv_peer.alloc("dst", 2, TENSOR)
    src = kv_prompt.cache_manager.allocate_cache(
        CacheDesc(2, [1, TENSOR], DataType.DT_UINT8, Placement.HOST)
    )
    fill(src, 3)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, dst["cache_id"])
    await kv_prompt.cache_manager.push_cache(key, src, timeout=10)
    assert await kv_peer.sha("dst") == sha(src)


PARENT_OF_A_PEER = """
import os, signal, sys, threading, anyio
from aiokvcache.testing import PeerProcess

async def main():
    peer = await PeerProcess("decoder", sys.argv[1]).start()
    print(peer.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: the peer must go by itself

anyio.run(main, backend=sys.argv[2])
"""


async def test_a_peer_dies_with_the_process_that_started_it(
    anyio_backend_name: str, transport: str
) -> None:
    """Its parent SIGKILLed (no clean-up runs), the peer follows within a second or so."""
    got = await anyio.run_process(
        [sys.executable, "-c", PARENT_OF_A_PEER, transport, anyio_backend_name], check=False
    )
    peer = int(got.stdout.split()[0])
    with anyio.fail_after(10):
        while True:
            try:
                os.kill(peer, 0)
            except ProcessLookupError:
                break
            stat = Path(f"/proc/{peer}/stat").read_text()  # noqa: ASYNC240
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                break  # dead, waiting for init to reap it
            await anyio.sleep(0.05)


# ------------------------------------------- the decode side against a prefill peer


async def prefill_source(
    kv_decoder: LLMDataDist, kv_prefill_peer: PeerProcess
) -> tuple[Cache, str]:
    """A destination cache here and the prefill's seeded source "src": (dst, its sha)."""
    dst = kv_decoder.cache_manager.allocate_cache(DESC)
    src = await kv_prefill_peer.alloc("src", 2 * LAYERS, TENSOR, seed=11)
    return dst, str(src["sha"])


async def test_the_decode_side_sees_a_prefill_peers_paced_layers(
    kv_decoder: LLMDataDist, kv_prefill_peer: PeerProcess
) -> None:
    """Layer by layer, 20 ms apart, each push tagged: notifications() names
    every layer from cluster 1 in order, wait_for_layers returns, the bytes
    are the prefill's."""
    dst, want = await prefill_source(kv_decoder, kv_prefill_peer)
    cm = kv_decoder.cache_manager
    seen: list[int] = []
    async with cm.notifications() as notes:
        await kv_prefill_peer.push_layers("src", 2, dst.cache_id, "req-1", every_ms=20)
        with anyio.fail_after(20):
            async for note in notes:
                assert (note.tag, note.src_cluster_id, note.cache_id) == ("req-1", 1, dst.cache_id)
                seen.append(note.layer)
                if len(seen) == LAYERS:
                    break
    assert seen == list(range(LAYERS))
    await cm.wait_for_layers("req-1", range(LAYERS), timeout=10, src_cluster_id=1)
    assert sha(dst) == want
    joined = await kv_prefill_peer.join_layers("req-1")
    assert set(joined["layers"].values()) == {"LLM_SUCCESS"}, joined


async def test_a_prefill_peer_frozen_mid_layer_then_thawed(
    kv_decoder: LLMDataDist, kv_prefill_peer: PeerProcess
) -> None:
    """Frozen once layer 2's jobs are submitted: layers 0-1 land, no layer
    after 2 can, a wait for all of them times out naming what landed; thawed,
    the rest land and the bytes are the prefill's."""
    dst, want = await prefill_source(kv_decoder, kv_prefill_peer)
    cm = kv_decoder.cache_manager
    await kv_prefill_peer.push_layers("src", 2, dst.cache_id, "req-2", freeze_at=2)
    with anyio.fail_after(10):
        while not await kv_prefill_peer.frozen():  # noqa: ASYNC110 (another process's state)
            await anyio.sleep(0.01)
    with pytest.raises(LLMException) as err:
        await cm.wait_for_layers("req-2", range(LAYERS), timeout=0.5)
    assert err.value.status_code == S.LLM_TIMEOUT
    assert {0, 1} <= set(err.value.landed) <= {0, 1, 2}, err.value.landed
    kv_prefill_peer.thaw()
    await cm.wait_for_layers("req-2", range(LAYERS), timeout=10)
    assert sha(dst) == want
    joined = await kv_prefill_peer.join_layers("req-2")
    assert set(joined["layers"].values()) == {"LLM_SUCCESS"}, joined
    assert isinstance(joined["froze_mid_layer"], bool)


async def test_a_prefill_peer_that_stops_after_two_layers_or_dies(
    kv_decoder: LLMDataDist, kv_prefill_peer: PeerProcess
) -> None:
    """stop_after: two layers land and no more; killed mid-stream, the
    decode side's wait ends by its timeout, and the decoder serves on."""
    dst, _ = await prefill_source(kv_decoder, kv_prefill_peer)
    cm = kv_decoder.cache_manager
    await kv_prefill_peer.push_layers("src", 2, dst.cache_id, "req-3", stop_after=2)
    joined = await kv_prefill_peer.join_layers("req-3")
    assert joined["layers"] == {"0": "LLM_SUCCESS", "1": "LLM_SUCCESS"}, joined
    with pytest.raises(LLMException) as err:
        await cm.wait_for_layers("req-3", range(3), timeout=0.3)
    assert set(err.value.landed) == {0, 1}  # a wait that returns would drop the record
    await kv_prefill_peer.push_layers("src", 2, dst.cache_id, "req-4", every_ms=200)
    await cm.wait_for_layers("req-4", range(1), timeout=10)
    await kv_prefill_peer.kill()
    with pytest.raises(LLMException) as err:
        await cm.wait_for_layers("req-4", range(LAYERS), timeout=1)
    assert err.value.status_code == S.LLM_TIMEOUT
    assert kv_decoder.cache_manager.stats()["live_jobs"] == 0


async def test_cancel_scope_and_fail_after_mid_push_are_quiescent(transport: str) -> None:
    # A 64 KiB window and no direct copies: a 64 MiB push is long enough to
    # be cut mid-way, on either transport.
    pr = await make_pair(transport, max_inflight_bytes=64 * 1024, direct_copy=False)
    try:
        big = CacheDesc(2, [1, 32 << 20], DataType.DT_UINT8, Placement.HOST)
        src = pr.p.allocate_cache(big)
        dst = pr.d.allocate_cache(big)
        fill(src, 4)
        key = CacheKeyByIdAndIndex(2, dst.cache_id)
        await pr.p.push_cache(key, src, src_layer_range=range(1), tensor_num_per_layer=1)
        with anyio.CancelScope() as scope:
            scope.deadline = anyio.current_time() + 0.005
            await pr.p.push_cache(key, src, tensor_num_per_layer=1)
        assert scope.cancelled_caught
        assert pr.p.stats()["live_jobs"] == 0
        await assert_still(dst)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.005):
                await pr.p.push_cache(key, src, tensor_num_per_layer=1)
        assert pr.p.stats()["live_jobs"] == 0
        await assert_still(dst)
        # A shielded scope is not cut: the push completes.
        with anyio.move_on_after(0.005):
            with anyio.CancelScope(shield=True):
                await pr.p.push_cache(key, src, tensor_num_per_layer=1)
        assert np.array_equal(dst.tensors[1], src.tensors[1])
    finally:
        await pr.close()


async def test_finalize_inside_a_cancelled_scope_still_finishes(transport: str) -> None:
    pr = await make_pair(transport)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pr.prompt.finalize()  # runs to its end, then the cancellation
    assert scope.cancelled_caught
    with pytest.raises(LLMException) as ei:
        pr.p.allocate_cache(DESC)
    assert ei.value.status_code == S.LLM_ENGINE_FINALIZED
    await pr.close()


async def test_notifications_iterator_ends_at_finalize(kv_pair: Pair) -> None:
    notes = kv_pair.d.notifications()
    got: list[Any] = []
    first = anyio.Event()

    async def read() -> None:
        async for note in notes:
            got.append(note)
            first.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.lowlevel.checkpoint()
            await kv_pair.p.notify(2, "last")
            await first.wait()
            await kv_pair.decoder.finalize()  # the iterator ends: read() returns
    assert [n.tag for n in got] == ["last"]


@pytest.mark.parametrize(
    "kv_options", [{"max_inflight_bytes": 64 * 1024, "direct_copy": False}], ids=["64k-window"]
)
async def test_a_prefill_peer_left_frozen_mid_layer_passes_its_teardown(
    kv_decoder: LLMDataDist, kv_prefill_peer: PeerProcess
) -> None:
    """The fixture thaws a peer the test left frozen and then holds it to no
    native job live: a test that checks the decode side while the prefill
    is frozen mid-layer, and ends there, passes. (The thawed layer loop goes
    on pushing: health() right after the thaw counted those jobs as left.)"""
    big = 4 << 20  # 8 MiB a layer through a 64 KiB window: the rest takes a while
    dst = kv_decoder.cache_manager.allocate_cache(
        CacheDesc(2 * LAYERS, [1, big], DataType.DT_UINT8, Placement.HOST)
    )
    await kv_prefill_peer.alloc("big", 2 * LAYERS, big, seed=12)
    await kv_prefill_peer.push_layers("big", 2, dst.cache_id, "req-5", freeze_at=0)
    with anyio.fail_after(10):
        while not await kv_prefill_peer.frozen():  # noqa: ASYNC110 (another process's state)
            await anyio.sleep(0.01)
    with pytest.raises(LLMException) as err:
        await kv_decoder.cache_manager.wait_for_layers("req-5", range(LAYERS), timeout=0.3)
    assert err.value.status_code == S.LLM_TIMEOUT


async def test_a_prefill_peer_thawed_before_its_freeze_goes_on(
    kv_decoder: LLMDataDist, kv_prefill_peer: PeerProcess
) -> None:
    """freeze_at k, and the test thaws before the peer reached layer k (it
    let it go on early): the thaw cancels the freeze, every layer lands.
    (Before, the thaw was lost: the peer stopped itself afterwards and stayed
    stopped.)"""
    dst, want = await prefill_source(kv_decoder, kv_prefill_peer)
    cm = kv_decoder.cache_manager
    await kv_prefill_peer.push_layers(
        "src", 2, dst.cache_id, "req-6", every_ms=100, freeze_at=LAYERS - 1
    )
    kv_prefill_peer.thaw()  # layer 0 is on its way; layer 7 is 0.7 s off
    try:
        await cm.wait_for_layers("req-6", range(LAYERS), timeout=5)
    finally:
        frozen = await kv_prefill_peer.frozen()
        kv_prefill_peer.thaw()
        await kv_prefill_peer.join_layers("req-6", timeout=10)
    assert not frozen
    assert sha(dst) == want
