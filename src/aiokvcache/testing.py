"""Helpers for tests, benchmarks and examples: a linked pair, a peer process.

Not part of the transfer API; it uses nothing but that API (``aiokvcache``),
the standard library and NumPy.

In one process:

* :func:`pair` (an async context manager) and :func:`make_pair`: a prompt
  :class:`~aiokvcache.LLMDataDist` (cluster 1) linked to a listening decoder
  (cluster 2), as a :class:`Pair`; :func:`options` and :func:`cluster_info`
  build what :meth:`~aiokvcache.LLMDataDist.init` and
  :meth:`~aiokvcache.LLMDataDist.link_clusters` take.
* :func:`fill`, :func:`snapshot`, :func:`same`, :func:`assert_still`,
  :func:`status_of`, :func:`blocks_desc`: small checks on caches.

Across processes:

* :class:`Child`: any child process spoken to in lines on stdin/stdout,
  always killed and reaped on :meth:`~Child.close` (a ``with`` block).
* :class:`Peer` (blocking) and :class:`AsyncPeer` (asyncio): the peer
  program, ``python -m aiokvcache._peer MODE ...``, spoken to in JSON lines:
  it prints one JSON object when ready (:attr:`Peer.hello`), then answers
  each request ``{"op": ..., ...}`` with one JSON object. Its modes:

  ``decode``
      the decode side of ``python -m aiokvcache bench``: a decoder
      (cluster 2) owning one KV cache of the bench's shape options;
      ``hello = {"address", "cache_id"}``; ops ``wait`` (``tag``: every
      layer of that tag landed), ``digest``.
  ``blocks TRANSPORT TENSORS BLOCKS BLOCK_BYTES``
      a decoder owning two uint8 blocks caches, ``BlocksCacheKey(2, 0)``
      zeroed and ``BlocksCacheKey(2, 1)`` filled from seed 99 (unless
      ``--no-pattern``); ``hello = {"address"}``; op ``hash`` (``cache``,
      ``tensor``, ``blocks``).
  ``blocked TRANSPORT``
      a decoder that blocks its own event loop on request (``time.sleep``
      or a pure-Python busy loop), to show that peers are served meanwhile;
      ``hello = {"address", "push", "pull", "gone"}`` (cache ids); ops
      ``block`` (``how``, ``seconds``: answers ``{"blocking": true}``, then
      ``{"unblocked_at", "sha"}``) and, while blocked, ``dealloc``.
  ``engine TRANSPORT SIZE``
      a bare native engine owning one zeroed region; ``hello = {"worker",
      "addr", "size", "rkey", "pid"}``; ops ``hash`` (``offset``,
      ``length``), ``fill`` (``seed``), ``notes`` (``count``).

  ``prefill TRANSPORT`` / ``decoder TRANSPORT``
      an :class:`~aiokvcache.LLMDataDist` driven op by op (prompt role,
      cluster 1 / decoder role, cluster 2 by default; ``--cluster-id``,
      ``--listen IP:PORT`` (the decoder's default 127.0.0.1:0),
      ``--auth-token``, ``--sync-kv-timeout MS``); ``hello = {"address",
      "pid", "cluster_id", "rss_kb"}``. Caches are named by the caller:
      ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed``: uint8 tensors
      of ``[1, bytes]``; answers ``cache_id``, ``addrs``, ``sha``),
      ``fill``, ``hash``, ``free``; links: ``link`` / ``unlink``
      (``address``, ``cluster_id``, ``timeout_ms``; answer ``status``,
      ``per``, ``seconds``); transfers: ``push`` / ``pull`` (``cluster_id``,
      ``cache_id``, ``src`` / ``dst``, ``call_timeout``: the call's ``timeout=``,
      seconds, default 5) answer ``status`` (an
      ``LLMStatusCode`` name, ``"LLM_SUCCESS"`` included: a failed transfer
      is a result, not an error), ``start`` and ``end`` (``time.monotonic()``,
      the same clock as the caller's on one machine), ``seconds`` and
      ``message``; ``loop`` (``loop``, ``count``, ``seconds``, ``srcs``,
      ``stop_on_error``) pushes back to back in the background,
      ``loop_status`` / ``loop_join`` (``wait`` seconds) report on it; ``reinit`` replaces the
      LLMDataDist by a fresh one; ``rss``, ``stats``.

  Every mode exits on ``{"op": "exit"}`` or end of input, ignores SIGINT
  (its parent decides when it ends) and takes ``--lifetime SECONDS``.
  :class:`AsyncPeer` runs it inside a network namespace with ``netns=``.

Across hosts (network namespaces, root only): :class:`NetCluster` makes N
hosts cabled to one bridge, :meth:`NetCluster.peer` starts the peer program
inside one, :meth:`NetCluster.cut` / :meth:`~NetCluster.restore` take a
host's cable down and up; :meth:`AsyncPeer.signal` stops, continues or kills
a host's process; :func:`read_memory` reads a (stopped) process's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiokvcache import (
    Cache,
    CacheDesc,
    CacheManager,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

from ._netcluster import (
    NETNS_PREFIX,
    NETNS_SUBNET,
    NetCluster,
    NetHost,
    netns_cleanup_stale,
    netns_unavailable,
)
from ._peerclient import AsyncPeer, Child, Peer, PeerError, PeerExited, peer_argv
from ._procfs import read_memory, rss_kb, threads_cpu_s

__all__ = [
    "DECODER_ID",
    "NETNS_PREFIX",
    "NETNS_SUBNET",
    "PROMPT_ID",
    "AsyncPeer",
    "Child",
    "NetCluster",
    "NetHost",
    "Pair",
    "Peer",
    "PeerError",
    "PeerExited",
    "assert_still",
    "blocks_desc",
    "cluster_info",
    "fill",
    "make_pair",
    "netns_cleanup_stale",
    "netns_unavailable",
    "options",
    "pair",
    "peer_argv",
    "read_memory",
    "rss_kb",
    "same",
    "snapshot",
    "status_of",
    "threads_cpu_s",
]

PROMPT_ID, DECODER_ID = 1, 2

# ---------------------------------------------------------------- in one process


def options(transport: str = "auto", listen: bool = False, **extra: Any) -> dict[str, str]:
    """:meth:`LLMDataDist.init` options: ``transport``, a listen address on
    127.0.0.1 (any port) if ``listen``, and any :class:`LLMConfig` attribute
    as a keyword (``sync_kv_timeout=60_000``, ``max_inflight_bytes=...``)."""
    cfg = LLMConfig()
    cfg.transport = transport
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    for k, v in extra.items():
        if not hasattr(type(cfg), k):
            raise AttributeError(f"LLMConfig has no option {k!r}")
        setattr(cfg, k, v)
    return cfg.generate_options()


def cluster_info(target: LLMDataDist | str, cluster_id: int | None = None) -> LLMClusterInfo:
    """Where to link to: a listening ``LLMDataDist`` or an ``"ip:port"`` address.

    ``cluster_id`` is the id we expect to find there: by default the
    instance's own; required with an address.
    """
    if isinstance(target, LLMDataDist):
        address = target.listen_address
        if address is None:
            raise ValueError("that LLMDataDist does not listen")
        cid = target.cluster_id if cluster_id is None else cluster_id
    else:
        if cluster_id is None:
            raise ValueError("cluster_id is required with an address")
        address, cid = target, cluster_id
    host, port = address.rsplit(":", 1)
    info = LLMClusterInfo()
    info.remote_cluster_id = cid
    info.append_remote_ip_info(host, int(port))
    return info


@dataclass
class Pair:
    """A prompt (cluster 1) linked to a listening decoder (cluster 2), one process."""

    prompt: LLMDataDist  # cluster 1, links to the decoder
    decoder: LLMDataDist  # cluster 2, listens

    @property
    def p(self) -> CacheManager:
        """The prompt's cache manager."""
        return self.prompt.cache_manager

    @property
    def d(self) -> CacheManager:
        """The decoder's cache manager."""
        return self.decoder.cache_manager

    def submitted(self) -> int:
        """Native jobs both engines were given so far."""
        return int(self.p.stats()["jobs_submitted"]) + int(self.d.stats()["jobs_submitted"])

    def live_jobs(self) -> int:
        """Native jobs not yet released, both engines together."""
        return int(self.p.stats()["live_jobs"]) + int(self.d.stats()["live_jobs"])

    async def close(self) -> None:
        """Finalize both (idempotent)."""
        try:
            await self.prompt.finalize()
        finally:
            await self.decoder.finalize()


async def make_pair(transport: str = "auto", **extra: Any) -> Pair:
    """Start a decoder and a prompt with :func:`options` ``(transport, **extra)``
    and link them; the caller closes the pair (or use :func:`pair`)."""
    decoder = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    prompt = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    try:
        await decoder.init(options(transport, listen=True, **extra))
        await prompt.init(options(transport, **extra))
        rc, per = await prompt.link_clusters([cluster_info(decoder)], timeout=5000)
        if rc != LLMStatusCode.LLM_SUCCESS or per != [LLMStatusCode.LLM_SUCCESS]:
            raise AssertionError(f"link failed: {rc.name} {[s.name for s in per]}")
    except BaseException:
        await Pair(prompt, decoder).close()
        raise
    return Pair(prompt, decoder)


@contextlib.asynccontextmanager
async def pair(transport: str = "auto", **extra: Any) -> AsyncIterator[Pair]:
    """A linked :class:`Pair` for the ``async with`` block; finalized after it.

    When the block ends normally, no native job may be left live in either
    engine (``AssertionError`` otherwise).
    """
    pr = await make_pair(transport, **extra)
    try:
        yield pr
    except BaseException:
        await pr.close()
        raise
    await pr.close()
    for dd in (pr.prompt, pr.decoder):
        live = dd.cache_manager.stats()["live_jobs"]
        if live:
            raise AssertionError(f"{live} native jobs still live in cluster {dd.cluster_id}")


def blocks_desc(layers: int = 3, blocks: int = 16, tokens: int = 4, dim: int = 8) -> CacheDesc:
    """2 tensors (K, V) per layer, ``blocks`` blocks of ``tokens x dim`` fp16."""
    return CacheDesc(2 * layers, [blocks, tokens, dim], DataType.DT_FLOAT16, Placement.HOST)


def fill(cache: Cache, seed: int) -> None:
    """Every tensor of ``cache`` from ``seed``: random bytes, or normals for floats."""
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        if t.dtype == np.uint8:
            t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
        else:
            t[...] = rng.standard_normal(t.shape).astype(t.dtype)


def snapshot(cache: Cache) -> list[np.ndarray]:
    """Copies of every tensor of ``cache``."""
    return [t.copy() for t in cache.tensors]


def same(before: Sequence[np.ndarray], cache: Cache) -> bool:
    """Whether ``cache`` still holds what :func:`snapshot` took."""
    return all(np.array_equal(x, y) for x, y in zip(before, cache.tensors, strict=True))


async def assert_still(cache: Cache, wait: float = 0.2) -> None:
    """Nothing writes into ``cache`` for ``wait`` seconds (``AssertionError`` otherwise)."""
    before = snapshot(cache)
    await asyncio.sleep(wait)
    if not same(before, cache):
        raise AssertionError("write after the call returned")


async def status_of(aw: Awaitable[Any]) -> LLMStatusCode:
    """The status code of the :class:`LLMException` ``aw`` raises.

    ``AssertionError`` if it raises none; any other exception propagates.
    """
    try:
        await aw
    except LLMException as exc:
        return exc.status_code
    raise AssertionError("no LLMException raised")
