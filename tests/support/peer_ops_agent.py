"""Ops of the peer program (:mod:`aiokvcache.testing.peer`) for the fuzzing
of the vLLM connector's messages (tests/test_peer_input_fuzz.py).

``none TRANSPORT --cluster-id N --ops peer_ops_agent.py``: the connector's
``TransferAgent`` over NumPy KV (:func:`agent_layout`), no vLLM; its hello
has the agent's ``address`` and ``cluster_id``. Ops: ``hold`` (P:
``req_id``, ``blocks``, ``seed``, ``lease``: the blocks filled from seed and
held; answers the grant ``key``, ``until_ms``, ``digest``), ``expect_push``
(D: ``req_id``, ``address``, ``cluster_id``, ``xid``, ``blocks``, ``key``),
``results``, ``state`` (``pending``, ``stats``), ``health``
(``loop_errors``: what reached its loop's exception handler,
``service_errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from aiokvcache.testing.peer import PeerNode, service_errors

#: The KV: layers of [blocks, block bytes] uint8, block size 4.
AGENT_LAYERS, AGENT_BLOCKS, AGENT_BLOCK_BYTES, AGENT_BS = 2, 32, 256, 4


def agent_layout(addrs: tuple[int, ...]) -> Any:
    """The KV layout over ``addrs`` (one tensor a layer)."""
    from aiokvcache.integrations.agent.kvtypes import KVLayout

    return KVLayout(AGENT_LAYERS, 1, AGENT_BLOCKS, AGENT_BLOCK_BYTES, AGENT_BS, addrs, "u8")


class Agent:
    """A started TransferAgent over NumPy KV and the errors its loop saw."""

    def __init__(self, cluster_id: int, transport: str) -> None:
        from aiokvcache.integrations.agent.kvlink import TransferAgent

        self.kv = [
            np.zeros((AGENT_BLOCKS, AGENT_BLOCK_BYTES), np.uint8) for _ in range(AGENT_LAYERS)
        ]
        layout = agent_layout(tuple(a.ctypes.data for a in self.kv))
        self.agent = TransferAgent(cluster_id, layout, transport=transport, timeout=5.0, grace=1.0)
        self.errors: list[str] = []

    def start(self) -> str:
        address = self.agent.start()
        loop = self.agent._loop
        assert loop is not None
        loop.call_soon_threadsafe(
            loop.set_exception_handler,
            lambda _l, ctx: self.errors.append(str(ctx.get("message"))[:300]),
        )
        return address

    async def hold(self, req: dict[str, Any]) -> dict[str, Any]:
        # P: a finished request's blocks, filled from seed, held.
        blocks = [int(b) for b in req["blocks"]]
        rng = np.random.default_rng(int(req["seed"]))
        for layer in self.kv:
            layer[blocks] = rng.integers(1, 255, (len(blocks), AGENT_BLOCK_BYTES), np.uint8)
        until_ms = int((time.time() + 3600) * 1000)
        key = self.agent.grant_key(str(req["req_id"]), blocks, until_ms)
        self.agent.hold(str(req["req_id"]), float(req.get("lease", 30)), blocks, until_ms)
        return {"key": key, "until_ms": until_ms, "digest": self.agent.block_digest(blocks)}

    async def expect_push(self, req: dict[str, Any]) -> dict[str, Any]:
        # D: wait for a push transfer from a peer.
        from aiokvcache.integrations.agent.kvtypes import Peer

        host, port = str(req["address"]).rsplit(":", 1)
        peer = Peer(host, int(port), int(req["cluster_id"]))
        self.agent.expect_push(
            str(req["req_id"]), peer, str(req["xid"]), req["blocks"], key=str(req.get("key", ""))
        )
        return {"expecting": True}

    async def results(self, req: dict[str, Any]) -> dict[str, Any]:
        got = self.agent.take_results()
        return {k: sorted(map(str, v)) for k, v in vars(got).items()}

    async def state(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"pending": self.agent.pending(), "stats": dict(self.agent.stats)}

    async def health(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"loop_errors": self.errors, "service_errors": service_errors()}


@contextlib.asynccontextmanager
async def start(node: PeerNode) -> AsyncIterator[None]:
    agent = Agent(node.args.cluster_id, node.args.transport)
    try:
        address = await asyncio.to_thread(agent.start)
        node.hello.update(address=address, cluster_id=agent.agent.cluster_id)
        for op in ("hold", "expect_push", "results", "state", "health"):
            node.ops[op] = getattr(agent, op)
        yield
    finally:
        agent.agent.close()
