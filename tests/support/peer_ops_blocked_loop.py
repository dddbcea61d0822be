"""Ops of the peer program (:mod:`aiokvcache.testing.peer`) for
tests/test_blocked_loop.py: a decoder that blocks its own event loop on
request (``time.sleep`` or a pure-Python busy loop), to show that peers are
served meanwhile.

It owns three caches from the start (:data:`BLOCKED_TENSORS` fp16 tensors
of :data:`BLOCKED_SHAPE`), their ids in its hello: ``push`` (a push
target), ``pull`` (bound to :data:`BLOCKED_PULL_KEY`, filled with
:func:`blocked_pattern`) and ``gone`` (deallocated on request).
``{"op": "block", "how": "sleep"|"busy", "seconds": S}`` answers
``{"blocking": true}`` at once, blocks the loop for S seconds, then answers
``{"unblocked_at": time.time(), "sha": sha256 of push}``. While it blocks, a
``{"op": "dealloc"}`` line is taken by a helper thread, which deallocates
``gone`` from there and answers ``{"released": true}`` once the engine gave
the memory back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from aiokvcache import Cache, CacheDesc, CacheKey, CacheManager, DataType, Placement
from aiokvcache._child import say
from aiokvcache.testing import DECODER_ID
from aiokvcache.testing.peer import PeerNode

#: The caches: 8 fp16 tensors of 64 KiB.
BLOCKED_SHAPE = [1, 64, 8, 64]
BLOCKED_TENSORS = 8
#: The pull source is bound to this key.
BLOCKED_PULL_KEY = CacheKey(DECODER_ID, req_id=7)


def blocked_pattern(tensor: int, nbytes: int) -> np.ndarray:
    """What tensor ``tensor`` of the pull source holds."""
    return np.arange(nbytes, dtype=np.uint64).astype(np.uint8) ^ tensor


def _block_loop(how: str, seconds: float) -> None:
    """Block the calling thread's event loop the way a model step or barrier would."""
    if how == "sleep":
        time.sleep(seconds)  # a syscall: the GIL is free
        return
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:  # pure Python: the GIL changes hands at switches
        x = (x * 1103515245 + 12345) % 2**31


def _dealloc_on_request(cm: CacheManager, gone: Cache) -> None:
    """The helper thread: take one line, and if it asks, deallocate ``gone``."""
    line = sys.stdin.readline()
    if not line or json.loads(line).get("op") != "dealloc":
        return
    before = int(cm.stats()["regions"])
    cm.deallocate_cache(gone)  # from this thread, the loop being blocked
    while int(cm.stats()["regions"]) >= before:
        time.sleep(0.01)
    say({"released": True})


@contextlib.asynccontextmanager
async def start(node: PeerNode) -> AsyncIterator[None]:
    desc = CacheDesc(BLOCKED_TENSORS, BLOCKED_SHAPE, DataType.DT_FLOAT16, Placement.HOST)
    cm = node.dd.cache_manager
    push = cm.allocate_cache(desc)
    pull = cm.allocate_cache(desc, [BLOCKED_PULL_KEY])
    gone = cm.allocate_cache(desc)
    for i, t in enumerate(pull.tensors):
        t.view(np.uint8).reshape(-1)[:] = blocked_pattern(i, t.nbytes)
    node.hello.update(push=push.cache_id, pull=pull.cache_id, gone=gone.cache_id)

    async def block(req: dict[str, Any]) -> dict[str, Any]:
        helper = threading.Thread(
            target=_dealloc_on_request, args=(cm, gone), name="dealloc", daemon=True
        )
        helper.start()
        say({"blocking": True})
        _block_loop(str(req["how"]), float(req["seconds"]))
        unblocked_at = time.time()
        helper.join()
        data = b"".join(t.tobytes() for t in push.tensors)
        return {"unblocked_at": unblocked_at, "sha": hashlib.sha256(data).hexdigest()}

    node.ops["block"] = block
    yield
