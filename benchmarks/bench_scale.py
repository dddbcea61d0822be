"""Many peers: how the cost of a link and the sharing of a decode grow from 1 to 64 prefills.

Workload, per N: one decode process owning a paged K/V cache (32 layers x
(K, V), 64 KiB blocks), and N prefill processes, each owning 4 blocks per
tensor. All N link to the decode at once, then each pushes its 32 layers (one
``push_blocks`` per layer, all 32 in flight, into its own destination blocks
by ``BlocksCacheKey``), round after round, for ``--seconds``, all starting
together. Each process is its own ``python -m aiokvcache.testing.peer``,
on loopback (``--netns``: each on a host of its own, network namespaces on
one bridge; root only).

Printed per N, against N = 1 of the same run (the baseline): link set-up
p50 / p99 (seconds each prefill's ``link_clusters`` took, all N at once);
the CPU one link costs (the prefill's process over its call plus the
decode's over all N, per link);
the decode process's RSS and open fds per link (after the links, against
before them); aggregate throughput and each peer's share (max / min bytes);
push latency p50 (median over peers) / p99 (worst peer's); failed pushes;
the decode's CPU in its progress thread and its service thread over the
push phase. ``--mode slot`` pushes the same bytes with ``push_cache`` into
a contiguous cache instead (the ``BlocksCacheKey`` lookup's cost shows as
the difference).

    python benchmarks/bench_scale.py                          # N = 1 2 4 8 16 32, tcp
    python benchmarks/bench_scale.py --peers 1,16,64 --runs 3
    python benchmarks/bench_scale.py --mode slot --peers 1,32
    python benchmarks/bench_scale.py --netns --peers 1,8,32   # one host per process

Numbers are printed, never asserted: the script exits 0 when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from _common import table

from aiokvcache.testing import JsonChild, peer_argv, rss_kb, thread_cpu_s
from aiokvcache.testing.netns import NetCluster, netns_unavailable

LAYERS = 32
BLOCK = 64 * 1024
BLOCKS_PER_PEER = 4


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far."""
    return sum(thread_cpu_s(pid).values())


@dataclass
class Result:
    n: int
    link_s: list[float]
    link_cpu_ms: float  # CPU per link: the prefill's and the decode's, together
    rss_per_link_kb: float
    fds_per_link: float
    gbs: float
    share: float
    p50_ms: float
    p99_ms: float
    failed: int
    progress_cpu_s: float
    service_cpu_s: float
    errors: list[str] = field(default_factory=list)


class Hosts:
    """Where the processes run: loopback, or one network namespace each."""

    def __init__(self, netns: bool, count: int) -> None:
        self.cluster = NetCluster(count).create() if netns else None

    def peer(self, i: int, role: str, *args: str) -> JsonChild:
        if self.cluster is None:
            listen = ["--listen=127.0.0.1:0"] if role == "decoder" else []
            argv = peer_argv(role, *args, *listen, lifetime=900)
            return JsonChild(argv, label=f"peer {role}", startup_timeout=180)
        host = self.cluster.hosts[i]
        listen = [f"--listen={host.ip}:0"] if role == "decoder" else []
        return self.cluster.peer(host, role, *args, *listen, lifetime=900, startup_timeout=180)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()


async def one_n(n: int, args: argparse.Namespace) -> Result:
    hosts = Hosts(args.netns, n + 1)
    common = [args.transport, "--sync-kv-timeout=60000"]
    if args.no_prewarm:
        common.append('--options={"prewarm": false}')
    decode = hosts.peer(0, "decoder", *common)
    prefills = [hosts.peer(i + 1, "prefill", *common, f"--cluster-id={10 + i}") for i in range(n)]
    try:
        await decode.start()
        if args.mode == "blocks":
            await decode.call(
                "alloc", name="dst", tensors=2 * LAYERS, bytes=n * BLOCKS_PER_PEER * BLOCK,
                blocks=n * BLOCKS_PER_PEER,
            )  # fmt: skip
        else:
            dst = await decode.call(
                "alloc", name="dst", tensors=2 * LAYERS, bytes=BLOCKS_PER_PEER * BLOCK, batch=n
            )
        await asyncio.gather(*(p.start() for p in prefills))
        for p in prefills:
            if args.mode == "blocks":
                await p.call(
                    "alloc", name="src", tensors=2 * LAYERS, bytes=BLOCKS_PER_PEER * BLOCK,
                    blocks=BLOCKS_PER_PEER, seed=1,
                )  # fmt: skip
            else:
                await p.call("alloc", name="src", tensors=2 * LAYERS, bytes=BLOCKS_PER_PEER * BLOCK)
        await asyncio.sleep(0.5)
        dpid = int(decode.hello["pid"])
        rss0, fds0, dcpu0 = rss_kb(dpid), proc_fds(dpid), proc_cpu_s(dpid)
        links = await asyncio.gather(
            *(
                p.call("link", address=decode.address, cluster_id=2, timeout_ms=60_000)
                for p in prefills
            )
        )
        bad = [r for r in links if r["status"] != "LLM_SUCCESS"]
        if bad:
            raise RuntimeError(f"{len(bad)} links failed: {bad[0]}")
        dcpu1 = proc_cpu_s(dpid)
        await asyncio.sleep(0.5)
        rss1, fds1 = rss_kb(dpid), proc_fds(dpid)
        cpu0 = thread_cpu_s(dpid)
        start_at = time.monotonic() + 1.0 + 0.02 * n
        reqs = []
        for i, p in enumerate(prefills):
            req: dict[str, Any] = {"src": "src", "seconds": args.seconds, "start_at": start_at}
            if args.mode == "blocks":
                req.update(
                    cluster_id=2,
                    src_blocks=list(range(BLOCKS_PER_PEER)),
                    dst_blocks=list(range(i * BLOCKS_PER_PEER, (i + 1) * BLOCKS_PER_PEER)),
                )
            else:
                req.update(cluster_id=2, cache_id=dst["cache_id"], slot=i)
            reqs.append(p.call("rounds", timeout=args.seconds + 120, **req))
        done = await asyncio.gather(*reqs)
        cpu1 = thread_cpu_s(dpid)
    finally:
        await asyncio.gather(*(p.close() for p in prefills), return_exceptions=True)
        await decode.close()
        hosts.close()
    moved = [r["bytes"] for r in done]
    elapsed = max(r["seconds"] for r in done)
    return Result(
        n=n,
        link_s=sorted(r["seconds"] for r in links),
        link_cpu_ms=(sum(r["cpu_s"] for r in links) + dcpu1 - dcpu0) / n * 1e3,
        rss_per_link_kb=(rss1 - rss0) / n,
        fds_per_link=(fds1 - fds0) / n,
        gbs=sum(moved) / elapsed / 1e9,
        share=max(moved) / max(1, min(moved)),
        p50_ms=statistics.median(r["p50"] for r in done) * 1e3,
        p99_ms=max(r["p99"] for r in done) * 1e3,
        failed=sum(r["failed"] for r in done),
        progress_cpu_s=cpu1.get("akv-progress", 0) - cpu0.get("akv-progress", 0),
        service_cpu_s=cpu1.get("akv-service", 0) - cpu0.get("akv-service", 0),
        errors=[r["first_error"] for r in done if r["first_error"]][:3],
    )


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def rng(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"


def report(runs: list[list[Result]], args: argparse.Namespace) -> None:
    by_n: dict[int, list[Result]] = {}
    for run in runs:
        for r in run:
            by_n.setdefault(r.n, []).append(r)
    base_p99 = [quantile(r.link_s, 0.99) for r in by_n[min(by_n)]]
    rows = []
    for n, rs in sorted(by_n.items()):
        p50 = [quantile(r.link_s, 0.5) * 1e3 for r in rs]
        p99 = [quantile(r.link_s, 0.99) * 1e3 for r in rs]
        ratio = [quantile(r.link_s, 0.99) / statistics.median(base_p99) for r in rs]
        rows.append(
            [
                str(n),
                f"{rng(p50, '.0f')} / {rng(p99, '.0f')}",
                rng(ratio, ".2f"),
                rng([r.link_cpu_ms for r in rs], ".1f"),
                rng([r.rss_per_link_kb / 1024 for r in rs], ".2f"),
                rng([r.fds_per_link for r in rs], ".1f"),
                rng([r.gbs for r in rs], ".2f"),
                rng([r.share for r in rs], ".2f"),
                f"{rng([r.p50_ms for r in rs], '.1f')} / {rng([r.p99_ms for r in rs], '.1f')}",
                str(sum(r.failed for r in rs)),
                f"{rng([r.progress_cpu_s for r in rs], '.2f')} / "
                f"{rng([r.service_cpu_s for r in rs], '.2f')}",
            ]
        )
    where = "network namespaces (one host each)" if args.netns else "loopback"
    print(
        f"{args.mode}: 1 decode + N prefills over {args.transport} on {where}; {LAYERS} layers x "
        f"(K,V) x {BLOCKS_PER_PEER} blocks of {BLOCK // 1024} KiB per push round; "
        f"{args.seconds:g} s of pushes; {len(runs)} run(s); {os.cpu_count()} cores"
    )
    print(
        table(
            [
                "N",
                "link p50 / p99, ms",
                "p99 / N=1's",
                "CPU/link, ms",
                "decode RSS/link, MiB",
                "fds/link",
                "aggregate GB/s",
                "share max/min",
                "push p50 / p99, ms",
                "failed",
                "decode CPU s: progress / service",
            ],
            rows,
            right=[True] * 11,
        )
    )
    for rs in by_n.values():
        for r in rs:
            for e in r.errors:
                print(f"  N={r.n}: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="1,2,4,8,16,32", help="the N to run, comma-separated")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of pushes per N")
    ap.add_argument("--runs", type=int, default=1, help="runs of every N (ranges over them)")
    ap.add_argument("--transport", choices=["tcp", "shm", "auto"], default="tcp")
    ap.add_argument(
        "--no-prewarm",
        action="store_true",
        help="aiokvcache.prewarm off: UCX selects its protocols in the first link, not at init",
    )
    ap.add_argument("--mode", choices=["blocks", "slot"], default="blocks")
    ap.add_argument("--netns", action="store_true", help="one network namespace per process")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args()
    if args.netns and (why := netns_unavailable()) is not None:
        print(f"--netns: {why}", file=sys.stderr)
        return 2
    ns = [int(x) for x in args.peers.split(",")]
    runs = [[asyncio.run(one_n(n, args)) for n in ns] for _ in range(args.runs)]
    report(runs, args)
    if args.json:
        print(json.dumps([[r.__dict__ for r in run] for run in runs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
