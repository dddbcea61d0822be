"""A bare native engine that puts one region into a peer's region, for
tests/test_lifetimes.py (the deadline-after-a-freeze case).

``python tests/support/lt_engine_sender.py TRANSPORT WORKER_HEX RKEY_HEX ADDR
SIZE CHUNK_BYTES TIMEOUT_MS``

Connects to the peer's worker, unpacks its key for ``[ADDR, ADDR+SIZE)``,
fills a region of its own with 1s and prints ``{"ready": true}``. On the
line ``go`` it submits one put of the whole region with a native deadline
of TIMEOUT_MS, prints ``{"submitted": true}``, waits until the engine
released it and prints ``{"status": NAME}``. Uses aiokvcache._native: the
chunk size is an engine setting the public API does not expose, and small
chunks make a step of the progress thread short.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import aiokvcache  # noqa: F401  (loads UCX before the native module)
from aiokvcache import _native as native


def main() -> None:
    transport, worker, rkey, addr, size, chunk, timeout_ms = sys.argv[1:8]
    a, n = int(addr), int(size)
    eng = native.Engine(transport, chunk_bytes=int(chunk), copy_lanes=1)
    try:
        ep = eng.connect(bytes.fromhex(worker), False)
        key = eng.rkey_unpack(ep, bytes.fromhex(rkey), a, n)
        _rid, src = eng.mem_alloc(n)
        np.frombuffer(native.buffer_from_address(src, n), np.uint8)[:] = 1
        print(json.dumps({"ready": True}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        job = eng.submit(
            native.OP_PUT, ep, np.array([[src, a, n, key]], np.uint64), b"", int(timeout_ms)
        )
        print(json.dumps({"submitted": True}), flush=True)
        eng.wait_released([job], 60.0)
        names = {value: name for value, name, _w, _l in native.STATUSES}
        status = [s for kind, jid, s, *_ in eng.drain() if kind == native.KIND_JOB and jid == job]
        print(json.dumps({"status": names.get(status[0], "?") if status else "?"}), flush=True)
        sys.stdin.readline()
    finally:
        eng.close()


if __name__ == "__main__":
    main()
