"""Testing helpers for code that uses aiokvcache, in the style of ``trio.testing``.

In one process (asyncio or trio, nothing beyond the base install):

* :func:`pair` (an async context manager) and :func:`make_pair`: a prompt
  :class:`~aiokvcache.LLMDataDist` (cluster 1) linked to a listening decoder
  (cluster 2), as a :class:`Pair`; :func:`options` and :func:`cluster_info`
  build what :meth:`~aiokvcache.LLMDataDist.init` and
  :meth:`~aiokvcache.LLMDataDist.link_clusters` take.
* :func:`fill`, :func:`snapshot`, :func:`same`, :func:`assert_still`,
  :func:`status_of`, :func:`blocks_desc`: small checks on caches.

In a child process:

* :class:`PeerProcess`: an ``LLMDataDist`` in a child process
  (``python -m aiokvcache.testing.peer``), driven by requests; frozen,
  thawed, slowed or killed on demand, to test hand-off code against a peer
  that stops answering, dies or crawls. It runs under asyncio and trio
  (anyio: ``pip install "aiokvcache[pytest]"``).
* :func:`peer_argv`: the peer program's command line, with ops modules of
  one's own (``--ops``: see :mod:`aiokvcache.testing.peer`), for
  :class:`JsonChild` (async) or :class:`JsonPeer` (blocking), which start
  any program that speaks JSON lines; :class:`Child`: any child program
  spoken to in lines (blocking). Each is always killed and reaped when it
  closes; :class:`PeerError`, :class:`PeerExited`.
* :func:`read_memory`, :func:`rss_kb`, :func:`thread_cpu_s`,
  :func:`threads_cpu_s`: what ``/proc`` tells of a process.

Hosts in network namespaces on one bridge (root only), to cut a peer's
cable: :mod:`aiokvcache.testing.netns`.

The fixtures of the pytest plugin (:mod:`aiokvcache.pytest_plugin`) are
built from these.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

from .. import _loopside
from .._child import Child, JsonPeer, PeerError, PeerExited
from ._procfs import read_memory, rss_kb, thread_cpu_s, threads_cpu_s

if TYPE_CHECKING:
    from ._process import JsonChild, PeerProcess

__all__ = [
    "BARE_ENGINE",
    "DECODER_ID",
    "PROMPT_ID",
    "Child",
    "JsonChild",
    "JsonPeer",
    "Pair",
    "PeerError",
    "PeerExited",
    "PeerProcess",
    "assert_still",
    "blocks_desc",
    "cluster_info",
    "fill",
    "freeze_process",
    "make_pair",
    "options",
    "pair",
    "peer_argv",
    "process_frozen",
    "read_memory",
    "rss_kb",
    "same",
    "snapshot",
    "status_of",
    "thread_cpu_s",
    "threads_cpu_s",
]


def __getattr__(name: str) -> Any:
    # The child-process client needs anyio (the "pytest" extra): imported
    # only when asked for.
    if name in ("PeerProcess", "JsonChild", "freeze_process", "process_frozen"):
        from . import _process

        return getattr(_process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PROMPT_ID, DECODER_ID = 1, 2

#: The ops module for ROLE ``none`` that makes the peer a bare native engine
#: owning one region (``--size`` bytes; :mod:`aiokvcache.testing._bare_engine`).
BARE_ENGINE = "aiokvcache.testing._bare_engine"


def peer_argv(
    role: str,
    *args: str,
    ops: Sequence[str] = (),
    lifetime: float | None = None,
    netns: str | None = None,
) -> list[str]:
    """The command line of the peer program, ``python -m
    aiokvcache.testing.peer ROLE ARGS...`` (see there), loading the ops
    modules ``ops`` (module names or ``.py`` paths) and ending after
    ``lifetime`` seconds if given; run inside network namespace ``netns``
    if given (``ip netns exec``, which execs the program itself: the
    child's pid is the peer's)."""
    argv = [sys.executable, "-m", "aiokvcache.testing.peer", role, *args]
    argv += [f"--ops={spec}" for spec in ops]
    if lifetime is not None:
        argv.append(f"--lifetime={lifetime:g}")
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    return argv


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

    @property
    def instances(self) -> tuple[LLMDataDist, LLMDataDist]:
        """(prompt, decoder)."""
        return self.prompt, self.decoder

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
    engine (``AssertionError`` otherwise, after both are finalized): a
    transfer still moving when its test returned is a bug of the test.
    """
    pr = await make_pair(transport, **extra)
    try:
        yield pr
    except BaseException:
        await pr.close()
        raise
    live = {dd.cluster_id: int(dd.cache_manager.stats()["live_jobs"]) for dd in pr.instances}
    await pr.close()
    left = {cid: n for cid, n in live.items() if n}
    if left:
        raise AssertionError(f"native jobs still live when the block ended: {left} (by cluster)")


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
    await _loopside.current().sleep(wait)
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
