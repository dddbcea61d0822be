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

import dataclasses
from collections.abc import Sequence

from ..memory.state import State
from ..model.errors import LLMStatusCode
from .discovery import Registry
from .handler import PeerHandler
from .linker import Linker
from .links import Links
from .lookups import Lookups
from .probe import Prober
from .retire import Retirement
from .servicethread import ServiceThread

__all__ = ["PeerService", "overall"]

def overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
    """The last non-success status of ``results``, else SUCCESS (as
    LLM-DataDist's link manager reports it)."""
    for r in reversed(results):
        if r != LLMStatusCode.LLM_SUCCESS:
            return r
    return LLMStatusCode.LLM_SUCCESS


class PeerService:
    """The service thread and the parts of the control plane that run on it.

    It assembles the parts and closes them; callers use the part that does
    the work (``thread.call``, ``linker.link_all``, ``lookups.remote_by_id``,
    ``retirement.retire_local`` ...), never a forward through here.
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

    async def close(self) -> None:
        """Leave etcd, close the server and every connection; cancel background
        work (service loop)."""
        if self.registry is not None:
            await self.registry.close()
        await self.linker.close_server()
        await self.links.close_all()
        await self.thread.cancel_spawned()
        self.prober.close()

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
        await registry.start(role, self.linker.listen_address)
        self.registry = self.linker.registry = registry

    async def update_registration(self, role: int) -> None:
        """The role or the control address changed (switch_role): tell etcd."""
        if self.registry is not None:
            await self.registry.update(role, self.linker.listen_address)
