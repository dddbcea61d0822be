"""aiokvcache.metrics: per-call records, phases stamped by the engine and the
loop, the Prometheus collector (scraped over HTTP), OpenTelemetry spans, and
nothing recorded while off (on asyncio and trio, over shm and TCP)."""

from __future__ import annotations

import itertools
import time
import urllib.request
from typing import Any

import anyio
import pytest

from aiokvcache import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
    TransferWithCacheKeyConfig,
    _telemetry,
    metrics,
)
from aiokvcache.testing import Pair, blocks_desc, fill

pytestmark = pytest.mark.anyio

prometheus_client = pytest.importorskip("prometheus_client")

S = LLMStatusCode


def _value(reg: Any, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


SLOT = CacheDesc(
    num_tensors=4, shape=(2, 64, 32), data_type=DataType.DT_FLOAT16, placement=Placement.HOST
)


async def test_records_phases_bytes_and_peer(kv_pair: Pair, registry: Any) -> None:
    pr = kv_pair
    desc = blocks_desc(layers=3)
    pr.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
    src = pr.p.allocate_blocks_cache(desc)
    fill(src, 1)
    before = time.monotonic_ns()
    await pr.p.push_blocks(BlocksCacheKey(2), src, [0, 1, 5], [2, 3, 4])
    rec = metrics.recent(1)[0]
    assert (rec.op, rec.peer, rec.status, rec.jobs) == ("push_blocks", 2, "ok", 3)
    # The stamps are in order, each from the engine's or the loop's clock.
    stamps = [rec.began_ns, rec.submitted_ns, rec.posted_ns, rec.done_ns, rec.seen_ns, rec.ended_ns]
    assert before <= stamps[0] and all(0 < a <= b for a, b in itertools.pairwise(stamps))
    assert list(rec.phases()) == list(metrics.PHASES)
    assert rec.segments >= 3
    assert (
        _value(registry, "aiokvcache_transfers_total", op="push_blocks", peer="2", status="ok") == 1
    )
    assert (
        _value(registry, "aiokvcache_transfer_bytes_total", op="push_blocks", peer="2")
        == rec.nbytes
    )
    for phase in metrics.PHASES:
        n = _value(
            registry, "aiokvcache_transfer_phase_seconds_count", op="push_blocks", phase=phase
        )
        assert n == 1, phase
    assert _value(registry, "aiokvcache_engine_jobs_submitted_total", cluster_id="1")


async def test_bytes_count_what_moved(kv_pair: Pair, registry: Any) -> None:
    pr = kv_pair
    desc = blocks_desc(layers=2, blocks=8)
    dst = pr.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
    src = pr.p.allocate_blocks_cache(desc)
    fill(src, 2)
    await pr.p.push_blocks(BlocksCacheKey(2), src, [0, 1], [0, 1])
    per_block = dst.tensors[0].nbytes // desc.shape[0]
    assert metrics.recent(1)[0].nbytes == 2 * desc.num_tensors * per_block
    await pr.p.pull_blocks(BlocksCacheKey(2), src, [0], [7])
    rec = metrics.recent(1)[0]
    assert (rec.op, rec.nbytes) == ("pull_blocks", desc.num_tensors * per_block)


async def test_a_failed_call_is_recorded_with_its_status(kv_pair: Pair, registry: Any) -> None:
    pr = kv_pair
    src = pr.p.allocate_cache(SLOT)
    with pytest.raises(LLMException):
        await pr.p.push_cache(CacheKeyByIdAndIndex(2, 424242, 0), src)
    rec = metrics.recent(1)[0]
    assert (rec.op, rec.status) == ("push_cache", "kv_cache_not_exist")
    assert rec.ended_ns >= rec.began_ns and not rec.posted_ns
    labels = {"op": "push_cache", "status": "kv_cache_not_exist"}
    assert _value(registry, "aiokvcache_transfer_seconds_count", **labels) == 1


async def test_a_cancelled_call_is_recorded_as_cancelled(kv_pair: Pair, registry: Any) -> None:
    pr = kv_pair
    desc = CacheDesc(
        num_tensors=2, shape=(1, 8 << 20), data_type=DataType.DT_UINT8, placement=Placement.HOST
    )
    dst = pr.d.allocate_cache(desc)
    src = pr.p.allocate_cache(desc)
    with anyio.move_on_after(0.0005):
        for _ in range(50):
            await pr.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src)
    rec = metrics.recent(1)[0]
    assert rec.status in ("cancelled", "ok")
    assert _value(registry, "aiokvcache_engine_live_jobs", cluster_id="1") == 0


async def test_layerwise_is_one_record(kv_pair: Pair, registry: Any) -> None:
    pr = kv_pair
    desc = CacheDesc(
        num_tensors=6, shape=(1, 4096), data_type=DataType.DT_UINT8, placement=Placement.HOST
    )
    dst = pr.d.allocate_cache(desc)
    src = pr.p.allocate_cache(desc)
    fill(src, 3)

    class Ready:
        def synchronize_layer(self, layer: int, timeout_in_millis: int | None) -> bool:
            return True

    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id, 0))
    task = await pr.p.transfer_cache_async(src, Ready(), [cfg])
    await task.synchronize()
    recs = [r for r in metrics.recent() if r.op == "transfer_cache_async"]
    assert len(recs) == 1 and recs[0].peer == 2 and recs[0].status == "ok"
    assert (recs[0].jobs, recs[0].nbytes) == (3, 6 * 4096)


async def test_push_blocks_retry_after_a_rebind_counts_only_the_push_that_landed(
    kv_pair: Pair, registry: Any
) -> None:
    """A push by BlocksCacheKey whose cache was retired under it runs again:
    counting both attempts reported bytes that went into retired memory."""
    pr = kv_pair
    desc = blocks_desc(layers=2, blocks=8)
    src = pr.p.allocate_blocks_cache(desc)
    key = BlocksCacheKey(2, 3)
    dst = pr.d.allocate_blocks_cache(desc, key)
    fill(src, 5)
    await pr.p.push_blocks(key, src, [0, 1], [4, 5])
    first = metrics.recent(1)[0]
    want = (first.nbytes, first.jobs, first.segments)
    assert first.jobs == 2  # one job per layer
    bad = []
    for _ in range(12):
        pr.d.deallocate_blocks_cache(dst)
        dst = pr.d.allocate_blocks_cache(desc, key)  # the key, on a new cache
        await pr.p.push_blocks(key, src, [0, 1], [4, 5])
        rec = metrics.recent(1)[0]
        assert rec.status == "ok"
        if (rec.nbytes, rec.jobs, rec.segments) != want:
            bad.append(rec)
    assert not bad, f"want (nbytes, jobs, segments) = {want}, got {bad}"
    total = registry.get_sample_value(
        "aiokvcache_transfer_bytes_total", {"op": "push_blocks", "peer": "2"}
    )
    assert total == 13 * first.nbytes


LAYERWISE = CacheDesc(
    num_tensors=6, shape=(1, 4096), data_type=DataType.DT_UINT8, placement=Placement.HOST
)


async def test_a_failed_transfer_cache_async_is_not_recorded_ok(
    kv_pair: Pair, registry: Any
) -> None:
    """A task that ended LLM_PARAM_INVALID (its synchronizer refused layer 1)
    was recorded, and counted, with status "ok"."""
    pr = kv_pair
    dst = pr.d.allocate_cache(LAYERWISE)
    src = pr.p.allocate_cache(LAYERWISE)

    class StopAtOne:
        def synchronize_layer(self, layer: int, timeout_in_millis: int | None) -> bool:
            return layer < 1

    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id, 0))
    task = await pr.p.transfer_cache_async(src, StopAtOne(), [cfg])
    assert await task.synchronize() == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        await task
    rec = [r for r in metrics.recent() if r.op == "transfer_cache_async"][-1]
    assert rec.status == "param_invalid", rec


async def test_a_timed_out_transfer_cache_async_is_recorded_as_timeout(
    kv_pair: Pair, registry: Any
) -> None:
    """A task past its timeout must be told apart from one that succeeded or
    failed otherwise, in its record and in aiokvcache_transfers_total."""
    pr = kv_pair
    dst = pr.d.allocate_cache(LAYERWISE)
    src = pr.p.allocate_cache(LAYERWISE)

    class Slow:
        async def synchronize_layer(self, layer: int, timeout_in_millis: int | None) -> bool:
            if layer == 1:
                await anyio.sleep(3)
            return True

    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id, 0))
    task = await pr.p.transfer_cache_async(src, Slow(), [cfg], timeout=0.3)
    with pytest.raises(LLMTimeoutError):
        await task
    rec = [r for r in metrics.recent() if r.op == "transfer_cache_async"][-1]
    assert rec.status == "timeout", rec
    assert registry.get_sample_value(
        "aiokvcache_transfers_total",
        {"op": "transfer_cache_async", "peer": "2", "status": "timeout"},
    )


async def test_off_records_nothing_and_stamps_nothing(kv_pair: Pair) -> None:
    pr = kv_pair
    metrics.reset()
    assert not _telemetry.active
    desc = blocks_desc(layers=2)
    pr.d.allocate_blocks_cache(desc, BlocksCacheKey(2))
    src = pr.p.allocate_blocks_cache(desc)
    groups: list[Any] = []
    orig = pr.prompt._rt.bridge._job_done  # type: ignore[attr-defined]

    def spy(res: Any) -> None:
        groups.append(pr.prompt._rt.bridge._groups.get(res.job_id))  # type: ignore[attr-defined]
        orig(res)

    pr.prompt._rt.bridge._job_done = spy  # type: ignore[attr-defined]
    await pr.p.push_blocks(BlocksCacheKey(2), src, [0], [1])
    assert metrics.recent() == []
    assert groups and all(g is None or g.seen_ns == 0 for g in groups)


async def test_link_setup_is_recorded(registry: Any) -> None:
    from aiokvcache import testing

    async with testing.pair("tcp"):
        pass
    assert _value(registry, "aiokvcache_link_setup_seconds_count", status="success") == 1


async def test_a_prometheus_scrape_over_http_shows_the_histograms(registry: Any) -> None:
    from aiokvcache import testing

    async with testing.pair("tcp") as pr:
        dst = pr.d.allocate_cache(SLOT)
        src = pr.p.allocate_cache(SLOT)
        for _ in range(5):
            await pr.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> bytes:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return bytes(resp.read())

        body = await anyio.to_thread.run_sync(scrape)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    text = body.decode()
    assert (
        'aiokvcache_transfer_phase_seconds_bucket{le="1e-06",op="push_cache",phase="done"}' in text
    )
    assert 'aiokvcache_transfer_seconds_count{op="push_cache",status="ok"} 5.0' in text
    assert 'aiokvcache_transfers_total{op="push_cache",peer="2",status="ok"} 5.0' in text


async def test_spans_one_per_call_children_of_the_callers_span() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    export = pytest.importorskip("opentelemetry.sdk.trace.export")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    from aiokvcache import testing

    metrics._tracer = provider.get_tracer("aiokvcache")
    metrics.add_sink(metrics._span)
    try:
        async with testing.pair("tcp") as pr:
            dst = pr.d.allocate_cache(SLOT)
            src = pr.p.allocate_cache(SLOT)
            with tracer.start_as_current_span("request"):
                await pr.p.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src)
    finally:
        metrics.remove_sink(metrics._span)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    push = spans["aiokvcache.push_cache"]
    assert push.parent is not None and push.parent.span_id == spans["request"].context.span_id
    assert [e.name for e in push.events] == list(metrics.PHASES)
    assert push.attributes["aiokvcache.peer"] == 2
    assert push.attributes["aiokvcache.bytes"] == 4 * 64 * 32 * 2  # slot 0 of 4 tensors
    assert push.start_time <= push.events[0].timestamp <= push.end_time
