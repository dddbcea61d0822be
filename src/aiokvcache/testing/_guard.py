"""The peer program's watchdog (:func:`guard`): it ends the peer when the
process that started it dies, or when its lifetime is up."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

from ._procfs import pid_alive

__all__ = ["guard"]


def guard(lifetime: float | None) -> None:
    """End this process when the process that started it dies, and after
    ``lifetime`` seconds (if given) whatever it is doing, frozen
    (``SIGSTOP``) included.

    Both are kept by a forked watchdog process, which a ``SIGSTOP`` of this
    one does not stop: it ``SIGKILL``s this process when the parent process
    is gone or the time is up (a stopped process dies of it too), and leaves
    when this one is gone. It watches the parent *process*: Linux's
    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked us exits, and
    trio starts subprocesses from worker threads that exit after 10 s idle.
    Call it first, before any thread starts.
    """
    parent = os.getppid()
    watched = _watch(parent)
    if os.getppid() != parent or parent == 1:
        os._exit(1)  # the parent died before we could watch it
    peer = os.getpid()
    pid = os.fork()
    if pid == 0:  # the watchdog
        try:
            # Not holding the peer's pipes: its parent sees them close when it dies.
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            end = None if lifetime is None else time.monotonic() + lifetime
            _watchdog(peer, parent, watched, end)
        finally:
            os._exit(0)
    if watched is not None:
        os.close(watched)
    # Reaped when it ends, so it leaves no zombie behind.
    threading.Thread(target=os.waitpid, args=(pid, 0), name="watchdog", daemon=True).start()


def _watch(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where the
    kernel has none (then the watchdog polls ``kill(pid, 0)``)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _watchdog(peer: int, parent: int, parent_fd: int | None, end: float | None) -> None:
    """Kill ``peer`` once ``parent`` (its parent process, ``parent_fd`` its
    pidfd) exited or ``end`` passed; return when ``peer`` itself is gone
    (we were reparented)."""
    while os.getppid() == peer:
        if end is not None and time.monotonic() >= end:
            break
        if parent_fd is not None:
            if select.select([parent_fd], [], [], 0.2)[0]:
                break  # the parent process exited
            continue
        time.sleep(0.2)
        if not pid_alive(parent):
            break
    else:
        return  # the peer ended
    with contextlib.suppress(ProcessLookupError):
        os.kill(peer, signal.SIGKILL)
