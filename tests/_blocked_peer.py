"""A decode process whose event loop is blocked while it is being used.

Usage: python _blocked_peer.py TRANSPORT MODE SECONDS (MODE: sleep | busy).

It listens, allocates three caches (``push``: a push target; ``pull``: a pull
source bound to a CacheKey and filled with a pattern; ``gone``: deallocated
later), prints ``READY {json}`` and ``BLOCKING``, then blocks its own event
loop for SECONDS: ``time.sleep`` (a syscall) or a pure-Python busy loop. A
helper thread meanwhile waits for ``dealloc`` on stdin, deallocates ``gone``
from that thread and prints ``RELEASED`` once the engine has given the memory
back. After the block it prints ``UNBLOCKED`` and ``DIGEST <hex>`` of the
push target, then finalizes on ``exit`` (or end of input).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time

import numpy as np

import aiokvcache as kv

SHAPE = [1, 64, 8, 64]  # 64 KiB per fp16 tensor
TENSORS = 8


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def block(mode: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    if mode == "sleep":
        time.sleep(seconds)
        return
    x = 0
    while time.monotonic() < end:  # pure Python: holds the GIL between switches
        x = (x * 1103515245 + 12345) % 2**31


async def main() -> None:
    transport, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.transport = transport
    dd = kv.LLMDataDist(kv.LLMRole.DECODER, cluster_id=2)
    await dd.init(cfg.generate_options())
    cm = dd.cache_manager
    desc = kv.CacheDesc(TENSORS, SHAPE, kv.DataType.DT_FLOAT16, kv.Placement.HOST)
    push = cm.allocate_cache(desc)
    pull = cm.allocate_cache(desc, [kv.CacheKey(2, req_id=7)])
    gone = cm.allocate_cache(desc)
    for i, t in enumerate(pull.tensors):
        t.view(np.uint8).reshape(-1)[:] = np.arange(t.nbytes, dtype=np.uint64).astype(np.uint8) ^ i
    say(
        "READY "
        + json.dumps(
            {
                "address": dd.listen_address,
                "push": push.cache_id,
                "pull": pull.cache_id,
                "gone": gone.cache_id,
            }
        )
    )

    def helper() -> None:
        line = sys.stdin.readline().strip()
        if line != "dealloc":
            return
        before = int(cm.stats()["regions"])
        cm.deallocate_cache(gone)  # from this thread, while the loop is blocked
        while int(cm.stats()["regions"]) >= before:
            time.sleep(0.01)
        say("RELEASED")

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    say("BLOCKING")
    block(mode, seconds)
    say("UNBLOCKED")
    digest = hashlib.sha256(b"".join(t.tobytes() for t in push.tensors)).hexdigest()
    say(f"DIGEST {digest}")
    thread.join()
    await asyncio.to_thread(sys.stdin.readline)  # "exit" or EOF
    await dd.finalize()


if __name__ == "__main__":
    asyncio.run(main())
