"""The control region: engine-lifetime memory that peers read and write.

Two things in it are reached by linked peers over the data plane:

* **probe slots** — the small buffers a link's data-path check puts a nonce
  into, for the owner to find there (a put probe) or for the putting side to
  read back (a read-back probe; see :mod:`.probe`);
* **retirement words** — one 8-byte word per live cache of ours. It holds the
  cache's id while the cache is live and 0 once ``deallocate_cache`` /
  ``unregister_cache`` has begun retiring it. Every transfer job a peer runs
  on that cache reads the word after it starts (the engine's job guard, see
  ``ext/job.hpp``) and fails with KV_CACHE_NOT_EXIST when it changed: a
  transfer that starts after the owner's call returned gets the right answer,
  whatever the invalidation message's progress. A reused word holds a newer
  cache's id, which a stale guard does not expect either.

The region is allocated once per engine and never released before the
engine closes, so a late or hostile write into it can never reach memory that
was reused for something else: the worst it does is spoil a probe (the link's
set-up then fails and is retried) or make a peer's own transfers fail. It is
a lease holder like a cache (:meth:`.state.State.lease`), valid until the
engine closes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from ..._loader import native
from ..model.errors import LLMStatusCode, make_error
from ..wire.messages import PROBE_BYTES

__all__ = ["PROBE_BYTES", "ControlRegion"]

#: Probe slots, used round-robin: one is reused only after this many more
#: probes, long after any probe that used it ended or was given up.
PROBE_SLOTS = 1024
#: Retirement words: the most caches one instance can have live at once.
GUARD_SLOTS = 1 << 17


class ControlRegion:
    """One engine's probe slots and retirement words (thread-safe)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.size = PROBE_SLOTS * PROBE_BYTES + GUARD_SLOTS * 8
        self.region, self.base = engine.mem_alloc(self.size)
        self.rkey: bytes = engine.rkey_pack(self.region)
        self._guard_base = self.base + PROBE_SLOTS * PROBE_BYTES
        self._words: npt.NDArray[np.uint64] = np.frombuffer(
            native.buffer_from_address(self._guard_base, GUARD_SLOTS * 8), dtype=np.uint64
        )
        # Guards every touch of the region's bytes from Python, and _closed:
        # after close() (before the engine unmaps it) nothing touches them.
        self._mu = threading.Lock()
        self._closed = False
        self._next_probe = 0
        self._free: list[int] = []
        self._next_guard = 0
        # A lease holder (State.lease): live until the engine closes.
        self.valid = True
        self.leases: set[Any] = set()
        self.used_eps: set[int] = set()

    # ------------------------------------------------------------- probes

    def probe_slot(self) -> int:
        """The address of the next probe slot (round-robin)."""
        with self._mu:
            i = self._next_probe
            self._next_probe = (i + 1) % PROBE_SLOTS
        return int(self.base + i * PROBE_BYTES)

    def is_probe_slot(self, addr: int) -> bool:
        """Whether ``addr`` is the start of one of our probe slots."""
        offset = int(addr) - int(self.base)
        return 0 <= offset < PROBE_SLOTS * PROBE_BYTES and offset % PROBE_BYTES == 0

    def close(self) -> None:
        """The engine is about to close (and unmap the region): from now on
        reads give zeros, writes do nothing."""
        with self._mu:
            self._closed = True
            self.valid = False

    def write(self, addr: int, data: bytes) -> None:
        """Write ``data`` at ``addr`` (a probe slot)."""
        self._check(addr, len(data))
        with self._mu:
            if not self._closed:
                native.buffer_from_address(addr, len(data))[:] = data

    def read(self, addr: int, length: int) -> bytes:
        """``length`` bytes at ``addr``."""
        self._check(addr, length)
        with self._mu:
            if self._closed:
                return bytes(length)
            return bytes(native.buffer_from_address(addr, length, True))

    def _check(self, addr: int, length: int) -> None:
        if not (self.base <= addr and addr + length <= self.base + self.size):
            raise ValueError("outside the control region")

    # ------------------------------------------------------------- guards

    def guard_alloc(self, word: int) -> int:
        """A retirement word holding ``word`` (> 0): its slot."""
        with self._mu:
            if self._free:
                slot = self._free.pop()
            elif self._next_guard < GUARD_SLOTS:
                slot = self._next_guard
                self._next_guard += 1
            else:
                raise make_error(
                    LLMStatusCode.LLM_OUT_OF_MEMORY,
                    f"too many live caches (at most {GUARD_SLOTS} per instance)",
                )
            if self._closed:
                raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "the engine is closing")
            self._words[slot] = word
        return slot

    def guard_addr(self, slot: int) -> int:
        """The address of retirement word ``slot``."""
        return int(self._guard_base + 8 * slot)

    def guard_retire(self, slot: int) -> None:
        """Mark the cache behind ``slot`` retired: peers' later jobs on it fail."""
        if slot >= 0:
            with self._mu:
                if not self._closed:
                    self._words[slot] = 0

    def guard_free(self, slot: int) -> None:
        """Give ``slot`` back (its cache's memory is released)."""
        if slot >= 0:
            with self._mu:
                if not self._closed:
                    self._words[slot] = 0
                self._free.append(slot)
