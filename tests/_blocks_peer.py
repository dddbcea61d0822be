"""A decode-side peer process for the cross-process blocks tests.

Usage: python _blocks_peer.py TRANSPORT TENSORS BLOCKS BLOCK_BYTES. Owns two
blocks caches of TENSORS x BLOCKS x BLOCK_BYTES (uint8): BlocksCacheKey(2, 0)
zeroed (pushed into), BlocksCacheKey(2, 1) filled from seed 99 (pulled from).
Prints ``READY ip:port``, then answers one line per stdin command:
``hash MODEL TENSOR ID,ID,...`` → sha256 of those blocks, in that order;
``exit``.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys

import numpy as np

import aiokvcache as kv


def pattern(tensors: int, blocks: int, block_bytes: int) -> np.ndarray:
    rng = np.random.default_rng(99)
    return rng.integers(0, 256, (tensors, blocks, block_bytes), dtype=np.uint8)


async def main() -> None:
    transport = sys.argv[1]
    tensors, blocks, block_bytes = (int(a) for a in sys.argv[2:5])
    cfg = kv.LLMConfig()
    cfg.transport = transport
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.sync_kv_timeout = 60_000
    desc = kv.CacheDesc(tensors, [blocks, block_bytes], kv.DataType.DT_UINT8, kv.Placement.HOST)
    async with kv.LLMDataDist(kv.LLMRole.DECODER, 2) as dd:
        await dd.init(cfg.generate_options())
        cm = dd.cache_manager
        caches = [
            cm.allocate_blocks_cache(desc, kv.BlocksCacheKey(2, 0)),
            cm.allocate_blocks_cache(desc, kv.BlocksCacheKey(2, 1)),
        ]
        src = pattern(tensors, blocks, block_bytes)
        for t, arr in enumerate(caches[1].tensors):
            arr[...] = src[t]
        print(f"READY {dd.listen_address}", flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            words = line.split()
            if not words or words[0] == "exit":
                return
            model, tensor = int(words[1]), int(words[2])
            ids = [int(x) for x in words[3].split(",")] if len(words) > 3 else []
            data = caches[model].tensors[tensor][ids].tobytes()
            print(hashlib.sha256(data).hexdigest(), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
