"""[ours] ``CacheManager.notify``: a notification that moves no bytes, for
control signals such as "done reading request 7" (the vLLM connector's pull
mode tells the prefill side with it that its blocks may be freed). On asyncio
and trio, over shm and TCP."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiokvcache import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    Notification,
    Placement,
)
from aiokvcache.testing import Pair, fill

pytestmark = pytest.mark.anyio


@pytest.fixture
def pair(kv_pair: Pair) -> Pair:
    """The plugin's linked pair, on the test's backend."""
    return kv_pair


async def _next(it: Any, into: list[Notification]) -> None:
    into.append(await it.__anext__())


async def test_notify_reaches_the_peer_both_ways(pair: Pair) -> None:
    to_d = pair.d.notifications()
    to_p = pair.p.notifications()
    got_d: list[Notification] = []
    got_p: list[Notification] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_next, to_d, got_d)
            tg.start_soon(_next, to_p, got_p)
            await anyio.lowlevel.checkpoint()
            jobs = pair.submitted()
            await pair.p.notify(2, "done:7", timeout=5)
            # Links are symmetric: the listening side notifies back over the same link.
            await pair.d.notify(1, b"\x00back", timeout=5)
    assert got_d == [Notification("done:7", 1, -1, None, -1)]
    assert got_p == [Notification(b"\x00back", 2, -1, None, -1)]
    assert pair.submitted() == jobs + 2
    assert pair.live_jobs() == 0
    # No tag record is left behind: a layer wait on the tag still waits.
    with pytest.raises(LLMTimeoutError):
        await pair.d.wait_for_layers("done:7", [0], timeout=0.05)


async def test_notify_comes_after_the_bytes_pushed_before_it(pair: Pair) -> None:
    desc = CacheDesc(2, [1, 64, 64], DataType.DT_FLOAT16, Placement.HOST)
    dst = pair.d.allocate_cache(desc)
    src = pair.p.allocate_cache(desc)
    fill(src, 5)
    got: list[Notification] = []
    with anyio.fail_after(10):
        async with pair.d.notifications() as seen, anyio.create_task_group() as tg:
            tg.start_soon(_next, seen, got)
            await anyio.lowlevel.checkpoint()
            await pair.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src)
            await pair.p.notify(2, "pushed")
    assert got[0].tag == "pushed"
    for t, s in zip(dst.tensors, src.tensors, strict=True):
        assert np.array_equal(np.asarray(t), np.asarray(s))


async def test_notify_bad_arguments_send_nothing(pair: Pair) -> None:
    jobs = pair.submitted()
    with pytest.raises(TypeError, match="tag"):
        await pair.p.notify(2, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tag"):
        await pair.p.notify(2, 7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tag is too long"):
        await pair.p.notify(2, "x" * 5000)
    with pytest.raises(TypeError, match="cluster_id"):
        await pair.p.notify("2", "t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        await pair.p.notify(2, "t", timeout=-1)
    with pytest.raises(LLMException) as ei:
        await pair.p.notify(9, "t")
    assert ei.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert pair.submitted() == jobs
