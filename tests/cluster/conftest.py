"""The test cluster: hosts in network namespaces, cabled to one bridge.

``make_cluster(n, uplink=False)`` gives a :class:`aiokvcache.testing.netns.NetCluster` of ``n``
hosts (``198.18.0.2``, ``.3``, ... on ``eth0``, loopback up), created for
the test and removed after it, passed or failed. Tests here are skipped,
with the reason, where network namespaces cannot be made (not root, no
iproute2, ``ip netns add`` refused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from support.harness import NetCluster, netns_unavailable

_unavailable: list[str | None] = []


def _reason() -> str | None:
    if not _unavailable:
        _unavailable.append(netns_unavailable())
    return _unavailable[0]


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., NetCluster]]:
    """``make_cluster(n, uplink=False)``: a fresh cluster of ``n`` hosts
    (:class:`NetCluster`'s arguments), deleted after the test."""
    reason = _reason()
    if reason is not None:
        pytest.skip(f"no network namespaces: {reason}")
    made: list[NetCluster] = []

    def make(n: int, *, uplink: bool = False) -> NetCluster:
        cluster = NetCluster(n, uplink=uplink)
        made.append(cluster)  # closed below even if create() fails half way
        return cluster.create()

    try:
        yield make
    finally:
        for cluster in reversed(made):
            cluster.close()
