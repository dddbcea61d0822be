"""One SGLang scheduler rank's memory and its :class:`RankEngine`, for the
tests of the SGLang backend: NumPy buffers laid out as SGLang's ``KVArgs``
lists them (K of each layer, then V; aux buffers of the given row sizes),
filled from a seed. No SGLang import."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiokvcache.integrations.sglang.engine import Buffers, Peer, RankEngine


class Rank:
    """A rank's buffers (random bytes from ``seed``; aux bytes from
    ``aux_low`` up) and its started engine."""

    def __init__(
        self,
        seed: int,
        transport: str,
        *,
        layers: int,
        pages: int,
        page: int,
        aux_rows: int,
        aux_items: Sequence[int],
        aux_low: int = 0,
        timeout: float = 10.0,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.kv = [rng.integers(0, 256, (pages, page), np.uint8) for _ in range(2 * layers)]
        self.aux = [rng.integers(aux_low, 256, (aux_rows, n), np.uint8) for n in aux_items]
        self.engine = RankEngine(
            Buffers.of([a.ctypes.data for a in self.kv], [a.nbytes for a in self.kv],
                       [page] * len(self.kv)),
            Buffers.of([a.ctypes.data for a in self.aux], [a.nbytes for a in self.aux],
                       list(aux_items)),
            transport=transport,
            timeout=timeout,
        )  # fmt: skip
        self.engine.start()

    @property
    def peer(self) -> Peer:
        host, port = self.engine.address.rsplit(":", 1)
        return Peer(host, int(port), self.engine.cluster_id)

    def run(self, coro: Any, timeout: float = 10) -> Any:
        """``coro`` on the engine's loop."""
        assert self.engine._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.engine._loop).result(timeout)

    def state(self) -> list[np.ndarray]:
        """A copy of every buffer, KV then aux."""
        return [a.copy() for a in (*self.kv, *self.aux)]

    def assert_unchanged(self, before: list[np.ndarray], msg: str = "") -> None:
        for a, b in zip((*self.kv, *self.aux), before, strict=True):
            np.testing.assert_array_equal(a, b, msg)

    def zero(self) -> None:
        for a in (*self.kv, *self.aux):
            a[:] = 0
