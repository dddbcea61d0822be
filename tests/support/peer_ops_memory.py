"""Ops of the peer program (:mod:`aiokvcache.testing.peer`) for
tests/test_memory_safety.py. Loaded after ``peer_ops_transfers.py`` and
``peer_ops_lifetimes.py`` (its ``push``, ``pull`` and ``link``).

* ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed``: 0 by default), in
  place of the built-in one: uint8 tensors of ``[1, bytes]``, random bytes
  from ``seed`` with no zero byte (a write of zeros into them shows);
* ``faulthandler``: ``faulthandler.enable()`` now, as an application may do
  at any time after it created its LLMDataDist.
"""

from __future__ import annotations

import faulthandler as _faulthandler
from typing import Any

import numpy as np

from aiokvcache.testing.peer import Handler, PeerNode, cache_sha


def register(ops: dict[str, Handler], node: PeerNode) -> None:
    alloc = ops["alloc"]

    async def alloc_nonzero(req: dict[str, Any]) -> dict[str, Any]:
        got = await alloc({**req, "seed": None})
        cache = node.caches[str(req["name"])]
        rng = np.random.default_rng(int(req.get("seed") or 0))
        for t in cache.tensors:
            t[...] = rng.integers(1, 256, t.shape, dtype=np.uint8)
        return {**got, "sha": cache_sha(cache)}

    async def faulthandler(req: dict[str, Any]) -> dict[str, Any]:
        _faulthandler.enable()
        return {"enabled": _faulthandler.is_enabled()}

    ops.update(alloc=alloc_nonzero, faulthandler=faulthandler)
