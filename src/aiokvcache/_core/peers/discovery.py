"""Discovery through etcd (the ``etcd`` extra, ``aetcd``): instances found by
cluster id, links to instances whose lease ended broken.

With ``aiokvcache.etcdEndpoint`` set, an instance registers itself at init
under ``<prefix>clusters/<cluster id>``: its role and control address, as
JSON, on a lease of ``aiokvcache.etcdLeaseTtl`` seconds that a task of the
service loop keeps alive (a third of the TTL apart). ``link_clusters`` with
an :class:`LLMClusterInfo` that has no ``remote_ip_info`` resolves the
cluster's address there. A watch on the prefix sees an entry deleted — its
owner finalized (the lease revoked at once) or stopped refreshing it (killed,
frozen, cut off from etcd) — and breaks our link to that cluster, within the
TTL: sooner than the peer-silence heartbeat (``aiokvcache.peerTimeout``,
5 s by default) when the TTL is shorter.

etcd is trusted for liveness and addresses, not for data: an address read
there is linked like any other (the handshake checks the peer's cluster id
and, when set, the auth token), but whoever can delete keys under the prefix
can break links. Everything here runs on the service loop (asyncio, whatever
the owner's loop), so trio owners get it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from typing import Any

from ..memory.state import State
from ..model.errors import LLMStatusCode, make_error
from .links import Links
from .servicethread import ServiceThread

__all__ = ["Registry", "cluster_id_of", "parse_endpoint"]

log = logging.getLogger("aiokvcache")

#: Seconds each etcd request may take before it counts as failed.
_RPC_TIMEOUT_S = 5
#: Seconds between attempts to watch again after the watch failed.
_REWATCH_PAUSE_S = 0.5


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port, got {text!r}")
    return host, int(port)


def _local_address_towards(host: str, port: int) -> str:
    """The address of the interface this host reaches ``host`` from (no
    packet is sent: a UDP socket's connect only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


#: An entry larger than this is not ours (ours are about 120 bytes).
_MAX_ENTRY = 4096


def _address_of(value: bytes) -> tuple[str, int] | None:
    """The control address in an etcd entry, or None: whoever can write
    under the prefix may have written anything there, so nothing in it is
    trusted beyond (a host string, a port in 1..65535)."""
    if len(value) > _MAX_ENTRY:
        return None
    try:
        entry = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    address = entry.get("address")
    if not (isinstance(address, list) and len(address) == 2):
        return None
    host, port = address
    if not (isinstance(host, str) and 0 < len(host) <= 255):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return host, port


def cluster_id_of(tail: str) -> int | None:
    """The cluster id a key names (its last part, canonical ASCII decimal in
    [0, 2**64)), or None: ``02``, ``²`` or ``٢`` name no cluster."""
    if not (tail.isascii() and tail.isdecimal()) or str(int(tail)) != tail:
        return None
    value = int(tail)
    return value if value < 2**64 else None


class Registry:
    """This instance's entry in etcd, the lease behind it, and the watch on
    everyone's. Service loop only."""

    def __init__(
        self,
        state: State,
        thread: ServiceThread,
        links: Links,
        endpoint: str,
        prefix: str,
        ttl: int,
    ) -> None:
        self._state = state
        self._thread = thread
        self._links = links
        self._endpoint = parse_endpoint(endpoint)
        self._dir = f"{prefix}clusters/"
        self._ttl = ttl
        self._client: Any = None
        self._lease: Any = None
        self._entry = b""
        self._tasks: list[asyncio.Task[None]] = []
        self._watch: Any = None
        #: Clusters seen registered: only their links are broken by absence.
        self._seen: set[int] = set()
        self._closed = False

    def key(self, cluster_id: int) -> bytes:
        """Where ``cluster_id``'s entry lives."""
        return f"{self._dir}{cluster_id}".encode()

    # -------------------------------------------------------------- start

    async def start(self, role: int, address: tuple[str, int] | None) -> None:
        """Connect, register, start the keep-alive and the watch; errors
        raise LLM_FEATURE_NOT_ENABLED (no aetcd) or LLM_LINK_FAILED."""
        try:
            import aetcd  # type: ignore[import-untyped]
        except ImportError:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "aiokvcache.etcdEndpoint needs the etcd extra: pip install 'aiokvcache[etcd]'",
            ) from None
        host, port = self._endpoint
        self._client = aetcd.Client(host, port, timeout=_RPC_TIMEOUT_S)
        try:
            await self._client.connect()
            self._entry = self._describe(role, address)
            await self._register()
            self._watch = await self._client.watch_prefix(self._dir.encode())
        except Exception as exc:
            await self.close()
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cannot register cluster {self._state.cluster_id} in etcd at "
                f"{host}:{port}: {type(exc).__name__}: {exc}",
            ) from None
        loop = asyncio.get_running_loop()
        cid = self._state.cluster_id
        self._tasks = [
            loop.create_task(self._keep_alive(), name=f"aiokvcache.etcd.lease.{cid}"),
            loop.create_task(self._watching(), name=f"aiokvcache.etcd.watch.{cid}"),
        ]
        log.info(
            "aiokvcache: cluster %d registered in etcd at %s:%d (%s, lease %d s)",
            cid,
            host,
            port,
            self.key(cid).decode(),
            self._ttl,
        )

    def _describe(self, role: int, address: tuple[str, int] | None) -> bytes:
        if address is not None:
            host, port = address
            if host in ("0.0.0.0", "::", ""):
                host = _local_address_towards(*self._endpoint)
            address = (host, port)
        entry = {
            "cluster_id": self._state.cluster_id,
            "role": role,
            "address": list(address) if address is not None else None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        return json.dumps(entry, sort_keys=True).encode()

    async def _register(self) -> None:
        self._lease = await self._client.lease(self._ttl)
        await self._client.put(self.key(self._state.cluster_id), self._entry, lease=self._lease)

    async def update(self, role: int, address: tuple[str, int] | None) -> None:
        """Register the new role or control address (switch_role)."""
        self._entry = self._describe(role, address)
        await self._client.put(self.key(self._state.cluster_id), self._entry, lease=self._lease)

    # ------------------------------------------------------------ resolve

    async def resolve(self, cluster_id: int) -> tuple[list[tuple[str, int]], str]:
        """The control address ``cluster_id`` registered (a list of one), or
        ([], why not)."""
        try:
            got = await self._client.get(self.key(cluster_id))
        except Exception as exc:
            return [], f"etcd lookup failed: {type(exc).__name__}: {exc}"
        if got is None:
            return [], f"cluster {cluster_id} is not registered in etcd"
        address = _address_of(got.value)
        if address is None:
            return [], f"cluster {cluster_id}'s etcd entry has no valid control address"
        self._seen.add(cluster_id)
        return [address], ""

    # ---------------------------------------------------------- keep-alive

    async def _keep_alive(self) -> None:
        """Refresh the lease a third of its TTL apart; register again when
        it was lost (etcd restarted, this process was stopped past the TTL)."""
        failing = False
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                reply = await self._lease.refresh()
                if reply is None or reply.TTL <= 0:
                    log.warning(
                        "aiokvcache: cluster %d's etcd lease ended: registering again",
                        self._state.cluster_id,
                    )
                    await self._register()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not failing:
                    log.warning("aiokvcache: etcd lease refresh failed: %s", exc)
                failing = True

    # --------------------------------------------------------------- watch

    async def _watching(self) -> None:
        """Break links to clusters whose entry went; watch again after a
        failure, and then check what was missed."""
        while True:
            try:
                async for event in self._watch:
                    try:
                        self._on_event(event)
                    except Exception:  # one bad event must not end the watch
                        log.exception("aiokvcache: etcd watch event not handled")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("aiokvcache: etcd watch failed (%s): watching again", exc)
            if self._closed:
                return
            await asyncio.sleep(_REWATCH_PAUSE_S)
            old, self._watch = self._watch, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.cancel(), _RPC_TIMEOUT_S)
            try:
                self._watch = await self._client.watch_prefix(self._dir.encode())
                await self._resync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("aiokvcache: etcd watch could not start again (%s)", exc)
                self._watch = _Ended()  # try again after the pause

    def _cluster_of(self, key: bytes) -> int | None:
        tail = key.decode(errors="replace")
        if not tail.startswith(self._dir):
            return None
        return cluster_id_of(tail[len(self._dir) :])

    def _on_event(self, event: Any) -> None:
        cid = self._cluster_of(event.kv.key)
        if cid is None:
            return
        if event.kind == "PUT":
            self._seen.add(cid)
            return
        if cid == self._state.cluster_id:
            return  # our own entry: the keep-alive registers again
        self._gone(cid, "its etcd lease ended")

    async def _resync(self) -> None:
        """After a lost watch: break links to seen clusters no longer registered."""
        present = set()
        for kv in await self._client.get_prefix(self._dir.encode()):
            cid = self._cluster_of(kv.key)
            if cid is not None:
                present.add(cid)
        self._seen |= present
        with self._state.lock:
            linked = set(self._state.links)
        for cid in (linked & self._seen) - present:
            self._gone(cid, "no longer registered in etcd")

    def _gone(self, cid: int, why: str) -> None:
        with self._state.lock:
            link = self._state.links.get(cid)
        if link is None or link.broken:
            return
        reason = f"cluster {cid}: {why}"
        log.warning("aiokvcache: link to cluster %d broken: %s", cid, why)
        self._links.break_link(link, reason)
        self._thread.spawn(link.conn.close(reason))

    # --------------------------------------------------------------- close

    async def close(self) -> None:
        """Leave etcd: the lease revoked (our entry goes at once, so peers
        break their links now), the watch and the client closed."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks = []
        if self._client is None:
            return
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.revoke(), _RPC_TIMEOUT_S)
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._watch.cancel(), _RPC_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._client.close(), _RPC_TIMEOUT_S)
        self._client = None


class _Ended:
    """A watch that has ended (its successor could not be started yet)."""

    def __aiter__(self) -> _Ended:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def cancel(self) -> None:
        return None
