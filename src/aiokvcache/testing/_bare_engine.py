"""An ops module of the peer program: a bare native engine owning one region.

``python -m aiokvcache.testing.peer none TRANSPORT --ops
aiokvcache.testing._bare_engine --size BYTES [--ucx-options JSON]``: no
LLMDataDist, a native engine and one zeroed region of ``--size`` bytes (for
the engine's own tests and ``benchmarks/bench_put.py``, which put into it).
Hello: ``worker`` (its UCX worker address, hex), ``addr``, ``size``,
``rkey`` (hex). Ops: ``hash`` (``offset``, ``length``: sha256 of those
bytes), ``fill`` (``seed``: random bytes), ``accept_notes`` (``worker``,
``key``: notifications carrying that key come from that worker's engine),
``notes`` (``count``: waits up to 10 s for that many notifications, each
``"at:length:sha"`` of bytes that must have landed first; answers ``ok`` or
``early`` for each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from .._loader import native
from .peer import PeerNode

__all__ = ["add_arguments", "start"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--size`` (the region's bytes) and ``--ucx-options`` (a JSON object)."""
    parser.add_argument("--size", type=int, required=True, help="the region's bytes")
    parser.add_argument("--ucx-options", default="{}", help="UCX options, a JSON object")


class _Region:
    """The engine, its region and the notifications it received."""

    def __init__(self, transport: str, size: int, ucx_options: dict[str, str]) -> None:
        kw: dict[str, Any] = {"ucx_options": ucx_options} if ucx_options else {}
        self.engine = native.Engine(transport, **kw)
        self.size = size
        self.region_id, self.addr = self.engine.mem_alloc(size)
        self.mem = np.frombuffer(native.buffer_from_address(self.addr, size), dtype=np.uint8)
        self.mem[:] = 0  # every page touched now: none faults in later
        self.received: list[str] = []

    def hello(self) -> dict[str, Any]:
        return {
            "worker": self.engine.worker_address.hex(),
            "addr": self.addr,
            "size": self.size,
            "rkey": self.engine.rkey_pack(self.region_id).hex(),
        }

    def _sha(self, offset: int, length: int) -> str:
        return hashlib.sha256(self.mem[offset : offset + length].tobytes()).hexdigest()

    async def hash(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"sha": self._sha(int(req["offset"]), int(req["length"]))}

    async def fill(self, req: dict[str, Any]) -> dict[str, Any]:
        rng = np.random.default_rng(int(req["seed"]))
        self.mem[:] = rng.integers(0, 256, self.size, dtype=np.uint8)
        return {"ok": True}

    async def accept_notes(self, req: dict[str, Any]) -> dict[str, Any]:
        # Notifications carrying this key come from the caller (a bare engine
        # attributes them by key, as a link does).
        back = self.engine.connect(bytes.fromhex(str(req["worker"])), False)
        key = bytes.fromhex(str(req["key"]))
        self.engine.set_note_keys(back, os.urandom(native.NOTE_KEY_LEN), key, 1)
        return {"ok": True}

    async def notes(self, req: dict[str, Any]) -> dict[str, Any]:
        want = int(req["count"])
        deadline = time.monotonic() + 10
        while len(self.received) < want and time.monotonic() < deadline:
            for kind, _id, _st, _ucs, _n, payload, *_ in self.engine.drain():
                if kind == native.KIND_NOTIFY:
                    # The bytes must be there when the notification is.
                    at, length, sha = payload.decode().split(":")
                    self.received.append(
                        "ok" if self._sha(int(at), int(length)) == sha else "early"
                    )
            await asyncio.sleep(0.001)
        return {"notes": self.received}


@contextlib.asynccontextmanager
async def start(node: PeerNode) -> AsyncIterator[None]:
    """Make the engine and its region, say them in the hello, add the ops."""
    region = _Region(node.args.transport, node.args.size, json.loads(node.args.ucx_options))
    try:
        node.hello.update(region.hello())
        node.ops.update(
            hash=region.hash,
            fill=region.fill,
            accept_notes=region.accept_notes,
            notes=region.notes,
        )
        yield
    finally:
        region.engine.close()
