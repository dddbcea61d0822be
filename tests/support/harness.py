"""What the test suite uses beyond :mod:`aiokvcache.testing`, and what it
takes from there, in one place.

Root-only network-namespace clusters (:mod:`aiokvcache.testing.netns`),
reading another process's memory and threads (:mod:`aiokvcache.testing`),
the clients of the peer program with the suite's ops modules
(:mod:`.peerclient`, ``peer_ops_*.py``), and the guards the fixtures assert
with (:mod:`.guards`).
"""

from __future__ import annotations

from aiokvcache._child import Child, PeerError, PeerExited
from aiokvcache.testing import read_memory, rss_kb, thread_cpu_s, threads_cpu_s
from aiokvcache.testing.netns import (
    NETNS_PREFIX,
    NETNS_SUBNET,
    NetCluster,
    NetHost,
    netns_cleanup_stale,
    netns_unavailable,
)

from .peerclient import (
    BARE_ENGINE,
    LIFETIMES,
    MEMORY,
    TRUST,
    AsyncPeer,
    Peer,
    ops_spec,
    suite_peer_argv,
)

__all__ = [
    "BARE_ENGINE",
    "LIFETIMES",
    "MEMORY",
    "NETNS_PREFIX",
    "NETNS_SUBNET",
    "TRUST",
    "AsyncPeer",
    "Child",
    "NetCluster",
    "NetHost",
    "Peer",
    "PeerError",
    "PeerExited",
    "mapping_of",
    "netns_cleanup_stale",
    "netns_unavailable",
    "ops_spec",
    "read_memory",
    "rss_kb",
    "suite_peer_argv",
    "thread_cpu_s",
    "threads_cpu_s",
]


def mapping_of(pid: int, addr: int) -> str:
    """``start-end`` (hex) of the mapping of process ``pid`` that holds ``addr``."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            span = line.split()[0]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return span
    raise AssertionError(f"no mapping holds {addr:#x} in pid {pid}")
