"""The decode side of ``python -m aiokvcache bench``: ``python -m aiokvcache._benchpeer``.

A decoder (cluster :data:`aiokvcache.bench.DECODER_ID`) owning one KV cache
of the bench's shape (the same shape options as ``bench``), listening on
127.0.0.1. It prints ``{"address", "cache_id"}`` when ready, then answers
JSON lines (:mod:`aiokvcache._child`): ``wait`` (``tag``: returns once every
layer of that tag landed, with the time each layer's notification arrived,
``time.monotonic()``, the bench's timeline) and ``digest`` (sha256 of what
the cache holds, in the bench's order). Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

from . import BlocksCacheKey, LLMDataDist, LLMRole, bench
from ._child import say, serve, unknown


async def _decode(args: argparse.Namespace) -> None:
    shape = bench.shape_of(args)
    async with LLMDataDist(LLMRole.DECODER, bench.DECODER_ID) as dd:
        await dd.init(bench.engine_options(args.transport, True, args.max_inflight))
        cm = dd.cache_manager
        began = time.monotonic()
        if shape.block_tokens:
            cache = cm.allocate_blocks_cache(shape.desc, BlocksCacheKey(bench.DECODER_ID))
        else:
            cache = cm.allocate_cache(shape.desc)
        # When each layer's notification reached this process (monotonic
        # clock, shared by both processes on one host): the bench's timeline.
        arrivals: dict[str, dict[int, float]] = {}

        async def record() -> None:
            async for note in cm.notifications():
                arrivals.setdefault(str(note.tag), {})[note.layer] = time.monotonic()

        recorder = asyncio.create_task(record())
        alloc_s = time.monotonic() - began
        say({"address": dd.listen_address, "cache_id": cache.cache_id, "alloc_s": alloc_s})

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            if req["op"] == "wait":
                # Every layer of this tag announced itself: the bytes are
                # in memory now.
                tag = str(req["tag"])
                await cm.wait_for_layers(tag, range(shape.layers), timeout=120)
                await asyncio.sleep(0)  # the recorder sees the last note too
                seen = arrivals.pop(tag, {})
                return {"landed": tag, "arrivals": {str(k): v for k, v in seen.items()}}
            if req["op"] == "digest":
                index = bench.block_order(shape) if shape.block_tokens else 0
                return {"sha": bench.digest(cache, index)}
            return unknown(req)

        try:
            await serve(handle)
        finally:
            recorder.cancel()


def main(argv: list[str] | None = None) -> int:
    """Serve until told to exit (or end of input)."""
    ap = argparse.ArgumentParser(prog="python -m aiokvcache._benchpeer", description=__doc__)
    bench.add_shape_arguments(ap)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench decides when we stop
    asyncio.run(_decode(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
