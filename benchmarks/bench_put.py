"""Awaited one-sided puts between two processes, beside ``ucx_perftest``.

Usage::

    python benchmarks/bench_put.py                 # shm and tcp, 4 KiB … 64 MiB (~1.5 min)
    python benchmarks/bench_put.py --quick         # a smoke run (~20 s)
    python benchmarks/bench_put.py --transport tcp --sizes 1M,16M --seconds 2

This process sends; a receiver process (the peer program of
:mod:`aiokvcache.testing` with the ops of a bare native engine,
``aiokvcache.testing._bare_engine``) owns the destination region and keeps
its engine progressing. For each size we keep a
window of awaited puts in flight, each one ``Bridge.run`` of one job (post,
flush to remote completion, completion through the eventfd to an asyncio
future), and count completions per second in steady state.

The plain baseline is ``ucx_perftest -t ucp_put_bw`` at the same size over the
same UCX transports. perftest reads one source buffer and writes one
destination buffer of the message size, so the headline "ours" column does
the same (every put in flight writes the same destination); the ratio
ours/perftest compares like with like. "distinct dst" is the realistic
pattern, one destination slot per put in flight (window × size bytes), which
is bound by memory bandwidth rather than cache once that exceeds the caches.
Over tcp our endpoints are plain, as the library connects them (UCX peer error
handling costs ~3.5x there); ``--tcp-peer-errors on`` measures that mode, and
``perftest -e`` (endpoints with error handling) is printed beside it then.

Also measured: awaited 4 KiB puts per second with 64 in flight, and the event
loop's lag (a 1 ms ticker's lateness) while a 1 GiB push (64 jobs of 16 MiB,
one group, like ``push_cache``) is in flight, beside the same ticker on an
idle loop.

Targets (from the issue): ≥ 0.8 × perftest at ≥ 1 MiB over shm and tcp;
≥ 50,000 awaited 4 KiB puts/s; loop lag < 5 ms. Numbers are printed, never
asserted: the script exits 0 when it ran, whatever it measured (130 when
interrupted, after printing what it had and ending its children).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import _common as C

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "4K,1M,16M"

TARGET_RATIO = 0.8  # × perftest, at sizes ≥ TARGET_RATIO_FROM
TARGET_RATIO_FROM = C.MiB
TARGET_SMALL_OPS = 50_000.0  # awaited 4 KiB puts/s, 64 in flight
TARGET_LAG_MS = 5.0
SMALL = 4 * C.KiB
SMALL_WINDOW = 64
LAG_JOB = 16 * C.MiB  # a push of N bytes is N / LAG_JOB jobs ("layers")

# Rough perftest speeds on a small host, only to size its runs (-n) so that
# each takes about --seconds: (messages/s, bytes/s).
PERFTEST_GUESS = {"shm": (400_000.0, 10e9), "tcp": (100_000.0, 1.5e9)}


# ----------------------------------------------------------------- results


@dataclass
class Row:
    """One size over one transport."""

    size: int
    window: int
    ours_ops: float | None = None  # perftest's memory pattern
    slots_ops: float | None = None  # one destination slot per put in flight
    perf: C.PerftestResult | None = None
    perf_e: C.PerftestResult | None = None  # perftest -e (peer error handling)
    errors: list[str] = field(default_factory=list)

    def bps(self, ops: float | None) -> float | None:
        return None if ops is None else ops * self.size

    @staticmethod
    def _ratio(ours: float | None, base: C.PerftestResult | None) -> float | None:
        if ours is None or base is None or base.bytes_per_s <= 0:
            return None
        return ours / base.bytes_per_s

    @property
    def ratio(self) -> float | None:
        return self._ratio(self.bps(self.ours_ops), self.perf)

    @property
    def ratio_e(self) -> float | None:
        return self._ratio(self.bps(self.ours_ops), self.perf_e)


@dataclass
class Lag:
    """Loop lag samples, in seconds."""

    idle: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    push_bytes: int = 0
    push_seconds: float = 0.0
    pushes: int = 0
    jobs: int = 0


@dataclass
class TransportResult:
    """Everything measured over one transport."""

    transport: str
    tls: str
    peer_errors: bool
    rows: list[Row] = field(default_factory=list)
    small_ops: float | None = None
    lag: Lag | None = None
    errors: list[str] = field(default_factory=list)


# ------------------------------------------------------------ measurement


def window_for(size: int, window_bytes: int, max_jobs: int) -> int:
    """Puts kept in flight: about ``window_bytes`` outstanding, 2 … max_jobs jobs."""
    return max(2, min(max_jobs, window_bytes // size))


@dataclass
class Link:
    """Our engine, its bridge, an endpoint to the receiver and a source region."""

    engine: Any
    bridge: Any
    ep: int
    rkey: int
    remote_addr: int
    remote_size: int
    src_addr: int
    src_size: int

    def put_job(self, src_off: int, dst_off: int, n: int) -> tuple[int, int, Any, bytes, int]:
        """One put job of one segment, as ``Bridge.run`` takes it."""
        import numpy as np

        from aiokvcache._bridge import OP_PUT

        assert src_off + n <= self.src_size and dst_off + n <= self.remote_size
        segs = np.array(
            [[self.src_addr + src_off, self.remote_addr + dst_off, n, self.rkey]], dtype=np.uint64
        )
        return (OP_PUT, self.ep, segs, b"", 0)


async def open_link(
    transport: str,
    info: dict[str, Any],
    src_size: int,
    engine_kw: dict[str, Any],
    *,
    peer_errors: bool,
) -> Link:
    """Engine + bridge on the running loop, connected to the receiver."""
    import numpy as np

    from aiokvcache._bridge import Bridge
    from aiokvcache._loader import native

    eng = native.Engine(transport, **engine_kw)
    try:
        bridge = Bridge(eng)
        ep = eng.connect(bytes.fromhex(info["worker"]), peer_errors)
        rkey = eng.rkey_unpack(ep, bytes.fromhex(info["rkey"]), info["addr"], info["size"])
        # Registered (mem_map'ed) source memory, as a real KV cache would be;
        # pages touched now so that no page fault is timed.
        _rid, src = eng.mem_alloc(src_size)
        np.frombuffer(native.buffer_from_address(src, src_size), dtype=np.uint8)[:] = 1
    except BaseException:
        eng.close()
        raise
    return Link(eng, bridge, ep, rkey, info["addr"], info["size"], src, src_size)


async def measure_puts(
    link: Link, size: int, window: int, *, distinct: bool, seconds: float, iters: int | None
) -> float:
    """Awaited puts per second with ``window`` in flight, in steady state."""
    from aiokvcache._core.transfer.runner import run_jobs

    jobs = [[link.put_job(0, i * size if distinct else 0, size)] for i in range(window)]
    done = 0
    stop = False
    target: int | None = None
    reached = asyncio.Event()
    # A hang fails the run instead of sticking (and, like real callers, every
    # await carries a timeout).
    per_job_timeout = 30.0 + size / 1e8

    async def worker(i: int) -> None:
        nonlocal done
        job = jobs[i]
        while not stop:
            await run_jobs(link.bridge, job, timeout=per_job_timeout)
            done += 1
            if target is not None and done >= target:
                reached.set()

    tasks = [asyncio.create_task(worker(i)) for i in range(window)]
    try:
        # Warm-up: connection, protocol selection, the window filling up.
        warm_until = time.perf_counter() + max(0.05, min(0.3, seconds / 4))
        while time.perf_counter() < warm_until or done < window:
            await asyncio.sleep(0.01)
            if any(t.done() for t in tasks):
                break
        c0, t0 = done, time.perf_counter()
        if iters is not None:
            target = c0 + iters
            wait = asyncio.ensure_future(reached.wait())
            await asyncio.wait([wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
            wait.cancel()
        else:
            # Returns early only if a worker failed (its error is raised below).
            await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
            # Slow cases (big puts over tcp): at least one window's worth of
            # completions, so the rate is not a count of zero or one.
            if done - c0 < window and not any(t.done() for t in tasks):
                target = c0 + window
                wait = asyncio.ensure_future(reached.wait())
                await asyncio.wait([wait, *tasks], timeout=60, return_when=asyncio.FIRST_COMPLETED)
                wait.cancel()
        c1, t1 = done, time.perf_counter()
    finally:
        stop = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return (c1 - c0) / (t1 - t0)


async def ticker(samples: list[float], stop: asyncio.Event, period: float = 0.001) -> None:
    """Sleep ``period`` again and again; record how late each wakeup was."""
    while not stop.is_set():
        expected = time.perf_counter() + period
        await asyncio.sleep(period)
        samples.append(max(0.0, time.perf_counter() - expected))


async def measure_lag(link: Link, total: int, *, min_seconds: float, max_pushes: int) -> Lag:
    """Ticker lateness on an idle loop, then while pushes of ``total`` bytes are in flight."""
    from aiokvcache._core.transfer.runner import run_jobs

    lag = Lag()
    stop = asyncio.Event()
    task = asyncio.create_task(ticker(lag.idle, stop))
    await asyncio.sleep(max(0.2, min_seconds))
    stop.set()
    await task

    # One push = one group of jobs, one per "layer", like push_cache.
    per = min(LAG_JOB, total)
    jobs = []
    for i in range(max(1, total // per)):
        off = i * per
        src_off = off % (link.src_size - per + 1)
        dst_off = off % (link.remote_size - per + 1)
        jobs.append(link.put_job(src_off, dst_off, per))
    lag.jobs = len(jobs)
    await run_jobs(link.bridge, jobs[:2], timeout=60)  # warm
    while lag.pushes < max_pushes and (lag.pushes == 0 or lag.push_seconds < min_seconds):
        samples: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(samples, stop))
        await asyncio.sleep(0)  # let the ticker start its first sleep
        t0 = time.perf_counter()
        try:
            await run_jobs(link.bridge, jobs, timeout=120)
        finally:
            lag.push_seconds += time.perf_counter() - t0
            stop.set()
            await task
        lag.busy.extend(samples)
        lag.push_bytes += per * len(jobs)
        lag.pushes += 1
    return lag


# ------------------------------------------------------------------ driver


@dataclass
class Plan:
    """What to run, from the command line."""

    transports: list[str]
    sizes: list[int]
    seconds: float
    iters: int | None
    window_bytes: int
    max_jobs: int
    lag_bytes: int
    lag_seconds: float
    perftest: bool
    distinct: bool
    repeat: int
    shm_tls: str
    tcp_peer_errors: bool
    engine_kw: dict[str, Any]
    quick: bool


def perftest_iters(transport: str, size: int, seconds: float, iters: int | None) -> int:
    """perftest's -n: about ``seconds`` of work at a guessed speed, bounded both ways."""
    if iters is not None:
        return max(1, iters)
    msgs, bw = PERFTEST_GUESS[transport]
    want = int(seconds * min(msgs, bw / size))
    low = max(20, min(10_000, (64 * C.MiB) // size))
    high = max(low, min(2_000_000, (8 * C.GiB) // size))
    return max(low, min(high, want))


def _perftest(
    children: C.Children,
    plan: Plan,
    transport: str,
    size: int,
    tls: str,
    flags: Sequence[str],
    row: Row,
) -> C.PerftestResult | None:
    # At least 0.2 s: shorter perftest runs are mostly start-up noise.
    n = perftest_iters(transport, size, max(0.2, plan.seconds), plan.iters)
    # Generous: a slow baseline (tcp with -e) must not be cut short.
    timeout = 60 + n * size / 1e8
    try:
        return C.run_perftest(children, "ucp_put_bw", size, n, tls, flags=flags, timeout=timeout)
    except Exception as exc:
        row.errors.append(f"perftest{' ' + ' '.join(flags) if flags else ''}: {exc}")
        return None


def _ours(
    runner: asyncio.Runner, link: Link, plan: Plan, row: Row, *, distinct: bool
) -> float | None:
    try:
        return runner.run(
            measure_puts(
                link,
                row.size,
                row.window,
                distinct=distinct,
                seconds=plan.seconds / (2 if distinct else 1),
                iters=plan.iters,
            )
        )
    except Exception as exc:
        row.errors.append(f"ours{' (distinct dst)' if distinct else ''}: {exc!r}")
        return None


def new_result(plan: Plan, transport: str) -> TransportResult:
    """An empty result for one transport, with its UCX_TLS and endpoint mode."""
    tls = plan.shm_tls if transport == "shm" else C.ENGINE_TLS[transport]
    # As the library connects: shared memory cannot do UCX peer error handling.
    return TransportResult(transport, tls, transport != "shm" and plan.tcp_peer_errors)


def run_transport(
    plan: Plan, res: TransportResult, runner: asyncio.Runner, children: C.Children
) -> None:
    """Every measurement over one transport, with its own receiver process.

    Fills ``res`` as it goes, so an interruption keeps what was measured.
    """
    from aiokvcache.testing import BARE_ENGINE, peer_argv

    transport, tls, peer_errors = res.transport, res.tls, res.peer_errors
    ucx_options = {"TLS": tls} if tls != C.ENGINE_TLS[transport] else {}
    windows = {s: window_for(s, plan.window_bytes, plan.max_jobs) for s in plan.sizes}
    need_small = SMALL not in plan.sizes or windows[SMALL] != SMALL_WINDOW
    lag_per = min(LAG_JOB, plan.lag_bytes)
    lag_span = min(plan.lag_bytes, 256 * C.MiB)  # a push wraps around this much memory
    remote_size = max([s * w for s, w in windows.items()] + [SMALL * SMALL_WINDOW, lag_span])
    src_size = max([*plan.sizes, lag_per, lag_span])
    engine_kw = dict(plan.engine_kw)
    if ucx_options:
        engine_kw["ucx_options"] = ucx_options

    lifetime = 600.0 + 20 * len(plan.sizes) * (plan.seconds + 5)
    argv = peer_argv(
        "none",
        transport,
        f"--size={remote_size}",
        f"--ucx-options={json.dumps(ucx_options)}",
        ops=[BARE_ENGINE],
        lifetime=lifetime,
    )
    receiver = children.peer(argv, label="engine", stderr=subprocess.DEVNULL)
    info = receiver.hello
    link: Link | None = None
    try:
        link = runner.run(open_link(transport, info, src_size, engine_kw, peer_errors=peer_errors))
        for size in plan.sizes:
            row = Row(size, windows[size])
            res.rows.append(row)
            # Best of --repeat, ours and perftest taking turns: noise on a small
            # host only ever slows a run down.
            for _ in range(plan.repeat):
                ops = _ours(runner, link, plan, row, distinct=False)
                if ops is not None and (row.ours_ops is None or ops > row.ours_ops):
                    row.ours_ops = ops
                if plan.perftest:
                    perf = _perftest(children, plan, transport, size, tls, (), row)
                    if perf is not None and (
                        row.perf is None or perf.bytes_per_s > row.perf.bytes_per_s
                    ):
                        row.perf = perf
            if plan.distinct:
                row.slots_ops = _ours(runner, link, plan, row, distinct=True)
            if plan.perftest and peer_errors:
                row.perf_e = _perftest(children, plan, transport, size, tls, ("-e",), row)
            progress = (
                f"  {transport} {C.fmt_size(size):>7}: ours {C.fmt_gbs(row.bps(row.ours_ops))}"
                f" GB/s, perftest {C.fmt_gbs(row.perf.bytes_per_s if row.perf else None)} GB/s"
            )
            if row.errors:
                progress += f"  [{'; '.join(row.errors)}]"
            print(progress, file=sys.stderr, flush=True)
        if need_small:
            try:
                res.small_ops = runner.run(
                    measure_puts(
                        link,
                        SMALL,
                        SMALL_WINDOW,
                        distinct=False,
                        seconds=plan.seconds,
                        iters=plan.iters,
                    )
                )
            except Exception as exc:
                res.errors.append(f"4 KiB puts: {exc!r}")
        else:
            res.small_ops = next(r.ours_ops for r in res.rows if r.size == SMALL)
        try:
            res.lag = runner.run(
                measure_lag(
                    link,
                    plan.lag_bytes,
                    min_seconds=plan.lag_seconds,
                    max_pushes=2 if plan.quick else 5,
                )
            )
        except Exception as exc:
            res.errors.append(f"loop lag: {exc!r}")
    finally:
        if link is not None:
            link.bridge.close()  # closes the engine (drains, then closes endpoints)
        children.end(receiver)


# ------------------------------------------------------------------ report


def verdict(flag: bool | None) -> str:
    """ok / MISS / n/a."""
    return "n/a" if flag is None else ("ok" if flag else "MISS")


def bandwidth_table(r: TransportResult, plan: Plan) -> str:
    """One transport's per-size table."""
    with_e = any(row.perf_e is not None for row in r.rows)
    headers = ["size", "in flight", "ours GB/s", "ours ops/s", "perftest GB/s"]
    headers += ["perftest ops/s", "ours/perftest", "target"]
    if plan.distinct:
        headers.append("distinct dst GB/s")
    if with_e:
        headers += ["perftest -e GB/s", "ours/perftest -e"]
    rows = []
    for row in r.rows:
        tgt = ""
        if row.size >= TARGET_RATIO_FROM:
            tgt = f"≥ {TARGET_RATIO:.1f} "
            tgt += verdict(None if row.ratio is None else row.ratio >= TARGET_RATIO)
        cells = [
            C.fmt_size(row.size),
            str(row.window),
            C.fmt_gbs(row.bps(row.ours_ops)),
            C.fmt_rate(row.ours_ops),
            C.fmt_gbs(row.perf.bytes_per_s if row.perf else None),
            C.fmt_rate(row.perf.ops_per_s if row.perf else None),
            C.fmt_ratio(row.ratio),
            tgt,
        ]
        if plan.distinct:
            cells.append(C.fmt_gbs(row.bps(row.slots_ops)))
        if with_e:
            cells += [C.fmt_gbs(row.perf_e.bytes_per_s if row.perf_e else None)]
            cells += [C.fmt_ratio(row.ratio_e)]
        rows.append(cells)
    right = [h != "target" for h in headers]
    return C.table(headers, rows, right=right)


def report(plan: Plan, results: Sequence[TransportResult]) -> str:
    """Every table, as text (markdown-friendly)."""
    out: list[str] = []
    for r in results:
        peer = ", endpoint with peer error handling" if r.peer_errors else ""
        out += ["", f"### put bandwidth over {r.transport} (UCX_TLS={r.tls}{peer})", ""]
        if r.rows:
            out.append(bandwidth_table(r, plan))
        for row in r.rows:
            out += [f"- {C.fmt_size(row.size)}: {e}" for e in row.errors]
        out += [f"- {e}" for e in r.errors]

    if not any(r.rows for r in results):
        return "\n".join(out)
    out += ["", "### targets", ""]
    rows = []
    for r in results:
        big = [row.ratio for row in r.rows if row.size >= TARGET_RATIO_FROM]
        worst = None if not big or None in big else min(x for x in big if x is not None)
        rows.append(
            [
                f"put GB/s ÷ perftest, sizes ≥ {C.fmt_size(TARGET_RATIO_FROM)} (worst)",
                r.transport,
                C.fmt_ratio(worst),
                f"≥ {TARGET_RATIO:.1f}",
                verdict(None if worst is None else worst >= TARGET_RATIO),
            ]
        )
    for r in results:
        small = r.small_ops
        if small is None:  # interrupted before the summary: the row may be there
            rows_4k = [x for x in r.rows if x.size == SMALL and x.window == SMALL_WINDOW]
            small = rows_4k[0].ours_ops if rows_4k else None
        rows.append(
            [
                f"awaited {C.fmt_size(SMALL)} puts/s, {SMALL_WINDOW} in flight",
                r.transport,
                C.fmt_rate(small),
                f"≥ {TARGET_SMALL_OPS:,.0f}",
                verdict(None if small is None else small >= TARGET_SMALL_OPS),
            ]
        )
    for r in results:
        what = f"loop lag during a {C.fmt_size(plan.lag_bytes)} push, max / p99"
        if r.lag is None or not r.lag.busy:
            rows.append([what, r.transport, "n/a", f"< {TARGET_LAG_MS:g} ms", "n/a"])
            continue
        worst_ms = max(r.lag.busy) * 1e3
        rows.append(
            [
                what,
                r.transport,
                f"{worst_ms:.2f} / {C.percentile(r.lag.busy, 99) * 1e3:.2f} ms",
                f"< {TARGET_LAG_MS:g} ms",
                verdict(worst_ms < TARGET_LAG_MS),
            ]
        )
    out.append(C.table(["check", "transport", "measured", "target", "ok"], rows))

    lag_rows = []
    for r in results:
        lag = r.lag
        if lag is None or not lag.busy:
            continue
        for label, samples, gbs in (
            ("idle loop (baseline)", lag.idle, None),
            (
                f"{lag.pushes} × {C.fmt_size(plan.lag_bytes)} push ({lag.jobs} jobs)",
                lag.busy,
                lag.push_bytes / lag.push_seconds if lag.push_seconds else None,
            ),
        ):
            lag_rows.append(
                [
                    r.transport,
                    label,
                    str(len(samples)),
                    f"{C.percentile(samples, 50) * 1e3:.3f}",
                    f"{C.percentile(samples, 99) * 1e3:.3f}",
                    f"{max(samples, default=0.0) * 1e3:.3f}",
                    "" if gbs is None else C.fmt_gbs(gbs),
                ]
            )
    if lag_rows:
        out += ["", "### event-loop lag: lateness of a 1 ms asyncio.sleep ticker", ""]
        headers = ["transport", "while", "ticks", "p50 ms", "p99 ms", "max ms", "push GB/s"]
        out.append(C.table(headers, lag_rows, right=[False, False] + [True] * 5))
    return "\n".join(out)


def header(plan: Plan) -> str:
    """What was run, where."""
    from aiokvcache._loader import native

    kw = plan.engine_kw
    per = f"{plan.iters} puts" if plan.iters else f"{plan.seconds:.2f} s"
    return "\n".join(
        [
            "## aiokvcache bench_put",
            "",
            f"- host: {platform.node()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, UCX {native.ucx_version()}",
            "- ours: awaited `Bridge.run([one put job], timeout=…)` (post, flush to remote "
            "completion, eventfd → future); window = max(2, min("
            f"{plan.max_jobs}, {C.fmt_size(plan.window_bytes)} / size)) puts in flight; "
            "source and destination are `mem_alloc` regions; engine "
            f"chunk_bytes={kw.get('chunk_bytes', 'default')}, "
            f"max_inflight_bytes={kw.get('max_inflight_bytes', 'default')}",
            "- ours and perftest write one destination buffer of the message size; "
            "'distinct dst' writes one slot per put in flight (the realistic pattern)",
            "- baseline: `ucx_perftest -t ucp_put_bw` over the same UCX_TLS (its own "
            "window, overall columns); GB = 1e9 bytes",
            f"- per size: best of {plan.repeat} × {per} after warm-up, ours and perftest "
            "taking turns ('distinct dst', 'perftest -e': one run, half the time for "
            "distinct dst)",
            "- perftest busy-polls on both sides (its passive side burns a core even for shm); "
            "our receiver sleeps in epoll. On a 2-core host both move ±30 % between runs",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        description="Awaited puts between two processes, beside ucx_perftest ucp_put_bw."
    )
    p.add_argument("--transport", choices=["shm", "tcp", "both"], default="both")
    p.add_argument("--sizes", default=None, help=f"comma-separated (default {DEFAULT_SIZES})")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="measured time per size (default 0.6; --quick 0.15)",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="puts per size instead of --seconds (perftest -n)"
    )
    p.add_argument("--quick", action="store_true", help="a fast smoke run (~20 s)")
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="ours and perftest each run this often per size, best kept (default 2; --quick 1)",
    )
    p.add_argument(
        "--window-bytes",
        type=C.parse_size,
        default=64 * C.MiB,
        help="bytes kept in flight (default 64M)",
    )
    p.add_argument("--max-jobs", type=int, default=64, help="most puts in flight (default 64)")
    p.add_argument(
        "--lag-bytes",
        type=C.parse_size,
        default=None,
        help="bytes per push in the loop-lag check (default 1G; --quick 256M)",
    )
    p.add_argument("--no-perftest", action="store_true", help="skip the ucx_perftest baseline")
    p.add_argument(
        "--no-distinct", action="store_true", help="skip the distinct-destination measurement"
    )
    p.add_argument(
        "--shm-tls",
        default=C.ENGINE_TLS["shm"],
        help="UCX_TLS for 'shm', on both sides and for perftest (default sm,self, as the "
        "engine; posix,self is worth a try)",
    )
    p.add_argument(
        "--tcp-peer-errors",
        choices=["on", "off"],
        default="off",
        help="connect tcp endpoints with UCX peer error handling (default off, as the library)",
    )
    p.add_argument(
        "--chunk-bytes", type=C.parse_size, default=None, help="engine chunk size (default its own)"
    )
    p.add_argument(
        "--max-inflight-bytes",
        type=C.parse_size,
        default=None,
        help="engine in-flight window (default its own)",
    )
    return p.parse_args(argv)


def make_plan(a: argparse.Namespace) -> Plan:
    """Defaults filled in."""
    engine_kw: dict[str, Any] = {}
    if a.chunk_bytes is not None:
        engine_kw["chunk_bytes"] = a.chunk_bytes
    if a.max_inflight_bytes is not None:
        engine_kw["max_inflight_bytes"] = a.max_inflight_bytes
    sizes = C.parse_sizes(a.sizes or (QUICK_SIZES if a.quick else DEFAULT_SIZES))
    return Plan(
        transports=["shm", "tcp"] if a.transport == "both" else [a.transport],
        sizes=sizes,
        seconds=a.seconds if a.seconds is not None else (0.15 if a.quick else 0.6),
        iters=a.iters,
        window_bytes=a.window_bytes,
        max_jobs=max(1, a.max_jobs),
        lag_bytes=a.lag_bytes or (256 * C.MiB if a.quick else C.GiB),
        lag_seconds=0.2 if a.quick else 0.5,
        perftest=not a.no_perftest,
        distinct=not a.no_distinct,
        repeat=max(1, a.repeat if a.repeat is not None else (1 if a.quick else 2)),
        shm_tls=a.shm_tls,
        tcp_peer_errors=a.tcp_peer_errors == "on",
        engine_kw=engine_kw,
        quick=a.quick,
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the plan; print the tables; end every child."""
    a = parse_args(argv)
    plan = make_plan(a)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # Like Ctrl-C: end the children in order and print what we have.
        signal.signal(signal.SIGTERM, _interrupt)
    print(header(plan), flush=True)
    children = C.Children()
    results: list[TransportResult] = []
    rc = 0
    t0 = time.monotonic()
    try:
        with asyncio.Runner() as runner:
            for transport in plan.transports:
                res = new_result(plan, transport)
                results.append(res)
                try:
                    run_transport(plan, res, runner, children)
                except Exception as exc:  # one transport failing must not hide the other
                    res.errors.append(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        print("\ninterrupted: partial results follow", file=sys.stderr, flush=True)
        rc = 130
    finally:
        children.close_all()
    print(report(plan, results))
    print(f"\n(total {time.monotonic() - t0:.0f} s)")
    return rc


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
