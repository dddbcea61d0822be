"""The background install of a same-host peer's caches once a link we made is
up (``Lookups.prefetch_soon``, ``aiokvcache.prefault``) and what it costs the
link, the service loop and the peer that serves them.

Mapping a same-host cache here is bounded per cache (at most 2 GiB of its
pages, design.md "The first transfer": 100-160 ms per 512 MiB on this host,
so up to some 0.4-0.65 s a cache), but the prefetch installs up to 32 of them
one after the other. Where a test needs that cost without gigabytes of shared
memory, ``install_remote`` is slowed by :data:`MAP_S` a cache, blocking the
calling thread as the real mapping does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import aiokvcache as kv
from aiokvcache._core.memory import catalog
from aiokvcache._core.peers import lookups
from aiokvcache._core.peers.retire import RETIRE_TIMEOUT_S
from aiokvcache.testing import PeerProcess, cluster_info, options
from support.instances import instance, link_of, runtime, wait_for

MiB = 1 << 20
#: One 2 GiB cache's mapping on this host (design.md: 100-160 ms per 512 MiB).
MAP_S = 0.4
#: More caches than RETIRE_TIMEOUT_S (5 s) of mappings: 8 s in all.
CACHES = 20


def u8(tensors: int, nbytes: int) -> kv.CacheDesc:
    return kv.CacheDesc(tensors, [1, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


def slow_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every install of a peer's cache costs MAP_S on the calling thread, as
    mapping a 2 GiB same-host cache does (rkey_unpack's prefault)."""
    real = catalog.install_remote

    def install(state: Any, link: Any, meta: Any) -> Any:
        with state.lock:
            known = meta.get("cache_id") in link.remote
        if not known:
            time.sleep(MAP_S)
        return real(state, link, meta)

    monkeypatch.setattr(lookups, "install_remote", install)


def installing(dd: kv.LLMDataDist) -> bool:
    """Whether ``dd``'s background installs are still queued or running."""
    lk = runtime(dd).service.lookups
    return bool(lk._queued or lk._installing)


def exposed_to_a_peer(dd: kv.LLMDataDist, cache_id: int) -> bool:
    st = runtime(dd).state
    with st.lock:
        rec = st.cache_table.caches.get(cache_id)
        return rec is not None and bool(rec.exposed)


@pytest.mark.parametrize("prefault", [True, False])
async def test_a_first_push_right_after_link_waits_only_for_its_own_cache(
    prefault: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of the prefetch is a fast first transfer. A push made right
    after link_clusters must not wait for all of the peer's caches (up to 32
    mappings, each up to 2 GiB) to be installed before its own one is: with
    the prefetch off it costs one mapping (MAP_S), so it must land well
    within a 3 s timeout."""
    slow_installs(monkeypatch)
    async with instance("shm", 2) as dec, instance("shm", 1, listen=False, prefault=prefault) as dd:
        dsts = [dec.cache_manager.allocate_cache(u8(2, 64 << 10)) for _ in range(CACHES)]
        rc, per = await dd.link_clusters([cluster_info(str(dec.listen_address), 2)])
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        cm = dd.cache_manager
        src = cm.allocate_cache(u8(2, 64 << 10))
        key = kv.CacheKeyByIdAndIndex(2, dsts[-1].cache_id, 0)
        start = time.monotonic()
        try:
            await cm.push_cache(key, src, timeout=3)
        finally:
            took = time.monotonic() - start
            await wait_for(lambda: not installing(dd), 20)
        assert took < 3, f"the first push took {took:.1f} s (one mapping is {MAP_S} s)"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("prefault", [True, False])
async def test_a_peer_retiring_a_cache_during_our_prefetch_does_not_cut_us_off(
    prefault: bool, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background installs take CACHES * MAP_S (8 s) in all: each runs in
    a worker thread, so our service loop still answers the peer that
    deallocates one of the caches it just listed (within RETIRE_TIMEOUT_S,
    5 s, or it would cut our link off), and the cache it retired is not
    recorded after (Link.retired), whether its install was queued, under
    way or done. Over TCP on one host the caches are installed ahead too, and
    the retired cache's key still unpacks (over shared memory its segment may
    be gone): only the tombstone keeps it out."""
    slow_installs(monkeypatch)
    async with (
        instance(transport, 2) as dec,
        instance(transport, 1, listen=False, prefault=prefault) as dd,
    ):
        dsts = [dec.cache_manager.allocate_cache(u8(2, 64 << 10)) for _ in range(CACHES)]
        rc, per = await dd.link_clusters([cluster_info(str(dec.listen_address), 2)])
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        if prefault:
            assert await wait_for(lambda: exposed_to_a_peer(dec, dsts[0].cache_id))
        dec.cache_manager.deallocate_cache(dsts[0])
        await wait_for(lambda: not installing(dd), 20)
        await asyncio.sleep(0.5)
        theirs = link_of(dec, 1)
        assert theirs is not None and not theirs.cut_off and not theirs.broken, (
            "the serving side cut off a peer whose service loop was busy installing its caches"
        )
        assert dec.cache_manager.stats()["quarantined_bytes"] == 0
        assert dsts[0].cache_id not in link_of(dd, 2).remote


@pytest.mark.parametrize(
    "prefault",
    [
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="documented limit (design.md, 'The first transfer'): the caches a "
                "same-host initiator installed ahead are exposed to it, so retiring one waits "
                "for its confirmation, and a frozen one is cut off and the memory quarantined",
            ),
        ),
        False,
    ],
)
async def test_deallocating_a_cache_a_frozen_initiator_never_used_frees_its_memory(
    prefault: bool,
) -> None:
    """A same-host initiator that linked and never used our cache, frozen
    when we deallocate it: the cache goes back (freed, not quarantined), as
    it does without the prefetch. With it, the link's ``caches`` request made
    the cache exposed to that peer, so retirement waits RETIRE_TIMEOUT_S for
    a confirmation that cannot come, cuts the peer off and quarantines the
    memory (registered user buffers: kept registered until finalize)."""
    async with (
        instance("shm", 2) as dec,
        PeerProcess("prefill", "shm", options={"prefault": prefault}, lifetime=120) as peer,
    ):
        cm = dec.cache_manager
        dst = cm.allocate_cache(u8(2, MiB))
        ln = await peer.link(str(dec.listen_address), 2)
        assert ln["per"] == ["LLM_SUCCESS"], ln
        if prefault:
            assert await wait_for(lambda: exposed_to_a_peer(dec, dst.cache_id))
        await asyncio.sleep(0.5)  # its install (if any) done
        before = cm.stats()["regions"]
        peer.freeze()
        try:
            cm.deallocate_cache(dst)
            assert await wait_for(
                lambda: cm.stats()["regions"] == before - 1, RETIRE_TIMEOUT_S + 10
            ), "memory not released"
            assert cm.stats()["quarantined_bytes"] == 0, (
                f"a cache the frozen peer never used was quarantined: {cm.stats()}"
            )
        finally:
            peer.thaw()


async def test_finalizing_while_caches_install_ends_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """finalize() while the background installs run (one in a worker thread):
    it returns without waiting for the queue, and nothing is recorded on the
    broken link after."""
    slow_installs(monkeypatch)
    async with instance("shm", 2) as dec:
        for _ in range(CACHES):
            dec.cache_manager.allocate_cache(u8(2, 64 << 10))
        dd = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
        await dd.init(options("shm", listen=False))
        rc, per = await dd.link_clusters([cluster_info(str(dec.listen_address), 2)])
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        link = link_of(dd, 2)
        assert await wait_for(lambda: bool(runtime(dd).service.lookups._installing))
        start = time.monotonic()
        await dd.finalize()
        took = time.monotonic() - start
        assert took < 3 * MAP_S + 2, f"finalize took {took:.1f} s"
        installed = len(link.remote)
        await asyncio.sleep(2 * MAP_S)
        assert len(link.remote) <= installed, "a cache was recorded after finalize"
