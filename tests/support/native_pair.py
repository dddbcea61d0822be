"""Two bare engines, one putting into the other's region over TCP through a
deliberately small window: a put slow enough to wait on, or to time out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aiokvcache._loader import native

__all__ = ["SlowPair", "slow_pair"]

MiB = 1 << 20


@dataclass
class SlowPair:
    """Engine ``a`` puts into ``b``'s region over TCP, through a small window."""

    a: Any
    b: Any
    ep: int
    rkey: int
    addr: int
    size: int
    src: npt.NDArray[np.uint8]

    def put(self) -> int:
        rows = np.array([[self.src.ctypes.data, self.addr, self.size, self.rkey]], np.uint64)
        return int(self.a.submit(native.OP_PUT, self.ep, rows))

    def completions(self, drained: list[tuple[int, ...]]) -> dict[int, int]:
        return {jid: st for kind, jid, st, *_ in drained if kind == native.KIND_JOB}


@contextlib.contextmanager
def slow_pair() -> Iterator[SlowPair]:
    """A 64 KiB window makes a 64 MiB put take hundreds of round trips (about
    half a second here); both engines are closed after the block."""
    a = native.Engine("tcp", max_inflight_bytes=64 * 1024, chunk_bytes=16 * 1024, direct_copy=False)
    b = native.Engine("tcp")
    try:
        size = 64 * MiB
        region, addr = b.mem_alloc(size)
        ep = a.connect(b.worker_address, False)
        rkey = a.rkey_unpack(ep, b.rkey_pack(region), addr, size)
        src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        yield SlowPair(a, b, ep, rkey, addr, size, src)
    finally:
        a.close()
        b.close()


class QuietHandler:
    """A control-plane handler (``control.Handler``) that answers nothing of
    note: for tests that speak the wire themselves."""

    def on_connected(self, conn: Any) -> None:
        pass

    async def handle_request(self, conn: Any, op: str, body: dict[str, Any]) -> dict[str, Any]:
        return {}

    def on_event(self, conn: Any, op: str, body: dict[str, Any]) -> None:
        pass

    def on_closed(self, conn: Any, reason: str) -> None:
        pass
