"""The runtime of one ``LLMDataDist``: engine, bridge, peer service, shared state.

Built by ``LLMDataDist.init()`` on the owner's event loop (the loop the
bridge binds to), torn down by ``finalize()``. The public classes are thin
surfaces over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct

from .. import _ucxlog
from .._bridge import Bridge
from .._loader import native
from .control import LocalInfo
from .errors import LLMStatusCode, make_error
from .notify import Receiver
from .options import EngineOptions
from .runner import Runner
from .service import PeerService
from .servicethread import until
from .state import State
from .transfers import Transfers

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
        try:
            engine = native.Engine(
                opts.transport,
                max_inflight_bytes=opts.max_inflight_bytes,
                max_unconfirmed_bytes=opts.max_unconfirmed_bytes,
                copy_lanes=opts.copy_lanes,
                progress_spin_us=opts.progress_spin_us,
                # Liveness off the GIL: see PeerService._heartbeat.
                keepalive_ms=opts.peer_timeout_ms // 4,
                direct_copy=opts.direct_copy,
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
        self.bridge = Bridge(engine)
        self.runner = Runner(self.state, self.bridge)
        self.receiver = Receiver()
        self.service = PeerService(self.state)
        self.transfers = Transfers(self.state, self.service, self.runner)
        self.bridge.on_notify = self.receiver.on_notify
        self.bridge.on_endpoint_error = self._on_endpoint_error
        self._closed = False

    @property
    def engine(self) -> native.Engine:
        """The native engine."""
        return self.state.engine  # type: ignore[no-any-return]

    def check_loop(self) -> None:
        """Transfers and notifications belong to the loop that ran init():
        a clear error from any other, before anything is submitted."""
        if asyncio.get_running_loop() is not self.bridge.loop:
            raise RuntimeError(
                "aiokvcache: this LLMDataDist's transfers and notifications must be awaited "
                "on the event loop that ran init(), not on another loop"
            )

    def _on_endpoint_error(self, ep: int, ucs_status: int) -> None:
        reason = f"transport error: {native.ucs_status_string(ucs_status)}"
        self.service.endpoint_failed(ep, reason)

    async def listen(self, host: str, port: int) -> None:
        """Start the control server on the service thread."""
        await self.service.call(self.service.listen(host, port))

    async def close(self) -> None:
        """finalize(): peers told, transfers ended, links and server closed, memory freed."""
        if self._closed:
            return
        self._closed = True
        st = self.state
        st.finalized = True
        with st.lock:
            for rec in st.registry.caches.values():
                rec.valid = False
                st.ctl.guard_retire(rec.guard_slot)
        self.receiver.close()
        # Tell peers first, so the transport errors they are about to see
        # read as a shutdown, not a failure.
        with contextlib.suppress(Exception):
            await self.service.call(self.service.announce_finalizing())
        # Local copies run in worker threads and cannot be stopped: the
        # engine unmaps every region when it closes, so wait for them first.
        with st.lock:
            copies = [
                lease
                for rec in st.registry.caches.values()
                for lease in rec.leases
                if lease.done is not None
            ]
        await until(lambda: st.leases_over(copies))
        # Nothing in Python touches the control region once the engine may
        # unmap it.
        st.ctl.close()
        # Joins the progress thread: every in-flight job is reported released
        # (ENGINE_FINALIZED) before memory goes.
        self.bridge.close()
        with contextlib.suppress(Exception):
            await self.service.call(self.service.close())
        self.service.stop()
        tasks = list(self.transfers.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        with st.lock:
            recs = list(st.registry.caches.values())
            st.registry.caches.clear()
            st.registry.keys.clear()
            st.registry.blocks_keys.clear()
        for rec in recs:
            rec.cache._invalidate()
        # The engine is closed (its worker and every connection gone): user
        # buffers held since a peer was cut off may go now.
        st.held_until_close.clear()
