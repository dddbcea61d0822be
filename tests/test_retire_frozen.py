"""Deallocating while a peer that holds the cache's metadata is frozen, and
the quarantine that follows.

The owner asks the frozen pusher to invalidate; it cannot answer, so the
owner cuts it off. Over TCP the frozen peer may still deliver what it had
sent when it thaws, whatever our side closed, so the memory is quarantined:
its pages go back while the peer is still frozen, its addresses are never
handed out again before finalize (test_lifetimes.py shows late puts landing
there).

The quarantine itself (``Engine.mem_quarantine``) gives back the whole
allocation, ends at the engine's close and at finalize() (a shared-memory
region too), and docs/api.md keeps the case it cannot close (a same-host
peer's CMA write). None of these asserts a timing: polls have generous bounds
only so that a failure cannot hang the run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache import _native as native
from aiokvcache import testing
from aiokvcache._core.peers.retire import RETIRE_TIMEOUT_S
from aiokvcache.testing import options
from support.harness import AsyncPeer

ROOT = Path(__file__).resolve().parent.parent
TENSORS, BYTES = 2, 1 << 20
HUGE = 2 << 20


async def regions_after(dd: kv.LLMDataDist, want: int, seconds: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if dd.cache_manager.stats()["regions"] == want:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


async def test_memory_waits_for_a_frozen_pusher_to_be_cut_off() -> None:
    async with kv.LLMDataDist(kv.LLMRole.DECODER, 2) as owner:
        await owner.init(options("tcp", listen=True))
        cm = owner.cache_manager
        desc = kv.CacheDesc(TENSORS, [1, BYTES], kv.DataType.DT_UINT8, kv.Placement.HOST)
        dst = cm.allocate_cache(desc)
        async with AsyncPeer("prefill", "tcp", lifetime=120) as peer:
            ln = await peer.call(
                "link", address=owner.listen_address, cluster_id=2, timeout_ms=5000
            )
            assert ln["per"] == ["LLM_SUCCESS"], ln
            await peer.call("alloc", name="src", tensors=TENSORS, bytes=BYTES, seed=1)
            res = await peer.call("push", cluster_id=2, cache_id=dst.cache_id, src="src")
            assert res["status"] == "LLM_SUCCESS", res  # the peer holds our metadata now
            before = cm.stats()["regions"]
            peer.signal(signal.SIGSTOP)
            try:
                cm.deallocate_cache(dst)
                # Unconfirmed (frozen), then cut off and quarantined: the
                # pages go back now, the peer still frozen.
                took = await regions_after(owner, before - 1, RETIRE_TIMEOUT_S + 10)
                assert took is not None, "memory not released while the peer is frozen"
                link = owner._links.get(1)
                assert link is None or link.broken, "the frozen peer was not cut off"
                assert cm.stats()["quarantined_bytes"] >= TENSORS * BYTES, cm.stats()
                print(f"quarantined {took:.2f} s after the call")
            finally:
                peer.signal(signal.SIGCONT)


# ------------------------------------------------------------------ the quarantine


def vma_at(addr: int) -> tuple[int, int, str] | None:
    """The /proc/self/maps entry holding ``addr``: (start, end, line)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return lo, hi, line.strip()
    return None


def resident_kib(addr: int, length: int) -> int:
    """Resident KiB of exactly [addr, addr + length) (mincore: per page, so
    neighbouring memory merged into the same mapping does not count)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    npages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * npages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(1 for b in vec if b & 1) * page // 1024


def test_engine_close_unmaps_a_quarantined_shared_region() -> None:
    """The quarantine replaces UCX's sysv allocation with a private mapping:
    close() then failed to shmdt() it, and the mapping outlived the engine."""
    native.ucx_log_take()
    eng = native.Engine("shm")
    try:
        rid, addr = eng.mem_alloc(1 << 20)
        before = vma_at(addr)
        assert before is not None
        eng.mem_quarantine(rid)
        assert eng.stats()["quarantined_bytes"] == 1 << 20
    finally:
        eng.close()
    lines, _ = native.ucx_log_take()
    left = vma_at(addr)
    assert left is None and not lines, f"outlived the engine: {left}; UCX said: {lines}"


async def test_finalize_unmaps_a_quarantined_cache(caplog: pytest.LogCaptureFixture) -> None:
    """The same through the API: a cache quarantined after its peer finalized
    must be unmapped by the owner's finalize(), with nothing logged by UCX."""
    caplog.set_level(logging.WARNING, logger="aiokvcache.ucx")
    pr = await testing.make_pair("shm")
    try:
        desc = kv.CacheDesc(2, [1, 1 << 20], kv.DataType.DT_UINT8, kv.Placement.HOST)
        dst = pr.d.allocate_cache(desc)
        src = pr.p.allocate_cache(desc)
        await pr.p.push_cache(kv.CacheKeyByIdAndIndex(2, dst.cache_id, 0), src, timeout=5)
        addr = dst.tensor_addrs[0]
        await pr.prompt.finalize()
        pr.d.deallocate_cache(dst)
        end = time.monotonic() + 30
        while pr.d.stats()["quarantined_bytes"] == 0 and time.monotonic() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert pr.d.stats()["quarantined_bytes"] >= 2 << 20, pr.d.stats()
        assert vma_at(addr) is not None
        await pr.decoder.finalize()
        bad = [r.getMessage() for r in caplog.records if r.name == "aiokvcache.ucx"]
        left = vma_at(addr)
        assert left is None and not bad, f"outlived finalize(): {left}; UCX said: {bad}"
    finally:
        await pr.close()


def thp_on() -> bool:
    # UCX's 'thp' allocation madvise()s MADV_HUGEPAGE: "madvise" mode is enough.
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not thp_on(), reason="needs transparent huge pages")
def test_quarantine_gives_back_the_whole_allocation() -> None:
    """Over TCP UCX rounds an allocation up to whole huge pages: quarantining
    only the requested length left the last huge page's rest resident."""
    eng = native.Engine("tcp")
    try:
        n = HUGE + 4096
        rid, addr = eng.mem_alloc(n)
        vma = vma_at(addr)
        assert vma is not None
        if addr % HUGE or vma[1] - addr < 2 * HUGE:
            pytest.skip(f"not a huge-page allocation here: {vma}")
        view = np.frombuffer(native.buffer_from_address(addr, n), np.uint8)
        view[:] = 1
        del view
        eng.mem_quarantine(rid)
        left = resident_kib(addr, 2 * HUGE)
        assert left == 0, f"{left} KiB of the quarantined allocation stay resident"
    finally:
        eng.close()


def test_api_doc_keeps_the_cma_exception() -> None:
    """Quarantine does not close a same-host peer's CMA write (process_vm_writev):
    api.md 7.6 must not promise that no late byte lands in freed memory without it."""
    api = (ROOT / "docs" / "api.md").read_text()
    sec = api.split("### 7.6", 1)[1].split("### 7.7", 1)[0]
    design = (ROOT / "docs" / "design.md").read_text()
    assert "process_vm_writev" in design
    assert "process_vm_writev" in sec or "CMA" in sec, (
        "api.md 7.6 claims no late byte lands in freed memory, without the CMA exception"
    )
