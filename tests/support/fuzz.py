"""Structure-aware mutation of what a peer sends (tests/test_peer_input_fuzz.py).

A :class:`Mutator` changes valid inputs the way a broken or hostile peer
would: bytes (bit flips, interesting bytes, truncation, growth, splices of
64-bit values) and decoded control-plane values (type confusion, extreme
ints, missing and extra keys, deep nesting). A :class:`Run` bounds a target
by time and keeps a journal of the last inputs, printed when the victim dies.

The run's length and seed come from the environment, so a CI run is short
and a long one is one variable away::

    AIOKVCACHE_FUZZ_SECONDS=150 python -m pytest tests/test_peer_input_fuzz.py
    AIOKVCACHE_FUZZ_SEED=1234 ...   # replay one run's choices

``AIOKVCACHE_FUZZ_SECONDS`` is per target (default 4).
"""

from __future__ import annotations

import collections
import os
import random
import struct
import time
from collections.abc import Iterator
from typing import Any

from aiokvcache._core.wire.codec import MAX_DEPTH, encode

__all__ = ["SECONDS", "Mutator", "Run", "encodable"]

#: Seconds each fuzz target runs (``AIOKVCACHE_FUZZ_SECONDS``).
SECONDS = float(os.environ.get("AIOKVCACHE_FUZZ_SECONDS", "4"))

_INTERESTING_BYTES = (0x00, 0x01, 0x0F, 0x10, 0x1F, 0x20, 0x3F, 0x40, 0x7F, 0x80, 0xFE, 0xFF)
_INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    7,
    8,
    16,
    255,
    256,
    4096,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**48,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**31),
    -(2**63),
)


def encodable(value: Any) -> bytes | None:
    """``value`` in the control plane's codec, or None if it cannot be."""
    try:
        return encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None


class Mutator:
    """Mutations drawn from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    # ------------------------------------------------------------- bytes

    def bytes_(self, data: bytes, rounds: int | None = None) -> bytes:
        """``data`` after one to four byte-level mutations."""
        out = bytearray(data)
        for _ in range(rounds or self.rng.randint(1, 4)):
            out = self._one(out)
        return bytes(out)

    def _one(self, b: bytearray) -> bytearray:
        r = self.rng
        n = len(b)
        pick = r.randrange(9)
        if n == 0 or pick == 0:  # grow
            return b + bytearray(r.randbytes(r.choice((1, 2, 7, 8, 64, r.randint(0, 600)))))
        i = r.randrange(n)
        if pick == 1:  # flip a bit
            b[i] ^= 1 << r.randrange(8)
        elif pick == 2:  # an interesting byte
            b[i] = r.choice(_INTERESTING_BYTES)
        elif pick == 3:  # truncate
            del b[r.randrange(n) :]
        elif pick == 4:  # delete a range
            del b[i : i + r.randint(1, 16)]
        elif pick == 5:  # insert random bytes
            b[i:i] = r.randbytes(r.randint(1, 32))
        elif pick == 6:  # a 64-bit value, either byte order
            value = r.choice(_INTERESTING_INTS) % 2**64
            b[i : i + 8] = struct.pack(r.choice(("<Q", ">Q")), value)
        elif pick == 7:  # duplicate a chunk
            j = r.randrange(n)
            b[j:j] = b[i : i + r.randint(1, 32)]
        else:  # a random byte
            b[i] = r.randrange(256)
        return b

    # ------------------------------------------------------------- values

    def random_value(self, depth: int = 0) -> Any:
        """A value the codec carries, of any type."""
        r = self.rng
        kinds = 9 if depth < MAX_DEPTH + 2 else 7
        k = r.randrange(kinds)
        if k == 0:
            return None
        if k == 1:
            return r.random() < 0.5
        if k == 2:
            return r.choice(_INTERESTING_INTS) + r.choice((0, 0, 1, -1))
        if k == 3:
            return r.choice((0.0, -1.0, 0.5, 1e300, float("inf"), float("nan"), 30.0))
        if k == 4:
            return r.choice(("", "x", "cache_by_id", "link_up", "\x00", "é" * 5, "a" * 5000))
        if k == 5:
            return r.randbytes(r.choice((0, 1, 8, 16, 32, 100, 300)))
        if k == 6:
            return r.randrange(-(2**63), 2**64)
        if k == 7:
            return [self.random_value(depth + 1) for _ in range(r.choice((0, 1, 2, 5)))]
        return {
            r.choice(("", "op", "body", "x", "rkey", "addr", "status")): self.random_value(
                depth + 1
            )
            for _ in range(r.choice((0, 1, 3)))
        }

    def value(self, v: Any, depth: int = 0) -> Any:
        """``v`` with one mutation somewhere inside it (containers are copied)."""
        r = self.rng
        if isinstance(v, dict) and v and r.random() < 0.8:
            out = dict(v)
            key = r.choice(list(out))
            what = r.randrange(6)
            if what == 0:
                del out[key]
            elif what == 1:
                out[r.choice(("extra", key + "_", ""))] = self.random_value(depth + 1)
            else:
                out[key] = self.value(out[key], depth + 1)
            return out
        if isinstance(v, list) and v and r.random() < 0.8:
            out_list = list(v)
            i = r.randrange(len(out_list))
            what = r.randrange(5)
            if what == 0:
                del out_list[i]
            elif what == 1:
                out_list.insert(i, self.random_value(depth + 1))
            elif what == 2:
                out_list.append(out_list[i])
            else:
                out_list[i] = self.value(out_list[i], depth + 1)
            return out_list
        if isinstance(v, bytes) and r.random() < 0.7:
            return self.bytes_(v)
        if isinstance(v, bool):
            return r.choice((not v, 0, 1, None))
        if isinstance(v, int) and r.random() < 0.7:
            return r.choice((r.choice(_INTERESTING_INTS), v + r.choice((-1, 1)), -v, v * 2**20))
        if isinstance(v, str) and r.random() < 0.5:
            return r.choice((v + "x", v[:-1], v.upper(), "", v * 100))
        return self.random_value(depth)  # type confusion

    def values(self, v: Any) -> Any:
        """``v`` after one to three value mutations."""
        for _ in range(self.rng.randint(1, 3)):
            v = self.value(v)
        return v


class Run:
    """One target's run: a time bound, a seed and a journal of the last inputs."""

    def __init__(self, name: str, seconds: float = SECONDS) -> None:
        env = os.environ.get("AIOKVCACHE_FUZZ_SEED")
        self.seed = int(env) if env else random.randrange(2**32)
        self.name = name
        self.rng = random.Random(f"{self.seed}:{name}")
        self.mutator = Mutator(self.rng)
        self.seconds = seconds
        self.count = 0
        self._journal: collections.deque[str] = collections.deque(maxlen=16)

    def __iter__(self) -> Iterator[int]:
        """Iteration numbers until the run's time is up (at least one)."""
        end = time.monotonic() + self.seconds
        while self.count == 0 or time.monotonic() < end:
            yield self.count
            self.count += 1

    def note(self, what: str, data: Any) -> None:
        """Record an input sent (the journal keeps the last 16)."""
        text = data.hex() if isinstance(data, (bytes, bytearray)) else repr(data)
        self._journal.append(f"#{self.count} {what}: {text[:400]}")

    def report(self) -> str:
        """How to replay this run, and the last inputs sent."""
        head = f"fuzz {self.name}: seed {self.seed} (AIOKVCACHE_FUZZ_SEED), {self.count} inputs"
        return "\n".join([head, *self._journal])
