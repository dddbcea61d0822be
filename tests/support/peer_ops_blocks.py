"""Ops of the peer program (:mod:`aiokvcache.testing.peer`) for the tests of
blocks caches across processes (tests/test_blocks.py, tests/test_liveness.py).

``decoder TRANSPORT --ops peer_ops_blocks.py --blocks-shape TENSORS BLOCKS
BLOCK_BYTES``: a decoder owning two uint8 blocks caches from the start,
``BlocksCacheKey(2, 0)`` zeroed (cache ``"0"``) and ``BlocksCacheKey(2, 1)``
filled with :func:`blocks_pattern` (cache ``"1"``). ``hash`` also takes
``cache`` (0 or 1), ``tensor`` and ``blocks``: sha256 of those blocks of
that one tensor, in that order.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from aiokvcache import BlocksCacheKey, CacheDesc, DataType, Placement
from aiokvcache.testing.peer import Handler, PeerNode


def blocks_pattern(tensors: int, blocks: int, block_bytes: int) -> np.ndarray:
    """What the ``BlocksCacheKey(2, 1)`` cache holds."""
    rng = np.random.default_rng(99)
    return rng.integers(0, 256, (tensors, blocks, block_bytes), dtype=np.uint8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks-shape", type=int, nargs=3, required=True,
        metavar=("TENSORS", "BLOCKS", "BLOCK_BYTES"), help="the two blocks caches' shape",
    )  # fmt: skip


def register(ops: dict[str, Handler], node: PeerNode) -> None:
    by_name = ops["hash"]

    async def hash_(req: dict[str, Any]) -> dict[str, Any]:
        if "cache" not in req:
            return await by_name(req)
        ids = [int(i) for i in req.get("blocks", [])]
        tensor = node.caches[str(req["cache"])].tensors[int(req["tensor"])]
        return {"sha": hashlib.sha256(tensor[ids].tobytes()).hexdigest()}

    ops["hash"] = hash_


@contextlib.asynccontextmanager
async def start(node: PeerNode) -> AsyncIterator[None]:
    tensors, blocks, block_bytes = node.args.blocks_shape
    desc = CacheDesc(tensors, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
    cm = node.dd.cache_manager
    cluster = node.args.cluster_id
    for model in (0, 1):
        cache = cm.allocate_blocks_cache(desc, BlocksCacheKey(cluster, model))
        node.caches[str(model)] = cache
    src = blocks_pattern(tensors, blocks, block_bytes)
    for t, arr in enumerate(node.caches["1"].tensors):
        arr[...] = src[t]
    yield
