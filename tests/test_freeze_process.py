"""freeze_process / PeerProcess.freeze on a child that is gone, and a frozen
PeerProcess's requests and lifetime.

A child that exited is a zombie until its parent reaps it: asyncio's child
watcher does so at once, trio only when ``returncode`` or ``wait()`` is
asked. ``freeze_process`` counts it as not stopped yet ('Z', not 'T') and
``/proc/PID`` still exists, so it waits out its whole timeout.

A request that timed out on a frozen peer gets its answer after the thaw: that
answer is not the next request's. A frozen peer whose test process died hard
still goes at its ``lifetime`` (a child program: tests/support/child_script.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiokvcache._child import PeerExited
from aiokvcache.testing import PeerProcess, freeze_process
from support.child_script import run_child

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


@pytest.mark.timeout(120)
async def test_a_timed_out_peer_request_does_not_answer_the_next_one(
    kv_peer: PeerProcess,
) -> None:
    """Requests carried no id: the late answer to one that timed out was
    read as the answer to the next one."""
    kv_peer.freeze()
    try:
        with pytest.raises(TimeoutError):
            await kv_peer.call("stats", timeout=0.5)
    finally:
        kv_peer.thaw()
    reply = await kv_peer.call("rss", timeout=30)
    assert "rss_kb" in reply, f"the answer to 'rss' was {sorted(reply)[:6]}..."


ORPHAN = """
import anyio, os
from aiokvcache.testing import PeerProcess


async def main():
    peer = PeerProcess("decoder", "shm", lifetime={lifetime})
    await peer.start()
    peer.freeze()
    print(peer.pid, flush=True)
    os._exit(0)  # the test process dies hard (OOM killer, CI timeout, SIGKILL)


anyio.run(main)
"""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_a_frozen_peer_ends_at_its_lifetime_when_the_test_process_dies(tmp_path: Path) -> None:
    """``lifetime`` promises the peer exits whatever happens: a watchdog
    thread of the frozen child itself never ran, and the peer stayed forever."""
    lifetime = 2.0
    done = run_child(ORPHAN.format(lifetime=lifetime), tmp_path, 90)
    assert done is not None and done.returncode == 0, done
    pid = int(done.stdout.split()[-1])  # the last line: the peer's pid
    try:
        time.sleep(lifetime + 4)
        state = _state(pid)
        assert state in (None, "Z"), (
            f"peer {pid} is still there (state {state}) {lifetime + 4:.0f} s after it was "
            f"started with lifetime={lifetime}"
        )
    finally:
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)
