"""Review of the quarantine change (Engine.mem_quarantine, LocalCache.unproven).

Each test fails because of a defect found in the review; none asserts a
timing (polls have generous bounds only so a failure cannot hang the run).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache import _native as native
from aiokvcache import testing

ROOT = Path(__file__).resolve().parent.parent
HUGE = 2 << 20


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


def rss_kib(lo: int, hi: int) -> int:
    """Resident KiB of every mapping overlapping [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            m = re.fullmatch(r"([0-9a-f]+)-([0-9a-f]+)", head)
            if m:
                a, b = int(m.group(1), 16), int(m.group(2), 16)
                inside = a < hi and b > lo
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total


# ------------------------------------------------------------------ C++ side
# quarantine_region() replaces UCX's allocation with a private anonymous
# mapping. For UCX's sysv allocation (transport "shm", and "auto", the
# default) ucp_mem_unmap() at close() then calls shmdt() on an address that
# is no longer a sysv attachment: EINVAL, "failed to free", and the
# quarantine mapping is never unmapped -- it outlives the engine.


def test_engine_close_unmaps_a_quarantined_shared_region() -> None:
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
    # The same through the API: a peer that held the cache's metadata
    # finalized (so the owner cuts it off), the cache is quarantined, and
    # the owner's finalize() must end the quarantine.
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
    # Over TCP UCX allocates with its 'thp' method: the length is rounded up
    # to whole huge pages. quarantine_region() replaces only r.len (the
    # requested length), so the rest of the last huge page -- faulted in
    # whole when the cache's last bytes were touched -- stays resident until
    # close(), against "gives its pages back at once".
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


# ------------------------------------------------------------------ docs
# api.md 7.6 dropped the paragraph on the case software cannot close
# (registered memory a same-host peer writes by CMA, process_vm_writev):
# quarantine does not close it either -- a CMA write needs nothing of ours,
# and after finalize() the held buffers are let go. design.md still says so.


def test_api_doc_keeps_the_cma_exception() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    sec = api.split("### 7.6", 1)[1].split("### 7.7", 1)[0]
    design = (ROOT / "docs" / "design.md").read_text()
    assert "process_vm_writev" in design
    assert "process_vm_writev" in sec or "CMA" in sec, (
        "api.md 7.6 claims no late byte lands in freed memory, without the CMA exception"
    )
