"""LLMDataDist: lifecycle, the control server, and links between clusters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import control
from ._bridge import Bridge
from ._loader import native
from .errors import LLMException, LLMStatusCode, make_error, param_invalid
from .options import EngineOptions
from .types import LLMClusterInfo, LLMRole, check_int, check_isinstance, check_uint64

if TYPE_CHECKING:
    from .cache_manager import CacheManager

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiokvcache")

_DEFAULT_LINK_TIMEOUT_MS = 3000
_PEER_FINALIZING = "the peer finalized"


def _host_id() -> bytes:
    """This machine's boot id: peers with the same one can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


@dataclass(eq=False)
class _Link:
    """A linked peer: its control connection and our UCX endpoint to it."""

    cluster_id: int
    conn: control.ControlConnection
    ep: int
    broken: bool = False
    reason: str = ""
    # Remote cache metadata, per remote cache id (see cache_manager).
    remote: dict[int, Any] = field(default_factory=dict)
    fetching: dict[int, asyncio.Future[Any]] = field(default_factory=dict)


class LLMDataDist:
    """One data-distribution instance (LLM-DataDist's ``LLMDataDist``, awaitable).

    ``await init(options)`` starts the native engine and, when
    ``llm.listenIpInfo`` is set, the control server. Use it as an async
    context manager to have :meth:`finalize` called on exit.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        if isinstance(role, bool) or not isinstance(role, int):
            raise TypeError(f"role must be LLMRole, got {type(role).__name__}")
        try:
            self._role = LLMRole(role)
        except ValueError:
            raise ValueError(f"role is out of range: {role}") from None
        self._cluster_id = check_uint64("cluster_id", cluster_id)
        self._options: EngineOptions | None = None
        self._engine: Any = None
        self._bridge: Bridge | None = None
        self._server: control.ControlServer | None = None
        self._local: control.LocalInfo | None = None
        self._links: dict[int, _Link] = {}
        self._linking: set[int] = set()
        self._cache_manager: CacheManager | None = None
        self._finalized = False
        self._initialized = False

    # ------------------------------------------------------------ lifecycle

    @property
    def cluster_id(self) -> int:
        """This instance's cluster id."""
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        """The current role."""
        return self._role

    @property
    def listen_address(self) -> str | None:
        """``"ip:port"`` the control server listens on (after init), else None."""
        if self._server is None:
            return None
        host, port = self._server.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def options(self) -> EngineOptions:
        """The parsed options given to :meth:`init`."""
        self._check_ready()
        assert self._options is not None
        return self._options

    @property
    def cache_manager(self) -> CacheManager:
        """The cache manager; ``RuntimeError`` before :meth:`init`."""
        if self._cache_manager is None:
            raise RuntimeError("cache_manager is available after init()")
        return self._cache_manager

    async def init(self, options: dict[str, str] | None = None) -> None:
        """Start the engine (and the control server if ``llm.listenIpInfo`` is set).

        ``options`` is :meth:`LLMConfig.generate_options`'s dict. Bad options
        raise before anything starts.
        """
        if self._finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "init() after finalize()")
        if self._initialized:
            raise param_invalid("init() was already called")
        opts = EngineOptions.from_options(options)
        if opts.unknown_keys:
            log.info("aiokvcache: ignoring options %s", ", ".join(opts.unknown_keys))
        try:
            engine = native.Engine(
                opts.transport,
                max_inflight_bytes=opts.max_inflight_bytes,
                direct_copy=opts.direct_copy,
            )
        except Exception as exc:
            code = (
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED
                if opts.transport != "auto"
                else LLMStatusCode.LLM_FAILED
            )
            raise make_error(
                code, f"cannot start the transfer engine with transport={opts.transport!r}: {exc}"
            ) from exc
        self._engine = engine
        self._bridge = Bridge(engine)
        self._options = opts
        self._local = control.LocalInfo(
            cluster_id=self._cluster_id,
            role=int(self._role),
            worker_address=engine.worker_address,
            auth_token=opts.auth_token,
            host_id=_host_id(),
        )
        from .cache_manager import CacheManager

        self._cache_manager = CacheManager(self)
        self._bridge.on_notify = self._cache_manager._on_notify
        self._bridge.on_endpoint_error = self._on_endpoint_error
        self._initialized = True
        if opts.listen_host is not None:
            try:
                await self._start_server(opts.listen_host, opts.listen_port or 0)
            except BaseException:
                await self.finalize()
                raise

    async def _start_server(self, host: str, port: int) -> None:
        assert self._local is not None
        server = control.ControlServer(self._local, self)
        try:
            await server.start(host, port)
        except LLMException as exc:
            raise make_error(
                LLMStatusCode.LLM_PARAM_INVALID, f"cannot listen on {host}:{port}: {exc.message}"
            ) from exc
        self._server = server

    async def finalize(self) -> None:
        """Stop everything: fail in-flight transfers with ENGINE_FINALIZED,
        close links and the server, release all memory. Idempotent."""
        if self._finalized:
            return
        self._finalized = True
        if self._cache_manager is not None:
            self._cache_manager._finalizing()
        # Tell peers first, so the transport errors they are about to see
        # read as a shutdown, not a failure.
        links = [lk for lk in self._links.values() if not lk.broken]
        if links:
            await asyncio.gather(
                *(lk.conn.request("finalizing", {}, timeout=1.0) for lk in links),
                return_exceptions=True,
            )
        if self._bridge is not None:
            # Joins the progress thread: every in-flight job is reported
            # released (ENGINE_FINALIZED) before memory goes.
            self._bridge.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.close()
        for link in list(self._links.values()):
            with contextlib.suppress(Exception):
                await link.conn.close("finalized")
        self._links.clear()
        if self._cache_manager is not None:
            await self._cache_manager._finalized()

    async def __aenter__(self) -> LLMDataDist:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.finalize()

    async def switch_role(
        self, role: LLMRole, switch_options: dict[str, str] | None = None
    ) -> None:
        """Change the role; with ``llm.listenIpInfo`` in ``switch_options``, start listening."""
        self._check_ready()
        if isinstance(role, bool) or not isinstance(role, int):
            raise TypeError(f"role must be LLMRole, got {type(role).__name__}")
        try:
            new_role = LLMRole(role)
        except ValueError:
            raise ValueError(f"role is out of range: {role}") from None
        opts = EngineOptions.from_options(switch_options) if switch_options else None
        if opts is not None and opts.listen_host is not None and self._server is None:
            await self._start_server(opts.listen_host, opts.listen_port or 0)
        self._role = new_role
        assert self._local is not None
        self._local = control.LocalInfo(
            cluster_id=self._local.cluster_id,
            role=int(new_role),
            worker_address=self._local.worker_address,
            auth_token=self._local.auth_token,
            host_id=self._local.host_id,
        )

    def _check_ready(self) -> None:
        if self._finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "this LLMDataDist is finalized")
        if not self._initialized:
            raise make_error(LLMStatusCode.LLM_FAILED, "call init() first")

    @property
    def _engine_or_raise(self) -> Any:
        self._check_ready()
        return self._engine

    # ---------------------------------------------------------------- links

    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = _DEFAULT_LINK_TIMEOUT_MS
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster; returns ``(status, [status per cluster])``.

        Does not raise on a link failure: the statuses say what happened
        (``LLM_LINK_FAILED``, ``LLM_ALREADY_LINK``, ``LLM_TIMEOUT``...).
        ``timeout`` is in milliseconds, per cluster.
        """
        self._check_ready()
        infos = self._check_clusters(clusters)
        timeout_ms = check_int("timeout", timeout, 1, 2**31 - 1)
        results = await asyncio.gather(*(self._link_one(c, timeout_ms) for c in infos))
        return _overall(results), list(results)

    def _check_clusters(self, clusters: Sequence[LLMClusterInfo]) -> list[LLMClusterInfo]:
        if not isinstance(clusters, (list, tuple)):
            raise TypeError(
                f"clusters must be a list of LLMClusterInfo, got {type(clusters).__name__}"
            )
        for i, c in enumerate(clusters):
            check_isinstance(f"clusters[{i}]", c, LLMClusterInfo)
            if c.remote_cluster_id is None:
                raise param_invalid(f"clusters[{i}].remote_cluster_id is not set")
        return list(clusters)

    async def _link_one(self, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        assert self._local is not None and self._options is not None
        cid = info.remote_cluster_id
        assert cid is not None
        existing = self._links.get(cid)
        if existing is not None and not existing.broken:
            return LLMStatusCode.LLM_ALREADY_LINK
        if cid in self._linking:
            return LLMStatusCode.LLM_PROCESSING_LINK
        if not info.remote_ip_info:
            log.warning("aiokvcache: link to cluster %d: no remote_ip_info", cid)
            return LLMStatusCode.LLM_PARAM_INVALID
        addresses = list(info.remote_ip_info)
        attempts = max(1, self._options.link_retry_count)
        self._linking.add(cid)
        try:
            loop = asyncio.get_running_loop()
            budget = timeout_ms / 1000
            if self._options.link_total_time_s > 0:  # LLM-DataDist's cap on all attempts
                budget = min(budget, float(self._options.link_total_time_s))
            deadline = loop.time() + budget
            status = LLMStatusCode.LLM_LINK_FAILED
            for attempt in range(attempts):
                # Every address of the cluster in turn, each with a fair share
                # of what is left, so one silent address cannot eat it all.
                for i, (host, port) in enumerate(addresses):
                    left = (deadline - loop.time()) / (len(addresses) - i)
                    if left <= 0:
                        break
                    status, reason = await self._try_link(cid, host, port, left)
                    if status in (
                        LLMStatusCode.LLM_SUCCESS,
                        LLMStatusCode.LLM_ALREADY_LINK,
                        LLMStatusCode.LLM_PARAM_INVALID,
                    ):
                        return status
                    log.warning(
                        "aiokvcache: link to cluster %d at %s:%d failed (attempt %d/%d): %s",
                        cid,
                        host,
                        port,
                        attempt + 1,
                        attempts,
                        reason,
                    )
                if attempt + 1 < attempts:  # a short pause before the next try
                    await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
            return status
        finally:
            self._linking.discard(cid)

    async def _try_link(
        self, cid: int, host: str, port: int, timeout: float
    ) -> tuple[LLMStatusCode, str]:
        """One connection attempt: (status, reason); the link exists on SUCCESS."""
        assert self._local is not None
        try:
            conn = await control.connect(host, port, self._local, self, timeout)
        except LLMException as exc:
            return exc.status_code, str(exc)
        if conn.peer_cluster_id != cid:
            await conn.close("wrong cluster id")
            return LLMStatusCode.LLM_LINK_FAILED, f"it is cluster {conn.peer_cluster_id}"
        return LLMStatusCode.LLM_SUCCESS, ""

    async def unlink_clusters(
        self,
        clusters: Sequence[LLMClusterInfo],
        timeout: int = _DEFAULT_LINK_TIMEOUT_MS,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink each cluster; returns ``(status, [status per cluster])``.

        Transfers in flight on an unlinked cluster fail with LINK_FAILED.
        """
        self._check_ready()
        infos = self._check_clusters(clusters)
        timeout_ms = check_int("timeout", timeout, 1, 2**31 - 1)
        check_isinstance("force", force, bool)
        results: list[LLMStatusCode] = []
        for c in infos:
            assert c.remote_cluster_id is not None
            link = self._links.get(c.remote_cluster_id)
            if link is None:
                results.append(LLMStatusCode.LLM_NOT_YET_LINK)
                continue
            self._drop_link(link, "unlinked")
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    await link.conn.close("unlinked")
            except TimeoutError:
                results.append(
                    LLMStatusCode.LLM_UNLINK_FAILED if not force else LLMStatusCode.LLM_SUCCESS
                )
                continue
            results.append(LLMStatusCode.LLM_SUCCESS)
        return _overall(results), results

    def _link_for(self, cluster_id: int) -> _Link:
        """The usable link to ``cluster_id``; raises NOT_YET_LINK / LINK_FAILED."""
        self._check_ready()
        link = self._links.get(cluster_id)
        if link is None:
            raise make_error(LLMStatusCode.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked")
        if link.broken:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"link to cluster {cluster_id} is broken: {link.reason}",
            )
        return link

    def _drop_link(self, link: _Link, reason: str) -> None:
        """Forget a link: fail its transfers, release its endpoint and keys."""
        if self._links.get(link.cluster_id) is link:
            del self._links[link.cluster_id]
        self._break(link, reason)
        if self._cache_manager is not None:
            self._cache_manager._forget_link(link)
        with contextlib.suppress(native.EngineClosedError):
            self._engine.disconnect(link.ep)

    def _break(self, link: _Link, reason: str) -> None:
        if link.broken:
            return
        link.broken = True
        link.reason = reason
        with contextlib.suppress(native.EngineClosedError):
            self._engine.fail_endpoint(link.ep)

    def _on_endpoint_error(self, ep: int, ucs_status: int) -> None:
        for link in self._links.values():
            if link.ep == ep and not link.broken:
                reason = f"transport error: {native.ucs_status_string(ucs_status)}"
                # INFO: the control connection's close (logged below) says
                # whether this was a failure or the peer shutting down.
                log.info("aiokvcache: link to cluster %d broke: %s", link.cluster_id, reason)
                link.broken = True
                link.reason = reason
                # The control connection may still be up; close it so the
                # peer learns of it too.
                task = asyncio.get_running_loop().create_task(link.conn.close(reason))
                self._cache_manager_tasks(task)

    def _cache_manager_tasks(self, task: asyncio.Task[Any]) -> None:
        if self._cache_manager is not None:
            self._cache_manager._track(task)

    # ------------------------------------------------- control.Handler side

    def on_connected(self, conn: control.ControlConnection) -> None:
        """A control connection finished its handshake: make it a link."""
        if self._finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "peer is finalizing")
        cid = conn.peer_cluster_id
        existing = self._links.get(cid)
        if existing is not None:
            if not existing.broken:
                raise make_error(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {cid} is already linked")
            self._drop_link(existing, "replaced by a new link")
        assert self._options is not None and self._local is not None
        # UCX peer-failure handling only for RDMA: UCX refuses it on shared
        # memory, and over TCP it cost 3.5x in bandwidth here (0.35 vs 1.23
        # GB/s); TCP errors still fail the operations (LINK_FAILED), and a
        # dead peer's control connection breaks the link on any transport.
        peer_errors = self._options.transport == "rdma"
        try:
            ep = self._engine.connect(conn.peer_worker_address, peer_errors)
        except Exception as exc:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cannot reach cluster {cid}'s transfer engine: {exc}",
            ) from exc
        self._links[cid] = _Link(cid, conn, ep)
        log.info("aiokvcache: cluster %d linked with cluster %d", self._cluster_id, cid)

    async def handle_request(
        self, conn: control.ControlConnection, op: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Serve a peer's request (cache metadata, invalidations)."""
        if self._cache_manager is None or self._finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "finalized")
        link = self._links.get(conn.peer_cluster_id)
        if link is None or link.conn is not conn:
            raise make_error(LLMStatusCode.LLM_NOT_YET_LINK, "not linked")
        if op == "finalizing":
            # The peer's engine is about to go: break the link now, so the
            # transport errors that follow read as a shutdown, not a failure.
            log.info("aiokvcache: cluster %d is finalizing", link.cluster_id)
            self._break(link, _PEER_FINALIZING)
            return {}
        return await self._cache_manager._serve(link, op, body)

    def on_event(self, conn: control.ControlConnection, op: str, body: dict[str, Any]) -> None:
        """Peers send no events in this protocol version; log and ignore."""
        log.warning("aiokvcache: unexpected event %r from cluster %d", op, conn.peer_cluster_id)

    def on_closed(self, conn: control.ControlConnection, reason: str) -> None:
        """The control connection closed: the link is broken (or was unlinked)."""
        link = self._links.get(conn.peer_cluster_id)
        if link is None or link.conn is not conn:
            return
        if reason == "peer closed: unlinked":
            self._drop_link(link, "unlinked by peer")
            return
        if self._finalized:
            level = logging.DEBUG
        elif reason == "peer closed: finalized" or link.reason == _PEER_FINALIZING:
            level = logging.INFO
        else:
            level = logging.WARNING
        log.log(level, "aiokvcache: link to cluster %d closed: %s", link.cluster_id, reason)
        self._break(link, f"control connection closed ({reason})")
        if self._cache_manager is not None:
            self._cache_manager._forget_link(link)


def _overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
    for r in results:
        if r != LLMStatusCode.LLM_SUCCESS:
            return r
    return LLMStatusCode.LLM_SUCCESS
