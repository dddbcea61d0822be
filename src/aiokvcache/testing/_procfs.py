"""What ``/proc`` tells about a process: its memory, its threads' CPU time,
its resident size (Linux; standard library only). :mod:`aiokvcache.testing`
exports these names."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "read_memory", "rss_kb", "thread_cpu_s", "threads_cpu_s"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_memory(pid: int, address: int, length: int) -> bytes:
    """``length`` bytes at ``address`` in process ``pid`` (``/proc/PID/mem``;
    works while it is stopped; needs ptrace rights over it, e.g. root)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(address)
        out = bytearray()
        while len(out) < length:
            chunk = f.read(length - len(out))
            if not chunk:
                raise OSError(f"short read at {address + len(out):#x} in pid {pid}")
            out += chunk
        return bytes(out)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s threads so far, by thread name (threads of one
    name summed), to the nanosecond: their schedstat (``/proc/PID/stat``
    counts clock ticks, 10 ms here, as coarse as a whole link)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended: its time went with it
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def threads_cpu_s(name: str = "akv-progress") -> float:
    """CPU seconds this process's threads named ``name`` used so far:
    ``akv-progress`` (the engines' progress threads), ``akv-copy`` (their
    copy lanes)."""
    return thread_cpu_s(os.getpid()).get(name, 0.0)


def rss_kb(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS`` in ``/proc/PID/status``), KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError(f"no VmRSS for pid {pid}")
