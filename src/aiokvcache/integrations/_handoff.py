"""The vLLM connector's hand-off protocol, as state machines without I/O.

Nothing here sends, sleeps or reads a clock: each method takes ``now`` and
returns what to answer or release; :mod:`._kvlink` carries the messages and
runs the clock. Every message is bound to the link it arrived on (``src``,
the cluster id aiokvcache attributed it to by the link's key, never what the
payload says) and, for pull, to the request's *grant key*: a random secret the
prefill's scheduler puts into the request's ``kv_transfer_params``, so only
the decode instance that was handed those params can claim or free the
request's blocks.

*Pull*, prefill side (:class:`PullHolds`), one request ``rid``::

    (unknown) --hold--> HELD --claim(key ok, blocks ok)--> GRANTED (claims)
    (unknown) --claim--> claim WAITS for the hold (bounded by ``claim_wait`` and D's deadline)
    GRANTED --done(src, nonce) of the last claim--> RELEASED
    GRANTED --a claim's deadline (D's own, carried in the claim) passes--> that claim drops
    HELD (no claimer) --lease passes, or free(key)--> RELEASED

A released request is reported sent (its blocks go back to the engine) and
remembered for a while, so that a late claim is refused, never granted.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Answer",
    "ProtocolError",
    "PullHolds",
    "Registration",
    "blocks_digest",
]


class ProtocolError(ValueError):
    """A peer's message that does not hold (dropped, and logged)."""


def blocks_digest(ids: Sequence[int]) -> str:
    """What a claim names a request's blocks by (both sides hash the list)."""
    return hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Answer:
    """A reply to send: ``kind`` ``"grant"`` or ``"refused"`` (with ``why``)."""

    to: int
    rid: str
    nonce: str
    kind: str
    why: str = ""


@dataclass
class _Hold:
    blocks: int
    digest: str
    key: str
    lease_end: float
    claims: dict[tuple[int, str], float] = field(default_factory=dict)  # (src, nonce) -> end


@dataclass
class _Waiting:
    src: int
    nonce: str
    key: str
    first: int
    last: int
    digest: str
    ttl_end: float
    give_up: float


class PullHolds:
    """Prefill side of pull: which finished requests' blocks are held, for whom.

    ``claim_wait``: how long a claim that arrives before the engine handed
    the request over waits for it. ``max_ttl``: the longest deadline a claim
    may ask for. ``max_waiting``: claims waiting at once (more are refused):
    a peer cannot grow this side's memory by claiming random ids.
    """

    def __init__(
        self,
        *,
        claim_wait: float,
        max_ttl: float = 3600.0,
        max_waiting: int = 4096,
        max_released: int = 65536,
    ) -> None:
        self.claim_wait = claim_wait
        self.max_ttl = max_ttl
        self.max_waiting = max_waiting
        self.max_released = max_released
        self._holds: dict[str, _Hold] = {}
        self._waiting: dict[tuple[int, str, str], _Waiting] = {}  # (src, rid, nonce)
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Counters: grants given, claims refused, leases that ran out unread.
        self.grants = 0
        self.refusals = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._holds) + len(self._waiting)

    def held(self, rid: str) -> bool:
        return rid in self._holds

    def claims(self, rid: str) -> set[tuple[int, str]]:
        """``(src, nonce)`` of the grants ``rid`` is held for."""
        h = self._holds.get(rid)
        return set(h.claims) if h is not None else set()

    # ------------------------------------------------------------ inputs

    def hold(
        self, rid: str, blocks: Sequence[int], key: str, lease: float, now: float
    ) -> list[Answer]:
        """The engine finished ``rid``: hold ``blocks`` for ``lease`` seconds.

        Returns the answers to claims that waited for it. A repeated hold, or
        one for a request already released, changes nothing.
        """
        if rid in self._holds or rid in self._released:
            return []
        self._holds[rid] = _Hold(len(blocks), blocks_digest(blocks), key, now + lease)
        out = []
        for wkey in [k for k in self._waiting if k[1] == rid]:
            w = self._waiting.pop(wkey)
            out.append(
                self._decide(w.src, rid, w.nonce, w.key, w.first, w.last, w.digest, w.ttl_end)
            )
        return out

    def claim(
        self,
        src: int,
        rid: str,
        nonce: str,
        key: str,
        ttl: float,
        first: int,
        last: int,
        digest: str,
        now: float,
    ) -> Answer | None:
        """``src`` asks to read blocks ``[first, last)`` of ``rid``'s list (named
        by ``digest``) until ``now + ttl``; ``nonce`` names this claim (its
        grant and its ``done``). Returns the answer, or ``None`` while the
        claim waits for the engine's hand-over."""
        if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and 0 < ttl <= self.max_ttl):
            return self._refuse(
                src, rid, nonce, f"a claim's deadline must be in (0, {self.max_ttl}] s"
            )
        if rid in self._released:
            return self._refuse(
                src, rid, nonce, "the prefill instance's lease on its blocks expired"
            )
        if rid not in self._holds:
            wkey = (src, rid, nonce)
            if wkey not in self._waiting and len(self._waiting) >= self.max_waiting:
                return self._refuse(src, rid, nonce, "too many claims waiting")
            give_up = now + min(self.claim_wait, ttl)
            self._waiting[wkey] = _Waiting(src, nonce, key, first, last, digest, now + ttl, give_up)
            return None
        return self._decide(src, rid, nonce, key, first, last, digest, now + ttl)

    def done(self, src: int, rid: str, nonce: str) -> bool:
        """``src``'s claim ``nonce`` finished reading ``rid`` (its pull is
        quiescent). True when that released the request. For a claim it did
        not make: ignored."""
        h = self._holds.get(rid)
        if h is None or (src, nonce) not in h.claims:
            return False
        del h.claims[src, nonce]
        if not h.claims:
            self._release(rid)
            return True
        return False

    def free(self, src: int, rid: str, key: str) -> bool:
        """``src`` will not read ``rid`` after all (its request was aborted or
        found its prefix locally): release now unless a claim reads it. Needs
        the request's key. True when that released it."""
        for wkey in [k for k in self._waiting if k[:2] == (src, rid)]:
            del self._waiting[wkey]
        h = self._holds.get(rid)
        if h is None or key != h.key or h.claims:
            return False
        self._release(rid)
        return True

    def tick(self, now: float) -> tuple[list[str], list[Answer]]:
        """Time passes: returns the requests released now (leases that ran out,
        claimers whose deadline passed) and refusals of claims that waited too
        long for their hold."""
        released: list[str] = []
        for rid, h in list(self._holds.items()):
            for ckey, end in list(h.claims.items()):
                if end <= now:
                    del h.claims[ckey]
            if not h.claims and h.lease_end <= now:
                self.expired += 1
                self._release(rid)
                released.append(rid)
        answers = []
        for wkey, w in list(self._waiting.items()):
            if w.give_up <= now:
                del self._waiting[wkey]
                answers.append(
                    self._refuse(w.src, wkey[1], w.nonce, "the request is not held here")
                )
        return released, answers

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (``None``: nothing held)."""
        ends = [w.give_up for w in self._waiting.values()]
        for h in self._holds.values():
            ends.append(max([h.lease_end, *h.claims.values()]))
        return min(ends) if ends else None

    # ------------------------------------------------------------ internals

    def _decide(
        self,
        src: int,
        rid: str,
        nonce: str,
        key: str,
        first: int,
        last: int,
        digest: str,
        end: float,
    ) -> Answer:
        h = self._holds[rid]
        if key != h.key:
            return self._refuse(src, rid, nonce, "wrong grant key")
        if digest != h.digest:
            return self._refuse(src, rid, nonce, "the claimed blocks are not the request's")
        if not (type(first) is int and type(last) is int and 0 <= first < last <= h.blocks):
            return self._refuse(src, rid, nonce, f"blocks [{first}, {last}) not in [0, {h.blocks})")
        h.claims[src, nonce] = max(end, h.claims.get((src, nonce), end))
        self.grants += 1
        return Answer(src, rid, nonce, "grant")

    def _refuse(self, src: int, rid: str, nonce: str, why: str) -> Answer:
        self.refusals += 1
        return Answer(src, rid, nonce, "refused", why)

    def _release(self, rid: str) -> None:
        self._holds.pop(rid, None)
        self._released[rid] = None
        while len(self._released) > self.max_released:
            self._released.popitem(last=False)


class Registration:
    """Decode side's block ids for one push transfer, from its parts.

    Bound to the cluster that sent the first part: parts from any other link
    are refused. Runs are checked against the engine's block count before
    anything is allocated, so a peer cannot make this side build a list
    longer than its own KV cache.
    """

    def __init__(self, num_blocks: int, runs_per_part: int) -> None:
        self.num_blocks = num_blocks
        self.runs_per_part = runs_per_part
        self.src: int | None = None
        self.parts: int | None = None
        self._got: dict[int, list[tuple[int, int]]] = {}
        self._count = 0

    def add(self, src: int, part: Any, parts: Any, runs: Any) -> list[int] | None:
        """One part; the whole id list once the last part is in, else ``None``.
        Raises :class:`ProtocolError` for a part that does not hold."""
        if self.src is not None and src != self.src:
            raise ProtocolError(f"cluster {src} registered for another cluster's transfer")
        max_parts = -(-self.num_blocks // self.runs_per_part) + 1
        if not (isinstance(parts, int) and 1 <= parts <= max_parts):
            raise ProtocolError(f"a registration of {parts!r} parts (at most {max_parts})")
        if self.parts is not None and parts != self.parts:
            raise ProtocolError("the registration's part count changed")
        if not (isinstance(part, int) and 0 <= part < parts) or part in self._got:
            raise ProtocolError(f"registration part {part!r} of {parts}: repeated or out of range")
        checked = self._runs(runs)
        self.src, self.parts = src, parts
        self._got[part] = checked
        if len(self._got) < parts:
            return None
        ids: list[int] = []
        for i in range(parts):
            for start, count in self._got[i]:
                ids.extend(range(start, start + count))
        self._got.clear()
        return ids

    def _runs(self, runs: Any) -> list[tuple[int, int]]:
        if not isinstance(runs, list) or len(runs) > self.runs_per_part:
            raise ProtocolError(f"a registration part holds at most {self.runs_per_part} runs")
        out = []
        total = self._count
        for r in runs:
            if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)):
                raise ProtocolError(f"a block run must be [start, count], got {r!r}")
            start, count = r
            if not (0 <= start and 1 <= count and start + count <= self.num_blocks):
                raise ProtocolError(f"block run {r!r} outside the {self.num_blocks} blocks")
            total += count
            if total > self.num_blocks:
                raise ProtocolError(f"more blocks registered than the {self.num_blocks} there are")
            out.append((start, count))
        self._count = total
        return out


def unruns(runs: Iterable[Sequence[int]]) -> list[int]:
    """The ids of ``[start, count]`` runs, in order."""
    out: list[int] = []
    for start, count in runs:
        out.extend(range(int(start), int(start) + int(count)))
    return out
