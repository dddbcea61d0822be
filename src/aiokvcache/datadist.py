"""LLMDataDist: lifecycle and links between clusters (the public surface).

The work happens in the private core: :class:`~aiokvcache._core.runtime.Runtime`
owns the native engine, the bridge on this loop and the peer-service thread
that serves peers even while this loop is blocked.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from typing import Any

from ._core.config.options import EngineOptions
from ._core.model.errors import LLMStatusCode, make_error, param_invalid
from ._core.model.types import LLMClusterInfo, LLMRole, check_int, check_isinstance, check_uint64
from ._core.runtime import Runtime
from .cache_manager import CacheManager

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiokvcache")

_DEFAULT_LINK_TIMEOUT_MS = 3000


def _check_role(role: Any) -> LLMRole:
    if isinstance(role, bool) or not isinstance(role, int):
        raise TypeError(f"role must be LLMRole, got {type(role).__name__}")
    try:
        return LLMRole(role)
    except ValueError:
        raise ValueError(f"role is out of range: {role}") from None


def _loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class LLMDataDist:
    """One data-distribution instance (LLM-DataDist's ``LLMDataDist``, awaitable).

    ``await init(options)`` starts the native engine and, when
    ``llm.listenIpInfo`` is set, the control server (on this instance's
    service thread, so peers are served while the event loop is busy). Use it
    as an async context manager to have :meth:`finalize` called on exit.
    """

    __slots__ = ("_cache_manager", "_cluster_id", "_finalized", "_role", "_rt")

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._role = _check_role(role)
        self._cluster_id = check_uint64("cluster_id", cluster_id)
        self._rt: Runtime | None = None
        self._cache_manager: CacheManager | None = None
        self._finalized = False

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
        bound = None if self._rt is None else self._rt.listen_address
        if bound is None:
            return None
        host, port = bound
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def options(self) -> EngineOptions:
        """The parsed options given to :meth:`init`."""
        return self._runtime().options

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
        if self._rt is not None:
            raise param_invalid("init() was already called")
        opts = EngineOptions.from_options(options).with_environment(options)
        if opts.unknown_keys:
            log.warning(
                "aiokvcache: unknown option keys, ignored: %s", ", ".join(opts.unknown_keys)
            )
        self._rt = Runtime(self._cluster_id, int(self._role), opts)
        # ge.session_device_id comes with ge.exec.deviceId (LLMConfig.device_id).
        no_effect = [k for k in opts.no_effect_keys if k != "ge.session_device_id"]
        ucx = self._rt.engine.ucx_config()
        if opts.rdma_traffic_class is not None and "IB_TRAFFIC_CLASS" not in ucx:
            no_effect.append("llm.RdmaTrafficClass")
        if opts.rdma_service_level is not None and "IB_SL" not in ucx:
            no_effect.append("llm.RdmaServiceLevel")
        if no_effect:
            log.info(
                "aiokvcache: LLM-DataDist options accepted, with no effect on this engine: %s",
                ", ".join(no_effect),
            )
        self._cache_manager = CacheManager(self._rt, self._check_ready)
        if opts.listen_host is not None:
            try:
                await self._rt.listen(opts.listen_host, opts.listen_port or 0)
            except BaseException:
                await self.finalize()
                raise
            if opts.auth_token is None and not _loopback(opts.listen_host):
                log.warning(
                    "aiokvcache: cluster %d listens on %s without an auth_token: anyone who "
                    "can reach that address can link, read and write its remote-accessible "
                    "caches (set aiokvcache.authToken; see docs/design.md, 'What a reachable "
                    "peer can do')",
                    self._cluster_id,
                    self.listen_address,
                )
        if opts.etcd_endpoint is not None:
            # After listening: the entry carries the bound control address.
            try:
                await self._rt.register(int(self._role))
            except BaseException:
                await self.finalize()
                raise

    async def finalize(self) -> None:
        """Stop everything: fail in-flight transfers with ENGINE_FINALIZED,
        close links and the server, release all memory. Idempotent."""
        if self._finalized:
            return
        if self._rt is not None:
            self._rt.check_can_close()  # a refused call changes nothing
        self._finalized = True
        if self._rt is not None:
            await self._rt.close()

    async def __aenter__(self) -> LLMDataDist:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.finalize()

    async def switch_role(
        self, role: LLMRole, switch_options: dict[str, str] | None = None
    ) -> None:
        """Change the role, and the listener with it, as LLM-DataDist does.

        With ``llm.listenIpInfo`` in ``switch_options`` the instance listens
        there (kept if it already listens there, moved if elsewhere);
        without it, a listening instance stops listening (server to
        client). Refused with ``LLM_EXIST_LINK`` while any cluster is
        linked: unlink first.
        """
        rt = self._runtime()
        new_role = _check_role(role)
        if switch_options is not None and not isinstance(switch_options, dict):
            raise TypeError(
                f"switch_options must be a dict or None, got {type(switch_options).__name__}"
            )
        opts = EngineOptions.from_options(switch_options) if switch_options else None
        linked = sorted(self._links)
        if linked:
            raise make_error(
                LLMStatusCode.LLM_EXIST_LINK,
                f"cannot switch role while linked to cluster(s) {linked}: unlink them first",
            )
        spec = None
        if opts is not None and opts.listen_host is not None:
            spec = (opts.listen_host, opts.listen_port or 0)
        await rt.relisten(spec)
        self._role = new_role
        rt.set_role(int(new_role))
        await rt.update_registration(int(new_role))

    def _check_ready(self) -> None:
        if self._finalized:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "this LLMDataDist is finalized")
        if self._rt is None:
            raise make_error(LLMStatusCode.LLM_FAILED, "call init() first")

    def _runtime(self) -> Runtime:
        self._check_ready()
        assert self._rt is not None
        return self._rt

    @property
    def _links(self) -> dict[int, Any]:
        """A snapshot of the links by cluster id."""
        if self._rt is None:
            return {}
        return self._rt.links()

    # ---------------------------------------------------------------- links

    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = _DEFAULT_LINK_TIMEOUT_MS
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster; returns ``(status, [status per cluster])``.

        Does not raise on a link failure: the statuses say what happened
        (``LLM_LINK_FAILED``, ``LLM_ALREADY_LINK``, ``LLM_TIMEOUT``...).
        ``timeout`` is in milliseconds, per cluster.
        """
        rt = self._runtime()
        infos = _check_clusters(clusters)
        timeout_ms = check_int("timeout", timeout, 1, 2**31 - 1)
        if not infos:
            return LLMStatusCode.LLM_PARAM_INVALID, []  # as LLM-DataDist: none to link
        return await rt.link_clusters(infos, timeout_ms)

    async def unlink_clusters(
        self,
        clusters: Sequence[LLMClusterInfo],
        timeout: int = _DEFAULT_LINK_TIMEOUT_MS,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink each cluster; returns ``(status, [status per cluster])``.

        A cluster that is not linked is ``LLM_SUCCESS``. Without ``force``
        the peer drops its side too; with it only ours goes (the peer's
        link breaks and stays until it unlinks), so both sides may call it.
        Transfers in flight on an unlinked cluster fail with LINK_FAILED.
        """
        rt = self._runtime()
        infos = _check_clusters(clusters)
        timeout_ms = check_int("timeout", timeout, 1, 2**31 - 1)
        check_isinstance("force", force, bool)
        if not infos:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        ids = [c.remote_cluster_id for c in infos if c.remote_cluster_id is not None]
        return await rt.unlink_clusters(ids, timeout_ms, force)


def _check_clusters(clusters: Sequence[LLMClusterInfo]) -> list[LLMClusterInfo]:
    if not isinstance(clusters, (list, tuple)):
        raise TypeError(f"clusters must be a list of LLMClusterInfo, got {type(clusters).__name__}")
    for i, c in enumerate(clusters):
        check_isinstance(f"clusters[{i}]", c, LLMClusterInfo)
        if c.remote_cluster_id is None:
            raise param_invalid(f"clusters[{i}].remote_cluster_id is not set")
    return list(clusters)
