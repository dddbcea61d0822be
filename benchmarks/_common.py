"""The benchmarks' harness: what the benchmark scripts share (not part of the package).

* :class:`Children`: every process a benchmark starts, each with a deadline,
  killed on exit, error or Ctrl-C; :meth:`Children.peer` starts a peer
  program (one that speaks JSON lines) and waits for its hello: the decode
  side of ``python -m aiokvcache bench`` (:data:`DECODE_PEER`), or the peer
  program of :mod:`aiokvcache.testing` (:func:`aiokvcache.testing.peer_argv`;
  with :data:`aiokvcache.testing.BARE_ENGINE`, a bare engine owning the
  destination region).
* :func:`run_perftest`: ``ucx_perftest`` from the libucx wheel, server and
  client, at one size, parsed into a :class:`PerftestResult`: the plain
  baseline every number is compared with.
* :func:`table`: a plain-text table that is also a markdown table.

The scripts import it as ``_common`` (``python benchmarks/bench_x.py`` puts
this directory first on ``sys.path``). What they share with the test suite
lives in :mod:`aiokvcache.testing`: the peer program, the ``/proc`` readers
(``thread_cpu_s``, ``threads_cpu_s``, ``rss_kb``) and the network-namespace
clusters (:mod:`aiokvcache.testing.netns`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from aiokvcache.testing import Child, JsonPeer

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# What the engine's transport names mean (ext/engine.cpp, transport_list).
ENGINE_TLS = {"shm": "sm,self", "tcp": "tcp,self"}


# ------------------------------------------------------------------ formats


def parse_size(text: str) -> int:
    """``4K``, ``16KiB``, ``1M``, ``2G`` or plain bytes → bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    value = int(float(t) * mult)
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (see :func:`parse_size`)."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def fmt_size(n: int) -> str:
    """Bytes as ``4 KiB`` / ``64 MiB`` / ``1 GiB`` (or plain bytes)."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def fmt_rate(x: float | None) -> str:
    """Operations per second with thousands separators."""
    return "n/a" if x is None else f"{x:,.0f}"


def fmt_gbs(bytes_per_s: float | None) -> str:
    """Bytes per second as GB/s (1 GB = 1e9 bytes)."""
    return "n/a" if bytes_per_s is None else f"{bytes_per_s / 1e9:.2f}"


def fmt_ratio(x: float | None) -> str:
    """A ratio with two decimals."""
    return "n/a" if x is None else f"{x:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] = ()) -> str:
    """A pipe table, padded for a terminal and valid markdown."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    align = list(right) + [False] * (len(headers) - len(right))

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, align, strict=True)
        ]
        return "| " + " | ".join(out) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if r else "-" * (w + 2)
            for w, r in zip(widths, align, strict=True)
        )
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100.0 * len(s) + 0.5) - 1))
    return s[k]


# ---------------------------------------------------------------- processes


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (an instance and the engine
    processes it started), ``pgid`` first."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(int(entry))
    return sorted(out, key=lambda p: (p != pgid, p))


#: The decode side of ``python -m aiokvcache bench``, taking the bench's shape
#: options (one cache of that shape; ``wait`` and ``digest``).
DECODE_PEER = (sys.executable, "-m", "aiokvcache._benchpeer")


class Children:
    """Every process a benchmark started; :meth:`close_all` ends them all.

    Children run in their own session so that a Ctrl-C reaches only us and
    we end them in order (our engine first, then the peers), instead of a
    peer vanishing under transfers in flight.
    """

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str] | Child] = []

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        """Start a child (text mode, own session) and remember it."""
        proc = subprocess.Popen(list(argv), text=True, start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def peer(
        self,
        argv: Sequence[str],
        *,
        label: str = "peer",
        startup_timeout: float = 120.0,
        stderr: int | IO[Any] | None = None,
    ) -> JsonPeer:
        """Start a peer program (own session), wait for its hello, remember it."""
        peer = JsonPeer(
            argv, label=label, startup_timeout=startup_timeout, stderr=stderr, new_session=True
        )
        self._procs.append(peer)
        return peer

    def end(self, proc: subprocess.Popen[str] | Child, grace: float = 3.0) -> None:
        """End one child: a peer is asked to exit (end of input); a plain process
        is terminated; either is killed if still there after ``grace``."""
        if isinstance(proc, Child):
            proc.close(grace)
            if proc in self._procs:
                self._procs.remove(proc)
            return
        for stream in (proc.stdin,):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace)
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        if proc in self._procs:
            self._procs.remove(proc)

    def close_all(self) -> None:
        """End every child still known, newest first."""
        for proc in reversed(list(self._procs)):
            self.end(proc)


def with_deadline(argv: Sequence[str], seconds: float) -> list[str]:
    """Wrap argv in coreutils ``timeout`` so the child dies even if we are killed."""
    tool = shutil.which("timeout")
    if tool is None:
        return list(argv)
    return [tool, "-k", "2", f"{max(1.0, seconds):.0f}", *argv]


def free_port() -> int:
    """A TCP port nobody listens on right now (racy by nature; callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    # Read the kernel's socket tables instead of connecting: a probe
    # connection would be taken for the perftest client.
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if len(cols) > 3 and cols[1].endswith(want) and cols[3] == "0A":
                    return True
    return False


# ---------------------------------------------------------------- perftest


def libucx_dir() -> Path:
    """The libucx wheel's package directory."""
    import libucx

    return Path(libucx.__file__).resolve().parent


def perftest_path() -> Path | None:
    """``ucx_perftest`` from the libucx wheel, or None when it is missing."""
    path = libucx_dir() / "bin" / "ucx_perftest"
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass(frozen=True)
class PerftestResult:
    """One ``ucx_perftest`` run (its "Final:" line, overall columns)."""

    test: str
    tls: str
    flags: tuple[str, ...]
    size: int
    iterations: int
    latency_us: float  # overall, per iteration
    bytes_per_s: float
    ops_per_s: float
    window: int


def _parse_final(text: str) -> list[float] | None:
    for row in text.splitlines():
        if row.startswith("Final:"):
            cols = row.split()[1:]
            if len(cols) >= 8:
                return [float(c) for c in cols[:8]]
    return None


def run_perftest(
    children: Children,
    test: str,
    size: int,
    iters: int,
    tls: str,
    *,
    warmup: int | None = None,
    timeout: float = 60.0,
    flags: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    attempts: int = 3,
) -> PerftestResult:
    """Run ``ucx_perftest -t test`` between two local processes over ``tls``.

    ``flags`` go to both sides (``-e``: endpoints with peer error handling).
    Raises RuntimeError (with the tool's last words) when it fails.
    """
    exe = perftest_path()
    if exe is None:
        raise RuntimeError("ucx_perftest not found in the libucx wheel")
    env = dict(os.environ)
    lib = str(libucx_dir() / "lib")
    env["LD_LIBRARY_PATH"] = lib + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""
    )
    env["UCX_TLS"] = tls
    env.update(extra_env or {})
    w = warmup if warmup is not None else max(2, min(1000, iters // 10))
    last_error = ""
    for _ in range(attempts):
        port = free_port()
        server = children.popen(
            with_deadline([str(exe), "-p", str(port), *flags], timeout + 5),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 10
            while not _listening(port):
                if server.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if server.poll() is not None or not _listening(port):
                last_error = f"server on port {port} did not start"
                continue
            argv = [str(exe), "127.0.0.1", "-p", str(port), "-t", test]
            argv += ["-s", str(size), "-n", str(iters), "-w", str(w), *flags]
            try:
                client = subprocess.run(
                    with_deadline(argv, timeout + 2),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired:
                last_error = f"client timed out after {timeout:.0f} s"
                continue
            final = _parse_final(client.stdout)
            if client.returncode != 0 or final is None:
                tail = (client.stdout + client.stderr).strip().splitlines()[-3:]
                last_error = f"rc {client.returncode}: {' / '.join(tail)}"
                continue
            window = 0
            for row in client.stdout.splitlines():
                if "Window size:" in row:
                    with contextlib.suppress(ValueError, IndexError):
                        window = int(row.split("Window size:")[1].strip(" |"))
            n, _p50, _avg, lat_overall, _bw_avg, bw_overall, _mr_avg, _mr_overall = final
            # perftest's "MB" is 2**20 bytes.
            bps = bw_overall * MiB
            return PerftestResult(
                test, tls, tuple(flags), size, int(n), lat_overall, bps, bps / size, window
            )
        finally:
            children.end(server, grace=2.0)
    raise RuntimeError(f"ucx_perftest {test} {fmt_size(size)} over {tls} failed: {last_error}")
