"""What ``/proc`` tells about a process: its memory, its threads' CPU time,
its resident size. :mod:`aiokvcache.testing` makes these names public."""

from __future__ import annotations

import os

__all__ = ["read_memory", "rss_kb", "threads_cpu_s"]


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


def threads_cpu_s(name: str = "akv-progress") -> float:
    """CPU seconds (user + system) this process's threads named ``name`` used
    so far: ``akv-progress`` (the engines' progress threads), ``akv-copy``
    (their copy lanes)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_kb(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS`` in ``/proc/PID/status``), KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError(f"no VmRSS for pid {pid}")
