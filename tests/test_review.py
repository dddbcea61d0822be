"""Review of the lifetimes change (43bb274 + 47da2d3): tests that failed on it.

Each test states the promise it holds the code to (docs/design.md,
docs/api.md) and how it fails. Peers are in-process instances, or child
processes (``tests/support/rv_peer.py``, ``rv_victim.py``, and the existing
``lt_peer.py``) where a peer must be frozen, shrink memory or may crash.
Some tests reach inside a *peer* instance to make it slow or hostile (a
slow link set-up, a long local copy, a write through the control-region key
every linked peer is given); the instance under test is used through its
public API.
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
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache import testing
from aiokvcache._loader import native
from aiokvcache.testing import cluster_info
from support.harness import AsyncPeer
from support.instances import instance, runtime

S = kv.LLMStatusCode
SUPPORT = Path(__file__).parent / "support"
RV_PEER = str(SUPPORT / "rv_peer.py")
RV_VICTIM = str(SUPPORT / "rv_victim.py")
LT_PEER = str(SUPPORT / "lt_peer.py")


def u8_desc(tensors: int, nbytes: int) -> kv.CacheDesc:
    return kv.CacheDesc(tensors, [1, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


class Peer(AsyncPeer):
    """A support program as an AsyncPeer (same JSON-lines protocol)."""

    def __init__(self, program: str, *args: str, **kw: Any) -> None:
        super().__init__("rv", *args, **kw)
        self.argv = [sys.executable, program, *args]
        self.mode = Path(program).stem


async def status_of(aw: Any) -> S:
    try:
        await aw
    except kv.LLMException as exc:
        return exc.status_code
    return S.LLM_SUCCESS


async def link(dd: kv.LLMDataDist, target: kv.LLMDataDist | str, cid: int | None = None) -> S:
    rc, _ = await dd.link_clusters([cluster_info(target, cid)], timeout=5000)
    return rc


async def regions_at_most(cm: kv.CacheManager, want: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cm.stats()["regions"] <= want:
            return True
        await asyncio.sleep(0.02)
    return cm.stats()["regions"] <= want


# ====================================================================== 1
# Retirement waits for the links a cache's metadata was served on
# (exposure), and for our own leases: but a lease ends when the engine
# reports its jobs released, and over TCP a job is reported released after
# its graces while UCX still holds its requests (docs/design.md,
# "Cancellation and quiescence"). The endpoint those requests are on is
# never waited for, so the memory is released at once and the frozen
# peer's reply to our own get lands in whatever is mapped there next.
# Promise: docs/api.md 7.6 step 3 "no byte of a peer's transfer lands in
# freed or reused memory"; design.md "Retired memory is never reused while a
# peer could still write into it"; "retirement waits for every
# endpoint that ever ... ran a job on it". (TCP only: a direct copy leaves
# nothing outstanding.)


async def test_our_abandoned_pull_does_not_write_memory_reused_after_deallocate() -> None:
    nbytes = 8 << 20
    async with (
        Peer(RV_PEER, "tcp", "--cluster-id=2") as peer,
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


# ====================================================================== 2
# The retirement guard is taken from the metadata only when the link's
# control-region key is already installed (catalog._parse). On the
# accepting side that key is installed only when the initiator asks for
# probe_back, so a lookup made before (the link exists from on_connected
# on) is cached for the link's lifetime without a guard. Promise: api.md
# 7.6 step 1 "A peer's push or pull that starts after the call returned
# fails with LLM_KV_CACHE_NOT_EXIST, whatever the progress of step 2".
# The owner's step 2 is held back by a lease on the cache (what a long
# copy_cache holds); the control cache shows that the guard answers when
# it is there.


async def test_a_push_after_deallocate_fails_for_a_cache_looked_up_during_link_setup(
    transport: str,
) -> None:
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
        st = runtime(owner).state
        with st.lock:
            recs = [st.registry.caches[c.cache_id] for c in (early, late)]
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


# ====================================================================== 3
# Every linked peer gets a key to our whole control region (probe slots
# and every cache's retirement word) and may write it. design.md: "A late
# or hostile write into it can spoil a probe or a peer's own transfers";
# "What a reachable peer can do": "(not into other memory: every transfer
# is checked against the cache's registered region on both sides)". One
# 8-byte put of a linked peer makes every *other* peer's transfers on a
# live cache fail with KV_CACHE_NOT_EXIST.


@pytest.mark.xfail(
    strict=True,
    reason="documented limit (design.md, 'What a linked peer can do'): a linked peer holds a key "
    "to the whole control region and can spoil probes and other peers' retirement words",
)
async def test_a_linked_peer_cannot_fail_other_peers_transfers_on_a_live_cache(
    transport: str,
) -> None:
    async with (
        instance(transport, 1) as owner,
        instance(transport, 2) as hostile,
        instance(transport, 3) as honest,
    ):
        x = owner.cache_manager.allocate_cache(u8_desc(2, 4096))
        key = kv.CacheKeyByIdAndIndex(1, x.cache_id, 0)
        for dd in (hostile, honest):
            assert await link(dd, owner) == S.LLM_SUCCESS
        mine = honest.cache_manager.allocate_cache(u8_desc(2, 4096))
        theirs = hostile.cache_manager.allocate_cache(u8_desc(2, 4096))
        assert await status_of(honest.cache_manager.push_cache(key, mine)) == S.LLM_SUCCESS
        assert await status_of(hostile.cache_manager.push_cache(key, theirs)) == S.LLM_SUCCESS
        # The hostile peer: 8 zero bytes into the cache's retirement word,
        # with the control-region key its link was given.
        hrt = runtime(hostile)
        lk = hrt.state.links[1]
        _, word_addr, _ = lk.remote[x.cache_id].guard
        zero = np.zeros(8, np.uint8)
        rows = np.array([[zero.ctypes.data, word_addr, 8, lk.ctl_rkey]], np.uint64)
        job = hrt.engine.submit(native.OP_PUT, lk.ep, rows, b"", 2000)
        assert await asyncio.to_thread(hrt.engine.wait_released, [job], 5.0)
        assert len(x.tensors) == 2  # still live at the owner (raises once retired)
        push = await status_of(honest.cache_manager.push_cache(key, mine))
        pull = await status_of(honest.cache_manager.pull_cache(key, mine))
        assert (push, pull) == (S.LLM_SUCCESS, S.LLM_SUCCESS), (
            f"after one 8-byte write by another linked peer into the owner's control region, "
            f"an honest peer's push/pull of a live cache: {push.name}/{pull.name}"
        )


# ====================================================================== 4
# link_clusters cancelled by its caller (asyncio.timeout, task.cancel())
# while the link is being probed: _try_link catches only LLMException, so
# the half-set-up link stays in State.links, never up and never broken,
# and _link_one answers every later link_clusters to that cluster with
# _await_up -> LLM_TIMEOUT, for as long as both processes live.


async def test_a_cancelled_link_clusters_leaves_no_link_that_never_comes_up(
    transport: str,
) -> None:
    async with instance(transport, 1, listen=False) as a, instance(transport, 2) as b:
        handler = runtime(b).service.handler
        gate = threading.Event()
        real = handler.handle_request

        async def slow(conn: Any, op: str, body: dict[str, Any]) -> dict[str, Any]:
            if op == "probe_back":  # a peer slow to check its half of the data path
                await asyncio.to_thread(gate.wait)
            return await real(conn, op, body)  # type: ignore[no-any-return]

        handler.handle_request = slow
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await a.link_clusters([cluster_info(b)], timeout=10000)
        finally:
            gate.set()
        await asyncio.sleep(0.3)  # b finished its probe
        again, _ = await a.link_clusters([cluster_info(b)], timeout=2000)
        assert again in (S.LLM_SUCCESS, S.LLM_ALREADY_LINK), (
            f"link_clusters after a cancelled one: {again.name} (the half-set-up link stays, "
            f"never up: every later call waits for it and times out)"
        )


# ====================================================================== 5
# finalize() marks caches invalid and closes the engine, which unmaps
# every allocated region, without waiting for the leases of local copies
# (copy_cache / copy_blocks / swap_blocks run in a worker thread): the copy
# thread then touches unmapped memory. Promise: design.md "Leases and
# retirement": every use holds a lease and memory is released only after
# leases_over; api.md 6.5 "nothing is written after the call returns".


@pytest.mark.parametrize("attempt", [0, 1])
def test_finalize_during_a_local_copy_does_not_crash(transport: str, attempt: int) -> None:
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


# ====================================================================== 6
# api.md 7.6 step 1: "This manager's own transfers and local copies that
# use the cache are cancelled (copies run to their end) and fail with
# LLM_KV_CACHE_NOT_EXIST." _in_thread returns normally after a copy whose
# cache was deallocated meanwhile.


async def test_a_local_copy_whose_cache_is_deallocated_meanwhile_fails(transport: str) -> None:
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


# ====================================================================== 7
# The SIGBUS guard is installed once, by the first engine, and assumes it
# stays the process's handler. An application that enables faulthandler
# (or any SIGBUS handler) after creating its LLMDataDist replaces it: a
# guarded copy through a shrunk segment then kills the process. design.md
# "Copies through a peer's mapping": "A fault inside a guarded copy jumps
# back out; the job fails with LINK_FAILED ... and the process lives."
# (shm only; the owner allocates from POSIX shared memory, as in
# test_lifetimes.py, so its file can be truncated.)


def _mapping_of(pid: int, addr: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            span = line.split()[0]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return span
    raise AssertionError(f"no mapping holds {addr:#x} in pid {pid}")


async def test_a_shrunk_segment_does_not_kill_a_process_that_enabled_faulthandler_later() -> None:
    posix = dict(os.environ, UCX_ALLOC_PRIO="md:posix")
    async with (
        Peer(LT_PEER, "shm", "--role", "decoder", "--cluster-id", "2", "--listen", env=posix) as x,
        Peer(RV_PEER, "shm", "--cluster-id=1", "--listen=none") as us,
    ):
        cache = await x.call("alloc", name="x", tensors=2, bytes=1 << 20, seed=1)
        ln = await us.call("link", address=x.hello["address"], cluster_id=2)
        assert ln["status"] == "LLM_SUCCESS", ln
        await us.call("alloc", name="s", tensors=2, bytes=1 << 20, seed=3)
        first = await us.call("push", cluster_id=2, cache_id=cache["cache_id"], src="s")
        assert first["status"] == "LLM_SUCCESS", first  # mapped now
        assert (await us.call("faulthandler"))["enabled"]
        span = _mapping_of(x.pid, cache["addrs"][0])
        os.truncate(f"/proc/{x.pid}/map_files/{span}", 0)
        try:
            res = await us.call(
                "push", cluster_id=2, cache_id=cache["cache_id"], src="s", timeout=3
            )
        except testing.PeerExited as exc:
            pytest.fail(f"a process that enabled faulthandler after init died on the copy: {exc}")
        assert res["status"] not in ("LLM_SUCCESS", "EXCEPTION"), res


# ====================================================================== 8
# api.md "Releasing": deallocate_cache & co. "are synchronous and
# thread-safe [ours]: they may run on any thread". Two threads releasing
# the same cache: the liveness check (LocalCaches.local) and the retirement
# (retire_local -> Registry.drop) are two critical sections, so both calls
# can pass the check: both return, the cache is retired twice
# (allocated_bytes is subtracted twice and goes negative; the second
# _release_later fails on mem_release: "background task failed"). One of
# the two must raise KV_CACHE_NOT_EXIST. The test forces the interleaving
# the scheduler may pick (both threads between check and retirement) with a
# barrier in front of LocalCaches.retire; without it the race shows in about
# 1 of 40 rounds at a short GIL switch interval.


async def test_two_threads_deallocating_one_cache_retire_it_once() -> None:
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


# ====================================================================== 9
# design.md "What a reachable peer can do": without auth_token anyone who
# reaches the control port links and "can push into and pull from those
# caches like any peer (not into other memory: every transfer is checked
# against the cache's registered region on both sides)". Over TCP only the
# sender checks (its own engine, against the (base, length) it claims when
# it unpacks the key), and the receiver's UCX applies a put at whatever
# address it names (the same document says so under "Hostile peer
# metadata"). A linked peer that unpacks a served key with another base
# writes memory of ours that is no cache at all. (TCP only: a same-host key
# that maps is checked against its mapping.)


@pytest.mark.xfail(
    strict=True,
    reason="documented limit (design.md, 'What an attacker on the network can still do'): UCX's "
    "TCP transport applies a put at any address it names; only linking is authenticated",
)
async def test_a_linked_peer_cannot_write_memory_outside_the_caches_it_was_served() -> None:
    async with instance("tcp", 1) as owner, instance("tcp", 2) as peer:
        x = owner.cache_manager.allocate_cache(u8_desc(2, 4096))
        private = np.zeros(4096, np.uint8)  # the owner's own memory, no cache
        assert await link(peer, owner) == S.LLM_SUCCESS
        src = peer.cache_manager.allocate_cache(u8_desc(2, 4096))
        key = kv.CacheKeyByIdAndIndex(1, x.cache_id, 0)
        assert await status_of(peer.cache_manager.push_cache(key, src)) == S.LLM_SUCCESS
        prt = runtime(peer)
        lk = prt.state.links[1]
        # The packed key the owner served for x (its metadata's regions[0].rkey).
        packed = runtime(owner).state.registry.caches[x.cache_id].rkeys[0]
        target = int(private.ctypes.data)
        rk = prt.engine.rkey_unpack(lk.ep, packed, target, 8)  # claims another base
        payload = np.full(8, 0xAB, np.uint8)
        rows = np.array([[payload.ctypes.data, target, 8, rk]], np.uint64)
        job = prt.engine.submit(native.OP_PUT, lk.ep, rows, b"", 2000)
        assert await asyncio.to_thread(prt.engine.wait_released, [job], 5.0)
        changed = int(np.count_nonzero(private))
        assert changed == 0, (
            f"a linked peer wrote {changed} bytes of the owner's memory outside any cache "
            f"(with the key served for cache {x.cache_id}, unpacked with another base)"
        )
