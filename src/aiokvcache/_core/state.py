"""The state two threads share: local caches, links, remote cache records.

Two threads touch it: the owner's event loop (the user's calls) and the peer
service thread (peers' requests, link changes, invalidations). The locking
rule is one lock, :attr:`State.lock`:

* every read that must be consistent and every write of the tables here
  (``Registry``'s dicts, ``State.links``, ``Link.remote``, the ``valid`` and
  ``jobs`` fields of records) happens with the lock held;
* the lock is held only for short, non-blocking work: dict operations,
  ``engine.submit`` / ``engine.cancel`` (queue a command, never wait), never
  an ``await``, never a native call that waits for the progress thread;
* nothing else is shared: each ``asyncio`` object belongs to one loop (the
  bridge's futures to the owner's, control connections to the service's).

A transfer records the native job ids it submitted in the ``jobs`` set of
every cache it touches, under the lock and in the same critical section as
the submit. Whoever retires a cache marks it invalid and takes a snapshot of
that set under the lock, so no job can start on it afterwards and every job
that started is in the snapshot: it cancels them and waits, natively, until
the engine has released each one before memory or keys go.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from .control import ControlConnection, LocalInfo
from .errors import LLMStatusCode, make_error
from .options import EngineOptions
from .types import BlocksCacheKey, Cache, CacheDesc, CacheKey

__all__ = ["Link", "LocalCache", "Registry", "RemoteCache", "State"]


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
    jobs: set[int] = field(default_factory=set)  # live native jobs using it
    valid: bool = True
    rkeys: list[bytes] | None = None  # packed, per region (lazily)
    blocks_key: BlocksCacheKey | None = None

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
    jobs: set[int] = field(default_factory=set)  # live native jobs using it
    valid: bool = True
    # Checked transfer plans between it and our caches (transfers.Plan),
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
    #: (region id, address) of the small buffer the link's data-path probes use.
    probe: tuple[int, int] | None = None


class Registry:
    """Our caches and the keys bound to them (all access under the state lock)."""

    def __init__(self) -> None:
        self.caches: dict[int, LocalCache] = {}
        self.keys: dict[CacheKey, tuple[int, int]] = {}  # key -> (cache id, batch index)
        self.blocks_keys: dict[BlocksCacheKey, int] = {}  # key -> cache id
        self.allocated_bytes = 0
        self._next_id = 1

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
        self.registry = Registry()
        self.links: dict[int, Link] = {}
        self.linking: set[int] = set()
        #: Set once finalize() begins; read by both threads.
        self.finalized = False

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
