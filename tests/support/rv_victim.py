"""A process for tests/test_memory_safety.py that may crash: finalize() during a local copy.

``python tests/support/rv_victim.py TRANSPORT``

Allocates two caches of 4 x 256 MiB, starts ``copy_cache`` between them (a
worker thread copies under a lease on both), and calls ``finalize()`` while
the copy holds its lease. Prints ``RESULT {json}`` (the copy's outcome) and
exits 0 if it lives; a copy through memory that finalize() unmapped kills it
(SIGSEGV).
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiokvcache as kv

TENSORS, BYTES = 4, 256 << 20


async def main(transport: str) -> None:
    cfg = kv.LLMConfig()
    cfg.transport = transport
    dd = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    await dd.init(cfg.generate_options())
    cm = dd.cache_manager
    desc = kv.CacheDesc(TENSORS, [1, BYTES], kv.DataType.DT_UINT8, kv.Placement.HOST)
    src, dst = cm.allocate_cache(desc), cm.allocate_cache(desc)
    for t in src.tensors:
        t[...] = 7
    task = asyncio.ensure_future(cm.copy_cache(dst, src))
    await asyncio.sleep(0)  # its first step: the lease is taken, the thread submitted
    assert not task.done()
    print("copy started; finalize", flush=True)
    await dd.finalize()
    try:
        await task
        outcome = "LLM_SUCCESS"
    except kv.LLMException as exc:
        outcome = exc.status_code.name
    print("RESULT " + json.dumps({"copy": outcome}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
