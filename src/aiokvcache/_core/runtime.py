"""The runtime of one ``LLMDataDist``: engine, bridge, peer service, shared state.

Built by ``LLMDataDist.init()`` on the owner's event loop (the loop the
bridge binds to: asyncio or trio, see :mod:`aiokvcache._loopside`), torn down
by ``finalize()``. The public classes are thin surfaces over it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import logging
import socket
import struct
from typing import Any

from .. import _loopside, _telemetry, _ucxlog
from .._bridge import Bridge
from .._loader import native
from .._loopside import LoopSide, ServiceGone
from .caches import LocalCaches
from .config.options import EngineOptions
from .memory.state import Link, State
from .model.errors import LLMStatusCode, make_error
from .model.types import LLMClusterInfo
from .peers.service import PeerService, overall
from .transfer.copies import LocalCopies
from .transfer.notify import Receiver
from .transfer.runner import Runner, engine_finalized
from .transfer.transfers import Transfers
from .wire.control import LocalInfo

__all__ = ["Runtime"]

log = logging.getLogger("aiokvcache")

_SIOCGIFADDR = 0x8915  # linux/sockios.h


def _interface_of(ip: str) -> str | None:
    """The local interface that holds address ``ip`` (IPv4), or None."""
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address on it
            if got[20:24] == packed:
                return name
    return None


def _ucx_options(opts: EngineOptions) -> dict[str, str]:
    """UCX settings from the options: which interfaces the data plane uses,
    and the RDMA traffic class and service level.

    ``net_devices`` when set; else, when the control plane listens on one
    specific address, the interface holding it — a multi-homed host then
    advertises and uses the interface its peers reach it on, not a
    management NIC or a default route elsewhere; else every interface.
    """
    devices = opts.net_devices
    if devices == "all" and opts.listen_host not in (None, "0.0.0.0", "::", ""):
        assert opts.listen_host is not None
        found = _interface_of(opts.listen_host)
        if found is not None and found != "lo":
            devices = found
    out = {} if devices == "all" else {"NET_DEVICES": devices}
    # LLM-DataDist's RDMA QoS options, for UCX's IB transports where this
    # build has them ('?': best effort, see Engine).
    if opts.rdma_traffic_class is not None:
        out["?IB_TRAFFIC_CLASS"] = str(opts.rdma_traffic_class)
    if opts.rdma_service_level is not None:
        out["?IB_SL"] = str(opts.rdma_service_level)
    return out


def _host_id() -> bytes:
    """This machine's boot id: peers with the same one can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


class Runtime:
    """Everything an initialized ``LLMDataDist`` runs on."""

    def __init__(self, cluster_id: int, role: int, opts: EngineOptions) -> None:
        """Start the engine, the bridge (on the running loop) and the service thread."""
        # The async library (asyncio or trio) first: under anything else
        # nothing has started yet.
        side = _loopside.current()
        try:
            engine = native.Engine(
                opts.transport,
                max_inflight_bytes=opts.max_inflight_bytes,
                max_unconfirmed_bytes=opts.max_unconfirmed_bytes,
                copy_lanes=opts.copy_lanes,
                progress_spin_us=opts.progress_spin_us,
                # Liveness off the GIL: see Links._heartbeat.
                keepalive_ms=opts.peer_timeout_ms // 4,
                direct_copy=opts.direct_copy,
                prewarm=opts.prewarm,
                prefault=opts.prefault,
                ucx_options=_ucx_options(opts),
            )
        except (native.NativeError, ValueError) as exc:
            _ucxlog.drain()  # UCX's reasons, into the aiokvcache.ucx logger
            code = (
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED
                if opts.transport != "auto"
                else LLMStatusCode.LLM_FAILED
            )
            raise make_error(
                code, f"cannot start the transfer engine with transport={opts.transport!r}: {exc}"
            ) from exc
        _ucxlog.drain()  # what UCX said while it started
        local = LocalInfo(
            cluster_id=cluster_id,
            role=role,
            worker_address=engine.worker_address,
            auth_token=opts.auth_token,
            host_id=_host_id(),
        )
        self.state = State(cluster_id, opts, engine, local)
        self.side: LoopSide = side
        self.bridge = Bridge(engine, side)
        self.runner = Runner(self.state, self.bridge)
        self.receiver = Receiver(side)
        self.service = PeerService(self.state)
        #: This instance's caches: memory, records, keys, retirement.
        self.caches = LocalCaches(self.state, self.service.retirement)
        #: Copies between this instance's caches.
        self.copies = LocalCopies(self.state, side)
        #: Lookups of peers' caches and transfers to and from them.
        self.transfers = Transfers(
            self.state, self.service.thread, self.service.lookups, self.runner
        )
        self.bridge.on_notify = self.receiver.on_notify
        self.bridge.on_endpoint_error = self._on_endpoint_error
        self._closed = False
        _telemetry.runtimes.add(self)

    @property
    def engine(self) -> native.Engine:
        """The native engine."""
        return self.state.engine  # type: ignore[no-any-return]

    @property
    def options(self) -> EngineOptions:
        """The options the runtime was started with."""
        return self.state.options

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """(host, port) the control server listens on, or None."""
        return self.service.linker.listen_address

    def links(self) -> dict[int, Link]:
        """A snapshot of the links by cluster id."""
        with self.state.lock:
            return dict(self.state.links)

    def stats(self) -> dict[str, int]:
        """Native engine stats plus cache and notification counters
        (``CacheManager.stats``)."""
        rcv = self.receiver
        out = dict(self.engine.stats())
        out["regions"] = max(0, out["regions"] - 1)  # the control region
        caches, allocated = self.caches.counts()
        out.update(caches=caches, allocated_bytes=allocated)
        out.update(
            tag_records=rcv.records,
            dropped_tag_records=rcv.dropped_records,
            dropped_notifications=rcv.dropped_notifications,
            bad_notifications=rcv.bad_notifications,
        )
        return out

    def check_loop(self) -> None:
        """Transfers and notifications belong to the loop that ran init():
        a clear error from any other, before anything is submitted."""
        if not self.side.is_current():
            raise RuntimeError(
                "aiokvcache: this LLMDataDist's transfers and notifications must be awaited "
                f"on the event loop that ran init() ({self.side.name}), not on "
                f"{self.side.describe_current()}"
            )

    async def on_service(self, coro: Any) -> Any:
        """``coro`` run on the peer-service thread, awaited on the owner's loop
        (checked first: from another loop nothing is submitted)."""
        try:
            self.check_loop()
        except RuntimeError:
            coro.close()
            raise
        return await self._on_service(coro)

    async def _on_service(self, coro: Any) -> Any:
        cf: concurrent.futures.Future[Any] = self.service.thread.call(coro)
        try:
            return await self.side.from_service(cf)
        except ServiceGone:
            raise engine_finalized() from None

    def _on_endpoint_error(self, ep: int, ucs_status: int) -> None:
        reason = f"transport error: {native.ucs_status_string(ucs_status)}"
        self.service.links.endpoint_failed(ep, reason)

    async def listen(self, host: str, port: int) -> None:
        """Start the control server on the service thread."""
        await self.on_service(self.service.linker.listen(host, port))

    async def relisten(self, spec: tuple[str, int] | None) -> None:
        """Listen at ``spec`` (host, port) instead, or stop listening (None)."""
        await self.on_service(self.service.linker.relisten(spec))

    def set_role(self, role: int) -> None:
        """The role this instance tells peers from now on."""
        self.service.linker.set_role(role)

    async def register(self, role: int) -> None:
        """Register in etcd (``aiokvcache.etcdEndpoint``, on the service thread)."""
        await self.on_service(self.service.register(role))

    async def update_registration(self, role: int) -> None:
        """Tell etcd the new role and control address (after switch_role)."""
        await self.on_service(self.service.update_registration(role))

    async def link_clusters(
        self, infos: list[LLMClusterInfo], timeout_ms: int
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link each cluster (on the service thread): the overall status and one per cluster."""
        results = await self.on_service(self.service.linker.link_all(infos, timeout_ms))
        return overall(results), results

    async def unlink_clusters(
        self, ids: list[int], timeout_ms: int, force: bool
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink each cluster id (on the service thread): the overall status and
        one per cluster."""
        results = await self.on_service(self.service.linker.unlink_all(ids, timeout_ms, force))
        return overall(results), results

    async def close(self) -> None:
        """finalize(): peers told, transfers ended, links and server closed, memory freed.

        It runs to its end even when the caller is cancelled meanwhile (an
        ``async with`` left by a cancel scope, ``fail_after`` around it) or
        interrupted (Ctrl-C under trio): a finalize cut short would leave the
        engine and its memory behind. The cancellation comes after.
        """
        if self._closed:
            return
        self.check_can_close()
        self._closed = True
        _telemetry.runtimes.discard(self)
        await self.side.shielded(self._close())

    def check_can_close(self) -> None:
        """``RuntimeError`` unless finalize() may run on the calling loop: the
        one that ran init() (under asyncio also any loop once that one no
        longer runs; under trio only the run that ran init())."""
        self.side.check_can_close()

    async def _close(self) -> None:
        st = self.state
        st.finalized = True
        self.caches.invalidate_all()
        self.receiver.close()
        # Tell peers first, so the transport errors they are about to see
        # read as a shutdown, not a failure.
        with contextlib.suppress(Exception):
            await self._on_service(self.service.links.announce_finalizing())
        # Local copies run in worker threads and cannot be stopped: the
        # engine unmaps every region when it closes, so wait for them first.
        copies = self.caches.copy_leases()
        await self.side.poll_until(lambda: st.leases_over(copies))
        # Nothing in Python touches the control region once the engine may
        # unmap it.
        st.ctl.close()
        # Joins the progress thread: every in-flight job is reported released
        # (ENGINE_FINALIZED) before memory goes.
        self.bridge.close()
        with contextlib.suppress(Exception):
            await self._on_service(self.service.close())
        self.service.thread.stop()
        await self.transfers.end_tasks()
        self.caches.drop_all()
        # The engine is closed (its worker and every connection gone): user
        # buffers held since a peer was cut off may go now.
        st.held_until_close.clear()
