"""Discovery through etcd (aiokvcache.etcdEndpoint): instances that know only
the etcd endpoint and each other's cluster ids link and push; a finalized
instance leaves at once; one killed or frozen is dropped within its lease,
sooner than the peer-silence heartbeat; a hostile entry fails only its own
link, and a key that is not a cluster id neither breaks a link nor blinds the
watch (on asyncio and trio, against a real etcd: tests/support/etcd.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from aiokvcache import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiokvcache.testing import PeerProcess, options
from support import etcd

pytestmark = pytest.mark.anyio

pytest.importorskip("aetcd")

S = LLMStatusCode
TTL = etcd.TEST_TTL
DESC = CacheDesc(2, (1, 4096), DataType.DT_UINT8, placement=Placement.HOST)


async def entry(endpoint: str, key: str) -> dict[str, Any] | None:
    return await anyio.to_thread.run_sync(etcd.get, endpoint, key)


async def until(pred: Any, timeout: float, what: str = "") -> float:
    """Seconds until ``pred()`` held (polled); fails after ``timeout``, saying ``what``."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s: {what}" if what else f"not within {timeout} s")
        await anyio.sleep(0.02)
    return time.monotonic() - start


async def test_two_instances_find_each_other_by_id_link_and_push(
    etcd_endpoint: str, prefix: str, transport: str
) -> None:
    opts = etcd.instance_options(etcd_endpoint, prefix)
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    prompt = LLMDataDist(LLMRole.PROMPT, 1)
    try:
        await decoder.init(options(transport, listen=True, **opts))
        await prompt.init(options(transport, **opts))
        reg = await entry(etcd_endpoint, f"{prefix}clusters/2")
        assert reg is not None and reg["cluster_id"] == 2 and reg["role"] == int(LLMRole.DECODER)
        assert f"{reg['address'][0]}:{reg['address'][1]}" == decoder.listen_address
        assert (await entry(etcd_endpoint, f"{prefix}clusters/1"))["address"] is None
        rc, per = await prompt.link_clusters([etcd.by_id(2)], timeout=5000)
        assert (rc, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        dst = decoder.cache_manager.allocate_cache(DESC)
        src = prompt.cache_manager.allocate_cache(DESC)
        for t in src.tensors:
            np.asarray(t)[:] = np.arange(4096, dtype=np.uint8)
        await prompt.cache_manager.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src)
        assert all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(src.tensors, dst.tensors, strict=True)
        )
        # finalize leaves etcd at once (the lease revoked), and the other's link goes.
        await decoder.finalize()
        assert await entry(etcd_endpoint, f"{prefix}clusters/2") is None
        await until(lambda: 2 not in prompt._links or prompt._links[2].broken, 5)
    finally:
        await prompt.finalize()
        await decoder.finalize()
    assert await entry(etcd_endpoint, f"{prefix}clusters/1") is None


async def test_a_cluster_etcd_does_not_know_fails_to_link(
    etcd_endpoint: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt:
        await prompt.init(options("tcp", **etcd.instance_options(etcd_endpoint, prefix)))
        with caplog.at_level(logging.WARNING, "aiokvcache"):
            _rc, per = await prompt.link_clusters([etcd.by_id(7)], timeout=2000)
        assert per == [S.LLM_LINK_FAILED]
        assert "cluster 7 is not registered in etcd" in caplog.text


@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_a_dead_or_frozen_peer_is_dropped_within_its_lease(
    etcd_endpoint: str, prefix: str, how: str
) -> None:
    """Killed, its sockets close; frozen, nothing closes and it sends nothing,
    and the heartbeat here would wait 60 s: its lease ending breaks the link."""
    opts = etcd.instance_options(etcd_endpoint, prefix, peer_timeout=60_000)
    peer = PeerProcess("decoder", "tcp", options=opts)
    async with peer, LLMDataDist(LLMRole.PROMPT, 1) as prompt:
        await prompt.init(options("tcp", **opts))
        _rc, per = await prompt.link_clusters([etcd.by_id(peer.cluster_id)], timeout=5000)
        assert per == [S.LLM_SUCCESS]

        def broken() -> bool:
            link = prompt._links.get(peer.cluster_id)
            return link is None or link.broken

        try:
            if how == "kill":
                await peer.kill()
            else:
                peer.freeze()
            took = await until(broken, TTL + 4)
            # Killed, its entry goes when the lease runs out (its sockets
            # closed at once); frozen, that is what broke the link.
            key = f"{prefix}clusters/{peer.cluster_id}"
            start = time.monotonic()
            while await entry(etcd_endpoint, key) is not None:
                assert time.monotonic() - start < TTL + 4, "the lease did not end"
                await anyio.sleep(0.1)
        finally:
            peer.thaw()
        assert took < TTL + 4  # not the 60 s heartbeat
        src = prompt.cache_manager.allocate_cache(DESC)
        with pytest.raises(LLMException) as err:
            await prompt.cache_manager.push_cache(CacheKeyByIdAndIndex(2, 1, 0), src)
        assert err.value.status_code in (S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK)
        if how == "freeze":
            await peer.kill()  # it would register again, thawed


# ----------------------------------------- entries and keys that are not a peer's


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
    """Anyone who can write etcd can write such an entry: parsing it must not
    raise out of link_clusters (nor overflow, nor recurse too deep)."""
    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt:
        await prompt.init(options("tcp", **etcd.instance_options(etcd_endpoint, prefix)))
        await etcd_put(etcd_endpoint, f"{prefix}clusters/5", value)
        _rc, per = await prompt.link_clusters([etcd.by_id(5)], timeout=2000)
        assert per == [S.LLM_LINK_FAILED]


@pytest.mark.parametrize("tail", ["02", "\u0662"], ids=["leading-zero", "arabic-indic-two"])
async def test_a_key_that_is_not_a_cluster_id_does_not_break_a_link(
    etcd_endpoint: str, prefix: str, tail: str
) -> None:
    """``clusters/02`` and ``clusters/<ARABIC-INDIC DIGIT TWO>`` are not cluster
    2's key (``clusters/2``): read as 2, their going broke the link to cluster 2."""
    async with linked(etcd_endpoint, prefix) as (_decoder, prompt):
        key = f"{prefix}clusters/{tail}"
        await etcd_put(etcd_endpoint, key, b"{}")
        await etcd_txn(etcd_endpoint, [{"requestDeleteRange": {"key": _b64(key)}}])
        await anyio.sleep(1.0)  # the watch has seen it by now
        assert _link_up(prompt, 2), "a foreign key's DELETE broke the link to cluster 2"


async def test_a_malformed_key_does_not_blind_the_watch(etcd_endpoint: str, prefix: str) -> None:
    """A key ``clusters/²`` (``str.isdigit`` but not ``int()``-able) in the same
    watch response as cluster 2's DELETE aborted the watch: the DELETE was lost
    (the link stayed, docs/discovery.md) and every resync failed on that key."""
    async with linked(etcd_endpoint, prefix, peer_timeout=60_000) as (_decoder, prompt):
        await etcd_txn(
            etcd_endpoint,
            [
                {"requestPut": {"key": _b64(f"{prefix}clusters/\u00b2"), "value": _b64("{}")}},
                {"requestDeleteRange": {"key": _b64(f"{prefix}clusters/2")}},
            ],
        )
        await until(lambda: not _link_up(prompt, 2), 4, "link to 2 broken after its entry went")


async def test_bad_etcd_options_are_refused_naming_the_key() -> None:
    cfg = LLMConfig()
    with pytest.raises((ValueError, LLMException), match=r"etcd_endpoint|host:port"):
        cfg.etcd_endpoint = "no-port"
    for key, value in (
        ("aiokvcache.etcdEndpoint", "localhost"),
        ("aiokvcache.etcdPrefix", "no-slash"),
        ("aiokvcache.etcdLeaseTtl", "0"),
    ):
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        with pytest.raises(LLMException, match=key) as err:
            await dd.init({**options("tcp"), key: value})
        assert err.value.status_code == S.LLM_PARAM_INVALID


async def test_an_unreachable_etcd_fails_init_and_leaves_nothing(tmp_path: Path) -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    dd = LLMDataDist(LLMRole.DECODER, 2)
    start = time.monotonic()
    with pytest.raises(LLMException) as err:
        await dd.init(options("tcp", listen=True, etcd_endpoint=f"127.0.0.1:{port}"))
    assert err.value.status_code == S.LLM_LINK_FAILED
    assert f"127.0.0.1:{port}" in err.value.message
    assert time.monotonic() - start < 15
    with pytest.raises(LLMException) as again:
        await dd.init(options("tcp"))
    assert again.value.status_code == S.LLM_ENGINE_FINALIZED


async def test_without_the_extra_init_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, etcd_endpoint: str
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "aetcd", None)  # import aetcd fails
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException, match=r"aiokvcache\[etcd\]") as err:
        await dd.init(options("tcp", etcd_endpoint=etcd_endpoint))
    assert err.value.status_code == S.LLM_FEATURE_NOT_ENABLED


def test_a_grpc_event_for_another_instances_closed_loop_is_no_service_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """grpc's aio poller (aetcd) hands each completion to the loop its call
    was made on, from whichever loop reads the events: after one instance of
    the process finalized, a late event of its RPCs fails on its closed loop
    inside another instance's service loop. That is logged at DEBUG, not as
    an error of ours (it failed the discovery test once in a full run);
    anything else still is."""
    import asyncio

    from aiokvcache._core.peers.servicethread import _grpc_event_for_a_closed_loop, _on_loop_error

    class PollerCompletionQueue:
        def _handle_events(self) -> None: ...

    loop = asyncio.new_event_loop()
    try:
        handle = asyncio.Handle(PollerCompletionQueue()._handle_events, (), loop)
        other = asyncio.Handle(print, (), loop)
        closed = RuntimeError("Event loop is closed")
        with caplog.at_level(logging.DEBUG, "aiokvcache.service"):
            _on_loop_error(loop, {"message": "m", "exception": closed, "handle": handle})
    finally:
        loop.close()
    levels = [r.levelno for r in caplog.records if r.name == "aiokvcache.service"]
    assert levels == [logging.DEBUG], levels
    # Anything else is still an error of the loop.
    assert not _grpc_event_for_a_closed_loop({"handle": handle}, ValueError("x"))
    assert not _grpc_event_for_a_closed_loop({"handle": other}, closed)
    assert not _grpc_event_for_a_closed_loop({}, RuntimeError("Event loop is closed"))
