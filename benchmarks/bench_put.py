"""Awaited one-sided puts between two processes, beside ``ucx_perftest``.

Usage::

    python benchmarks/bench_put.py                 # shm and tcp, 4 KiB … 64 MiB
    python benchmarks/bench_put.py --quick         # a smoke run, ~20 s
    python benchmarks/bench_put.py --transport tcp --sizes 1M,16M --seconds 2

This process sends; a spawned receiver process (``--serve``) owns the
destination region and keeps its engine progressing. For each size we keep a
window of awaited puts in flight (``Bridge.run`` of one job each: post, flush
to remote completion, complete through the eventfd to an asyncio future) and
count completions per second in steady state. ``ucx_perftest ucp_put_bw`` at
the same size and over the same UCX transports is the plain baseline; the
ratio ours/perftest is what the targets are about.

Also measured: awaited 4 KiB puts per second with 64 in flight, and the event
loop's lag (a 1 ms ticker's lateness) while a 1 GiB push is in flight, beside
the same ticker on an idle loop.

Targets (from the issue): ≥ 0.8 × perftest at ≥ 1 MiB over shm and tcp;
≥ 50,000 awaited 4 KiB puts/s; loop lag < 5 ms. Numbers are printed, never
asserted: the script exits 0 when it ran, whatever it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C

SCRIPT = Path(__file__).resolve()

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "4K,64K,1M,16M"

TARGET_RATIO = 0.8  # × perftest, at sizes ≥ TARGET_RATIO_FROM
TARGET_RATIO_FROM = C.MiB
TARGET_SMALL_OPS = 50_000.0  # awaited 4 KiB puts/s, 64 in flight
TARGET_LAG_MS = 5.0
SMALL = 4 * C.KiB
SMALL_WINDOW = 64
LAG_JOB = 16 * C.MiB  # a push of N bytes is N / LAG_JOB jobs ("layers")


# ----------------------------------------------------------------- results


@dataclass
class Row:
    """One size over one transport."""

    size: int
    window: int
    ours_ops: float | None = None
    perf: C.PerftestResult | None = None
    error: str = ""

    @property
    def ours_bps(self) -> float | None:
        return None if self.ours_ops is None else self.ours_ops * self.size

    @property
    def ratio(self) -> float | None:
        if self.ours_bps is None or self.perf is None or self.perf.bytes_per_s <= 0:
            return None
        return self.ours_bps / self.perf.bytes_per_s


@dataclass
class Lag:
    """Loop lag samples, in seconds."""

    idle: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    push_bytes: int = 0
    push_seconds: float = 0.0
    pushes: int = 0


@dataclass
class TransportResult:
    """Everything measured over one transport."""

    transport: str
    tls: str
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
        import numpy as np

        from aiokvcache._bridge import OP_PUT

        assert src_off + n <= self.src_size and dst_off + n <= self.remote_size
        segs = np.array(
            [[self.src_addr + src_off, self.remote_addr + dst_off, n, self.rkey]], dtype=np.uint64
        )
        return (OP_PUT, self.ep, segs, b"", 0)


async def open_link(
    transport: str, info: dict[str, Any], src_size: int, engine_kw: dict[str, Any]
) -> Link:
    """Engine + bridge on the running loop, connected to the receiver."""
    import numpy as np

    from aiokvcache._bridge import Bridge
    from aiokvcache._loader import native

    eng = native.Engine(transport, **engine_kw)
    try:
        bridge = Bridge(eng)
        ep = eng.connect(bytes.fromhex(info["worker"]), transport != "shm")
        rkey = eng.rkey_unpack(ep, bytes.fromhex(info["rkey"]), info["addr"], info["size"])
        # Registered (mem_map'ed) source memory, as a real KV cache would be;
        # pages touched now so no page fault is timed.
        _rid, src = eng.mem_alloc(src_size)
        np.frombuffer(native.buffer_from_address(src, src_size), dtype=np.uint8)[:] = 1
    except BaseException:
        eng.close()
        raise
    return Link(eng, bridge, ep, rkey, info["addr"], info["size"], src, src_size)


async def measure_puts(
    link: Link, size: int, window: int, *, seconds: float, iters: int | None
) -> float:
    """Awaited puts per second with ``window`` in flight, in steady state."""
    jobs = [[link.put_job(0, i * size, size)] for i in range(window)]
    done = 0
    stop = False
    target: int | None = None
    reached = asyncio.Event()
    per_job_timeout = 30.0 + size / 1e8  # a hang fails the run; it never sticks

    async def worker(i: int) -> None:
        nonlocal done
        job = jobs[i]
        while not stop:
            await link.bridge.run(job, timeout=per_job_timeout)
            done += 1
            if target is not None and done >= target:
                reached.set()

    tasks = [asyncio.create_task(worker(i)) for i in range(window)]
    try:
        # Warm-up: connections, rkey caches, the window filling up.
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
    """Ticker lateness idle, then while pushes of ``total`` bytes are in flight."""
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
    await link.bridge.run(jobs[:2], timeout=60)  # warm
    while lag.pushes < max_pushes and (lag.pushes == 0 or lag.push_seconds < min_seconds):
        samples: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(samples, stop))
        await asyncio.sleep(0)  # let the ticker start its first sleep
        t0 = time.perf_counter()
        try:
            await link.bridge.run(jobs, timeout=120)
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
    shm_tls: str
    engine_kw: dict[str, Any]
    quick: bool


def perftest_iters(size: int, est_ops: float | None, seconds: float, iters: int | None) -> int:
    """Iterations for perftest: about ``seconds`` at our rate, bounded both ways."""
    if iters is not None:
        return max(1, iters)
    low = max(20, min(10_000, (64 * C.MiB) // size))
    want = int(2 * seconds * (est_ops or 0.0))
    high = max(low, min(2_000_000, (8 * C.GiB) // size))
    return max(low, min(high, want))


def run_transport(
    plan: Plan, transport: str, runner: asyncio.Runner, children: C.Children
) -> TransportResult:
    tls = plan.shm_tls if transport == "shm" else C.ENGINE_TLS[transport]
    ucx_options = {"TLS": tls} if tls != C.ENGINE_TLS[transport] else {}
    res = TransportResult(transport, tls)
    windows = {s: window_for(s, plan.window_bytes, plan.max_jobs) for s in plan.sizes}
    need_small = SMALL not in plan.sizes or windows[SMALL] != SMALL_WINDOW
    lag_per = min(LAG_JOB, plan.lag_bytes)
    remote_size = max([s * w for s, w in windows.items()] + [SMALL * SMALL_WINDOW, lag_per])
    remote_size = max(remote_size, min(plan.lag_bytes, 256 * C.MiB))
    src_size = max([*plan.sizes, lag_per, min(plan.lag_bytes, 256 * C.MiB)])
    engine_kw = dict(plan.engine_kw)
    if ucx_options:
        engine_kw["ucx_options"] = ucx_options

    lifetime = 600.0 + 10 * len(plan.sizes) * (plan.seconds + 5)
    proc, info = C.spawn_receiver(
        children, SCRIPT, transport, remote_size, ucx_options, lifetime=lifetime
    )
    link: Link | None = None
    try:
        link = runner.run(open_link(transport, info, src_size, engine_kw))
        for size in plan.sizes:
            row = Row(size, windows[size])
            res.rows.append(row)
            try:
                row.ours_ops = runner.run(
                    measure_puts(link, size, row.window, seconds=plan.seconds, iters=plan.iters)
                )
            except Exception as exc:
                row.error = f"ours: {type(exc).__name__}: {exc}"
            if plan.perftest:
                n = perftest_iters(size, row.ours_ops, plan.seconds, plan.iters)
                try:
                    row.perf = C.run_perftest(
                        children,
                        "ucp_put_bw",
                        size,
                        n,
                        tls,
                        timeout=60 + n * size / 2e8,
                    )
                except Exception as exc:
                    row.error += ("; " if row.error else "") + f"perftest: {exc}"
            print(
                f"  {transport} {C.fmt_size(size):>7}: ours {C.fmt_gbs(row.ours_bps)} GB/s"
                f", perftest {C.fmt_gbs(row.perf.bytes_per_s if row.perf else None)} GB/s"
                + (f"  [{row.error}]" if row.error else ""),
                file=sys.stderr,
                flush=True,
            )
        if need_small:
            try:
                res.small_ops = runner.run(
                    measure_puts(link, SMALL, SMALL_WINDOW, seconds=plan.seconds, iters=plan.iters)
                )
            except Exception as exc:
                res.errors.append(f"4 KiB puts: {type(exc).__name__}: {exc}")
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
            res.errors.append(f"loop lag: {type(exc).__name__}: {exc}")
    finally:
        if link is not None:
            link.bridge.close()  # closes the engine: flushes and disconnects first
        C.stop_receiver(children, proc)
    return res


# ------------------------------------------------------------------ report


def ok(flag: bool | None) -> str:
    return "n/a" if flag is None else ("ok" if flag else "MISS")


def report(plan: Plan, results: Sequence[TransportResult]) -> str:
    out: list[str] = []
    for r in results:
        out.append("")
        out.append(f"### put bandwidth over {r.transport} (UCX_TLS={r.tls})")
        out.append("")
        headers = [
            "size",
            "in flight",
            "ours GB/s",
            "ours ops/s",
            "perftest GB/s",
            "perftest ops/s",
            "ours/perftest",
            "target",
        ]
        rows = []
        for row in r.rows:
            tgt = ""
            if row.size >= TARGET_RATIO_FROM:
                flag = None if row.ratio is None else row.ratio >= TARGET_RATIO
                tgt = f"≥ {TARGET_RATIO:.1f} {ok(flag)}"
            rows.append(
                [
                    C.fmt_size(row.size),
                    str(row.window),
                    C.fmt_gbs(row.ours_bps),
                    C.fmt_rate(row.ours_ops),
                    C.fmt_gbs(row.perf.bytes_per_s if row.perf else None),
                    C.fmt_rate(row.perf.ops_per_s if row.perf else None),
                    C.fmt_ratio(row.ratio),
                    tgt,
                ]
            )
        out.append(C.table(headers, rows, right=[True] * 7))
        for row in r.rows:
            if row.error:
                out.append(f"- {C.fmt_size(row.size)}: {row.error}")
        for e in r.errors:
            out.append(f"- {e}")

    out.append("")
    out.append("### targets")
    out.append("")
    rows = []
    for r in results:
        big = [row.ratio for row in r.rows if row.size >= TARGET_RATIO_FROM]
        worst = None if not big or any(x is None for x in big) else min(x for x in big if x)
        rows.append(
            [
                f"put GB/s ÷ perftest, sizes ≥ {C.fmt_size(TARGET_RATIO_FROM)} (worst)",
                r.transport,
                C.fmt_ratio(worst),
                f"≥ {TARGET_RATIO:.1f}",
                ok(None if worst is None else worst >= TARGET_RATIO),
            ]
        )
    for r in results:
        rows.append(
            [
                f"awaited {C.fmt_size(SMALL)} puts/s, {SMALL_WINDOW} in flight",
                r.transport,
                C.fmt_rate(r.small_ops),
                f"≥ {TARGET_SMALL_OPS:,.0f}",
                ok(None if r.small_ops is None else r.small_ops >= TARGET_SMALL_OPS),
            ]
        )
    for r in results:
        lag = r.lag
        if lag is None or not lag.busy:
            rows.append(
                [
                    f"loop lag during a {C.fmt_size(plan.lag_bytes)} push",
                    r.transport,
                    "n/a",
                    f"< {TARGET_LAG_MS:g} ms",
                    "n/a",
                ]
            )
            continue
        worst_ms = max(lag.busy) * 1e3
        rows.append(
            [
                f"loop lag during a {C.fmt_size(plan.lag_bytes)} push, max / p99",
                r.transport,
                f"{worst_ms:.2f} / {C.percentile(lag.busy, 99) * 1e3:.2f} ms",
                f"< {TARGET_LAG_MS:g} ms",
                ok(worst_ms < TARGET_LAG_MS),
            ]
        )
    out.append(C.table(["check", "transport", "measured", "target", "ok"], rows))

    lag_rows = []
    for r in results:
        lag = r.lag
        if lag is None or not lag.busy:
            continue
        lag_rows.append(
            [
                r.transport,
                "idle loop (baseline)",
                str(len(lag.idle)),
                f"{C.percentile(lag.idle, 50) * 1e3:.3f}",
                f"{C.percentile(lag.idle, 99) * 1e3:.3f}",
                f"{max(lag.idle, default=0.0) * 1e3:.3f}",
                "",
            ]
        )
        gbs = lag.push_bytes / lag.push_seconds if lag.push_seconds else None
        lag_rows.append(
            [
                r.transport,
                f"{lag.pushes} × {C.fmt_size(plan.lag_bytes)} push "
                f"({lag.push_bytes // max(1, lag.pushes) // min(LAG_JOB, plan.lag_bytes)} jobs)",
                str(len(lag.busy)),
                f"{C.percentile(lag.busy, 50) * 1e3:.3f}",
                f"{C.percentile(lag.busy, 99) * 1e3:.3f}",
                f"{max(lag.busy) * 1e3:.3f}",
                C.fmt_gbs(gbs),
            ]
        )
    if lag_rows:
        out.append("")
        out.append("### event-loop lag: lateness of a 1 ms asyncio.sleep ticker")
        out.append("")
        out.append(
            C.table(
                ["transport", "while", "ticks", "p50 ms", "p99 ms", "max ms", "push GB/s"],
                lag_rows,
                right=[False, False, True, True, True, True, True],
            )
        )
    return "\n".join(out)


def header(plan: Plan) -> str:
    from aiokvcache._loader import native

    kw = plan.engine_kw
    lines = [
        "## aiokvcache bench_put",
        "",
        f"- host: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"UCX {native.ucx_version()}",
        f"- ours: awaited `Bridge.run([put])` (post + flush to remote completion + eventfd → "
        f"future), window = max(2, min({plan.max_jobs}, {C.fmt_size(plan.window_bytes)} / size))"
        f" jobs in flight; source and destination are `mem_alloc` regions; engine "
        f"chunk_bytes={kw.get('chunk_bytes', 'default')}, "
        f"max_inflight_bytes={kw.get('max_inflight_bytes', 'default')}",
        "- baseline: `ucx_perftest -t ucp_put_bw` over the same UCX_TLS (its default window, "
        "overall columns); GB = 1e9 bytes",
        f"- per size: {f'{plan.iters} puts' if plan.iters else f'{plan.seconds:.2f} s'}"
        " after warm-up",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--transport", choices=["shm", "tcp", "both"], default="both")
    p.add_argument("--sizes", default=None, help=f"comma-separated (default {DEFAULT_SIZES})")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="measured time per size (default 0.6; --quick 0.15)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="puts per size instead of --seconds (also perftest's -n)",
    )
    p.add_argument("--quick", action="store_true", help="a fast smoke run (~20 s)")
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
        "--shm-tls",
        default=C.ENGINE_TLS["shm"],
        help="UCX_TLS for 'shm', both sides and perftest (default sm,self; try posix,self)",
    )
    p.add_argument(
        "--chunk-bytes",
        type=C.parse_size,
        default=None,
        help="engine chunk size (default: the engine's)",
    )
    p.add_argument(
        "--max-inflight-bytes",
        type=C.parse_size,
        default=None,
        help="engine in-flight window (default: the engine's)",
    )
    p.add_argument(
        "--serve",
        nargs=3,
        metavar=("TRANSPORT", "SIZE", "UCX_OPTIONS_JSON"),
        help=argparse.SUPPRESS,
    )
    return p.parse_args(argv)


def make_plan(a: argparse.Namespace) -> Plan:
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
        shm_tls=a.shm_tls,
        engine_kw=engine_kw,
        quick=a.quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.serve:
        transport, size, options = a.serve
        C.receiver_main(transport, int(size), json.loads(options))
        return 0
    plan = make_plan(a)
    print(header(plan), flush=True)
    children = C.Children()
    results: list[TransportResult] = []
    rc = 0
    t0 = time.monotonic()
    try:
        with asyncio.Runner() as runner:
            for transport in plan.transports:
                try:
                    results.append(run_transport(plan, transport, runner, children))
                except Exception as exc:  # one transport failing must not hide the other
                    failed = TransportResult(transport, C.ENGINE_TLS[transport])
                    failed.errors.append(f"{type(exc).__name__}: {exc}")
                    results.append(failed)
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
