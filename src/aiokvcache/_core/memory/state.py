"""The state two threads share: local caches, links, remote cache records.

Two threads touch it: the owner's event loop (the user's calls) and the peer
service thread (peers' requests, link changes, invalidations). The locking
rule is one lock, :attr:`State.lock`:

* every read that must be consistent and every write of the tables here
  (``CacheTable``'s dicts, ``State.links``, ``Link.remote``, the ``valid`` and
  ``jobs`` fields of records) happens with the lock held;
* the lock is held only for short, non-blocking work: dict operations,
  ``engine.submit`` / ``engine.cancel`` (queue a command, never wait), never
  an ``await``, never a native call that waits for the progress thread;
* nothing else is shared: each ``asyncio`` object belongs to one loop (the
  bridge's futures to the owner's, control connections to the service's).

**Leases.** Every use of a cache's memory holds a :class:`Lease` on it,
taken through one API, :meth:`State.lease`: native jobs (transfers, link
probes), work on another thread (local copies) and copies done inside the
critical section itself (inline copies). ``lease`` checks that every cache is
still valid and starts the work in one critical section of the lock, so a
retirement either sees the lease or the user sees the retirement. Whoever
retires a cache marks it invalid and snapshots its leases under the lock: no
use can start afterwards and every use that started is in the snapshot; it
cancels the native ones and waits until the engine released them and the
thread work ended (:meth:`State.leases_done`) before memory or keys go.

**Exposure.** A cache's metadata (addresses, keys) handed to a peer lets that
peer write it without us. Each cache remembers every link its metadata went
out on (:attr:`LocalCache.exposed`, recorded in the same critical section as
the lookup that served it); retirement waits for each of those links to be
proven quiescent — the peer confirmed the invalidation, or confirmed an
unlink after its own jobs were released, or our endpoint to it closed at the
transport — whether or not the link is still in :attr:`State.links`.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._loader import native
from ..config.options import EngineOptions
from ..model.errors import LLMException, LLMStatusCode, make_error
from ..model.types import BlocksCacheKey, Cache, CacheDesc, CacheKey
from ..wire.control import ControlConnection, LocalInfo
from .ctlregion import ControlRegion

__all__ = ["CacheTable", "Lease", "Link", "LocalCache", "RemoteCache", "State"]


@dataclass(eq=False, slots=True)
class Lease:
    """One use of cache memory, held from its start until it is over.

    ``jobs``: the native jobs of the use (released by the engine; a
    retirement cancels them). ``done``: set when work on another thread
    ended (None for native jobs). ``holders``: the records it is held on.
    ``eps``: the endpoints its jobs ran on — a job the engine released
    unproven (a frozen peer) may still move bytes until its endpoint closed
    (``Engine.endpoint_unproven``).
    """

    jobs: list[int]
    done: threading.Event | None
    holders: tuple[Any, ...]
    eps: frozenset[int] = frozenset()


@dataclass(eq=False)
class LocalCache:
    """A cache of ours: its memory regions, keys and the jobs using it."""

    cache: Cache
    desc: CacheDesc
    addrs: list[int]
    regions: list[tuple[int, int, int]]  # (region id, base, length)
    tensor_region: list[int]  # index into regions, per tensor
    remote_accessible: bool
    allocated: bool
    keys: dict[CacheKey, int] = field(default_factory=dict)  # key -> batch index
    leases: set[Lease] = field(default_factory=set)  # live uses of its memory
    #: Every endpoint a job of ours on it ever ran on (see State.used_quiet).
    used_eps: set[int] = field(default_factory=set)
    valid: bool = True
    rkeys: list[bytes] | None = None  # packed, per region (lazily)
    blocks_key: BlocksCacheKey | None = None
    #: Links its metadata was served on (see the module docstring, "Exposure").
    exposed: set[Link] = field(default_factory=set)
    #: Its retirement word in the control region (see :mod:`.ctlregion`):
    #: slot index, or -1 without one.
    guard_slot: int = -1

    @property
    def cache_id(self) -> int:
        """The cache's id."""
        return self.cache.cache_id

    @property
    def is_blocks(self) -> bool:
        """Whether it is a blocks (paged) cache."""
        return self.cache.is_blocks_cache


@dataclass(eq=False)
class RemoteCache:
    """A peer's cache as we use it: its metadata and our unpacked keys."""

    cache_id: int
    desc: CacheDesc
    addrs: list[int]
    tensor_rkey: list[int]  # native rkey id per tensor
    rkey_ids: list[int]
    is_blocks: bool = False
    leases: set[Lease] = field(default_factory=set)  # live uses of its memory
    #: Every endpoint a job of ours on it ever ran on (see State.used_quiet).
    used_eps: set[int] = field(default_factory=set)
    valid: bool = True
    #: (control-region rkey id, address, expected word): the job guard that
    #: tells a transfer the owner retired this cache (see ext/job.hpp).
    guard: tuple[int, int, int, bool] | None = None
    # Checked transfer plans between it and our caches (slots.Plan),
    # owner loop only; they go with the record.
    plans: dict[tuple[Any, ...], Any] = field(default_factory=dict)


@dataclass(eq=False)
class Link:
    """A linked peer: its control connection and our UCX endpoint to it.

    ``conn`` belongs to the service loop; the owner reads only ``ep``,
    ``broken``, ``reason`` and ``remote`` (under the lock).
    """

    cluster_id: int
    conn: ControlConnection
    ep: int
    broken: bool = False
    reason: str = ""
    remote: dict[int, RemoteCache] = field(default_factory=dict)  # by remote cache id
    #: Ids of caches the peer retired (its invalidate): never recorded again,
    #: whatever metadata of them an install still holds (a background one,
    #: Lookups._prefetch, runs off the service loop). The peer's ids grow.
    retired: set[int] = field(default_factory=set)
    #: The peer's blocks cache each BlocksCacheKey was last found bound to
    #: (model id -> its record). A blocks key leaves its cache only when the
    #: cache retires, so a record still valid is still bound (Transfers).
    blocks_keys: dict[int, RemoteCache] = field(default_factory=dict)
    #: Our rkey id for the peer's control region (its probe slots and
    #: retirement words), unpacked when the link is probed.
    ctl_rkey: int | None = None
    #: (base, length) of the peer's control region.
    ctl_span: tuple[int, int] = (0, 0)
    #: Set once the link's data path moved bytes both ways.
    up: bool = False
    #: The acceptor's side: our half of the data path worked (probe_back);
    #: the link is up once the initiator says its half worked too (link_up).
    half_up: bool = False
    #: A put probe the peer asked for is running (service loop): one at a
    #: time per link, so that a peer cannot hold many of our polls.
    put_probing: bool = False
    #: Set once no retirement waits for this link any more: the peer
    #: confirmed an unlink after its jobs were released (nothing it posted
    #: can reach our memory), or it was cut off (``cut_off``: what it posted
    #: may still land; see ``Retirement._quarantine`` in :mod:`.retire`).
    quiescent: bool = False
    #: Set when it was cut off: dropped without the peer's confirmation.
    cut_off: bool = False


#: How many tensor spans before an address cache_at() looks at.
_OVERLAP_LOOKBACK = 64


#: What lease() returns for a use done inside its critical section.
_DONE = Lease([], None, ())


def _retired(holder: Any) -> LLMException:
    if isinstance(holder, RemoteCache):
        what = f"the remote cache {holder.cache_id} was deallocated"
    elif isinstance(holder, LocalCache):
        what = f"the local cache {holder.cache_id} was deallocated"
    else:
        what = "the engine is closing"
    return make_error(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, what)


class CacheTable:
    """Our caches and the keys bound to them (all access under the state lock)."""

    def __init__(self) -> None:
        self.caches: dict[int, LocalCache] = {}
        self.keys: dict[CacheKey, tuple[int, int]] = {}  # key -> (cache id, batch index)
        self.blocks_keys: dict[BlocksCacheKey, int] = {}  # key -> cache id
        self.allocated_bytes = 0
        self._next_id = 1
        # Sorted [start, end) spans of remote-accessible tensors, for
        # cache_by_addr: bisect instead of a scan of every cache.
        self._spans: list[tuple[int, int, int]] = []  # (start, end, cache id)

    def new_cache_id(self) -> int:
        """The next cache id (one counter per instance, from 1)."""
        cid = self._next_id
        self._next_id += 1
        return cid

    def add(self, rec: LocalCache, keys: list[CacheKey], blocks_key: BlocksCacheKey | None) -> None:
        """Make ``rec`` live and bind its keys."""
        self.caches[rec.cache_id] = rec
        for i, k in enumerate(keys):
            if not k.is_placeholder:
                rec.keys[k] = i
                self.keys[k] = (rec.cache_id, i)
        if blocks_key is not None:
            rec.blocks_key = blocks_key
            self.blocks_keys[blocks_key] = rec.cache_id
        if rec.allocated:
            self.allocated_bytes += sum(r[2] for r in rec.regions)
        if rec.remote_accessible:
            for a in rec.addrs:
                bisect.insort(self._spans, (a, a + rec.desc.size, rec.cache_id))

    def drop(self, rec: LocalCache) -> None:
        """Take ``rec`` out of every lookup (its memory is the caller's business)."""
        rec.valid = False
        if self.caches.get(rec.cache_id) is rec:
            del self.caches[rec.cache_id]
        for k in rec.keys:
            self.keys.pop(k, None)
        if rec.blocks_key is not None and self.blocks_keys.get(rec.blocks_key) == rec.cache_id:
            del self.blocks_keys[rec.blocks_key]
        if rec.allocated:
            self.allocated_bytes -= sum(r[2] for r in rec.regions)
        if rec.remote_accessible:
            for a in rec.addrs:
                i = bisect.bisect_left(self._spans, (a, a + rec.desc.size, rec.cache_id))
                if i < len(self._spans) and self._spans[i][2] == rec.cache_id:
                    del self._spans[i]

    def cache_at(self, addr: int) -> LocalCache | None:
        """The live, remote-accessible cache one of whose tensors holds ``addr``.

        O(log n): a bisect, then a look back over at most
        :data:`_OVERLAP_LOOKBACK` spans (only memory a user registered twice
        overlaps).
        """
        i = bisect.bisect_right(self._spans, (addr, 2**64, 2**64))
        for j in range(i - 1, max(i - 1 - _OVERLAP_LOOKBACK, -1), -1):
            start, end, cid = self._spans[j]
            if start <= addr < end:
                rec = self.caches.get(cid)
                if rec is not None and rec.valid:
                    return rec
        return None

    def served(self, cache_id: int, remote_access: bool) -> LocalCache:
        """The cache a peer may use, or the error it gets."""
        rec = self.caches.get(cache_id)
        if rec is None or not rec.valid:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {cache_id} does not exist on the peer"
            )
        if not rec.remote_accessible or not remote_access:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED, f"cache {cache_id} is not remote accessible"
            )
        return rec


class State:
    """Everything of one ``LLMDataDist`` that both threads use (see module docstring)."""

    def __init__(
        self, cluster_id: int, options: EngineOptions, engine: Any, local: LocalInfo
    ) -> None:
        self.lock = threading.RLock()
        self.cluster_id = cluster_id
        self.options = options
        self.engine = engine
        self.local = local
        self.cache_table = CacheTable()
        self.links: dict[int, Link] = {}
        self.linking: set[int] = set()
        #: Set once finalize() begins; read by both threads.
        self.finalized = False
        #: Probe slots and retirement words (see :mod:`.ctlregion`).
        self.ctl = ControlRegion(engine)
        #: Owners of registered user buffers retired unproven: referenced
        #: until finalize (the engine keeps their registrations until close).
        self.held_until_close: list[Any] = []

    # ------------------------------------------------------------- leases

    def lease(
        self,
        holders: Sequence[Any],
        start: Callable[[], list[int]] | None = None,
        eps: frozenset[int] = frozenset(),
    ) -> Lease:
        """Hold ``holders`` (cache records, the control region) for one use.

        The check that every holder is still valid and ``start`` run in one
        critical section of the lock, so a retirement either sees the lease
        or this call sees the retirement (KV_CACHE_NOT_EXIST naming the
        first retired holder). ``start`` submits the use's native jobs and
        returns their ids, or does the whole use itself (an inline copy) and
        returns ``[]``: then nothing is held afterwards. ``start=None``: the
        use is work on another thread; end it with :meth:`end_lease`.
        ``eps``: the endpoints the jobs run on (see :class:`Lease`).
        """
        with self.lock:
            for h in holders:
                if not h.valid:
                    raise _retired(h)
            if start is None:
                lease = Lease([], threading.Event(), tuple(holders), eps)
            else:
                jobs = start()
                if not jobs:  # done inside the critical section: nothing held
                    return _DONE
                lease = Lease(jobs, None, tuple(holders), eps)
            for h in lease.holders:
                h.leases.add(lease)
                if eps:
                    h.used_eps.update(eps)
        return lease

    def end_lease(self, lease: Lease) -> None:
        """The use is over (its jobs released, its thread work done)."""
        with self.lock:
            for h in lease.holders:
                h.leases.discard(lease)
        if lease.done is not None:
            lease.done.set()

    def cancel_leases(self, leases: Iterable[Lease]) -> None:
        """Cancel the native jobs of ``leases`` (thread work cannot be stopped)."""
        ids = [j for lease in leases for j in lease.jobs]
        if ids:
            with contextlib.suppress(native.EngineClosedError):
                self.engine.cancel_many(ids)

    def leases_over(self, leases: Iterable[Lease]) -> bool:
        """True once every job of ``leases`` is released and all their thread work ended."""
        ids: list[int] = []
        for lease in leases:
            if lease.done is not None and not lease.done.is_set():
                return False
            ids.extend(lease.jobs)
        return not ids or self.engine.closed or bool(self.engine.wait_released(ids, 0.0))

    def used_quiet(self, holder: Any) -> bool:
        """True once no endpoint a job of ours on ``holder`` ever ran on holds
        a job the engine released unproven (a frozen peer: its requests may
        still move bytes until the endpoint's close completes). Call once the
        holder's leases are over: a lease ends when its jobs are released,
        and an unproven release outlives it."""
        with self.lock:
            eps = list(holder.used_eps)
        return not any(self.engine.endpoint_unproven(ep) for ep in eps)

    def check_open(self) -> None:
        """ENGINE_FINALIZED once finalize() has begun."""
        if self.finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "this LLMDataDist is finalized")

    def link_for(self, cluster_id: int) -> Link:
        """The usable link to ``cluster_id``; raises NOT_YET_LINK / LINK_FAILED."""
        self.check_open()
        with self.lock:
            link = self.links.get(cluster_id)
        if link is None:
            raise make_error(LLMStatusCode.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked")
        if link.broken:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"link to cluster {cluster_id} is broken: {link.reason}",
            )
        return link
