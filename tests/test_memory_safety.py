"""Memory this process released, or a peer took back, is never touched: no
byte of our own abandoned request lands in memory reused after
deallocate_cache, a push that starts after deallocate_cache returned fails
(whenever the peer looked the cache up), local copies hold the memory they
copy (against finalize() and deallocate_cache), two threads releasing one
cache retire it once, and a copy through a peer's shrunk segment fails without
killing the process, whatever SIGBUS handler the application installed.

Peers are in-process instances, or child processes (the peer program with
the ops of ``tests/support/peer_ops_memory.py`` or ``peer_ops_lifetimes.py``,
``rv_victim.py``) where a peer must be frozen, shrink its memory or may
crash. Some tests reach inside a *peer* instance to make it slow (a slow
link set-up, a held retirement); the instance under test is used through
its public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache import testing
from aiokvcache.testing import cluster_info
from support.harness import LIFETIMES, MEMORY, AsyncPeer, mapping_of
from support.instances import instance, link, regions_at_most, runtime, status_of, u8_desc

S = kv.LLMStatusCode
SUPPORT = Path(__file__).parent / "support"
RV_VICTIM = str(SUPPORT / "rv_victim.py")


def memory_peer(role: str, transport: str, cluster_id: int) -> AsyncPeer:
    """The peer program with the memory ops (tests/support/peer_ops_memory.py):
    the LLMConfig default layer deadline, 1 s."""
    args = (f"--cluster-id={cluster_id}", "--sync-kv-timeout=1000")
    return AsyncPeer(role, transport, *args, ops=MEMORY, lifetime=180)


# ------------------------------------------------- retirement


async def test_our_abandoned_pull_does_not_write_memory_reused_after_deallocate() -> None:
    """Over TCP a timed-out pull's jobs count as released while UCX still holds
    its gets: the memory went at once, and the thawed peer's replies landed in
    whatever was allocated there next (docs/api.md 7.6 step 3)."""
    nbytes = 8 << 20
    async with (
        memory_peer("decoder", "tcp", 2) as peer,
        instance("tcp", 1, listen=False) as dd,
    ):
        cm = dd.cache_manager
        assert await link(dd, peer.address, 2) == S.LLM_SUCCESS
        src = await peer.call("alloc", name="src", tensors=2, bytes=nbytes, seed=5)
        key = kv.CacheKeyByIdAndIndex(2, src["cache_id"], 0)
        dst = cm.allocate_cache(u8_desc(2, nbytes))
        await cm.pull_cache(key, dst)  # the peer's metadata is known from here on
        before = cm.stats()["regions"]
        old = set(dst.tensor_addrs)
        peer.signal(signal.SIGSTOP)
        try:
            # Our gets sit in the frozen peer's socket; released after the graces.
            assert await status_of(cm.pull_cache(key, dst, timeout=0.5)) != S.LLM_SUCCESS
            cm.deallocate_cache(dst)
            released = await regions_at_most(cm, before - 1, 2.0)
            reused: kv.Cache | None = None
            if released:
                # Memory that was ours to reuse: a new cache, zeroed.
                reused = cm.allocate_cache(u8_desc(2, nbytes))
                for t in reused.tensors:
                    t[...] = 0
        finally:
            peer.signal(signal.SIGCONT)
        if not released:
            return  # held while our requests into it were outstanding: the promise
        assert reused is not None
        changed = 0
        for _ in range(50):  # the thawed peer answers our gets at once
            await asyncio.sleep(0.1)
            changed = sum(int(np.count_nonzero(t)) for t in reused.tensors)
            if changed:
                break
        same = old & set(reused.tensor_addrs)
        assert changed == 0, (
            f"deallocate_cache released the memory while our own abandoned pull still had gets "
            f"outstanding to the frozen peer; after the thaw {changed} bytes of the peer's cache "
            f"landed in a cache allocated since (same addresses: {bool(same)})"
        )
        assert not same, "memory released with our own gets into it outstanding"


async def test_a_push_after_deallocate_fails_for_a_cache_looked_up_during_link_setup(
    transport: str,
) -> None:
    """A cache looked up before the accepting side had the link's control key
    kept no retirement guard for the link's lifetime: a push after
    deallocate_cache returned still succeeded (docs/api.md 7.6 step 1)."""
    async with instance(transport, 1) as b, instance(transport, 2) as owner:
        prober = runtime(owner).service.prober
        gate = threading.Event()
        real_probe = prober.half

        async def slow_probe(lk: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            await asyncio.to_thread(gate.wait)  # a slow link set-up
            return await real_probe(lk, timeout, nonce)  # type: ignore[no-any-return]

        prober.half = slow_probe
        ocm, bcm = owner.cache_manager, b.cache_manager
        early = ocm.allocate_cache(u8_desc(2, 4096))
        src = bcm.allocate_cache(u8_desc(2, 4096))
        linking = asyncio.ensure_future(owner.link_clusters([cluster_info(b)], timeout=20000))
        try:
            for _ in range(1000):
                if 2 in b._links:
                    break
                await asyncio.sleep(0.01)
            assert 2 in b._links, "the owner's link never reached b"
            first = await status_of(
                bcm.push_cache(kv.CacheKeyByIdAndIndex(2, early.cache_id, 0), src)
            )
            assert first == S.LLM_SUCCESS, first
        finally:
            gate.set()
        rc, _ = await linking
        assert rc == S.LLM_SUCCESS, rc
        late = ocm.allocate_cache(u8_desc(2, 4096))
        late_key = kv.CacheKeyByIdAndIndex(2, late.cache_id, 0)
        assert await status_of(bcm.push_cache(late_key, src)) == S.LLM_SUCCESS
        # The owner's release of the memory is held back by a lease on each
        # cache (what a long copy_cache holds): only the guard can answer.
        st = runtime(owner).state
        with st.lock:
            recs = [st.cache_table.caches[c.cache_id] for c in (early, late)]
        holds = [st.lease((rec,)) for rec in recs]  # as copy_cache does
        early_key = kv.CacheKeyByIdAndIndex(2, early.cache_id, 0)
        try:
            ocm.deallocate_cache(early)
            ocm.deallocate_cache(late)
            # Both calls returned: a push that starts now must fail.
            guarded = await status_of(bcm.push_cache(late_key, src))
            unguarded = await status_of(bcm.push_cache(early_key, src))
        finally:
            for h in holds:
                st.end_lease(h)
        assert guarded == S.LLM_KV_CACHE_NOT_EXIST, guarded
        assert unguarded == S.LLM_KV_CACHE_NOT_EXIST, (
            f"a push that started after deallocate_cache returned ended {unguarded.name}: "
            f"b looked the cache up while the link was being set up, so its record has no "
            f"retirement guard, for the link's lifetime"
        )


async def test_two_threads_deallocating_one_cache_retire_it_once() -> None:
    """deallocate_cache may run on any thread: two that both passed the
    liveness check retired the cache twice (allocated_bytes went negative)."""
    # The barrier in front of LocalCaches.retire forces the interleaving the
    # scheduler may pick (both threads between check and retirement);
    # without it the race shows in about 1 of 40 rounds at a short GIL
    # switch interval. One of the two calls must raise KV_CACHE_NOT_EXIST.
    async with instance("shm", 1, listen=False) as dd:
        cm = dd.cache_manager
        tr = runtime(dd).caches
        real_retire = tr.retire
        barrier = threading.Barrier(2)

        def retire(rec: Any) -> None:  # both threads past the check, then on
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=1.0)
            real_retire(rec)

        tr.retire = retire
        cache = cm.allocate_cache(u8_desc(1, 4096))
        outcomes: list[str] = []

        def release() -> None:
            try:
                cm.deallocate_cache(cache)
                outcomes.append("ok")
            except kv.LLMException as exc:
                outcomes.append(exc.status_code.name)

        threads = [threading.Thread(target=release) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert await regions_at_most(cm, 0, 5.0)
        allocated = cm.stats()["allocated_bytes"]
        assert sorted(outcomes) == ["LLM_KV_CACHE_NOT_EXIST", "ok"], (
            f"two threads deallocating one cache: {outcomes}; allocated_bytes {allocated}"
        )


# ------------------------------------------------- local copies


@pytest.mark.parametrize("attempt", [0, 1])
def test_finalize_during_a_local_copy_does_not_crash(transport: str, attempt: int) -> None:
    """finalize() closed the engine, unmapping every region, without waiting
    for the leases of local copies: the copy thread touched unmapped memory."""
    proc = subprocess.run(
        [sys.executable, RV_VICTIM, transport],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    tail = (proc.stdout + proc.stderr)[-1500:]
    assert proc.returncode == 0, (
        f"finalize() during copy_cache killed the process (rc {proc.returncode}): {tail}"
    )
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert results, tail
    assert json.loads(results[-1][len("RESULT ") :])["copy"] in (
        "LLM_SUCCESS",
        "LLM_ENGINE_FINALIZED",
    )


async def test_a_local_copy_whose_cache_is_deallocated_meanwhile_fails(transport: str) -> None:
    """A copy whose cache was deallocated meanwhile returned normally: it must
    fail with LLM_KV_CACHE_NOT_EXIST (docs/api.md 7.6 step 1)."""
    async with instance(transport, 1, listen=False) as dd:
        cm = dd.cache_manager
        src, dst = cm.allocate_cache(u8_desc(4, 32 << 20)), cm.allocate_cache(u8_desc(4, 32 << 20))
        task = asyncio.ensure_future(cm.copy_cache(dst, src))
        await asyncio.sleep(0)  # the copy holds its lease, its thread is submitted
        assert not task.done()
        cm.deallocate_cache(src)
        outcome = await status_of(task)
        assert outcome == S.LLM_KV_CACHE_NOT_EXIST, (
            f"copy_cache whose source was deallocated during the copy ended {outcome.name}"
        )


# ------------------------------------------------- a peer's shrunk segment


async def test_a_shrunk_segment_does_not_kill_a_process_that_enabled_faulthandler_later() -> None:
    """The SIGBUS guard was installed once, by the first engine: an application
    that enabled faulthandler afterwards replaced it, and a guarded copy through
    a peer's shrunk segment then killed the process."""
    # shm only; the owner allocates from POSIX shared memory (a file it can
    # truncate), as in test_lifetimes.py.
    posix = dict(os.environ, UCX_ALLOC_PRIO="md:posix")
    async with (
        AsyncPeer("decoder", "shm", "--cluster-id=2", ops=LIFETIMES, env=posix) as x,
        memory_peer("prefill", "shm", 1) as us,
    ):
        cache = await x.call("alloc", name="x", tensors=2, bytes=1 << 20, seed=1)
        ln = await us.call("link", address=x.hello["address"], cluster_id=2)
        assert ln["status"] == "LLM_SUCCESS", ln
        await us.call("alloc", name="s", tensors=2, bytes=1 << 20, seed=3)
        first = await us.call("push", cluster_id=2, cache_id=cache["cache_id"], src="s")
        assert first["status"] == "LLM_SUCCESS", first  # mapped now
        assert (await us.call("faulthandler"))["enabled"]
        span = mapping_of(x.pid, cache["addrs"][0])
        os.truncate(f"/proc/{x.pid}/map_files/{span}", 0)
        try:
            res = await us.call(
                "push", cluster_id=2, cache_id=cache["cache_id"], src="s", timeout=3
            )
        except testing.PeerExited as exc:
            pytest.fail(f"a process that enabled faulthandler after init died on the copy: {exc}")
        assert res["status"] not in ("LLM_SUCCESS", "EXCEPTION"), res
