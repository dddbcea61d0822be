"""The vLLM connector's hand-off protocol, as state machines without I/O.

Nothing here sends, sleeps or reads a clock: each method takes ``now`` and
returns what to answer or release; the agent's sides
(:mod:`.prefill_pull`, :mod:`.prefill_push`) carry the messages and run the
clock. Every message is bound to the link it arrived on (``src``,
the cluster id aiokvcache attributed it to by the link's key, never what the
payload says) and, for pull, to the request's *grant key*.

*Grant keys.* Each prefill worker draws a secret at start and gives it to its
own scheduler only (vLLM's handshake metadata, inside the instance). When
the scheduler hands a finished request over (its blocks held until the worker
reports it sent), it puts ``grant_key(secret, rid, n, digest, until)``, a MAC
of the request id, its block list and an expiry (the longest hold, renewals
included, and a grace, on the wall clock of the host both run on), into the
request's ``kv_transfer_params``. A
claim must carry it: only a decode instance handed those params can claim or
free the request, only for exactly those blocks, and the worker can check a
claim that arrives before the engine told it of the request (vLLM delivers
that on the engine's next step, which an idle offline engine may not take for
a long time) without trusting any unknown id.

*Pull*, prefill side (:class:`PullHolds`), one request ``rid``::

    (unknown) --hold--> HELD (lease running)
    (unknown) --claim(key verifies)--> PENDING (granted; the hold not yet seen)
    HELD or PENDING --claim(key, blocks, range ok)--> granted: claims[(src, nonce)] = D's deadline
    --done(src, nonce) of the last claim, or free(key) with none--> READ
    READ and HELD (or HELD, no claim, lease passed) --> RELEASED (reported sent)
    a claim's deadline (D's own, carried in the claim) passes --> that claim drops

A released request is remembered until its key expires, so that a late claim
is refused, never granted; a key past its expiry is refused anyway.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import hmac
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Answer",
    "BadMessage",
    "PullHolds",
    "Registration",
    "blocks_digest",
    "grant_key",
    "push_key",
    "push_key_ok",
]


#: The most decode workers one prefill worker's request may have reading it.
MAX_READERS = 64


class BadMessage(ValueError):
    """A peer's message that does not hold (dropped, and logged)."""


def blocks_digest(ids: Sequence[int]) -> str:
    """What a claim names a request's blocks by (both sides hash the list)."""
    return hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=8).hexdigest()


def grant_key(secret: bytes, rid: str, n: int, digest: str, until_ms: int) -> str:
    """The key that lets a reader claim request ``rid``'s ``n`` blocks whose
    list hashes to ``digest`` (:func:`blocks_digest`) from the worker whose
    secret is ``secret``, until ``until_ms`` (that worker's wall clock, in
    milliseconds: its scheduler, on the same host, sets it)."""
    msg = f"aiokv-grant\0{rid}\0{n}\0{digest}\0{until_ms}".encode()
    return hmac.new(secret, msg, hashlib.blake2b).hexdigest()[:32]


def push_key(secret: bytes, xid: str) -> str:
    """The key that lets a decode instance register for push transfer ``xid``
    (the transfer id as the prefill worker whose secret is ``secret`` knows
    it, its rank's suffix included): what that worker's scheduler puts in the
    request's params, one per worker."""
    msg = f"aiokv-push\0{xid}".encode()
    return hmac.new(secret, msg, hashlib.blake2b).hexdigest()[:32]


def push_key_ok(
    secret: bytes, xid: str, key: Any, client_key: str | None, known: bool
) -> bool | None:
    """Whether ``key`` is push transfer ``xid``'s key: this worker's MAC of the
    transfer id (its scheduler made it), or ``client_key``, the key a client
    gave both requests (decode first). ``None``: not decidable yet (decode
    first, the engine has not told this worker the client's key: ``known``
    is whether it stepped the request)."""
    if not isinstance(key, str) or not key:
        return False
    if hmac.compare_digest(key.encode(), push_key(secret, xid).encode()):
        return True
    if client_key is not None:
        return hmac.compare_digest(key.encode(), client_key.encode())
    return False if known else None


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
    n: int  # blocks
    digest: str
    key: str
    until_ms: int  # the key's expiry (wall clock, ms)
    lease_end: float  # inf until the engine handed it over
    created: float
    lease: float = 0.0  # the lease a renewal grants again (seconds)
    known: bool = False  # the engine handed it over (hold())
    read: bool = False  # every claim ended (or a free came): release once known
    claims: dict[tuple[int, str], float] = field(default_factory=dict)  # (src, nonce) -> end
    readers: int = 1  # decode workers that read it (the most a claim said)
    finished: set[int] = field(default_factory=set)  # clusters whose read ended (or freed)


class PullHolds:
    """Prefill side of pull: which finished requests' blocks are held, for whom.

    ``secret``: this worker's grant-key secret. ``max_ttl``: the longest
    deadline a claim may ask for. ``max_pending``: requests claimed before
    the engine handed them over, at once (more are refused): a peer cannot
    grow this side's memory. ``pending_ttl``: how long such a record outlives
    its claims while the hand-over does not come.

    Every input costs O(log n) in what is held: deadlines sit in a heap that
    :meth:`tick` pops lazily. A released request is remembered until its key
    expires (its ``until``), so that no claim with its old params is granted,
    whatever came since.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        max_ttl: float = 3600.0,
        max_pending: int = 4096,
        pending_ttl: float = 600.0,
    ) -> None:
        self._secret = secret
        self.max_ttl = max_ttl
        self.max_pending = max_pending
        self.pending_ttl = pending_ttl
        self._holds: dict[str, _Hold] = {}
        self._pending = 0  # records not yet handed over
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0
        # Released hand-overs, (id, their key's expiry in ms), in release
        # order: a request id handed over again is another hand-over.
        self._released: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        #: Leases that ran out unread.
        self.expired = 0

    def __len__(self) -> int:
        return len(self._holds)

    def key(self, rid: str, blocks: Sequence[int], until_ms: int) -> str:
        """The grant key of ``rid`` over ``blocks`` (what the scheduler computes)."""
        return grant_key(self._secret, rid, len(blocks), blocks_digest(blocks), until_ms)

    def held(self, rid: str) -> bool:
        h = self._holds.get(rid)
        return h is not None and h.known

    def claims(self, rid: str) -> set[tuple[int, str]]:
        """``(src, nonce)`` of the live grants of ``rid``."""
        h = self._holds.get(rid)
        return set(h.claims) if h is not None else set()

    def released_count(self) -> int:
        return len(self._released)

    # ------------------------------------------------------------ inputs

    def hold(
        self, rid: str, blocks: Sequence[int], lease: float, until_ms: int, now: float
    ) -> bool:
        """The engine handed ``rid`` over: hold ``blocks`` until every claim
        ended, or ``lease`` seconds with none. True when it is released at once
        (its readers were already done). A repeated hold, or one for a
        hand-over already released, changes nothing (the same id handed over
        again, with another key, is a new hand-over)."""
        if (rid, until_ms) in self._released:
            return False
        h = self._holds.get(rid)
        if h is not None and h.known:
            return False
        digest = blocks_digest(blocks)
        if h is None or (h.n, h.digest, h.until_ms) != (len(blocks), digest, until_ms):
            # (Claims verified against another block list cannot be this
            # request's: the scheduler makes one key per hand-over.)
            if h is not None:
                self._pending -= 1
            h = self._holds[rid] = _Hold(
                len(blocks), digest, self.key(rid, blocks, until_ms), until_ms, now + lease, now
            )
        else:
            self._pending -= 1
        h.known = True
        h.lease_end = now + lease
        h.lease = lease
        if h.read and not h.claims:
            self._release(rid, h)
            return True
        self._schedule(rid, h.lease_end)
        return False

    def claim(
        self,
        src: int,
        rid: str,
        nonce: str,
        key: Any,
        ttl: Any,
        first: Any,
        last: Any,
        n: Any,
        digest: Any,
        until_ms: Any,
        now: float,
        wall_ms: int,
        readers: Any = 1,
    ) -> Answer:
        """``src`` asks to read blocks ``[first, last)`` of ``rid``'s ``n`` blocks
        (their list hashing to ``digest``) until ``now + ttl``, with the key
        valid until ``until_ms``; ``nonce`` names this claim (its grant and its
        ``done``). ``wall_ms``: this host's wall clock. ``readers``: how many
        decode workers read ``rid`` from here (each its heads); it is held
        until that many clusters are done, or its lease runs out."""
        if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and 0 < ttl <= self.max_ttl):
            return self._refuse(
                src, rid, nonce, f"a claim's deadline must be in (0, {self.max_ttl}] s"
            )
        if not self._verify(rid, key, n, digest, until_ms):
            return self._refuse(src, rid, nonce, "wrong grant key")
        if (rid, until_ms) in self._released or wall_ms >= until_ms:
            return self._refuse(
                src, rid, nonce, "the prefill instance's lease on its blocks expired"
            )
        if not (type(first) is int and type(last) is int and 0 <= first < last <= n):
            return self._refuse(src, rid, nonce, f"blocks [{first}, {last}) not in [0, {n})")
        if not (type(readers) is int and 1 <= readers <= MAX_READERS):
            return self._refuse(src, rid, nonce, f"readers {readers!r} not in [1, {MAX_READERS}]")
        h = self._holds.get(rid)
        if h is None:
            if self._pending >= self.max_pending:
                return self._refuse(src, rid, nonce, "too many requests claimed before hand-over")
            h = self._new_pending(rid, n, digest, key, until_ms, now)
        elif (h.n, h.digest, h.until_ms) != (n, digest, until_ms):
            return self._refuse(src, rid, nonce, "the claimed blocks are not the request's")
        end = now + ttl
        h.claims[src, nonce] = max(end, h.claims.get((src, nonce), end))
        h.readers = max(h.readers, readers)
        h.read = False
        self._schedule(rid, end)
        return Answer(src, rid, nonce, "grant")

    def done(self, src: int, rid: str, nonce: str) -> bool:
        """``src``'s claim ``nonce`` finished reading ``rid`` (its pull is
        quiescent). True when that released the request. For a claim it did
        not make: ignored."""
        h = self._holds.get(rid)
        if h is None or (src, nonce) not in h.claims:
            return False
        del h.claims[src, nonce]
        h.finished.add(src)
        return self._maybe_read(rid, h)

    def free(
        self,
        src: int,
        rid: str,
        key: Any,
        n: Any,
        digest: Any,
        until_ms: Any,
        now: float,
        wall_ms: int,
    ) -> bool:
        """``src`` will not read ``rid`` after all (its request was aborted or
        found its prefix locally): release it as soon as no claim reads it.
        Needs the request's key. True when that released it now."""
        if not self._live_key(rid, key, n, digest, until_ms):
            return False
        h = self._holds.get(rid)
        if h is None:
            # Before the hand-over: remembered (bounded), released with it.
            if wall_ms >= until_ms or self._pending >= self.max_pending:
                return False
            h = self._new_pending(rid, n, digest, key, until_ms, now)
        elif (h.n, h.digest, h.until_ms) != (n, digest, until_ms):
            return False
        h.finished.add(src)
        if h.claims:
            return False
        return self._maybe_read(rid, h)

    def renew(
        self,
        src: int,
        rid: str,
        key: Any,
        n: Any,
        digest: Any,
        until_ms: Any,
        now: float,
        wall_ms: int,
    ) -> bool:
        """A decode that holds ``rid``'s params (its key proves it) is alive and
        will claim it: its lease runs another full lease from ``now``, never
        past the key's expiry (the longest a hand-over is held). True when it
        was extended. Before the hand-over, or for a released request: nothing."""
        if not self._live_key(rid, key, n, digest, until_ms):
            return False
        h = self._holds.get(rid)
        if h is None or not h.known or (h.n, h.digest, h.until_ms) != (n, digest, until_ms):
            return False
        cap = now + max(0.0, (until_ms - wall_ms) / 1000)
        end = min(now + h.lease, cap)
        if end <= h.lease_end:
            return False
        # No new heap entry: the one due at the old lease end finds the lease
        # running and schedules its end (one entry per hold, whatever the
        # renewals).
        h.lease_end = end
        return True

    def tick(self, now: float, wall_ms: int) -> list[str]:
        """Time passes: returns the requests released now (leases that ran
        out, claims whose deadline passed). Records of requests claimed but
        never handed over are dropped ``pending_ttl`` after their last claim;
        released ids are forgotten once their keys expired."""
        released: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            _, _, rid = heapq.heappop(self._heap)
            h = self._holds.get(rid)
            if h is None:
                continue
            for ckey, end in list(h.claims.items()):
                if end <= now:
                    del h.claims[ckey]
            if h.claims:
                self._schedule(rid, min(h.claims.values()))
            elif h.known:
                if h.lease_end <= now:
                    if not h.read:
                        self.expired += 1
                    self._release(rid, h)
                    released.append(rid)
                else:
                    self._schedule(rid, h.lease_end)
            elif h.created + self.pending_ttl <= now:
                del self._holds[rid]
                self._pending -= 1
            else:
                self._schedule(rid, h.created + self.pending_ttl)
        while self._released:
            hid = next(iter(self._released))
            if hid[1] > wall_ms:
                break
            del self._released[hid]
        return released

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (``None``: nothing held)."""
        return self._heap[0][0] if self._heap else None

    # ------------------------------------------------------------ internals

    def _verify(self, rid: str, key: Any, n: Any, digest: Any, until_ms: Any) -> bool:
        if not (
            isinstance(key, str)
            and type(n) is int
            and isinstance(digest, str)
            and type(until_ms) is int
        ):
            return False
        return hmac.compare_digest(grant_key(self._secret, rid, n, digest, until_ms), key)

    def _live_key(self, rid: str, key: Any, n: Any, digest: Any, until_ms: Any) -> bool:
        """``key`` verifies for ``rid`` and its hand-over was not released."""
        return self._verify(rid, key, n, digest, until_ms) and (rid, until_ms) not in self._released

    def _new_pending(
        self, rid: str, n: int, digest: str, key: str, until_ms: int, now: float
    ) -> _Hold:
        h = self._holds[rid] = _Hold(n, digest, key, until_ms, math.inf, now)
        self._pending += 1
        self._schedule(rid, now + self.pending_ttl)
        return h

    def _schedule(self, rid: str, when: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, rid))

    def _maybe_read(self, rid: str, h: _Hold) -> bool:
        if h.claims or len(h.finished) < h.readers:
            return False
        h.read = True
        if h.known:
            self._release(rid, h)
            return True
        return False

    def _refuse(self, src: int, rid: str, nonce: str, why: str) -> Answer:
        return Answer(src, rid, nonce, "refused", why)

    def _release(self, rid: str, h: _Hold) -> None:
        if self._holds.pop(rid, None) is not None and not h.known:
            self._pending -= 1
        self._released[rid, h.until_ms] = None


class Registration:
    """Decode side's block ids for one push transfer, from its parts.

    Bound to the cluster that sent the first part: parts from any other link
    are refused. At most ``max_blocks`` ids (a push never writes more blocks
    than a request holds on the prefill side, so the prefill's own block
    count) of at most ``max_id``, checked before anything is built, so a peer
    cannot make this side build a list longer than its own KV cache. (The
    ids are the decode side's: its transfers check them against its cache.)
    """

    MAX_ID = 1 << 40

    def __init__(self, max_blocks: int, runs_per_part: int) -> None:
        self.max_blocks = max_blocks
        self.runs_per_part = runs_per_part
        self.src: int | None = None
        self.parts: int | None = None
        self._got: dict[int, list[tuple[int, int]]] = {}
        self._count = 0

    @property
    def count(self) -> int:
        """Ids registered so far."""
        return self._count

    def add(self, src: int, part: Any, parts: Any, runs: Any) -> list[int] | None:
        """One part; the whole id list once the last part is in, else ``None``.
        Raises :class:`BadMessage` for a part that does not hold."""
        if self.src is not None and src != self.src:
            raise BadMessage(f"cluster {src} registered for another cluster's transfer")
        max_parts = -(-self.max_blocks // self.runs_per_part) + 1
        if not (type(parts) is int and 1 <= parts <= max_parts):
            raise BadMessage(f"a registration of {parts!r} parts (at most {max_parts})")
        if self.parts is not None and parts != self.parts:
            raise BadMessage("the registration's part count changed")
        if not (type(part) is int and 0 <= part < parts) or part in self._got:
            raise BadMessage(f"registration part {part!r} of {parts}: repeated or out of range")
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
            raise BadMessage(f"a registration part holds at most {self.runs_per_part} runs")
        out = []
        total = self._count
        for r in runs:
            if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)):
                raise BadMessage(f"a block run must be [start, count], got {r!r}")
            start, count = r
            if not (0 <= start and 1 <= count and start + count <= self.MAX_ID):
                raise BadMessage(f"block run {r!r} outside [0, 2**40)")
            total += count
            if total > self.max_blocks:
                raise BadMessage(
                    f"more blocks registered than the {self.max_blocks} a request can hold here"
                )
            out.append((start, count))
        self._count = total
        return out
