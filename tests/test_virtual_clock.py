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

import time
from typing import Any

import anyio
import pytest
import sniffio

from aiokvcache import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    Placement,
)
from aiokvcache.testing import PeerProcess, fill

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
