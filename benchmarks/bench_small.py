"""Small transfers: per-layer push time, loop CPU per call, idle progress CPU.

Workload: a decode process owns one cache of 32 layers x (K, V)
x S bytes (S = 2 KiB, 16 KiB, 128 KiB); this process pushes its copy with
one ``push_cache`` per layer, either all 32 in flight at once or each
awaited before the next. Baseline measured in the same run:
``ucx_perftest -t ucp_put_lat -s S`` over the same UCX transports. Also:
the event loop thread's CPU time per ``push_cache`` call (in-flight case),
the progress thread's CPU time over idle seconds, and the floor: the loop's
CPU time for one awaited job that moves nothing (the bridge alone).

    python benchmarks/bench_small.py                    # shm and tcp
    python benchmarks/bench_small.py --transport shm --seconds 2
    python benchmarks/bench_small.py --backend trio     # the same on trio

Targets: all in flight at 2 KiB <= 10 us per layer on shm; each
awaited at 2 KiB <= 30 us on shm, <= 60 us on tcp; loop CPU per call <= 8 us.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
from _common import DECODE_PEER, Children, run_perftest, table

import aiokvcache as kv
from aiokvcache.testing import cluster_info, options, threads_cpu_s

KiB = 1 << 10
LAYERS = 32
SIZES = (2 * KiB, 16 * KiB, 128 * KiB)
PERFTEST_TLS = {"shm": "sm,self", "tcp": "tcp,self"}
HEAD_DIM = 128  # fp16: a token is 256 bytes


class Loop:
    """What the measurement needs of the async library: run, gather, sleep."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        if self.backend == "asyncio":
            return asyncio.run(fn(*args))
        import trio

        return trio.run(fn, *args)

    async def gather(self, aws: list[Awaitable[None]]) -> None:
        if self.backend == "asyncio":
            await asyncio.gather(*aws)
            return
        import trio

        async with trio.open_nursery() as nursery:
            for aw in aws:
                nursery.start_soon(_await, aw)

    async def sleep(self, seconds: float) -> None:
        if self.backend == "asyncio":
            await asyncio.sleep(seconds)
            return
        import trio

        await trio.sleep(seconds)


async def _await(aw: Awaitable[None]) -> None:
    await aw


async def measure(
    loop: Loop, transport: str, size: int, seconds: float, idle_s: float, children: Children
) -> dict[str, float]:
    tokens = size // (2 * HEAD_DIM)
    shape = [f"--layers={LAYERS}", f"--tokens={tokens}", "--heads=1", f"--head-dim={HEAD_DIM}"]
    argv = [*DECODE_PEER, *shape, f"--transport={transport}"]
    peer = children.peer(argv, label="decode", startup_timeout=60)
    out: dict[str, float] = {}
    try:
        async with kv.LLMDataDist(kv.LLMRole.PROMPT, 1) as dd:
            await dd.init(options(transport, sync_kv_timeout=60_000))
            ret, rets = await dd.link_clusters([cluster_info(peer.address, 2)], timeout=10_000)
            if ret != kv.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link failed: {rets}")
            desc = kv.CacheDesc(
                2 * LAYERS, [1, tokens, 1, HEAD_DIM], kv.DataType.DT_FLOAT16, kv.Placement.HOST
            )
            cm = dd.cache_manager
            src = cm.allocate_cache(desc)
            key = kv.CacheKeyByIdAndIndex(2, int(peer.hello["cache_id"]))
            layers = [range(i, i + 1) for i in range(LAYERS)]

            async def in_flight() -> None:
                await loop.gather([cm.push_cache(key, src, src_layer_range=r) for r in layers])

            async def awaited() -> None:
                for r in layers:
                    await cm.push_cache(key, src, src_layer_range=r)

            for name, one_pass in (("in_flight", in_flight), ("awaited", awaited)):
                for _ in range(20):  # warm up: metadata, endpoints, caches
                    await one_pass()
                passes = 0
                cpu0 = time.thread_time()
                start = time.perf_counter()
                while time.perf_counter() - start < seconds:
                    await one_pass()
                    passes += 1
                elapsed = time.perf_counter() - start
                cpu = time.thread_time() - cpu0
                calls = passes * LAYERS
                out[f"{name}_us"] = elapsed / calls * 1e6
                out[f"{name}_loop_cpu_us"] = cpu / calls * 1e6
            await loop.sleep(0.5)  # let any spin after the last call end
            cpu0 = threads_cpu_s()
            await loop.sleep(idle_s)
            out["idle_progress_cpu_ms"] = (threads_cpu_s() - cpu0) * 1e3
    finally:
        children.end(peer)
    return out


async def bridge_floor(transport: str, seconds: float) -> dict[str, float]:
    """The loop's own cost of one awaited job that moves nothing: the bridge
    (submit, progress thread, completion eventfd, wake-up, resolve) with no
    planning, leases or checks. No push on the job path can cost less."""
    from aiokvcache import _bridge
    from aiokvcache._loader import native

    eng, other = native.Engine(transport), native.Engine(transport)
    bridge = _bridge.Bridge(eng)
    try:
        ep = eng.connect(other.worker_address, False)
        job = (_bridge.OP_PUT, ep, np.zeros((0, 4), np.uint64), b"", 0)
        for _ in range(2000):
            await bridge.wait(bridge.submit_group([job], checked=True))
        n, cpu0, start = 0, time.thread_time(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            await bridge.wait(bridge.submit_group([job], checked=True))
            n += 1
        wall = (time.perf_counter() - start) / n * 1e6
        cpu = (time.thread_time() - cpu0) / n * 1e6
    finally:
        bridge.close()
        other.close()
    return {"wall_us": wall, "cpu_us": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=["shm", "tcp", "both"], default="both")
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    ap.add_argument("--idle", type=float, default=2.0, help="idle seconds measured")
    ap.add_argument(
        "--backend", choices=["asyncio", "trio"], default="asyncio", help="the async library"
    )
    ap.add_argument(
        "--metrics",
        action="store_true",
        help="with aiokvcache.metrics on (every call recorded): what recording costs",
    )
    args = ap.parse_args()
    if args.metrics:
        from aiokvcache import metrics

        metrics.enable(prometheus=False, tracing=False)
    loop = Loop(args.backend)
    transports = ["shm", "tcp"] if args.transport == "both" else [args.transport]
    children = Children()
    rows = []
    try:
        for tr in transports:
            for size in SIZES:
                lat = run_perftest(children, "ucp_put_lat", size, 20000, PERFTEST_TLS[tr])
                r = loop.run(measure, loop, tr, size, args.seconds, args.idle, children)
                rows.append(
                    [
                        tr,
                        f"{size // KiB} KiB",
                        f"{r['in_flight_us']:.1f}",
                        f"{r['awaited_us']:.1f}",
                        f"{lat.latency_us:.2f}",
                        f"{r['in_flight_loop_cpu_us']:.1f}",
                        f"{r['awaited_loop_cpu_us']:.1f}",
                        f"{r['idle_progress_cpu_ms']:.1f} / {args.idle:.0f} s",
                    ]
                )
    finally:
        children.close_all()
    print(
        f"push_cache on {args.backend}, {LAYERS} layers x (K,V), one call per layer, "
        f"metrics {'on' if args.metrics else 'off'}; "
        f"{args.seconds:g} s per measurement; {os.cpu_count()} cores"
    )
    print(
        table(
            [
                "transport",
                "tensor",
                "all in flight, us/layer",
                "each awaited, us/layer",
                "perftest put_lat, us",
                "loop CPU/call (in flight), us",
                "loop CPU/call (awaited), us",
                "idle progress CPU, ms",
            ],
            rows,
            right=[False, True, True, True, True, True, True, True],
        )
    )
    for tr in transports:
        f = loop.run(bridge_floor, tr, min(args.seconds, 2.0))
        print(
            f"floor, {tr}: an awaited job that moves nothing costs the loop "
            f"{f['cpu_us']:.1f} us of CPU ({f['wall_us']:.1f} us wall)"
        )
    print("targets: 2 KiB shm in flight <= 10, awaited <= 30 (tcp <= 60); loop CPU/call <= 8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
