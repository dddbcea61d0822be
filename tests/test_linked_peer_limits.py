"""What a linked peer can still do to us: the limits docs/design.md documents
("What a linked peer can do", "What an attacker on the network can still
do"), each held by a strict xfail, so that the day one is closed the test
says so.

A linked peer is given a key to our whole control region (probe slots and
every cache's retirement word), and over TCP our UCX applies a put at any
address the peer's unpacked key names. The hostile peer here is an in-process
instance reached inside (its engine submits the put).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache._loader import native
from support.instances import instance, link, runtime, status_of, u8_desc

S = kv.LLMStatusCode


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="documented limit (design.md, 'What a linked peer can do'): a linked peer holds a key "
    "to the whole control region and can spoil probes and other peers' retirement words",
)
async def test_a_linked_peer_cannot_fail_other_peers_transfers_on_a_live_cache(
    transport: str,
) -> None:
    """One 8-byte put by a linked peer into a cache's retirement word makes
    every other peer's transfers on that live cache fail KV_CACHE_NOT_EXIST."""
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
        _, word_addr, _, _ = lk.remote[x.cache_id].guard
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


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="documented limit (design.md, 'What an attacker on the network can still do'): UCX's "
    "TCP transport applies a put at any address it names; only linking is authenticated",
)
async def test_a_linked_peer_cannot_write_memory_outside_the_caches_it_was_served() -> None:
    """Over TCP only the sender checks a transfer against the cache's region:
    a peer that unpacks a served key with another base writes memory of ours
    that is no cache at all. (A same-host key that maps is checked.)"""
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
        packed = runtime(owner).state.cache_table.caches[x.cache_id].rkeys[0]
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
