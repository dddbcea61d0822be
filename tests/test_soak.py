"""Soak: many small tagged pushes, the receiver waiting for each one's layers.

After a warm-up, the process's resident memory stays flat, the native live
job counters return to zero and the receiver's per-tag state stays bounded
(a tag's record goes once its wait returned). Both sides share this process
(one Pair), so one RSS covers them.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from aiokvcache import CacheDesc, CacheKeyByIdAndIndex, DataType, Placement
from aiokvcache.testing import fill, pair

# Tens of thousands take seconds; AIOKVCACHE_SOAK_PUSHES sets a longer soak.
PUSHES = int(os.environ.get("AIOKVCACHE_SOAK_PUSHES", "30000")) // 500 * 500
WARMUP = 1000
IN_FLIGHT = 16
LAYERS = 2
# Allowed RSS growth after warm-up: a leak of one small object per push would
# show as far more (30000 pushes x a few hundred bytes ... x layers).
RSS_SLACK_KIB = 16 * 1024


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.slow
@pytest.mark.timeout(max(240, PUSHES // 25))
async def test_many_small_tagged_pushes_leave_nothing_behind(transport: str) -> None:
    desc = CacheDesc(2 * LAYERS, [IN_FLIGHT, 512], DataType.DT_FLOAT16, Placement.HOST)
    async with pair(transport) as pr:
        dst = pr.d.allocate_cache(desc)
        src = pr.p.allocate_cache(desc)
        fill(src, 1)
        sem = asyncio.Semaphore(IN_FLIGHT)
        rss: dict[str, int] = {}

        async def one(i: int) -> None:
            slot = i % IN_FLIGHT
            tag = f"req-{i}"
            async with sem:
                key = CacheKeyByIdAndIndex(2, dst.cache_id, slot)
                waiter = asyncio.create_task(pr.d.wait_for_layers(tag, range(LAYERS), timeout=30))
                await pr.p.push_cache(key, src, src_batch_index=slot, tag=tag, timeout=30)
                await waiter

        for start in range(0, PUSHES, 500):
            await asyncio.gather(*(one(i) for i in range(start, start + 500)))
            if start + 500 == WARMUP:
                rss["warm"] = rss_kib()
        rss["end"] = rss_kib()
        stats_p, stats_d = pr.p.stats(), pr.d.stats()
        assert stats_p["live_jobs"] == 0 and stats_d["live_jobs"] == 0
        assert stats_d["tag_records"] == 0, "tag records outlived their waits"
        assert stats_d["dropped_tag_records"] == 0
        assert stats_d["notifications_received"] >= PUSHES * LAYERS
        grew = rss["end"] - rss["warm"]
        print(f"{transport}: RSS {rss['warm']} -> {rss['end']} KiB ({grew:+d}), {PUSHES} pushes")
        assert grew < RSS_SLACK_KIB, f"RSS grew by {grew} KiB after warm-up"
