"""The cluster fixture itself: hosts reach each other, cuts cut, nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from support.harness import NETNS_PREFIX, NetCluster, netns_cleanup_stale

MakeCluster = Callable[..., NetCluster]

# Connect from one host to another's listener: "ok", or the error's name.
_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
    print("ok")
except OSError as e:
    print(type(e).__name__)
"""
_LISTEN = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(8); print("up", flush=True); time.sleep(30)
"""


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_hosts_reach_each_other_and_cuts_cut(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(2)
    h1, h2 = cluster.hosts
    assert cluster.run(h1, "ip", "-br", "link", "show", "lo").stdout.split()[1] != "DOWN"
    listener = subprocess.Popen(
        ["ip", "netns", "exec", h2.netns, sys.executable, "-c", _LISTEN, h2.ip],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        probe = [sys.executable, "-c", _PROBE, h2.ip, "7000"]
        assert cluster.run(h1, *probe).stdout.strip() == "ok"
        cluster.cut(h2)
        assert cluster.run(h1, *probe).stdout.strip() in ("TimeoutError", "OSError")
        cluster.restore(h2)
        # The port needs a moment to carry traffic again after it comes up.
        got = [cluster.run(h1, *probe).stdout.strip() for _ in range(5)]
        assert "ok" in got, got
        # Nothing of the root namespace was touched (checked without sending
        # anything from it: its default route leads off this machine).
        root = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
        assert "198.18." not in root and "198.19." not in root
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        assert not any(h.cable in links.split() for h in cluster.hosts)
    finally:
        listener.kill()
        listener.wait()
        if listener.stdout is not None:
            listener.stdout.close()


@pytest.mark.usefixtures("make_cluster")  # for its skip where namespaces cannot be made
def test_close_removes_everything_even_after_a_failure() -> None:
    cluster = NetCluster(2)
    with pytest.raises(RuntimeError), cluster:
        names = cluster.namespaces
        assert set(names) <= set(_netns())
        raise RuntimeError("the test failed")
    assert not set(names) & set(_netns())


def test_stale_namespaces_of_a_killed_run_are_removed(make_cluster: MakeCluster) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: a run killed without cleaning up
    stale = f"{NETNS_PREFIX}-{dead.pid}-1-br"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        make_cluster(1)  # create() cleans up first
        assert stale not in _netns()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert netns_cleanup_stale() == []
