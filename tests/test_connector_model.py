"""A model of the vLLM connector's push hand-off, explored by hypothesis
(stateful testing): one prefill agent and two decode agents on a virtual
clock (tests/support/connector_sim.py), and every event vLLM and the network
produce, in any order: the prefill engine's steps and layers, its release
(finished or aborted) and preemption; decode loads of the transfer (vLLM's
``n > 1`` children and retries: several at once, on one worker or two), with
the right push key or a wrong one, and their aborts; every message arriving
after a drawn latency (so reordered), some lost, some twice; a side's Python
starved for a while; forged and replayed messages from a third cluster;
pushes landing after a drawn time, failing, or running past their deadline;
a decode's link made anew (restarted with the same cluster id).

The promises checked, after every step and once everything drained:

* a load reported received holds exactly the prefill's KV, every layer;
* nothing is written into a decode's blocks after it gave them back, and no
  push reads a prefill block after the prefill's engine got it back;
* each request is reported exactly once on each side (a load: received,
  failed or aborted; the prefill request: sent);
* no per-request state outlives its request.

``AIOKVCACHE_MODEL_EXAMPLES`` (default 60) sets how many runs; a long run:
``AIOKVCACHE_MODEL_EXAMPLES=3000 python -m pytest tests/test_connector_model.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aiokvcache.integrations.agent.kvlink import TransferAgent
from aiokvcache.integrations.agent.kvtypes import KVLayout, Peer
from aiokvcache.integrations.agent.wire import Cancel, Pushed, PushFail, Reg
from support.connector_sim import (
    Clock,
    Message,
    World,
    advance,
    deliver,
    fields,
    make_agent,
    patch_module_clocks,
    restore_module_clocks,
    virtual_loop,
)

EXAMPLES = int(os.environ.get("AIOKVCACHE_MODEL_EXAMPLES", "60"))
# About 15 ms an example here; a long run gets the time it needs.
pytestmark = pytest.mark.timeout(max(120, EXAMPLES // 20))
LAYERS, BLOCKS, BS = 2, 64, 4
PROMPT = 12  # tokens: 3 blocks
P, D1, D2, EVIL = 11, 22, 33, 44
TIMEOUT, GRACE = 2.0, 1.0
XID = "req@1/0"


def kv(layer: int, i: int) -> tuple[str, int, int]:
    """What the prefill computes into the i-th block of its request, layer ``layer``."""
    return ("kv", layer, i)


class PushHandoff(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.saved_clocks = patch_module_clocks(self.clock)
        self.loop = virtual_loop(self.clock)
        asyncio.set_event_loop(self.loop)
        self.world: World | None = None
        self.agents: dict[int, TransferAgent] = {}
        self.reports: dict[int, list[tuple[str, str]]] = {}
        # The prefill engine: its request's steps, each saving every layer in turn.
        self.p_blocks = [1, 2, 3]
        self.p_end = 0  # tokens computed (all layers)
        self.p_step_end: int | None = None  # the step being computed
        self.p_layer = 0  # its next layer to save
        self.p_released = False
        self.p_preempted = 0
        # The decode loads: id -> (cluster, its blocks, good key).
        self.loads: dict[str, tuple[int, list[int], bool]] = {}
        self.next_block = {D1: 10, D2: 10}
        self.log: list[str] = []  # what was reported when (shown with a failure)

    @initialize(rng=st.randoms(use_true_random=False), prefill_first=st.booleans())
    def start(self, rng: random.Random, prefill_first: bool) -> None:
        """The world, and a first load of the transfer: registered before the
        prefill computes (decode first) or after it finished (prefill first)."""
        layout = KVLayout(LAYERS, 1, BLOCKS, 64, BS, tuple(range(1, LAYERS + 1)), "u8")
        # A plain Random seeded from hypothesis's: teardown draws from it too.
        self.world = World(layout, random.Random(rng.getrandbits(64)), self.loop)
        for c in (P, D1, D2):
            self.agents[c] = make_agent(self.world, c, TIMEOUT, GRACE)
            self.reports[c] = []
            self._watch(c, self.agents[c])
        if prefill_first:
            while not self.p_released:
                self.p_advance(12)
        self.d_load(D1, True)

    @property
    def w(self) -> World:
        assert self.world is not None
        return self.world

    def _watch(self, cluster: int, agent: TransferAgent) -> None:
        res = agent._results
        sent, loaded, failed = res.sent, res.loaded, res.failed

        def on_sent(rid: str) -> None:
            self.reports[cluster].append(("sent", rid))
            self.log.append(f"{self.clock.now - 1000:.2f} cluster {cluster} sent {rid}")
            for b in self.p_blocks:  # back to the engine, reused at once
                self.w.freed.add((cluster, b))
                for layer in range(LAYERS):
                    self.w.memory[cluster, layer, b] = ("reused", b)
            sent(rid)

        def on_loaded(rid: str, *a: Any) -> None:
            self.reports[cluster].append(("loaded", rid))
            self.log.append(f"{self.clock.now - 1000:.2f} cluster {cluster} loaded {rid}")
            self._check_loaded(rid)
            self._give_back(rid)
            loaded(rid, *a)

        def on_failed(rid: str, ids: list[int], reason: str) -> None:
            self.reports[cluster].append(("failed" if reason != "aborted" else "aborted", rid))
            self.log.append(f"{self.clock.now - 1000:.2f} cluster {cluster} {reason} {rid}")
            self._give_back(rid)
            failed(rid, ids, reason)

        res.sent, res.loaded, res.failed = on_sent, on_loaded, on_failed  # type: ignore[method-assign]

    def _check_loaded(self, rid: str) -> None:
        cluster, blocks, _ = self.loads[rid]
        for layer in range(LAYERS):
            for i, b in enumerate(blocks):
                got = self.w.memory.get((cluster, layer, b))
                if got != kv(layer, i):
                    self.w.violations.append(
                        f"load {rid} reported received; layer {layer} block {i} holds {got!r}"
                    )

    def _give_back(self, rid: str) -> None:
        cluster, blocks, _ = self.loads[rid]
        for b in blocks:
            self.w.returned.add((cluster, b))

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the loop, as the agent's own thread would run it."""

        async def inside() -> Any:
            return fn(*args)

        return self.loop.run_until_complete(inside())

    def run(self, seconds: float = 0.0) -> None:
        """Let the loop run (``seconds`` of virtual time pass)."""
        advance(self.loop, self.clock, seconds)

    # ------------------------------------------------------------ the prefill engine

    @precondition(lambda self: not self.p_released)
    @rule(chunk=st.sampled_from([4, 8, 12]))
    def p_advance(self, chunk: int) -> None:
        """The prefill engine's next event: a step begins (``chunk`` tokens),
        a layer of it is saved, or the request finishes."""
        sender = self.agents[P].push_sender
        if self.p_step_end is not None:
            layer = self.p_layer
            for i in range(-(-self.p_step_end // BS)):
                self.w.memory[P, layer, self.p_blocks[i]] = kv(layer, i)
            self.call(sender.layer_saved, [XID], layer)
            self.p_layer += 1
            if self.p_layer == LAYERS:
                self.p_end, self.p_step_end = self.p_step_end, None
        elif self.p_end < PROMPT:
            end = min(PROMPT, self.p_end + chunk)
            self.p_step_end, self.p_layer = end, 0
            blocks = list(self.p_blocks)
            self.call(sender.step, XID, "p-req", blocks, BS, end, end >= PROMPT, None)
        else:
            self.p_finish()
        self.run()

    def p_finish(self) -> None:
        self.p_released = True
        self.call(self.agents[P].push_sender.release, XID, "p-req", False)

    @precondition(lambda self: not self.p_released and self.p_end > 0)
    @rule()
    def p_abort(self) -> None:
        self.p_released = True
        self.call(self.agents[P].push_sender.release, XID, "p-req", True)

    @precondition(lambda self: not self.p_released and self.p_preempted < 2 and self.p_end < PROMPT)
    @rule()
    def p_preempt(self) -> None:
        """vLLM preempts the request: its pushes stop before its blocks are
        reused; it is recomputed from the start in new blocks."""
        self.loop.run_until_complete(self.agents[P].push_sender.preempt([XID]))
        for b in self.p_blocks:
            self.w.freed.add((P, b))
            for layer in range(LAYERS):
                self.w.memory[P, layer, b] = ("reused", b)
        self.p_preempted += 1
        self.p_blocks = [b + 10 * self.p_preempted for b in (1, 2, 3)]
        self.p_end, self.p_step_end, self.p_layer = 0, None, 0

    # ------------------------------------------------------------ the decode side

    @precondition(lambda self: len(self.loads) < 3)
    @rule(cluster=st.sampled_from([D1, D2]), good=st.booleans(), readers=st.sampled_from([1, 2]))
    def d_load(self, cluster: int, good: bool, readers: int = 1) -> None:
        """A decode load of the transfer; ``readers`` 2: it says two decode
        workers register with this prefill worker (a decode of a larger
        tensor-parallel size), so the prefill keeps taking loads until loads
        of two clusters ended (or its reaper closes the transfer)."""
        rid = f"d{len(self.loads)}"
        start = self.next_block[cluster]
        self.next_block[cluster] += 3
        blocks = [start, start + 1, start + 2]
        self.loads[rid] = (cluster, blocks, good)
        key = self.agents[P].push_key(XID) if good else "wrong" * 6
        agent = self.agents[cluster]
        shape = (None, readers, None, None)
        coro = agent.receiver.expect_push(Peer("p", 1, P), XID, blocks, 0, key, shape=shape)
        self.call(agent.receiver.start, rid, blocks, coro)
        self.run()

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def d_abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.loads)))
        cluster = self.loads[rid][0]
        self.call(self.agents[cluster].receiver.cancel, rid)
        self.run()

    @precondition(lambda self: bool(self.loads))
    @rule(cluster=st.sampled_from([D1, D2]))
    def d_restart_link(self, cluster: int) -> None:
        """The decode's link to the prefill is made anew (it restarted with the
        same cluster id, or the link broke and came back)."""
        self.w.links[cluster] = self.w.links.get(cluster, 0) + 1

    # ------------------------------------------------------------ the network, time

    @rule(side=st.sampled_from([P, D1, D2]), seconds=st.sampled_from([0.5, 1.5, 3.0]))
    def starve(self, side: int, seconds: float) -> None:
        """``side``'s Python gets no turn for a while: its messages wait."""
        self.w.paused[side] = self.clock.now + seconds

    @precondition(lambda self: self.world is not None and bool(self.world.seen))
    @rule(data=st.data(), to=st.sampled_from([P, D1, D2]))
    def forge(self, data: st.DataObject, to: int) -> None:
        """A third cluster replays what it saw, rewritten to every message of
        the push protocol."""
        seen = fields(data.draw(st.sampled_from(self.w.seen)))
        xid = str(seen[0]) if seen else XID
        nonce = next((str(f) for f in seen[1:] if isinstance(f, str) and len(f) == 16), "n")
        key = next((f for f in seen if isinstance(f, str) and len(f) == 32), "k" * 32)
        msg = data.draw(
            st.sampled_from(
                [
                    Reg(xid, 0, 1, [[40, 3]], 0, 5.0, nonce, key, "x"),
                    Reg(xid, 0, 1, [], 0, 5.0, nonce, "k" * 32, "x"),
                    Cancel(xid, nonce),
                    Pushed(xid, nonce),
                    PushFail(xid, nonce, "forged"),
                ]
            )
        )
        self.call(deliver, self.agents, Message(EVIL, to, msg.encode()))
        self.run()

    @rule(seconds=st.sampled_from([0.01, 0.3, 1.0, 2.5]))
    def time_passes(self, seconds: float) -> None:
        self.run(seconds)

    # ------------------------------------------------------------ promises

    @invariant()
    def nothing_broke(self) -> None:
        assert not self.w.violations, (self.w.violations, self.log)

    @invariant()
    def each_request_reported_at_most_once(self) -> None:
        for cluster, got in self.reports.items():
            rids = [rid for _, rid in got]
            assert len(rids) == len(set(rids)), f"cluster {cluster} reported twice: {got}"

    def teardown(self) -> None:
        try:
            self._drain()
        finally:
            for agent in self.agents.values():
                for t in list(agent._tasks):
                    t.cancel()
                self.loop.run_until_complete(asyncio.gather(*agent._tasks, return_exceptions=True))
            self.loop.close()
            asyncio.set_event_loop(None)
            restore_module_clocks(self.saved_clocks)

    def _drain(self) -> None:
        """Everything ends: the engine computes and finishes the request, the
        network and the pushes run out, time passes past every deadline; then
        every promise holds and nothing is left."""
        if self.world is None:
            return
        while not self.p_released:  # the engine computes the rest and finishes
            self.p_advance(12)
        self.w.paused.clear()
        self.run(60.0)
        assert not self.w.violations, (self.w.violations, self.log)
        kinds = sorted({k for got in self.reports.values() for k, r in got if r != "p-req"})
        event(f"loads {len(self.loads)}, pushes {len(self.w.pushes)}, reports {kinds}")
        assert not self.w.violations, self.w.violations
        p_got = [rid for _, rid in self.reports[P]]
        assert p_got == ["p-req"], f"the prefill request reported {p_got}"
        for rid, (cluster, _, _) in self.loads.items():
            got = [kind for kind, r in self.reports[cluster] if r == rid]
            assert len(got) == 1, f"load {rid} reported {got}"
        for cluster, agent in self.agents.items():
            assert agent.pending() == 0, (
                f"cluster {cluster} still holds state: push {agent.push_sender.transfers}, "
                f"waits {agent.receiver._waits}"
            )


PushHandoff.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_push_handoff = PushHandoff.TestCase
