"""Hosts in network namespaces, cabled to one bridge (Linux, root only).

:class:`NetCluster` makes N hosts (:class:`NetHost`: a namespace with its
own ``eth0``, ``198.18.0.x``), cuts and restores their cables, runs commands
inside one and starts the peer program (:mod:`aiokvcache.testing.peer`)
there; :func:`netns_unavailable` says why it cannot work here (a skip
reason). It shells out to iproute2's ``ip``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self

from . import peer_argv
from ._procfs import pid_alive

if TYPE_CHECKING:
    from ._process import JsonChild

__all__ = [
    "NETNS_PREFIX",
    "NETNS_SUBNET",
    "NetCluster",
    "NetHost",
    "netns_cleanup_stale",
    "netns_unavailable",
]

#: Every namespace a :class:`NetCluster` makes is named ``akvc-<pid>-<n>-...``.
NETNS_PREFIX = "akvc"
#: The hosts' addresses: ``198.18.0.<i + 1>/24`` (RFC 2544 benchmarking space),
#: on a bridge of each cluster's own, so clusters never share a wire.
NETNS_SUBNET = "198.18.0"

_ip_lock = threading.Lock()
_clusters_made = 0


#: Addresses the cluster's hosts use (198.18.0.0/15, the benchmarking range).
_CLUSTER_NETS = ("198.18.0.0/15",)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why :class:`NetCluster` cannot work here (a skip reason), or None."""
    if shutil.which("ip") is None:
        return "no iproute2: `ip` is not on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is not allowed)"
    probe = f"{NETNS_PREFIX}-{os.getpid()}-probe"
    _ip("netns", "del", probe, check=False)
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _netns_list() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_delete(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def netns_cleanup_stale() -> list[str]:
    """Delete the namespaces of runs that died without cleaning up: those of
    :data:`NETNS_PREFIX` whose creating process is gone. Returns their names."""
    gone = []
    for name in _netns_list():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != NETNS_PREFIX or not parts[1].isdigit():
            continue
        if pid_alive(int(parts[1])):
            continue  # a live run's (ours included: create() deletes its own names)
        _netns_delete(name)
        gone.append(name)
    return gone


@dataclass
class NetHost:
    """One host of a :class:`NetCluster`: a network namespace with loopback
    and ``eth0`` (``ip``/24), cabled to the cluster's bridge."""

    name: str  # "h1", "h2", ...
    netns: str  # its namespace
    ip: str  # eth0's address
    cable: str  # the bridge-side end of its veth pair, in the bridge's namespace

    def address(self, port: int) -> str:
        """``"ip:port"`` on this host."""
        return f"{self.ip}:{port}"


class NetCluster:
    """N hosts in network namespaces joined by veth pairs to one bridge.

    The bridge lives in a namespace of its own, so the root namespace is
    untouched; every name is ``akvc-<pid>-<n>-...`` (``n`` counts the
    clusters this process made), so parallel runs never collide, and
    :meth:`create` first removes what a killed run left (see
    :func:`netns_cleanup_stale`). :meth:`close` (also at the end of a
    ``with`` block, failing or not) kills every process left in the hosts
    and deletes every namespace. Needs root: see :func:`netns_unavailable`.

    Faults: :meth:`cut` / :meth:`restore` take a host's cable down / up (its
    ``eth0`` keeps its address and sees no carrier: packets vanish, nothing
    is reset); a peer's :class:`~aiokvcache.testing.JsonChild` ``.signal()``
    / ``.kill()`` stop, continue or kill a host's process.
    """

    def __init__(self, hosts: int, *, uplink: bool = False) -> None:
        global _clusters_made
        if not 1 <= hosts <= 200:
            raise ValueError("1 to 200 hosts")
        #: Give every host a second interface, ``up0`` (198.19.<i>.1/24, one
        #: end of a veth pair whose other end is up in the same host: it
        #: reaches nothing) holding the default route, as on a multi-homed
        #: host whose default route is not the cluster network.
        self.uplink = uplink
        with _ip_lock:
            _clusters_made += 1
            n = _clusters_made
        self.tag = f"{NETNS_PREFIX}-{os.getpid()}-{n}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = [
            NetHost(f"h{i}", f"{self.tag}-h{i}", f"{NETNS_SUBNET}.{i + 1}", f"c{i}")
            for i in range(1, hosts + 1)
        ]
        self._made: list[str] = []
        self._routes: list[str] = []  # root-namespace guard routes we added

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster (the bridge's first)."""
        return [self.bridge_ns, *(h.netns for h in self.hosts)]

    def create(self) -> Self:
        """Make the bridge and the hosts (everything made so far is removed if it fails)."""
        netns_cleanup_stale()
        for name in self.namespaces:  # a killed run of ours under the same name
            if name in _netns_list():
                _netns_delete(name)
        try:
            # A safety belt: should anything in the root namespace ever aim at
            # a cluster address, the kernel refuses it here instead of routing
            # it off the machine through the default gateway.
            for net in _CLUSTER_NETS:
                if _ip("route", "add", "unreachable", net, check=False).returncode == 0:
                    self._routes.append(net)
            br = self.bridge_ns
            _ip("netns", "add", br)
            self._made.append(br)
            _ip("-n", br, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip(
                    "-n", br, "link", "add", h.cable, "type", "veth",
                    "peer", "name", "eth0", "netns", h.netns,
                )  # fmt: skip
                _ip("-n", br, "link", "set", h.cable, "master", "br0", "up")
                _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                if self.uplink:
                    i = self.hosts.index(h) + 1
                    ns = h.netns
                    _ip("-n", ns, "link", "add", "up0", "type", "veth", "peer", "name", "up0x")
                    _ip("-n", ns, "addr", "add", f"198.19.{i}.1/24", "dev", "up0")
                    _ip("-n", ns, "link", "set", "up0x", "up")
                    _ip("-n", ns, "link", "set", "up0", "up")
                    _ip("-n", ns, "route", "add", "default", "via", f"198.19.{i}.254")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill what runs in the hosts and delete every namespace. Idempotent."""
        for name in reversed(self._made):
            _netns_delete(name)
        self._made.clear()
        for net in self._routes:
            _ip("route", "del", "unreachable", net, check=False)
        self._routes.clear()

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def cut(self, host: NetHost) -> float:
        """Take ``host``'s cable down; ``time.monotonic()`` just after."""
        _ip("-n", self.bridge_ns, "link", "set", host.cable, "down")
        return time.monotonic()

    def restore(self, host: NetHost) -> float:
        """Put ``host``'s cable back up; ``time.monotonic()`` just after."""
        _ip("-n", self.bridge_ns, "link", "set", host.cable, "up")
        return time.monotonic()

    def run(
        self, host: NetHost, *argv: str, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``host`` and wait for it."""
        return subprocess.run(
            ["ip", "netns", "exec", host.netns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def peer(
        self,
        host: NetHost,
        role: str,
        *args: str,
        ops: Sequence[str] = (),
        lifetime: float | None = None,
        startup_timeout: float = 60,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> JsonChild:
        """The peer program (:func:`~aiokvcache.testing.peer_argv`) inside
        ``host``, as a :class:`~aiokvcache.testing.JsonChild` not started
        yet (``async with`` it); needs anyio."""
        from ._process import JsonChild

        return JsonChild(
            peer_argv(role, *args, ops=ops, lifetime=lifetime, netns=host.netns),
            label=f"peer {role} on {host.name}",
            startup_timeout=startup_timeout,
            env=env,
            stderr=stderr,
        )
