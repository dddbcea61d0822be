"""The peer service: one thread per ``LLMDataDist`` that owns the control plane.

It runs its own asyncio loop with the control server, every control
connection (accepted and initiated), handshakes, the cache-metadata requests
peers send us and those we send them, invalidations and their
acknowledgements. So peers are served while the owner's event loop is blocked
in a syscall, a synchronous model step or a barrier, as LLM-DataDist serves
them from native threads. The data plane needs no Python on the passive side
at all (one-sided UCX, driven by the engine's progress thread).

:class:`PeerService` holds the parts, each with one job: the thread and its
loop (:class:`.servicethread.ServiceThread`), the live links
(:class:`.links.Links`), the data-path probe (:class:`.probe.Prober`),
linking on request and the listener (:class:`.linker.Linker`), serving peers
(:class:`.handler.PeerHandler`), our lookups of peers' caches
(:class:`.lookups.Lookups`) and retirement (:class:`.retire.Retirement`).
The service never touches the bridge and never completes a future of the
owner's loop itself. Shared tables follow :mod:`.state`'s locking rule.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from ..memory.state import Link, LocalCache, RemoteCache, State
from ..model.errors import LLMStatusCode
from ..model.types import BlocksCacheKey, CacheKey, LLMClusterInfo
from .discovery import Registry
from .handler import PeerHandler
from .linker import Linker
from .links import Links
from .lookups import Lookups
from .probe import Prober
from .retire import Retirement
from .servicethread import ServiceThread

__all__ = ["PeerService", "overall"]

T = TypeVar("T")


def overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
    """The last non-success status of ``results``, else SUCCESS (as
    LLM-DataDist's link manager reports it)."""
    for r in reversed(results):
        if r != LLMStatusCode.LLM_SUCCESS:
            return r
    return LLMStatusCode.LLM_SUCCESS


class PeerService:
    """The service thread and the parts of the control plane that run on it.

    The methods below are the calls the runtime and the public classes make;
    each is one part's.
    """

    def __init__(self, state: State) -> None:
        self._state = state
        self.thread = ServiceThread(f"aiokvcache-service-{state.cluster_id}")
        self.links = Links(state, self.thread)
        self.prober = Prober(state, self.thread)
        # Our handshakes carry a probe slot (the peer's first probe asks nothing).
        state.local = dataclasses.replace(state.local, probe=self.prober.probe_payload)
        self.retirement = Retirement(state, self.thread, self.links)
        self.handler = PeerHandler(state, self.links, self.prober, self.retirement)
        self.lookups = Lookups(state, self.thread, self.prober)
        self.linker = Linker(
            state, self.thread, self.links, self.prober, self.handler, self.lookups.prefetch_soon
        )
        #: This instance's etcd entry and watch (aiokvcache.etcdEndpoint), or None.
        self.registry: Registry | None = None

    # ------------------------------------------------------------- thread

    def call(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the service loop; the caller awaits the result
        through its loop side (see :meth:`.servicethread.ServiceThread.call`)."""
        return self.thread.call(coro)

    def stop(self) -> None:
        """Stop the loop (pending tasks are cancelled) and join the thread."""
        self.thread.stop()

    async def close(self) -> None:
        """Leave etcd, close the server and every connection; cancel background
        work (service loop)."""
        if self.registry is not None:
            await self.registry.close()
        await self.linker.close_server()
        await self.links.close_all()
        await self.thread.cancel_spawned()
        self.prober.close()

    # -------------------------------------------------------------- links

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The bound (host, port) of the control server, if it listens."""
        return self.linker.listen_address

    async def listen(self, host: str, port: int) -> None:
        """Start the control server (service loop)."""
        await self.linker.listen(host, port)

    async def relisten(self, spec: tuple[str, int] | None) -> None:
        """switch_role's listener (see :meth:`.linker.Linker.relisten`)."""
        await self.linker.relisten(spec)

    def set_role(self, role: int) -> None:
        """Announce ``role`` in later handshakes."""
        self.linker.set_role(role)

    async def register(self, role: int) -> None:
        """Register in etcd (``aiokvcache.etcdEndpoint``) with ``role`` and the
        control address, if any; resolve clusters there from now on (service loop)."""
        st = self._state
        opts = st.options
        assert opts.etcd_endpoint is not None
        registry = Registry(
            st,
            self.thread,
            self.links,
            opts.etcd_endpoint,
            opts.etcd_prefix,
            opts.etcd_lease_ttl_s,
        )
        await registry.start(role, self.listen_address)
        self.registry = self.linker.registry = registry

    async def update_registration(self, role: int) -> None:
        """The role or the control address changed (switch_role): tell etcd."""
        if self.registry is not None:
            await self.registry.update(role, self.listen_address)

    async def link_all(
        self, infos: Sequence[LLMClusterInfo], timeout_ms: int
    ) -> list[LLMStatusCode]:
        """Link every cluster concurrently; one status each (service loop)."""
        return await self.linker.link_all(infos, timeout_ms)

    async def unlink_all(
        self, cluster_ids: Sequence[int], timeout_ms: int, force: bool
    ) -> list[LLMStatusCode]:
        """Unlink each cluster in turn (see :meth:`.linker.Linker.unlink_all`)."""
        return await self.linker.unlink_all(cluster_ids, timeout_ms, force)

    def endpoint_failed(self, ep: int, reason: str) -> None:
        """The engine reported an endpoint error (from any thread)."""
        self.links.endpoint_failed(ep, reason)

    async def announce_finalizing(self) -> None:
        """Tell every linked peer we are going, so its errors read as a shutdown."""
        await self.links.announce_finalizing()

    # ------------------------------------------------------------ caches

    def retire_local(self, rec: LocalCache) -> None:
        """Our cache ``rec`` goes (see :meth:`.retire.Retirement.retire_local`)."""
        self.retirement.retire_local(rec)

    async def remote_by_id(self, link: Link, cache_id: int) -> RemoteCache:
        """The peer's cache ``cache_id``, fetched once per link (service loop)."""
        return await self.lookups.remote_by_id(link, cache_id)

    async def remote_by_key(self, link: Link, key: CacheKey) -> tuple[RemoteCache, int]:
        """The peer's cache and batch index bound to ``key`` (service loop)."""
        return await self.lookups.remote_by_key(link, key)

    async def remote_blocks(self, link: Link, key: BlocksCacheKey) -> RemoteCache:
        """The peer's blocks cache bound to ``key`` (service loop)."""
        return await self.lookups.remote_blocks(link, key)

    async def remotes_by_addr(self, link: Link, addrs: list[int]) -> None:
        """Ask the peer which caches hold ``addrs``; record every one (service loop)."""
        await self.lookups.remotes_by_addr(link, addrs)
