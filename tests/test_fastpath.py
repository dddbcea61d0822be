"""The fast path for small transfers (issue: small transfers at hardware
speed): one native crossing per call, prepared plans, inline same-host
copies, and a progress thread that sleeps when idle.

Timings are benchmarks (``benchmarks/bench_small.py``), never asserted here;
these tests hold the semantics: exact bytes, all-or-nothing submission,
plans that never outlive their caches, and no idle spinning.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from aiokvcache import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
    Placement,
)
from aiokvcache._loader import native
from aiokvcache.testing import Pair, fill
from support.guards import engine_of
from support.harness import threads_cpu_s

S = LLMStatusCode


def desc(tokens: int, layers: int = 4) -> CacheDesc:
    return CacheDesc(2 * layers, [2, tokens, 128], DataType.DT_FLOAT16, Placement.HOST)


@pytest.mark.parametrize("tokens", [8, 512], ids=["2KiB-inline", "128KiB-jobs"])
async def test_small_pushes_and_pulls_move_exact_bytes(
    pair: Pair, transport: str, tokens: int
) -> None:
    dst, src = pair.d.allocate_cache(desc(tokens)), pair.p.allocate_cache(desc(tokens))
    back = pair.p.allocate_cache(desc(tokens))
    for t in dst.tensors:  # allocated memory is not zeroed: make slot 0 known
        t[...] = 0
    fill(src, 3)
    key = CacheKeyByIdAndIndex(2, dst.cache_id, 1)
    before = pair.p.stats()
    for layer in range(4):  # one call per layer, the same shape twice: a plan hit
        for _ in range(2):
            await pair.p.push_cache(
                key, src, src_batch_index=0, src_layer_range=range(layer, layer + 1)
            )
    await pair.p.pull_cache(key, back, batch_index=1)
    after = pair.p.stats()
    for i in range(8):
        want = np.asarray(src.tensors[i])[0]
        assert np.array_equal(np.asarray(dst.tensors[i])[1], want)
        assert not np.asarray(dst.tensors[i])[0].any()
        assert np.array_equal(np.asarray(back.tensors[i])[1], want)
    inline = after["inline_copies"] - before["inline_copies"]
    # Tagless, same host, direct copy, at most 64 KiB: inline; else jobs.
    if transport == "shm" and tokens == 8:
        assert inline == 9 and after["jobs_submitted"] == before["jobs_submitted"]
    else:
        assert inline == 0 and after["jobs_submitted"] > before["jobs_submitted"]


async def test_tagged_small_push_takes_the_job_path_and_notifies(pair: Pair) -> None:
    dst, src = pair.d.allocate_cache(desc(8)), pair.p.allocate_cache(desc(8))
    fill(src, 4)
    key = CacheKeyByIdAndIndex(2, dst.cache_id)
    waiter = asyncio.create_task(pair.d.wait_for_layers("r1", range(4), timeout=10))
    await pair.p.push_cache(key, src, tag="r1")
    await waiter
    assert np.array_equal(np.asarray(dst.tensors[7])[0], np.asarray(src.tensors[7])[0])


async def test_a_plan_never_outlives_its_remote_cache(pair: Pair) -> None:
    dst, src = pair.d.allocate_cache(desc(8)), pair.p.allocate_cache(desc(8))
    key = CacheKeyByIdAndIndex(2, dst.cache_id)
    await pair.p.push_cache(key, src)  # plan built and used
    pair.d.deallocate_cache(dst)
    for _ in range(200):  # the invalidation reaches us on the service thread
        try:
            await pair.p.push_cache(key, src)
        except LLMException as exc:
            assert exc.status_code == S.LLM_KV_CACHE_NOT_EXIST
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("pushes into a deallocated cache kept succeeding")
    new = pair.d.allocate_cache(desc(8))
    fill(src, 5)
    await pair.p.push_cache(CacheKeyByIdAndIndex(2, new.cache_id), src)
    assert np.array_equal(np.asarray(new.tensors[0])[0], np.asarray(src.tensors[0])[0])


async def test_submit_many_is_all_or_nothing(pair: Pair) -> None:
    engine = engine_of(pair.prompt)
    rows = np.zeros((1, 4), np.uint64)
    live = engine.stats()["live_jobs"]
    submitted = engine.stats()["jobs_submitted"]
    with pytest.raises(ValueError, match="get jobs carry no payload"):
        engine.submit_many([(native.OP_PUT, 1, rows, b"", 0), (native.OP_GET, 1, rows, b"x", 0)])
    with pytest.raises(ValueError, match="op must be"):
        engine.submit_many([(native.OP_PUT, 1, rows, b"", 0), (9, 1, rows, b"", 0)])
    assert engine.stats()["live_jobs"] == live
    assert engine.stats()["jobs_submitted"] == submitted
    assert engine.submit_many([]) == []


def test_copy_inline_refuses_what_it_cannot_map() -> None:
    a, b = native.Engine("shm"), native.Engine("shm")
    try:
        region, addr = b.mem_alloc(1 << 16)
        ep = a.connect(b.worker_address, False)
        rkey = a.rkey_unpack(ep, b.rkey_pack(region), addr, 1 << 16)
        src = np.arange(4096, dtype=np.uint8)
        row = np.array([[src.ctypes.data, addr, 4096, rkey]], np.uint64)
        assert a.copy_inline(native.OP_PUT, ep, [row], 1 << 16) == native.INLINE_COPIED
        got = np.frombuffer(native.buffer_from_address(addr, 4096), np.uint8)
        assert np.array_equal(got, src)
        no = native.INLINE_NO
        assert a.copy_inline(native.OP_PUT, ep, [row], 1024) == no  # over the size bound
        past = np.array([[src.ctypes.data, addr + (1 << 16) - 100, 4096, rkey]], np.uint64)
        assert a.copy_inline(native.OP_PUT, ep, [row, past], 1 << 16) == no  # outside: nothing
        assert a.copy_inline(native.OP_PUT, ep + 1, [row], 1 << 16) == no  # another endpoint's key
        a.rkey_release(rkey)
        assert a.copy_inline(native.OP_PUT, ep, [row], 1 << 16) == no  # released: gone
        assert a.stats()["inline_copies"] == 1
    finally:
        a.close()
        b.close()


async def test_progress_thread_sleeps_when_idle(pair: Pair) -> None:
    dst, src = pair.d.allocate_cache(desc(512)), pair.p.allocate_cache(desc(512))
    key = CacheKeyByIdAndIndex(2, dst.cache_id)
    for _ in range(50):  # job-path work, then silence
        await pair.p.push_cache(key, src)
    await asyncio.sleep(0.2)
    cpu0, t0 = threads_cpu_s(), time.monotonic()
    await asyncio.sleep(5.0)
    cpu = threads_cpu_s() - cpu0
    # Two engines' progress threads over 5 idle seconds: wake-ups every
    # 100 ms cost microseconds; one spinning thread would show ~5 s.
    assert cpu < 0.1, (
        f"progress threads used {cpu:.3f} s of CPU in {time.monotonic() - t0:.1f} idle s"
    )


async def test_copy_lanes_option_reaches_the_engine() -> None:
    from aiokvcache import LLMConfig, LLMDataDist, LLMRole
    from aiokvcache.testing import options

    cfg = LLMConfig()
    assert cfg.copy_lanes == 0  # from the core count
    cfg.copy_lanes = 3
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({**options("shm"), **cfg.generate_options()})
        assert engine_of(dd).copy_lanes == 3
    with pytest.raises(ValueError, match="copy_lanes"):
        cfg.copy_lanes = 65


async def test_progress_spin_option_reaches_the_engine() -> None:
    from aiokvcache import LLMConfig, LLMDataDist, LLMRole
    from aiokvcache.testing import options

    cfg = LLMConfig()
    assert cfg.progress_spin_us == 100
    cfg.progress_spin_us = 0
    assert cfg.generate_options()["aiokvcache.progressSpinUs"] == "0"
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({**options("shm"), **cfg.generate_options()})
        assert engine_of(dd).progress_spin_us == 0
    with pytest.raises(ValueError, match="progress_spin_us"):
        cfg.progress_spin_us = 100_001
    with pytest.raises(ValueError, match="progress_spin_us"):
        cfg.progress_spin_us = -1
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        with pytest.raises(LLMException, match="progressSpinUs"):
            await dd.init({**options("shm"), "aiokvcache.progressSpinUs": "fast"})
