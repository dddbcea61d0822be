"""A peer process for engine tests: owns one region, answers line commands.

Usage: python _engine_peer.py TRANSPORT SIZE. Prints one JSON line describing
its region (worker address, address, packed rkey), then answers one JSON line
per command read from stdin: ``hash OFF LEN``, ``fill SEED``, ``notes``,
``exit``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from aiokvcache._loader import native


def main() -> None:
    transport, size = sys.argv[1], int(sys.argv[2])
    eng = native.Engine(transport)
    rid, addr = eng.mem_alloc(size)
    mem = np.frombuffer(native.buffer_from_address(addr, size), dtype=np.uint8)
    mem[:] = 0
    print(
        json.dumps(
            {
                "worker": eng.worker_address.hex(),
                "addr": addr,
                "size": size,
                "rkey": eng.rkey_pack(rid).hex(),
            }
        ),
        flush=True,
    )
    notes: list[str] = []
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "hash":
            off, n = int(words[1]), int(words[2])
            out = {"sha": hashlib.sha256(mem[off : off + n].tobytes()).hexdigest()}
        elif words[0] == "fill":
            rng = np.random.default_rng(int(words[1]))
            mem[:] = rng.integers(0, 256, size, dtype=np.uint8)
            out = {"ok": True}
        elif words[0] == "notes":
            want = int(words[1])
            deadline = time.monotonic() + 10
            while len(notes) < want and time.monotonic() < deadline:
                for kind, _id, _st, _ucs, _n, payload in eng.drain():
                    if kind == native.KIND_NOTIFY:
                        # The bytes must be there when the notification is.
                        off, n, sha = payload.decode().split(":")
                        got = hashlib.sha256(
                            mem[int(off) : int(off) + int(n)].tobytes()
                        ).hexdigest()
                        notes.append("ok" if got == sha else "early")
                time.sleep(0.001)
            out = {"notes": notes}
        elif words[0] == "exit":
            break
        else:
            out = {"error": line}
        print(json.dumps(out), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
