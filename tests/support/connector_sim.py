"""A simulated world for the vLLM connector's agents (tests/test_connector_model.py):
``TransferAgent``s on one event loop with a virtual clock, their aiokvcache
calls replaced by a network the test drives message by message (delivered,
reordered, duplicated, lost, forged) and by pushes it lands, fails or lets
run out, writing into simulated KV memory. Nothing here decides what the
connector should do: it records what happened (writes, reports) for the
test's invariants."""

from __future__ import annotations

import asyncio
import json
import random
import selectors
import time as _real_time
import types
from dataclasses import dataclass, field
from typing import Any

from aiokvcache import LLMException, LLMStatusCode
from aiokvcache.integrations.agent import (
    decode as _decode,
)
from aiokvcache.integrations.agent import (
    links as _links,
)
from aiokvcache.integrations.agent import (
    prefill_pull as _prefill_pull,
)
from aiokvcache.integrations.agent import (
    prefill_push as _prefill_push,
)
from aiokvcache.integrations.agent.kvlink import TransferAgent
from aiokvcache.integrations.agent.kvtypes import KVLayout, Peer
from aiokvcache.integrations.agent.wire import PREFIX, decode

# ------------------------------------------------------------------ virtual time


class Clock:
    """Virtual seconds: the loop's time and the connector's ``time.monotonic``.
    Time moves only up to ``until`` (what the test lets pass)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.until = self.now


class _Selector(selectors.DefaultSelector):
    """A select that never waits: it moves the virtual clock towards the next
    timer instead (the loop asks with that timer's distance), as far as the
    test lets time pass."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if not ready and timeout is not None and timeout > 0:
            c = self.clock
            c.now = max(c.now, min(c.now + timeout, c.until))
        return ready


def virtual_loop(clock: Clock) -> asyncio.AbstractEventLoop:
    loop = asyncio.SelectorEventLoop(_Selector(clock))
    loop.time = lambda: clock.now  # type: ignore[method-assign]
    return loop


def advance(loop: asyncio.AbstractEventLoop, clock: Clock, seconds: float) -> None:
    """Run ``loop``, letting ``seconds`` of virtual time pass (0: only the
    work ready now, and what it makes ready)."""
    clock.until = clock.now + seconds

    async def until_then() -> None:
        # One sleep to the end: the timers due before it run on their way.
        await asyncio.sleep(seconds)
        for _ in range(10):
            await asyncio.sleep(0)

    loop.run_until_complete(until_then())


def patch_module_clocks(clock: Clock) -> list[tuple[Any, Any]]:
    """The connector's modules read ``time.monotonic``: the virtual clock."""
    shim = types.SimpleNamespace(
        monotonic=lambda: clock.now,
        perf_counter=lambda: clock.now,
        time=_real_time.time,
        sleep=_real_time.sleep,
    )
    saved = []
    for mod in (_decode, _links, _prefill_pull, _prefill_push):
        saved.append((mod, mod.time))
        mod.time = shim  # type: ignore[attr-defined]
    return saved


def restore_module_clocks(saved: list[tuple[Any, Any]]) -> None:
    for mod, t in saved:
        mod.time = t


# ------------------------------------------------------------------ the world


@dataclass
class Message:
    src: int
    dst: int
    tag: str
    #: The link it travels on (the sender's link token when it was sent).
    link: Any = None


@dataclass
class PushOp:
    """One push_blocks call of the prefill: it lands (writes), fails or is
    cancelled (then writes or not, as ``writes_on_cancel`` says: a cancelled
    transfer may have moved part of its bytes, never after it ended)."""

    src: int
    dst: int
    src_blocks: list[int]
    dst_blocks: list[int]
    layers: range
    fut: asyncio.Future[None]
    writes_on_cancel: bool
    done: bool = False
    started: float = 0.0


@dataclass
class World:
    """The network and the memory. Each message arrives after a latency drawn
    from ``rng`` (now, soon, late: a starved receiver), may be lost or arrive
    twice, and never before the receiver's loop runs again (``paused``: a
    side whose Python is starved until then). Each push lands after a drawn
    duration, or fails."""

    layout: KVLayout
    rng: random.Random
    loop: asyncio.AbstractEventLoop
    agents: dict[int, TransferAgent] = field(default_factory=dict)
    #: cluster -> virtual time until which its loop handles no message.
    paused: dict[int, float] = field(default_factory=dict)
    sent: int = 0
    pushes: list[PushOp] = field(default_factory=list)
    #: (cluster, layer, block) -> what is in that block.
    memory: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    #: (cluster, block): blocks a decode gave back to its engine (reused).
    returned: set[tuple[int, int]] = field(default_factory=set)
    #: (cluster, block): prefill blocks its engine got back.
    freed: set[tuple[int, int]] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    #: cluster -> its link token (a restart makes a new one).
    links: dict[int, int] = field(default_factory=dict)
    #: Messages seen on the wire (a hostile third cluster replays them).
    seen: list[Message] = field(default_factory=list)

    def latency(self) -> float:
        return self.rng.choice([0.0, 0.0, 0.001, 0.01, 0.1, 0.6, 2.5])

    def send(self, m: Message) -> None:
        m.link = self.links.get(m.src)
        self.sent += 1
        if len(self.seen) < 32:
            self.seen.append(m)
        r = self.rng.random()
        copies = 0 if r < 0.03 else 2 if r < 0.08 else 1  # lost, duplicated
        for _ in range(copies):
            self.loop.call_later(self.latency(), self._arrive, m)

    def _arrive(self, m: Message) -> None:
        until = self.paused.get(m.dst, 0.0)
        if until > self.loop.time():
            self.loop.call_at(until, self._arrive, m)
            return
        deliver(self.agents, m)

    def write(self, op: PushOp) -> None:
        for layer in op.layers:
            for sb, db in zip(op.src_blocks, op.dst_blocks, strict=True):
                if (op.src, sb) in self.freed:
                    self.violations.append(f"push read prefill block {sb} after it was freed")
                if (op.dst, db) in self.returned:
                    self.violations.append(
                        f"push wrote block {db} of cluster {op.dst} after it was given back "
                        f"(at {self.loop.time() - 1000:.2f} s, a push started at "
                        f"{op.started - 1000:.2f} s)"
                    )
                self.memory[op.dst, layer, db] = self.memory.get((op.src, layer, sb))

    def land(self, op: PushOp, ok: bool) -> None:
        """A push's end, as the transport reports it."""
        if op.done or op.fut.done():
            return
        if ok:
            self.write(op)
            op.fut.set_result(None)
        else:
            if op.writes_on_cancel:
                self.write(op)
            op.fut.set_exception(LLMException(LLMStatusCode.LLM_LINK_FAILED, "link failed"))


class SimCM:
    """What an agent's CacheManager does in the world."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me

    async def notify(self, cluster: int, tag: str, timeout: float | None = None) -> None:
        self.world.send(Message(self.me, cluster, tag))

    async def push_blocks(self, key: Any, cache: Any, src: Any, dst: Any, **kw: Any) -> None:
        loop = asyncio.get_running_loop()
        op = PushOp(
            self.me,
            key.prompt_cluster_id,
            list(src),
            list(dst),
            kw["src_layer_range"],
            loop.create_future(),
            self.world.rng.random() < 0.5,
            started=loop.time(),
        )
        self.world.pushes.append(op)
        w = self.world
        takes = w.rng.choice([0.0, 0.001, 0.05, 0.5, 3.0])
        loop.call_later(takes, w.land, op, w.rng.random() < 0.9)
        timeout = kw.get("timeout")
        try:
            await asyncio.wait_for(asyncio.shield(op.fut), timeout)
        except TimeoutError:
            self._end(op, wrote=op.writes_on_cancel)
            raise LLMException(LLMStatusCode.LLM_TIMEOUT, "push timed out") from None
        except asyncio.CancelledError:
            self._end(op, wrote=op.writes_on_cancel)
            raise
        finally:
            op.done = True

    def _end(self, op: PushOp, wrote: bool) -> None:
        if not op.fut.done():
            op.fut.cancel()
        if wrote:
            self.world.write(op)


def make_agent(world: World, cluster: int, timeout: float, grace: float) -> TransferAgent:
    agent = TransferAgent(cluster, world.layout, timeout=timeout, grace=grace)
    loop = world.loop
    world.agents[cluster] = agent
    agent.links.cm = SimCM(world, cluster)  # type: ignore[assignment]
    agent.links.cache = object()
    agent._loop = loop
    world.links.setdefault(cluster, 0)

    async def linked(peer: Peer) -> None:
        return None

    async def quiesce(cluster_id: int) -> None:
        # The peer's engine answers an unlink once its transfers on the link
        # were released: every push between the two ends now, and the link
        # is gone (a later one is another).
        world.links[cluster] = world.links.get(cluster, 0) + 1
        world.links[cluster_id] = world.links.get(cluster_id, 0) + 1
        for op in world.pushes:
            if not op.done and {op.src, op.dst} == {cluster, cluster_id}:
                op.fut.cancel()
        for _ in range(50):
            if all(op.done for op in world.pushes if {op.src, op.dst} == {cluster, cluster_id}):
                return
            await asyncio.sleep(0)

    agent.links.link = linked  # type: ignore[method-assign]
    agent.links.quiesce = quiesce  # type: ignore[method-assign]
    agent.links.current = lambda cid: world.links.get(cid)  # type: ignore[method-assign]
    return agent


def deliver(agents: dict[int, TransferAgent], m: Message) -> None:
    """Hand ``m`` to its destination agent as the link it came on attributes it."""
    agent = agents.get(m.dst)
    if agent is None or not m.tag.startswith(PREFIX):
        return
    try:
        agent._route(m.src, decode(m.tag), m.link)
    except Exception:  # a message that does not decode: dropped (and counted)
        agent.stats["dropped_messages"] += 1


def fields(m: Message) -> list[Any]:
    """A message's fields after its op."""
    return list(json.loads(m.tag)[2:])
