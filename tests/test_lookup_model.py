"""A model of a peer's caches as this side learns them, explored by
hypothesis (stateful testing) over two real in-process instances on shared
memory and over TCP: the owner allocates and deallocates caches, this side links (which
installs the owner's caches in the background, ``Lookups.prefetch_soon``),
unlinks and pushes, in any order, with each background install slowed by a
drawn delay so that look-ups, invalidations and unlinks land in the middle
of them. The promises checked:
* a push to a live cache over a link reports success and its bytes landed;
* a push to a cache the owner deallocated before the push began never
  reports success, nor does a push without a link;
* once the installs are over, the link records no cache the owner retired,
  and the owner quarantined nothing (no peer of it is frozen here).
``AIOKVCACHE_LOOKUP_MODEL_EXAMPLES`` (default 10) sets how many runs.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import aiokvcache as kv
from aiokvcache._core.memory import catalog
from aiokvcache._core.peers import lookups
from aiokvcache.testing import cluster_info, options
from support.instances import link_of, runtime, wait_for

EXAMPLES = int(os.environ.get("AIOKVCACHE_LOOKUP_MODEL_EXAMPLES", "10"))
pytestmark = pytest.mark.timeout(max(300, EXAMPLES * 60))
S = kv.LLMStatusCode
SIZE = 64 << 10


def desc() -> kv.CacheDesc:
    return kv.CacheDesc(2, [1, SIZE], kv.DataType.DT_UINT8, kv.Placement.HOST)


class PeerCaches(RuleBasedStateMachine):
    transport = "shm"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.rng = random.Random(0)
        real = catalog.install_remote

        def slow_install(state: Any, link: Any, meta: Any) -> Any:
            time.sleep(self.rng.choice([0, 0.01, 0.1, 0.2]))
            return real(state, link, meta)

        self.saved = lookups.install_remote
        lookups.install_remote = slow_install
        self.owner = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
        self.me = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
        self.run(self.owner.init(options(self.transport, listen=True)))
        self.run(self.me.init(options(self.transport, listen=False)))
        self.src = self.me.cache_manager.allocate_cache(desc())
        self.live: dict[int, kv.Cache] = {}
        self.dead: list[int] = []
        self.linked = False
        self.fill = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.settle()
            self.run(self.me.finalize())
            self.run(self.owner.finalize())
        finally:
            lookups.install_remote = self.saved
            self.loop.close()
            asyncio.set_event_loop(None)

    @initialize(caches=st.integers(1, 4))
    def start(self, caches: int) -> None:
        """The owner has some caches when this side links."""
        for _ in range(caches):
            self.allocate()
        self.link()

    @precondition(lambda self: len(self.live) < 6)
    @rule()
    def allocate(self) -> None:
        cache = self.owner.cache_manager.allocate_cache(desc())
        self.live[cache.cache_id] = cache

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.live)))
        self.owner.cache_manager.deallocate_cache(self.live.pop(cid))
        self.dead.append(cid)

    @precondition(lambda self: not self.linked)
    @rule()
    def link(self) -> None:
        address = str(self.owner.listen_address)
        rc, per = self.run(self.me.link_clusters([cluster_info(address, 2)], timeout=10_000))
        assert rc == S.LLM_SUCCESS, per
        self.linked = True

    @precondition(lambda self: self.linked)
    @rule()
    def unlink(self) -> None:
        address = str(self.owner.listen_address)
        rc, per = self.run(self.me.unlink_clusters([cluster_info(address, 2)], timeout=10_000))
        assert rc == S.LLM_SUCCESS, per
        self.linked = False

    @precondition(lambda self: self.live or self.dead)
    @rule(data=st.data())
    def push(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted([*self.live, *self.dead])))
        self.fill = self.fill % 250 + 1
        for t in self.src.tensors:
            t.view(np.uint8)[...] = self.fill
        key = kv.CacheKeyByIdAndIndex(2, cid, 0)
        try:
            self.run(self.me.cache_manager.push_cache(key, self.src, timeout=10))
        except kv.LLMException as exc:
            assert cid not in self.live or not self.linked, f"a push to live cache {cid}: {exc}"
            event(f"a push refused: {exc.status_code.name}")
            return
        event("a push landed")
        assert self.linked, f"a push to cache {cid} succeeded without a link"
        assert cid in self.live, f"a push to cache {cid}, deallocated before it, succeeded"
        for t in self.live[cid].tensors:
            assert (t.view(np.uint8) == self.fill).all(), f"cache {cid} lacks the pushed bytes"

    @rule(seconds=st.sampled_from([0.005, 0.05, 0.15]))
    def wait(self, seconds: float) -> None:
        """Time passes: background installs move on meanwhile."""
        self.run(asyncio.sleep(seconds))

    @rule()
    def settle(self) -> None:
        """The background installs run out; then the link records no retired cache."""
        lk = runtime(self.me).service.lookups

        self.run(wait_for(lambda: not (lk._queued or lk._installing), 30))
        self.run(asyncio.sleep(0.05))  # an invalidate on its way is handled
        assert not (lk._queued or lk._installing), "background installs never ended"
        link = link_of(self.me, 2)
        if self.linked and link is not None:
            st_ = runtime(self.me).state
            with st_.lock:
                recorded = set(link.remote)
            stale = recorded & set(self.dead)
            assert not stale, f"caches the owner retired are still recorded: {sorted(stale)}"

    @invariant()
    def nothing_quarantined(self) -> None:
        assert self.owner.cache_manager.stats()["quarantined_bytes"] == 0


class PeerCachesOverTcp(PeerCaches):
    """The same on one host over TCP: its caches are installed ahead too
    (same host id), but their keys unpack whatever the owner did since."""

    transport = "tcp"


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PeerCaches.TestCase.settings = SETTINGS
PeerCachesOverTcp.TestCase.settings = SETTINGS
test_a_peers_caches_as_we_learn_them = PeerCaches.TestCase
test_a_peers_caches_as_we_learn_them_over_tcp = PeerCachesOverTcp.TestCase
