"""A cache's first transfer runs at speed, and a failed transfer says which
deadline ended it and what landed.

* ``aiokvcache.prefault`` (default on): allocate_cache and register_cache
  fault in the cache's pages, and installing a same-host peer's cache maps all
  of it, so the first transfer does not (it was 15-40x slower than the next).
  Checked by what is resident, never by timing.
* A timed-out transfer names its deadline: ``exc.deadline`` is
  ``"timeout=… s"`` (the call's) or ``"sync_kv_timeout=… ms"`` (each layer
  job's), and ``exc.landed`` holds the destination layers that landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache._core.peers import lookups
from aiokvcache.testing import PeerProcess, cluster_info
from support.harness import rss_kb
from support.instances import instance, is_up, link_of, wait_for

MiB = 1 << 20


def u8(tensors: int, nbytes: int) -> kv.CacheDesc:
    return kv.CacheDesc(tensors, [1, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


# ------------------------------------------------------------------ prefault


@pytest.mark.parametrize("prefault", [True, False])
async def test_allocate_cache_faults_its_pages_in(prefault: bool) -> None:
    """With prefault on, the cache is resident once allocate_cache returns
    (its memory committed then); off, it is not until it is written."""
    async with instance("shm", 1, listen=False, prefault=prefault) as dd:
        before = rss_kb(os.getpid())
        cache = dd.cache_manager.allocate_cache(u8(4, 16 * MiB))
        grew = rss_kb(os.getpid()) - before
        if prefault:
            assert grew >= 60 * 1024, f"{grew} KiB resident after allocating 64 MiB"
        else:
            assert grew < 16 * 1024, f"{grew} KiB resident after allocating 64 MiB"
        dd.cache_manager.deallocate_cache(cache)


async def test_register_cache_faults_the_users_pages_in_without_changing_them() -> None:
    """register_cache faults the user's untouched pages in (MADV_POPULATE_WRITE:
    nothing written), and their bytes stay what they were."""
    async with instance("shm", 1, listen=False) as dd:
        buf = np.empty((2, 16 * MiB), np.uint8)  # untouched: not resident yet
        buf[:, :16] = 7  # ... but for a first page with bytes of ours
        before = rss_kb(os.getpid())
        cache = dd.cache_manager.register_cache(u8(2, 16 * MiB), [buf[0], buf[1]])
        grew = rss_kb(os.getpid()) - before
        assert grew >= 30 * 1024, f"{grew} KiB resident after registering 32 MiB"
        assert (buf[:, :16] == 7).all() and not buf[:, 16:].any()
        dd.cache_manager.unregister_cache(cache.cache_id)


async def test_a_same_host_peers_cache_is_mapped_whole_at_its_first_lookup() -> None:
    """Pushing one layer of 16 into a same-host decoder's cache maps all of its
    64 MiB into this process at the lookup (resident here), so the first push
    of every other layer finds its pages mapped already."""
    async with (
        PeerProcess("decoder", "shm") as dec,
        instance("shm", 1, listen=False) as dd,
    ):
        made = await dec.alloc("dst", 32, 2 * MiB)  # 16 layers of (K, V)
        rc, per = await dd.link_clusters([cluster_info(dec.address, 2)], timeout=10_000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        cm = dd.cache_manager
        src = cm.allocate_cache(u8(2, 2 * MiB))
        before = rss_kb(os.getpid())
        key = kv.CacheKeyByIdAndIndex(2, made["cache_id"], 0)
        await cm.push_cache(key, src, dst_layer_range=range(0, 1), timeout=30)
        grew = rss_kb(os.getpid()) - before
        assert grew >= 60 * 1024, f"{grew} KiB resident after the first one-layer push"


async def test_a_same_host_peers_caches_are_mapped_once_the_link_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any push: once our link to a same-host decoder is up, its cache
    is installed here in the background, mapped whole (resident), so the
    first push neither asks for it nor makes its page-table entries."""
    async with (
        PeerProcess("decoder", "shm") as dec,
        instance("shm", 1, listen=False) as dd,
    ):
        made = await dec.alloc("dst", 32, 2 * MiB)
        before = rss_kb(os.getpid())
        rc, per = await dd.link_clusters([cluster_info(dec.address, 2)], timeout=10_000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        link = link_of(dd, 2)
        assert await wait_for(lambda: made["cache_id"] in link.remote), "not installed ahead"
        grew = rss_kb(os.getpid()) - before
        assert grew >= 60 * 1024, f"{grew} KiB resident after the link"
        asked: list[str] = []
        real_ask = lookups.Lookups._ask

        async def ask(self: Any, link: Any, request: Any) -> Any:
            asked.append(request.op.value)
            return await real_ask(self, link, request)

        monkeypatch.setattr(lookups.Lookups, "_ask", ask)
        cm = dd.cache_manager
        src = cm.allocate_cache(u8(2, 2 * MiB))
        key = kv.CacheKeyByIdAndIndex(2, made["cache_id"], 0)
        await cm.push_cache(key, src, dst_layer_range=range(0, 1), timeout=30)
        assert asked == [], asked


async def test_without_prefault_a_peers_caches_are_looked_up_at_first_use() -> None:
    async with (
        PeerProcess("decoder", "shm") as dec,
        instance("shm", 1, listen=False, prefault=False) as dd,
    ):
        made = await dec.alloc("dst", 2, MiB)
        rc, per = await dd.link_clusters([cluster_info(dec.address, 2)], timeout=10_000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        link = link_of(dd, 2)
        await asyncio.sleep(0.3)
        assert made["cache_id"] not in link.remote
        cm = dd.cache_manager
        key = kv.CacheKeyByIdAndIndex(2, made["cache_id"], 0)
        await cm.push_cache(key, cm.allocate_cache(u8(2, MiB)), timeout=30)
        assert made["cache_id"] in link.remote


@pytest.mark.parametrize("refusal", ["param_invalid", "bad_answer"])
async def test_a_peer_that_will_not_list_its_caches_still_serves_the_first_push(
    refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that refuses ``caches`` (an older one: an unknown request) or
    answers it with metadata that does not check: the link stays, the
    first push looks its cache up as always and lands."""
    from aiokvcache._core.peers import handler

    def refuse(self: Any, link: Any) -> Any:
        raise kv.LLMException("no such request", kv.LLMStatusCode.LLM_PARAM_INVALID)

    async with instance("shm", 2) as dec, instance("shm", 1, listen=False) as dd:
        dst = dec.cache_manager.allocate_cache(u8(2, MiB))
        if refusal == "param_invalid":
            monkeypatch.setattr(handler.PeerHandler, "_served_all", refuse)
        else:
            asked = handler.PeerHandler._serve_lookup

            def lookup(self: Any, link: Any, request: Any) -> Any:
                answer = asked(self, link, request)
                if request.op.value == "caches":  # only that answer is bad: a 1-byte key
                    bad = [
                        {**m, "regions": [{**m["regions"][0], "rkey": b"x"}]}
                        for m in answer["caches"]
                    ]
                    answer = {"caches": bad}
                return answer

            monkeypatch.setattr(handler.PeerHandler, "_serve_lookup", lookup)
        rc, per = await dd.link_clusters([cluster_info(str(dec.listen_address), 2)])
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        await asyncio.sleep(0.3)
        assert dst.cache_id not in link_of(dd, 2).remote
        cm = dd.cache_manager
        src = cm.allocate_cache(u8(2, MiB))
        src.tensors[0].view(np.uint8)[:] = 9
        key = kv.CacheKeyByIdAndIndex(2, dst.cache_id, 0)
        await cm.push_cache(key, src, timeout=30)
        assert (dst.tensors[0].view(np.uint8) == 9).all()
        assert is_up(dd, 2)


async def test_a_cache_installed_ahead_is_retired_when_its_owner_drops_it() -> None:
    """A cache the peer installed ahead (never pushed to) is exposed to it:
    deallocating it asks the peer to drop it, and the peer's next push to it
    is refused (KV_CACHE_NOT_EXIST), not written."""
    async with instance("shm", 2) as dec, instance("shm", 1, listen=False) as dd:
        dst = dec.cache_manager.allocate_cache(u8(2, MiB))
        rc, per = await dd.link_clusters([cluster_info(str(dec.listen_address), 2)])
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        link = link_of(dd, 2)
        assert await wait_for(lambda: dst.cache_id in link.remote)
        dec.cache_manager.deallocate_cache(dst)
        assert await wait_for(lambda: dst.cache_id not in link.remote), "not dropped"
        cm = dd.cache_manager
        key = kv.CacheKeyByIdAndIndex(2, dst.cache_id, 0)
        with pytest.raises(kv.LLMException) as caught:
            await cm.push_cache(key, cm.allocate_cache(u8(2, MiB)), timeout=10)
        assert caught.value.status_code == kv.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


# ------------------------------------------------------------------ deadlines


@contextlib.asynccontextmanager
async def linked_to_a_decoder(
    sync_kv_timeout: int,
) -> AsyncIterator[tuple[PeerProcess, kv.CacheManager, kv.Cache, dict[str, Any]]]:
    """A decoder in a child process (cluster 2, a cache of 8 x 1 MiB, as
    ``made``) linked over tcp from an instance with ``sync_kv_timeout``: the
    decoder, our cache manager and our 8 x 1 MiB source cache."""
    async with (
        PeerProcess("decoder", "tcp") as dec,
        instance("tcp", 1, listen=False, sync_kv_timeout=sync_kv_timeout) as dd,
    ):
        made = await dec.alloc("dst", 8, MiB)
        rc, per = await dd.link_clusters([cluster_info(dec.address, 2)], timeout=10_000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        cm = dd.cache_manager
        yield dec, cm, cm.allocate_cache(u8(8, MiB)), made


async def frozen_push(sync_kv_timeout: int, timeout: float) -> kv.LLMException:
    """Push 4 layers to a decoder over tcp while it is frozen: the error."""
    async with linked_to_a_decoder(sync_kv_timeout) as (dec, cm, src, made):
        key = kv.CacheKeyByIdAndIndex(2, made["cache_id"], 0)
        await cm.push_cache(key, src, timeout=30)  # the lookup done, its keys known
        dec.signal(signal.SIGSTOP)
        try:
            with pytest.raises(kv.LLMTimeoutError) as caught:
                await cm.push_cache(key, src, timeout=timeout)
        finally:
            dec.signal(signal.SIGCONT)
        await asyncio.sleep(0.2)
        return caught.value


async def test_a_layer_jobs_own_deadline_is_named_as_such() -> None:
    """sync_kv_timeout ends the call long before its timeout=: the message and
    ``.deadline`` say it was the per-layer-job deadline, and ``.landed`` is
    the set of layers whose bytes landed (the peer is frozen: none)."""
    exc = await frozen_push(sync_kv_timeout=300, timeout=30)
    assert exc.deadline == "sync_kv_timeout=300 ms", exc
    assert "its sync_kv_timeout of 300 ms per layer job passed" in exc.message, exc
    assert "the call's timeout=30 s had not" in exc.message, exc
    assert exc.landed == frozenset(), exc
    assert exc.message.endswith("landed: no layer"), exc


async def test_the_calls_own_timeout_is_named_as_such() -> None:
    """timeout= ends the call first: ``.deadline`` is ``"timeout=0.5 s"``."""
    exc = await frozen_push(sync_kv_timeout=60_000, timeout=0.5)
    assert exc.deadline == "timeout=0.5 s", exc
    assert "the call's timeout=0.5 s passed" in exc.message, exc
    assert exc.landed == frozenset(), exc


def test_what_landed_is_written_one_way() -> None:
    assert kv.LLMException("x").landed is None and kv.LLMException("x").deadline is None
    from aiokvcache._core.model.errors import landed_text

    assert landed_text([]) == "no layer"
    assert landed_text({3}) == "layer 3"
    assert landed_text([2, 0, 1]) == "layers 0, 1, 2"


async def test_a_failed_waits_error_says_what_landed_and_its_deadline() -> None:
    """wait_for_layers' timeout: ``.landed`` (the awaited layers that arrived)
    and ``.deadline``, as a transfer's."""
    async with instance("shm", 2) as dd:
        with pytest.raises(kv.LLMTimeoutError) as caught:
            await dd.cache_manager.wait_for_layers("nothing", [0, 1], timeout=0.2)
    assert caught.value.landed == frozenset() and caught.value.deadline == "timeout=0.2 s"
    assert "landed: no layer" in caught.value.message


async def test_the_calls_timeout_is_named_when_a_slow_lookup_left_less_than_sync_kv_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """timeout=1.5 s, sync_kv_timeout=1000 ms, a look-up that takes 0.8 s: the
    jobs get the 0.7 s left of the call's timeout, which is what fires, and
    what the error names (it named sync_kv_timeout)."""
    from aiokvcache._core.transfer import transfers as tr

    async with linked_to_a_decoder(1000) as (dec, cm, src, made):
        key = kv.CacheKeyByIdAndIndex(2, made["cache_id"], 0)
        await cm.push_cache(key, src, timeout=30)
        real = tr.Transfers.remote_slot

        async def slow_lookup(self: Any, *a: Any, **k: Any) -> Any:
            found = await real(self, *a, **k)
            dec.signal(signal.SIGSTOP)  # the jobs hang from now on
            await asyncio.sleep(0.8)  # a busy peer's service loop
            return found

        monkeypatch.setattr(tr.Transfers, "remote_slot", slow_lookup)
        try:
            with pytest.raises(kv.LLMTimeoutError) as caught:
                await cm.push_cache(key, src, timeout=1.5)
        finally:
            dec.signal(signal.SIGCONT)
        await asyncio.sleep(0.2)
    assert caught.value.deadline == "timeout=1.5 s", caught.value


class _Ready(kv.LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.parametrize(
    ("sync_ms", "timeout", "named"),
    [(300, 30.0, "sync_kv_timeout=300 ms"), (60_000, 0.5, "timeout=0.5 s")],
)
async def test_transfer_cache_async_errors_say_what_landed_and_their_deadline(
    sync_ms: int, timeout: float, named: str
) -> None:
    """transfer_cache_async's timeouts, either kind, carry ``.deadline`` and
    ``.landed`` as push_cache's do, and a destination cut short does not read
    "ok"."""
    async with linked_to_a_decoder(sync_ms) as (dec, cm, src, made):
        cfg = kv.TransferWithCacheKeyConfig(kv.CacheKeyByIdAndIndex(2, made["cache_id"], 0))
        await (await cm.transfer_cache_async(src, _Ready(), [cfg], timeout=30))  # keys known
        dec.signal(signal.SIGSTOP)
        try:
            task = await cm.transfer_cache_async(src, _Ready(), [cfg], timeout=timeout)
            with pytest.raises(kv.LLMTimeoutError) as caught:
                await task
        finally:
            dec.signal(signal.SIGCONT)
        await asyncio.sleep(0.2)
    exc = caught.value
    assert exc.deadline == named, exc
    assert exc.landed == frozenset(), exc
    assert "): ok (" not in exc.message, exc


async def test_a_peers_pages_it_never_made_are_not_made_here() -> None:
    """A same-host peer that allocated without prefault (its pages not made):
    installing its key maps only the pages it has, never allocating its
    segment here (one 16 MiB layer pushed into its 512 MiB cache used to
    commit all 512 MiB, charged to us)."""

    def shmem_mib() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Shmem:"):
                    return int(line.split()[1]) // 1024
        return 0

    async with (
        instance("shm", 2, prefault=False) as dec,
        instance("shm", 1, listen=False) as pre,
    ):
        rc, per = await pre.link_clusters([cluster_info(dec)], timeout=10_000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        dst = dec.cache_manager.allocate_cache(u8(64, 8 * MiB))  # 512 MiB, no pages yet
        src = pre.cache_manager.allocate_cache(u8(2, 8 * MiB))
        before = shmem_mib()
        key = kv.CacheKeyByIdAndIndex(2, dst.cache_id, 0)
        await pre.cache_manager.push_cache(key, src, dst_layer_range=range(0, 1), timeout=60)
        grew = shmem_mib() - before
    assert grew < 128, f"shared memory grew by {grew} MiB for a 16 MiB push"
