"""In-process LLMDataDist instances for tests that reach inside them: one
initialized instance per ``async with``, its private runtime, its links, and a
bounded wait on the running loop; and the small calls such tests make (a byte
cache's descriptor, a link, a call's status)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiokvcache as kv
from aiokvcache import testing


@contextlib.asynccontextmanager
async def instance(
    transport: str, cluster_id: int, listen: bool = True, **extra: Any
) -> AsyncIterator[kv.LLMDataDist]:
    """An initialized in-process LLMDataDist (a listening decoder, or with
    ``listen=False`` a prompt), finalized afterwards."""
    role = kv.LLMRole.DECODER if listen else kv.LLMRole.PROMPT
    dd = kv.LLMDataDist(role, cluster_id)
    await dd.init(testing.options(transport, listen=listen, **extra))
    try:
        yield dd
    finally:
        await dd.finalize()


def runtime(dd: kv.LLMDataDist) -> Any:
    """The private runtime of an initialized in-process instance."""
    rt = dd._rt
    assert rt is not None, "not initialized"
    return rt


def link_of(dd: kv.LLMDataDist, cid: int) -> Any:
    """``dd``'s link to cluster ``cid``, or None."""
    st = runtime(dd).state
    with st.lock:
        return st.links.get(cid)


def is_up(dd: kv.LLMDataDist, cid: int) -> bool:
    """Whether ``dd``'s link to ``cid`` is up and not broken."""
    link = link_of(dd, cid)
    return link is not None and link.up and not link.broken


async def wait_for(pred: Callable[[], bool], limit: float = 10.0) -> bool:
    """Poll ``pred`` until it holds or ``limit`` seconds passed (a bound, not
    an expectation: nothing asserts how long it took)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not pred():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.002)
    return True


async def wait_event(event: threading.Event, limit: float = 10.0) -> bool:
    """:func:`wait_for` a thread's event."""
    return await wait_for(event.is_set, limit)


def u8_desc(tensors: int, nbytes: int) -> kv.CacheDesc:
    """``tensors`` host tensors of ``nbytes`` bytes each."""
    return kv.CacheDesc(tensors, [1, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


async def status_of(aw: Any) -> kv.LLMStatusCode:
    """The status ``aw`` ends with: LLM_SUCCESS, or its LLMException's."""
    try:
        await aw
    except kv.LLMException as exc:
        return exc.status_code
    return kv.LLMStatusCode.LLM_SUCCESS


async def link(
    dd: kv.LLMDataDist, target: kv.LLMDataDist | str, cid: int | None = None
) -> kv.LLMStatusCode:
    """``dd.link_clusters`` to ``target`` (an instance, or an address and ``cid``)."""
    rc, _ = await dd.link_clusters([testing.cluster_info(target, cid)], timeout=5000)
    return rc


async def regions_at_most(cm: kv.CacheManager, want: int, seconds: float) -> bool:
    """Whether ``cm.stats()["regions"]`` falls to ``want`` or below within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cm.stats()["regions"] <= want:
            return True
        await asyncio.sleep(0.02)
    return cm.stats()["regions"] <= want
