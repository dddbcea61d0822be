"""What the test suite (and the benchmarks) use beyond :mod:`aiokvcache.testing`.

Root-only network-namespace clusters (:mod:`.netcluster`), reading another
process's memory and threads (:mod:`.procfs`), the suite's peer program and
its clients (:mod:`.peerclient`, ``peer_modes.py``), and the guards the
fixtures assert with (:mod:`.guards`). None of it is installed.
"""

from __future__ import annotations

from aiokvcache._child import Child, PeerError, PeerExited

from .netcluster import (
    NETNS_PREFIX,
    NETNS_SUBNET,
    NetCluster,
    NetHost,
    netns_cleanup_stale,
    netns_unavailable,
)
from .peerclient import PEER_MODES, AsyncPeer, Peer, peer_argv
from .procfs import read_memory, rss_kb, thread_cpu_s, threads_cpu_s

__all__ = [
    "NETNS_PREFIX",
    "NETNS_SUBNET",
    "PEER_MODES",
    "AsyncPeer",
    "Child",
    "NetCluster",
    "NetHost",
    "Peer",
    "PeerError",
    "PeerExited",
    "netns_cleanup_stale",
    "netns_unavailable",
    "peer_argv",
    "read_memory",
    "rss_kb",
    "thread_cpu_s",
    "threads_cpu_s",
]
