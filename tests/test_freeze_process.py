"""freeze_process / PeerProcess.freeze on a child that is gone.

A child that exited is a zombie until its parent reaps it: asyncio's child
watcher does so at once, trio only when ``returncode`` or ``wait()`` is
asked. ``freeze_process`` counts it as not stopped yet ('Z', not 'T') and
``/proc/PID`` still exists, so it waits out its whole timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from aiokvcache._child import PeerExited
from aiokvcache.testing import PeerProcess, freeze_process

pytestmark = pytest.mark.anyio


def zombie_or_gone(pid: int, limit: float = 10.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return
        except OSError:
            return
        time.sleep(0.001)
    raise AssertionError(f"{pid} still running")


def test_freeze_process_of_a_process_that_exited_says_it_is_gone() -> None:
    """An exited, unreaped child: ProcessLookupError at once (what the
    docstring promises for a process that is gone), not TimeoutError after
    ``timeout``."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        start = time.monotonic()
        with pytest.raises(ProcessLookupError):
            freeze_process(child.pid, timeout=1.0)
        assert time.monotonic() - start < 0.5
    finally:
        child.wait()


async def test_freezing_a_peer_that_died_is_peer_exited() -> None:
    """PeerProcess.freeze() of a child that died (crashed, killed): PeerExited
    at once, on asyncio and on trio alike."""
    async with PeerProcess("prefill", "tcp", lifetime=60) as peer:
        os.kill(peer.pid, signal.SIGKILL)
        zombie_or_gone(peer.pid)
        start = time.monotonic()
        with pytest.raises(PeerExited):
            peer.freeze()
        assert time.monotonic() - start < 1.0
