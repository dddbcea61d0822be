"""Review of the metrics and etcd-discovery features: each test here fails on a
defect found in review (records with the wrong bytes/jobs/status; etcd entries
and keys that break the watch or the link call)."""

from __future__ import annotations

import base64
import contextlib
import json
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
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
    TransferWithCacheKeyConfig,
    metrics,
)
from aiokvcache.testing import Pair, blocks_desc, fill, options
from support import etcd

pytestmark = pytest.mark.anyio

prometheus_client = pytest.importorskip("prometheus_client")

S = LLMStatusCode
TTL = etcd.TEST_TTL


# ----------------------------------------------------------------- metrics


async def test_push_blocks_retry_after_a_rebind_counts_only_the_push_that_landed(
    kv_pair: Pair, registry: Any
) -> None:
    """A push by BlocksCacheKey whose recorded cache was retired under it is
    asked again and run again (Transfers.by_blocks_key). Its record must show
    the call's push, not both attempts: the first one's bytes went into
    retired memory, and its jobs and segments are not the call's."""
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
    """The synchronizer refuses layer 1: the task ends LLM_PARAM_INVALID, but
    its record (and aiokvcache_transfers_total) says status="ok"."""
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


# -------------------------------------------------------------------- etcd

pytest.importorskip("aetcd")


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _post(endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{endpoint}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


async def etcd_put(endpoint: str, key: str, value: bytes) -> None:
    await anyio.to_thread.run_sync(
        _post, endpoint, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)}
    )


async def etcd_txn(endpoint: str, ops: list[dict[str, Any]]) -> None:
    """Several puts/deletes in one revision (one watch response)."""
    await anyio.to_thread.run_sync(_post, endpoint, "/v3/kv/txn", {"success": ops})


async def until(pred: Any, timeout: float, what: str = "") -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s: {what}")
        await anyio.sleep(0.02)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def linked(endpoint: str, prefix: str, **extra: Any) -> Any:
    """A decoder (2, listening) and a prompt (1), both registered in etcd, the
    prompt linked to the decoder by cluster id."""
    opts = etcd.instance_options(endpoint, prefix, **extra)
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    prompt = LLMDataDist(LLMRole.PROMPT, 1)
    try:
        await decoder.init(options("tcp", listen=True, **opts))
        await prompt.init(options("tcp", **opts))
        _rc, per = await prompt.link_clusters([etcd.by_id(2)], timeout=5000)
        assert per == [S.LLM_SUCCESS]
        yield decoder, prompt
    finally:
        await prompt.finalize()
        await decoder.finalize()


def _link_up(dd: LLMDataDist, cid: int) -> bool:
    link = dd._links.get(cid)
    return link is not None and not link.broken


# A hostile or broken entry for cluster 5: link_clusters must report
# LLM_LINK_FAILED for it (as for any entry without a usable address), not raise.
HOSTILE = {
    "port-overflows-int": b'{"address": ["127.0.0.1", 1e400]}',
    "port-out-of-range": b'{"address": ["127.0.0.1", 70000]}',
    "port-negative": b'{"address": ["127.0.0.1", -1]}',
    "deeply-nested": b"[" * 100_000,
}


@pytest.mark.parametrize("value", list(HOSTILE.values()), ids=list(HOSTILE))
async def test_a_hostile_etcd_entry_fails_its_link_and_nothing_else(
    etcd_endpoint: str, prefix: str, value: bytes
) -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt:
        await prompt.init(options("tcp", **etcd.instance_options(etcd_endpoint, prefix)))
        await etcd_put(etcd_endpoint, f"{prefix}clusters/5", value)
        _rc, per = await prompt.link_clusters([etcd.by_id(5)], timeout=2000)
        assert per == [S.LLM_LINK_FAILED]


@pytest.mark.parametrize("tail", ["02", "\u0662"], ids=["leading-zero", "arabic-indic-two"])
async def test_a_key_that_is_not_a_cluster_id_does_not_break_a_link(
    etcd_endpoint: str, prefix: str, tail: str
) -> None:
    """``clusters/02`` and ``clusters/<ARABIC-INDIC DIGIT TWO>`` are not
    cluster 2's key (that is ``clusters/2``): their going must not break the
    link to cluster 2."""
    async with linked(etcd_endpoint, prefix) as (_decoder, prompt):
        key = f"{prefix}clusters/{tail}"
        await etcd_put(etcd_endpoint, key, b"{}")
        await etcd_txn(etcd_endpoint, [{"requestDeleteRange": {"key": _b64(key)}}])
        await anyio.sleep(1.0)  # the watch has seen it by now
        assert _link_up(prompt, 2), "a foreign key's DELETE broke the link to cluster 2"


async def test_a_malformed_key_does_not_blind_the_watch(etcd_endpoint: str, prefix: str) -> None:
    """A key ``clusters/²`` (``str.isdigit`` but not ``int()``-able) arrives in
    the same watch response as the DELETE of cluster 2's entry: the link to
    cluster 2 must still be broken (docs/discovery.md: when an entry goes, the
    link is broken). In the code the ValueError aborts the watch loop, the
    DELETE is lost, and every resync fails on the same key."""
    async with linked(etcd_endpoint, prefix, peer_timeout=60_000) as (_decoder, prompt):
        await etcd_txn(
            etcd_endpoint,
            [
                {"requestPut": {"key": _b64(f"{prefix}clusters/\u00b2"), "value": _b64("{}")}},
                {"requestDeleteRange": {"key": _b64(f"{prefix}clusters/2")}},
            ],
        )
        await until(lambda: not _link_up(prompt, 2), 4, "link to 2 broken after its entry went")
