"""push_cache throughput between two processes, beside ucx_perftest and memcpy.

Workload: a decode process owns a cache of 32 layers x (K, V) x
1 MiB; this process pushes its own copy with one ``push_cache`` per layer,
all 32 layers in flight at once, again and again. Baselines measured in the
same run: ``ucx_perftest -t ucp_put_bw -s 1MiB`` over the same UCX transports,
and a plain memcpy of the same working set in one process (one thread, and
as many threads as copy lanes), measured right before and after each row. perftest is given
about as many iterations as our measurement moves in ``--seconds``, so both
run for similar times; its TCP figure still varies widely between runs here
(2.6-4.5 GB/s at 1 MiB).

    python benchmarks/bench_push.py                 # shm and tcp
    python benchmarks/bench_push.py --transport tcp --seconds 5

Targets: >= 0.8 x perftest over shm, >= 0.85 x perftest over tcp.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time

import numpy as np
from _common import DECODE_PEER, Children, fmt_gbs, fmt_ratio, run_perftest, table

import aiokvcache as kv
from aiokvcache.testing import cluster_info, options, threads_cpu_s

MiB = 1 << 20
PERFTEST_TLS = {"shm": "sm,self", "tcp": "tcp,self"}
TARGET = {"shm": 0.80, "tcp": 0.85}


def memcpy_threads(total: int, seconds: float, threads: int) -> float:
    """Bytes/s of ``threads`` threads each copying its stripe, 1 MiB at a time
    (NumPy releases the GIL for the copy)."""
    if threads <= 1:
        return memcpy_baseline(total, seconds)
    src = np.ones(total, np.uint8)
    dst = np.zeros(total, np.uint8)
    stripe = total // threads
    moved = [0] * threads

    def run(i: int, start: float) -> None:
        lo, hi = i * stripe, (i + 1) * stripe
        while time.perf_counter() - start < seconds:
            for off in range(lo, hi, MiB):
                np.copyto(dst[off : off + MiB], src[off : off + MiB])
            moved[i] += hi - lo

    start = time.perf_counter()
    pool = [threading.Thread(target=run, args=(i, start)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(moved) / (time.perf_counter() - start)


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this thread (the event loop), the progress
    threads and the copy-lane threads."""
    return {
        "loop": time.thread_time(),
        "progress": threads_cpu_s("akv-progress"),
        "lanes": threads_cpu_s("akv-copy"),
    }


def memcpy_baseline(total: int, seconds: float) -> float:
    """Bytes/s of np.copyto over the same working set, 1 MiB at a time."""
    src = np.ones(total, np.uint8)
    dst = np.zeros(total, np.uint8)
    moved = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for off in range(0, total, MiB):
            np.copyto(dst[off : off + MiB], src[off : off + MiB])
        moved += total
    return moved / (time.perf_counter() - start)


async def measure(
    transport: str,
    layers: int,
    seconds: float,
    direct_copy: bool,
    children: Children,
    unconfirmed: int | None = None,
    lanes: int | None = None,
) -> tuple[float, dict[str, float]]:
    """Bytes/s of awaited push passes (one push_cache per layer, all in
    flight), and the cores' worth this process's threads kept busy meanwhile:
    the event loop, the progress thread, the copy lanes."""
    # The decode side: the bench's decode peer, one cache of layers x (K, V) x 1 MiB.
    shape = [f"--layers={layers}", "--tokens=4096", "--heads=1", "--head-dim=128"]
    argv = [*DECODE_PEER, *shape, f"--transport={transport}"]
    peer = children.peer(argv, label="decode", startup_timeout=60)
    try:
        async with kv.LLMDataDist(kv.LLMRole.PROMPT, 1) as dd:
            extra: dict[str, int] = {}
            if unconfirmed is not None:
                extra["max_unconfirmed_bytes"] = unconfirmed
            if lanes is not None:
                extra["copy_lanes"] = lanes
            await dd.init(
                options(transport, direct_copy=direct_copy, sync_kv_timeout=60_000, **extra)
            )
            ret, rets = await dd.link_clusters([cluster_info(peer.address, 2)], timeout=10_000)
            if ret != kv.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link failed: {rets}")
            desc = kv.CacheDesc(
                2 * layers, [1, 4096, 1, 128], kv.DataType.DT_FLOAT16, kv.Placement.HOST
            )
            cm = dd.cache_manager
            src = cm.allocate_cache(desc)
            for t in src.tensors:
                t[...] = 1
            key = kv.CacheKeyByIdAndIndex(2, int(peer.hello["cache_id"]))

            async def one_pass() -> None:
                await asyncio.gather(
                    *(
                        cm.push_cache(key, src, src_layer_range=range(i, i + 1))
                        for i in range(layers)
                    )
                )

            for _ in range(3):  # warm up: metadata, endpoints, page faults
                await one_pass()
            passes = 0
            cpu0 = thread_cpu()
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                await one_pass()
                passes += 1
            elapsed = time.perf_counter() - start
            cpu1 = thread_cpu()
        busy = {k: (cpu1[k] - cpu0[k]) / elapsed for k in cpu0}
        return passes * layers * 2 * MiB / elapsed, busy
    finally:
        children.end(peer)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=["shm", "tcp", "both"], default="both")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    ap.add_argument(
        "--max-unconfirmed",
        type=int,
        default=None,
        help="the pusher's max_unconfirmed_bytes (default: the library's, 2 MiB; 0: no bound)",
    )
    ap.add_argument(
        "--copy-lanes",
        type=int,
        default=None,
        help="the pusher's copy_lanes (default: the library's, from the core count)",
    )
    args = ap.parse_args()
    transports = ["shm", "tcp"] if args.transport == "both" else [args.transport]
    total = args.layers * 2 * MiB
    children = Children()
    rows = []
    lanes_n = args.copy_lanes or 2
    base_s = min(args.seconds, 1.0)
    mems: list[float] = []
    mems_n: list[float] = []

    def baselines() -> tuple[float, float]:
        # Both memcpy baselines again, right beside each measurement: this
        # VM's memory bandwidth drifts by 2x within a minute, so a ratio to a
        # baseline taken minutes earlier says little.
        mems.append(memcpy_baseline(total, base_s))
        # One lane: the N-thread baseline is the one-thread one.
        mems_n.append(mems[-1] if lanes_n <= 1 else memcpy_threads(total, base_s, lanes_n))
        return mems[-1], mems_n[-1]

    try:
        for tr in transports:
            # perftest runs about as long as our measurement does.
            rate = 8e9 if tr == "shm" else 3e9
            iters = max(500, int(args.seconds * rate / MiB))
            perf = run_perftest(
                children, "ucp_put_bw", MiB, iters, PERFTEST_TLS[tr], timeout=60 + 4 * args.seconds
            )
            variants = (
                [("direct copy", True), ("UCX lanes", False)] if tr == "shm" else [("", True)]
            )
            for label, direct in variants:
                m1, n1 = baselines()
                ours, busy = asyncio.run(
                    measure(
                        tr,
                        args.layers,
                        args.seconds,
                        direct,
                        children,
                        args.max_unconfirmed,
                        args.copy_lanes,
                    )
                )
                m2, n2 = baselines()
                mem, mem_n = (m1 + m2) / 2, (n1 + n2) / 2
                ratio = ours / perf.bytes_per_s
                name = f"{tr} {label}".strip()
                rows.append(
                    [
                        name,
                        fmt_gbs(ours),
                        fmt_gbs(perf.bytes_per_s),
                        fmt_ratio(ratio),
                        f">= {TARGET[tr]:.2f}: {'met' if ratio >= TARGET[tr] else 'NOT met'}",
                        fmt_ratio(ours / mem),
                        fmt_ratio(ours / mem_n),
                        " / ".join(f"{busy[k]:.2f}" for k in ("loop", "progress", "lanes")),
                    ]
                )
    finally:
        children.close_all()
    print(
        f"push_cache: {args.layers} layers x (K,V) x 1 MiB, one push_cache per layer, all in "
        f"flight; {args.seconds:.0f} s per row; copy lanes: {args.copy_lanes or 'default'}"
    )
    print(
        f"memcpy of the same {total // MiB} MiB, measured before and after each row (the "
        f"ratios use the mean of the two): {fmt_gbs(min(mems))}-{fmt_gbs(max(mems))} GB/s on "
        f"one thread, {fmt_gbs(min(mems_n))}-{fmt_gbs(max(mems_n))} on {lanes_n}"
    )
    print(
        table(
            [
                "transport",
                "aiokvcache",
                "ucx_perftest put_bw 1 MiB",
                "ratio",
                "target",
                "vs memcpy",
                f"vs {lanes_n}-thread memcpy",
                "cores busy: loop / progress / lanes",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
