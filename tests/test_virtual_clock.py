"""Every ``timeout=`` counts real time, whatever clock the run has.

``trio.testing.MockClock(autojump_threshold=0)`` jumps ahead whenever every
task waits, and a task waiting for a native completion or a peer's answer
waits: a timeout on that clock fired at once (a push with ``timeout=5``
failed "timed out looking up the destination cache" after 0-4 ms). The
library's deadlines and the test kit's waits are real time; a test's own
``trio.sleep`` still jumps. Each test runs on asyncio and on trio under
MockClock, with the plugin's fixtures (a peer process held for 30 virtual s).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sniffio

from aiokvcache import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aiokvcache.testing import PeerProcess, assert_still, fill

pytestmark = pytest.mark.anyio

TENSOR = 64 * 1024
LAYERS = 4
DESC = CacheDesc(2 * LAYERS, [1, TENSOR], DataType.DT_UINT8, Placement.HOST)


@pytest.fixture(params=["asyncio", "trio-mockclock"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "asyncio":
        return "asyncio"
    from trio.testing import MockClock

    return ("trio", {"clock": MockClock(autojump_threshold=0)})


async def test_pushes_with_a_timeout_land_under_a_virtual_clock(
    kv_prompt: LLMDataDist, kv_peer: PeerProcess
) -> None:
    cm = kv_prompt.cache_manager
    dst = await kv_peer.alloc("dst", 2 * LAYERS, TENSOR)
    src = cm.allocate_cache(DESC)
    fill(src, 5)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, dst["cache_id"])
    for round_ in range(3):
        for layer in range(LAYERS):
            await cm.push_cache(
                key, src, src_layer_range=range(layer, layer + 1), tag=f"r{round_}", timeout=5
            )
        got = await kv_peer.wait_for_layers(f"r{round_}", range(LAYERS))
        assert got["status"] == "LLM_SUCCESS", got
    if sniffio.current_async_library() == "trio":
        await anyio.sleep(30)  # virtual: MockClock jumps it, the peer is held 30 s
    assert kv_peer.returncode is None
    await cm.push_cache(key, src, timeout=5)


async def test_a_timeout_fires_after_its_real_time_under_a_virtual_clock(
    kv_prompt: LLMDataDist, kv_peer: PeerProcess
) -> None:
    """Not at once (the virtual clock jumping past it), not never: a push to
    a frozen peer ends LLM_TIMEOUT once its 0.5 s of real time passed."""
    cm = kv_prompt.cache_manager
    dst = await kv_peer.alloc("dst", 2 * LAYERS, TENSOR)
    src = cm.allocate_cache(DESC)
    key = CacheKeyByIdAndIndex(kv_peer.cluster_id, dst["cache_id"])
    await cm.push_cache(key, src, timeout=5)
    other = await kv_peer.alloc("other", 2 * LAYERS, TENSOR)  # a look-up the frozen peer owes
    kv_peer.freeze()
    try:
        start = time.monotonic()
        with pytest.raises(LLMException) as err:
            await cm.push_cache(
                CacheKeyByIdAndIndex(kv_peer.cluster_id, other["cache_id"]), src, timeout=0.5
            )
        took = time.monotonic() - start
    finally:
        kv_peer.thaw()
    assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT, err.value
    assert took >= 0.45, f"timed out after {took:.3f} s of real time, before its 0.5 s"


async def test_wait_for_layers_counts_real_time_under_a_virtual_clock(
    kv_pair: Any,
) -> None:
    """The decode side waits for a peer's layers: real time too."""
    p, d = kv_pair.p, kv_pair.d
    src, dst = p.allocate_cache(DESC), d.allocate_cache(DESC)
    key = CacheKeyByIdAndIndex(2, dst.cache_id)
    start = time.monotonic()
    with pytest.raises(LLMException) as err:
        await d.wait_for_layers("never", range(LAYERS), timeout=0.3)
    assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert time.monotonic() - start >= 0.25
    async with anyio.create_task_group() as tg:

        async def push_later() -> None:
            await anyio.sleep(1)  # virtual under MockClock
            await p.push_cache(key, src, tag="t", timeout=5)

        tg.start_soon(push_later)
        await d.wait_for_layers("t", range(LAYERS), timeout=5)


class _FirstLayerLater(LayerSynchronizer):
    """Layer 0 is ready after 1 s of real time (a worker thread computing it)."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if layer_index == 0:
            await anyio.to_thread.run_sync(time.sleep, 1.0)
        return True


async def test_cache_task_synchronize_counts_real_time_under_a_virtual_clock(
    kv_pair: Any,
) -> None:
    """CacheTask.synchronize(timeout_in_millis) / get_results(...) wait for a
    transfer the native engine moves: real time too (under MockClock,
    ``synchronize(5000)`` once answered LLM_TIMEOUT at once, the task still
    running)."""
    p, d = kv_pair.p, kv_pair.d
    src, dst = p.allocate_cache(DESC), d.allocate_cache(DESC)
    fill(src, 3)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    await (await p.transfer_cache_async(src, _FirstLayerLater(), [cfg], timeout=10))  # keys known
    task = await p.transfer_cache_async(src, _FirstLayerLater(), [cfg], timeout=10)
    start = time.monotonic()
    status = await task.synchronize(5000)
    took = time.monotonic() - start
    if not task.done():
        await task.synchronize()
    assert status == LLMStatusCode.LLM_SUCCESS, (
        f"synchronize(5000) answered {status.name} after {took:.3f} s of real time, "
        f"the task still running"
    )


async def test_assert_still_watches_for_its_real_time_under_a_virtual_clock(
    kv_pair: Any,
) -> None:
    """testing.assert_still(cache, wait) says nothing wrote into the cache for
    ``wait`` seconds: a late write comes from the native engine or a peer,
    which no virtual clock drives, so it watches for ``wait`` real seconds
    (a trio.sleep under MockClock jumped: it watched for 0 s)."""
    cache = kv_pair.d.allocate_cache(DESC)
    start = time.monotonic()
    await assert_still(cache, wait=0.5)
    took = time.monotonic() - start
    assert took >= 0.45, f"assert_still(wait=0.5) watched for {took:.3f} s of real time"


_INFINITE_WAIT = r"""
import math, sys, time
import trio, trio.testing
from aiokvcache.testing import PeerProcess

async def main():
    # No limit on the start-up (anyio's inf), then a 0.5 s call to a frozen peer.
    async with PeerProcess("decoder", "tcp", startup_timeout=math.inf) as peer:
        peer.freeze()
        start = time.monotonic()
        try:
            await peer.call("stats", timeout=0.5)
        except TimeoutError:
            print(f"timed out after {time.monotonic() - start:.2f} s", flush=True)
        finally:
            peer.thaw()

trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a plain test (its child runs trio): once
def test_an_infinite_test_kit_wait_leaves_real_time_deadlines_working() -> None:
    """Under MockClock a test-kit wait given ``math.inf`` (anyio's "no limit":
    PeerProcess(startup_timeout=...), call/health/join_layers(timeout=...),
    close(grace=...)) means no deadline, and the shared real-time timer goes
    on serving the next ones (a 0.5 s call to a frozen peer times out). An
    infinite entry once made its thread die of Condition.wait(inf)."""
    import subprocess
    import sys

    try:
        out = subprocess.run(
            [sys.executable, "-c", _INFINITE_WAIT], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired as exc:
        err = (
            (exc.stderr or b"").decode(errors="replace")
            if isinstance(exc.stderr, bytes)
            else (exc.stderr or "")
        )
        tail = [ln for ln in err.splitlines() if "Error" in ln][-2:]
        raise AssertionError(
            f"call('stats', timeout=0.5) to a frozen peer still waiting after 15 s: {tail}"
        ) from None
    assert "timed out after" in out.stdout, (out.stdout, out.stderr[-2000:])


async def test_ended_waits_leave_no_timer_entries_behind_under_a_virtual_clock(
    kv_pair: Any,
) -> None:
    """A real-time deadline that ended (its call returned) is forgotten: behind
    one wait still pending (a decode loop's wait_for_layers(timeout=600) for
    the whole test), 500 later calls leave a bounded number of entries in
    the shared timer's heap, not one each until its own timeout is due."""
    from aiokvcache._loopside._trio import REAL_TIMER

    d = kv_pair.d
    async with anyio.create_task_group() as tg:
        pending = anyio.CancelScope()

        async def long_wait() -> None:
            with pending, contextlib.suppress(LLMException):
                await d.wait_for_layers("all-test", [0], timeout=600)

        tg.start_soon(long_wait)
        await anyio.lowlevel.checkpoint()
        before = REAL_TIMER.pending()
        for n in range(500):
            with anyio.move_on_after(0.005):  # the test's own wait: virtual under MockClock
                await d.wait_for_layers(f"w{n}", [0], timeout=601)
        grown = REAL_TIMER.pending() - before
        pending.cancel()
    assert grown < 50, f"{grown} ended deadlines still held by the real-time timer thread"
