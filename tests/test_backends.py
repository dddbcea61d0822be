"""The same awaitables under asyncio and trio: a peer in another process, its
faults (frozen, slowed, killed), cancel scopes and deadlines (a local copy's
worker thread included), notifications iterators, and the loop an instance
belongs to: the clear errors for another one, and runs in several threads.

Every async test runs on both backends (anyio's plugin) and both transports,
with the fixtures of aiokvcache's pytest plugin (``kv_pair``, ``kv_peer``,
``kv_prompt``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import trio

from aiokvcache import (
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    testing,
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


@pytest.mark.timeout(60)
async def test_a_copy_cut_by_a_cancel_scope_has_finished_when_it_raises(kv_pair: Pair) -> None:
    """A local copy runs in a worker thread: a cancel scope that cut it must
    not return while that thread still writes the destination."""
    desc = CacheDesc(4, [1, 64 << 20], DataType.DT_UINT8, Placement.HOST)
    src = kv_pair.p.allocate_cache(desc)
    dst = kv_pair.p.allocate_cache(desc)
    for t in src.tensors:
        t[...] = 5
    with anyio.CancelScope() as scope:
        scope.cancel()  # cancelled before the copy even starts its thread...
        await kv_pair.p.copy_cache(dst, src)
    assert scope.cancelled_caught
    with anyio.move_on_after(0.002) as scope:  # ...and while it runs
        await kv_pair.p.copy_cache(dst, src)
    assert scope.cancelled_caught
    # Returned: the copy is whole and nothing writes any more.
    assert all(int(t[0, -1]) == 5 and int(t[0, 0]) == 5 for t in dst.tensors)
    await assert_still(dst, 0.1)


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


@pytest.mark.timeout(60)
async def test_two_readers_of_one_notifications_iterator_both_end(kv_pair: Pair) -> None:
    """The iterator kept one waiter: a second concurrent reader replaced the
    first one's, which then never woke, not at close() nor at finalize()."""
    notes = kv_pair.d.notifications()
    ended: list[str] = []

    async def read(name: str) -> None:
        async for _ in notes:
            pass
        ended.append(name)

    with anyio.move_on_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, "a")
            tg.start_soon(read, "b")
            await anyio.sleep(0.1)
            notes.close()  # documented: stops it at once
            await anyio.sleep(0.5)
            # finalize() ends every iterator too: still not the first reader.
            await kv_pair.decoder.finalize()
    assert sorted(ended) == ["a", "b"], f"readers that ended: {ended}"


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


# ------------------------------------------- the loop an instance belongs to


def _other_loop(owner: str, fn: Any) -> None:
    """Run ``fn`` (an async function) on the other library, in a thread."""
    thread = threading.Thread(
        target=(lambda: asyncio.run(fn())) if owner == "trio" else (lambda: trio.run(fn))
    )
    thread.start()
    thread.join(30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("owner", ["trio", "asyncio"])
def test_link_clusters_from_another_loop_is_refused_before_it_links(owner: str) -> None:
    """Without the loop check first, the link was made anyway and the call
    failed afterwards with a foreign message."""
    seen: list[BaseException] = []
    linked: list[list[int]] = []

    async def main() -> None:
        dec = LLMDataDist(LLMRole.DECODER, 2)
        pro = LLMDataDist(LLMRole.PROMPT, 1)
        await dec.init(testing.options("shm", listen=True))
        await pro.init(testing.options("shm"))
        try:

            async def misuse() -> None:
                try:
                    await pro.link_clusters([testing.cluster_info(dec)], timeout=3000)
                except BaseException as exc:
                    seen.append(exc)

            await anyio.to_thread.run_sync(_other_loop, owner, misuse)
            await anyio.sleep(1)  # whatever the service thread went on doing
            linked.append(sorted(pro._links))
        finally:
            await pro.finalize()
            await dec.finalize()

    # In a thread of its own: the anyio plugin's loop may run in this one.
    runner = threading.Thread(target=anyio.run, args=(main,), kwargs={"backend": owner})
    runner.start()
    runner.join(50)
    assert seen, "link_clusters from another loop raised nothing"
    assert linked == [[]], f"{seen[0]!r}, and linked anyway: {linked}"
    assert isinstance(seen[0], RuntimeError) and "init()" in str(seen[0]), repr(seen[0])


TWO_RUNS_DESC = CacheDesc(4, [1, 1 << 20], DataType.DT_UINT8, Placement.HOST)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_two_trio_runs_in_two_threads_transfer_between_them(transport: str) -> None:
    """Each instance belongs to its own run: two trio runs of one process,
    one instance each, must not get in each other's way."""
    import queue

    where: queue.Queue[tuple[str, int]] = queue.Queue()
    got: dict[str, Any] = {}

    async def decoder() -> None:
        dec = LLMDataDist(LLMRole.DECODER, 2)
        await dec.init(testing.options(transport, listen=True))
        try:
            dst = dec.cache_manager.allocate_cache(TWO_RUNS_DESC)
            assert dec.listen_address is not None
            where.put((dec.listen_address, dst.cache_id))
            with trio.fail_after(30):
                for i in range(10):
                    await dec.cache_manager.wait_for_layers(f"r{i}", [0, 1], timeout=10)
            got["bytes"] = bytes(dst.tensors[3][0, :4])
        finally:
            await dec.finalize()

    async def prompt() -> None:
        address, cache_id = await trio.to_thread.run_sync(where.get, True, 30)
        pro = LLMDataDist(LLMRole.PROMPT, 1)
        await pro.init(testing.options(transport))
        try:
            await pro.link_clusters([testing.cluster_info(address, 2)], timeout=5000)
            src = pro.cache_manager.allocate_cache(TWO_RUNS_DESC)
            src.tensors[3][...] = 7
            for i in range(10):
                with trio.fail_after(10):
                    key = CacheKeyByIdAndIndex(2, cache_id)
                    await pro.cache_manager.push_cache(key, src, tag=f"r{i}")
            got["live"] = pro.cache_manager.stats()["live_jobs"]
            await trio.sleep(0.3)
        finally:
            await pro.finalize()

    runs = [threading.Thread(target=trio.run, args=(fn,)) for fn in (decoder, prompt)]
    for r in runs:
        r.start()
    for r in runs:
        r.join(60)
    assert got == {"bytes": b"\x07" * 4, "live": 0}, got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_finalize_from_another_asyncio_loop_is_refused_while_the_owner_loop_runs() -> None:
    """Closing from another loop resolved the owner loop's futures from the
    wrong thread and never woke it: its waiting calls hung. The refusal
    changes nothing; the owner's own finalize then ends its waiters."""
    ready = threading.Event()
    owner: dict[str, Any] = {}
    refused = threading.Event()
    ended = threading.Event()

    def run_owner() -> None:
        async def main() -> None:
            dd = LLMDataDist(LLMRole.DECODER, 2)
            await dd.init(testing.options("shm"))
            owner["dd"] = dd
            ready.set()

            async def wait() -> None:
                try:
                    await dd.cache_manager.wait_for_layers("never", [0])
                except LLMException as exc:
                    owner["status"] = exc.status_code.name

            waiter = asyncio.ensure_future(wait())
            await asyncio.to_thread(refused.wait, 20)
            assert not waiter.done()  # the refused finalize changed nothing
            await dd.finalize()
            await waiter
            ended.set()

        asyncio.run(main())

    thread = threading.Thread(target=run_owner, daemon=True)
    thread.start()
    assert ready.wait(20)

    async def finalize() -> None:
        try:
            await owner["dd"].finalize()
        except RuntimeError as exc:
            owner["refusal"] = str(exc)
        refused.set()

    other = threading.Thread(target=lambda: asyncio.run(finalize()))
    other.start()
    other.join(20)
    assert ended.wait(20), owner
    thread.join(5)
    assert "the event loop that ran init()" in owner.get("refusal", ""), owner
    assert owner["status"] == "LLM_ENGINE_FINALIZED"
