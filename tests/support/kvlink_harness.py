"""A ``TransferAgent`` (the vLLM connector's engine-independent half) driven on
a test's own event loop, its aiokvcache calls replaced by a :class:`Recorder`:
no network, no vLLM. Used by tests/test_kvlink_protocol.py and
tests/test_connector_push.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokvcache.integrations.agent.kvlink import TransferAgent
from aiokvcache.integrations.agent.kvtypes import KVLayout, Peer

LAYERS, BLOCKS, BS = 3, 64, 4
#: The clusters the tests play: the prefill, the decode, a hostile third.
P_ID, D_ID, EVIL = 11, 22, 33
#: Grant keys' expiry the tests use (wall clock, ms): an hour ahead.
UNTIL = int((time.time() + 3600) * 1000)


class Recorder:
    """Stands in for the agent's CacheManager: records what it sends; each test
    decides how long a notification takes and how pushes and pulls end."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list[Any]]] = []
        self.notify_delay: Callable[[list[Any]], float] = lambda msg: 0.0
        self.push: Callable[[int], Awaitable[None]] = self._ok
        self.pull: Callable[[], Awaitable[None]] = self._ok0
        self.pushes: list[tuple[int, int]] = []  # (cluster, layer)

    @staticmethod
    async def _ok(layer: int) -> None:
        await asyncio.sleep(0)

    @staticmethod
    async def _ok0() -> None:
        await asyncio.sleep(0)

    async def notify(self, cluster: int, tag: str, timeout: float | None = None) -> None:
        msg = json.loads(tag)[1:]
        delay = self.notify_delay(msg)
        if delay:
            await asyncio.sleep(delay)
        self.sent.append((cluster, msg))

    async def push_blocks(self, key: Any, cache: Any, src: Any, dst: Any, **kw: Any) -> None:
        layer = kw["src_layer_range"].start
        self.pushes.append((key.prompt_cluster_id, layer))
        await self.push(layer)

    async def pull_blocks(self, *args: Any, **kw: Any) -> None:
        await self.pull()

    def kinds(self, to: int | None = None) -> list[str]:
        return [m[0] for c, m in self.sent if to is None or c == to]


async def make_agent(
    timeout: float = 5.0,
    grace: float = 1.0,
    blocks: int = BLOCKS,
    heads: int = 1,
    total_heads: int = 0,
    windows: tuple[int, ...] = (0,),
) -> tuple[TransferAgent, Recorder]:
    """An agent on the running loop, speaking through a Recorder; every peer
    counts as linked. ``heads``/``total_heads``: a head-major layout;
    ``windows``: its KV cache groups' sliding windows (0: full attention)."""
    addrs = tuple(range(1, LAYERS + 1))
    layout = KVLayout(
        LAYERS, 1, blocks, 64, BS, addrs, "u8", heads=heads, total_heads=total_heads,
        windows=windows,
    )  # fmt: skip
    agent = TransferAgent(1, layout, timeout=timeout, grace=grace)
    rec = Recorder()
    agent.links.cm = rec  # type: ignore[assignment]
    agent.links.cache = object()
    agent._loop = asyncio.get_running_loop()

    async def linked(peer: Peer) -> None:
        return None

    agent.links.link = linked  # type: ignore[method-assign]
    return agent, rec


async def close_agent(agent: TransferAgent) -> None:
    """Cancel what the agent still runs (the tests' loop outlives it)."""
    for t in list(agent._tasks):
        t.cancel()
    await asyncio.gather(*agent._tasks, return_exceptions=True)
    agent.pull_server.stop()


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def reg_args(
    agent: TransferAgent,
    fields: list[Any],
    nonce: str = "n1",
    key: str | None = None,
    layout: str | None = None,
) -> list[Any]:
    """A registration part's fields (``[xid, part, parts, runs, first, ttl]``)
    completed as a decode handed the request's params would send them: load
    ``nonce``, the transfer's push key (or ``key``) and ``agent``'s layout
    digest (or ``layout``)."""
    xid = str(fields[0])
    return [
        *fields,
        nonce,
        agent.push_key(xid) if key is None else key,
        agent.layout.digest(per_rank=True) if layout is None else layout,
    ]


def load_nonce(rec: Recorder, to: int, xid: str) -> str:
    """The nonce of the last load a decode agent registered for ``xid`` with ``to``."""
    regs = [m for c, m in rec.sent if c == to and m[0] == "reg" and m[1] == xid]
    assert regs, f"no registration of {xid} sent to cluster {to}: {rec.sent}"
    return str(regs[-1][7])


def step_all(agent: Any, xid: str = "x", end: int = 12, key: str | None = None) -> None:
    """The engine computes ``xid``'s 12 tokens (3 blocks) in one step, every layer."""
    agent.push_sender.step(xid, "p-req", [1, 2, 3], BS, end, True, key)
    for layer in range(LAYERS):
        agent.push_sender.layer_saved([xid], layer)
