"""An instance belongs to the loop (asyncio) or run (trio) that ran its init():
anything else gets a clear error, and the instance goes on working."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from aiokvcache import (
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMRole,
    Placement,
)
from aiokvcache.testing import make_pair, options

DESC = CacheDesc(2, [1, 4096], DataType.DT_UINT8, Placement.HOST)


def test_init_outside_any_event_loop_is_a_clear_error() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    coro = dd.init(options("shm"))
    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        coro.send(None)
    coro.close()


def test_another_trio_run_or_an_asyncio_loop_is_refused() -> None:
    errors: list[str] = []

    async def misuse(dd: LLMDataDist, key: CacheKeyByIdAndIndex, src: Cache) -> None:
        try:
            await dd.cache_manager.push_cache(key, src)
        except RuntimeError as exc:
            errors.append(str(exc))

    async def main() -> None:
        pr = await make_pair("shm")
        try:
            src = pr.p.allocate_cache(DESC)
            dst = pr.d.allocate_cache(DESC)
            key = CacheKeyByIdAndIndex(2, dst.cache_id)
            for other in (
                lambda: trio.run(misuse, pr.prompt, key, src),
                lambda: asyncio.run(misuse(pr.prompt, key, src)),
            ):
                thread = threading.Thread(target=other)
                thread.start()
                await trio.to_thread.run_sync(thread.join)
            await pr.p.push_cache(key, src)  # still fine on its own run
        finally:
            await pr.close()

    trio.run(main)
    assert len(errors) == 2, errors
    assert "another trio loop" in errors[0] and "(trio)" in errors[0]
    assert "not on asyncio" in errors[1]


def test_finalize_from_another_trio_run_is_refused_and_the_owner_still_can() -> None:
    errors: list[str] = []

    async def main() -> None:
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(options("shm"))

        async def other() -> None:
            try:
                await dd.finalize()
            except RuntimeError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=trio.run, args=(other,))
        thread.start()
        await trio.to_thread.run_sync(thread.join)
        dd.cache_manager.allocate_cache(DESC)  # not finalized by the refused call
        await dd.finalize()

    trio.run(main)
    assert len(errors) == 1 and "the trio run that ran init()" in errors[0], errors
