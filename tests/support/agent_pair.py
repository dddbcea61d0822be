"""Two vLLM-connector TransferAgents in one process, each with its own loop
thread and NumPy "KV caches" in vLLM's CPU layout, driven from the test's
(synchronous) thread as vLLM's worker drives them (tests/test_kvlink.py,
tests/test_connector_push.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from aiokvcache.integrations.agent.kvlink import TransferAgent, cluster_id_for
from aiokvcache.integrations.agent.kvtypes import KVLayout, Peer
from aiokvcache.integrations.agent.results import TransferResults

LAYERS, BLOCKS, BLOCK_BYTES, BS = 3, 16, 256, 4


class Side:
    """One agent and its KV: ``LAYERS`` arrays of ``blocks`` x ``block_bytes``."""

    def __init__(
        self,
        name: str,
        transport: str,
        *,
        blocks: int = BLOCKS,
        block_bytes: int = BLOCK_BYTES,
        heads: int = 1,
        total_heads: int = 0,
        **kw: float,
    ) -> None:
        """``heads``/``total_heads``: a head-major layout (see ``KVLayout``)."""
        self.kv = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(LAYERS)]
        addrs = tuple(a.ctypes.data for a in self.kv)
        layout = KVLayout(
            LAYERS, 1, blocks, block_bytes, BS, addrs, "u8", heads=heads, total_heads=total_heads
        )
        self.agent = TransferAgent(cluster_id_for(name, 0), layout, transport=transport, **kw)
        host, port = self.agent.start().rsplit(":", 1)
        self.peer = Peer(host, int(port), self.agent.cluster_id)
        self.got = TransferResults()

    def poll(self) -> TransferResults:
        r = self.agent.take_results()
        self.got.finished_sending |= r.finished_sending
        self.got.finished_recving |= r.finished_recving
        self.got.failed_recving |= r.failed_recving
        self.got.invalid_block_ids |= r.invalid_block_ids
        return self.got


def wait_for(cond: object, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def fill(side: Side, blocks: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for layer in side.kv:
        layer[blocks] = rng.integers(1, 255, (len(blocks), layer.shape[1]), np.uint8)


def same(p: Side, pb: list[int], d: Side, db: list[int]) -> bool:
    return all(np.array_equal(pl[pb], dl[db]) for pl, dl in zip(p.kv, d.kv, strict=True))


@contextlib.contextmanager
def agent_pair(
    transport: str, *, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> Iterator[tuple[Side, Side]]:
    """A prefill and a decode :class:`Side` (timeout 5 s, grace 1 s unless
    ``prefill`` / ``decode`` say otherwise), closed at the end."""
    p = Side("prefill", transport, **{"timeout": 5.0, "grace": 1.0, **(prefill or {})})
    try:
        d = Side("decode", transport, **{"timeout": 5.0, "grace": 1.0, **(decode or {})})
        try:
            yield p, d
        finally:
            d.agent.close()
    finally:
        p.agent.close()
