"""The vLLM connector's engine-independent half (``aiokvcache.integrations.agent.kvlink``):
two TransferAgents in one process, each with its own loop thread, moving
NumPy "KV caches" in vLLM's CPU layout, driven from this (synchronous) thread
as vLLM's worker drives them: pulls and pushes, a load after the link went
away, and the agent's own metrics sink next to the user's. No vLLM needed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from aiokvcache import _telemetry, metrics
from aiokvcache.integrations.agent.kvlink import TransferAgent, cluster_id_for
from aiokvcache.integrations.agent.kvtypes import KVLayout, Peer, block_runs
from support.agent_pair import BLOCK_BYTES, BS, LAYERS, Side, agent_pair, fill, same, wait_for


@pytest.fixture
def sides(transport: str) -> Iterator[tuple[Side, Side]]:
    with agent_pair(transport) as pair:
        yield pair


def test_block_runs_and_cluster_ids() -> None:
    assert block_runs([3, 4, 5, 9, 10, 2]) == [[3, 3], [9, 2], [2, 1]]
    assert block_runs([]) == []
    assert cluster_id_for("e", 0) == cluster_id_for("e", 0) != cluster_id_for("e", 1)
    with pytest.raises(ValueError, match="addrs"):
        KVLayout(2, 2, 4, 8, 4, (1, 2, 3))


UNTIL = int((time.time() + 3600) * 1000)  # the grant keys' expiry (wall clock, ms)


def test_pull_claims_reads_then_frees(sides: tuple[Side, Side]) -> None:
    p, d = sides
    fill(p, [1, 2, 7], 1)
    # D may claim before P's engine handed the request over: its key (made
    # by P's scheduler) proves the request and its blocks.
    key = p.agent.grant_key("p-req", [1, 2, 7], UNTIL)
    lay = p.agent.layout.digest()
    d.agent.pull("d-req", p.peer, "p-req", [1, 2, 7], [5, 6, 3], lay, key=key, until_ms=UNTIL)
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert not d.got.failed_recving
    assert same(p, [1, 2, 7], d, [5, 6, 3])
    time.sleep(0.2)
    assert not p.poll().finished_sending  # not reported before the engine handed it over
    p.agent.hold("p-req", 30, [1, 2, 7], UNTIL)
    wait_for(lambda: "p-req" in p.poll().finished_sending)  # at once: D is done
    m = d.agent.take_metrics()
    assert m["bytes"] == [3 * LAYERS * BLOCK_BYTES] and len(m["seconds"]) == 1, m


def test_the_load_metrics_are_what_the_pull_moved(sides: tuple[Side, Side]) -> None:
    # Scattered prefill blocks into consecutive decode blocks: a span breaks
    # wherever either side does, so three spans a tensor (not one, as the
    # local runs alone would say). The figures are the pull call's record.
    p, d = sides
    remote, local = [1, 5, 9], [7, 8, 9]
    fill(p, remote, 5)
    key = p.agent.grant_key("p-req", remote, UNTIL)
    d.agent.pull("d-req", p.peer, "p-req", remote, local, key=key, until_ms=UNTIL)
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert not d.got.failed_recving and same(p, remote, d, local)
    m = d.agent.take_metrics()
    assert m["descriptors"] == [3 * LAYERS], m
    assert m["bytes"] == [3 * LAYERS * BLOCK_BYTES], m
    assert m["calls"]["pull_blocks"] == {"ok": 1}, m
    assert set(m["phases"]["pull_blocks"]) == {"submitted", "posted", "done", "seen"}
    assert m["phases"]["pull_blocks"]["done"] > 0, m


def test_metrics_enabled_is_false_after_disable_while_an_agent_runs() -> None:
    """The agent records through the public add_sink: its internal sink made
    ``metrics.enabled()`` say True, so code that enables metrics only when off
    never registered its collector in a vLLM process."""
    assert not metrics.enabled(), "another test left a sink on"
    side = Side("metrics-sink", "tcp", timeout=5.0, grace=1.0)
    try:
        assert _telemetry.active  # the agent's records are being made
        assert not metrics.enabled(), "enabled() before anyone enabled metrics"
        metrics.enable(prometheus=False, tracing=False)
        assert metrics.enabled()
        metrics.disable()
        assert not metrics.enabled(), (
            "metrics.disable() was called and no user sink is on, yet "
            "metrics.enabled() is True: the connector's internal sink counts as one"
        )
    finally:
        metrics.disable()
        side.agent.close()
    assert not _telemetry.active


def test_pull_of_part_of_a_request(sides: tuple[Side, Side]) -> None:
    p, d = sides
    fill(p, [4, 5, 6], 4)
    p.agent.hold("p-req", 30, [4, 5, 6], UNTIL)
    key = p.agent.grant_key("p-req", [4, 5, 6], UNTIL)
    d.agent.pull("d-req", p.peer, "p-req", [4, 5, 6], [9, 10], key=key, until_ms=UNTIL, first=1)
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert not d.got.failed_recving
    assert same(p, [5, 6], d, [9, 10])


def test_pull_after_the_lease_expired_fails_and_reads_nothing(sides: tuple[Side, Side]) -> None:
    p, d = sides
    fill(p, [1], 2)
    p.agent.hold("p-req", 0, [1], UNTIL)
    # reaped: the engine may reuse block 1
    wait_for(lambda: "p-req" in p.poll().finished_sending, timeout=5)
    key = p.agent.grant_key("p-req", [1], UNTIL)
    d.agent.pull("d-req", p.peer, "p-req", [1], [4], key=key, until_ms=UNTIL)
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert d.got.failed_recving == {"d-req"}
    assert d.got.invalid_block_ids == {4}
    assert not d.kv[0][4].any()


def test_pull_with_another_layout_fails(sides: tuple[Side, Side]) -> None:
    p, d = sides
    d.agent.pull("d-req", p.peer, "p-req", [1], [4], digest="0" * 16)
    wait_for(lambda: "d-req" in d.poll().failed_recving)


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
def test_push_layer_by_layer(sides: tuple[Side, Side], order: str) -> None:
    p, d = sides
    pblocks, dblocks = [2, 3, 4], [9, 1, 12]
    fill(p, pblocks, 3)
    if order == "decode-first":
        d.agent.expect_push("d-req", p.peer, "x1", dblocks, key=p.agent.push_key("x1"))
        time.sleep(0.2)  # the registration arrives before P computes anything
    # Two prefill chunks: tokens [0, 6) then [6, 10) (blocks of 4 tokens).
    p.agent.push_step("x1", "p-req", pblocks, BS, 6, final=False)
    for layer in range(LAYERS):
        p.agent.layer_saved(["x1"], layer)
    p.agent.push_step("x1", "p-req", pblocks, BS, 10, final=True)
    for layer in range(LAYERS):
        p.agent.layer_saved(["x1"], layer)
    p.agent.push_release("x1", "p-req")
    if order == "prefill-first":
        d.agent.expect_push("d-req", p.peer, "x1", dblocks, key=p.agent.push_key("x1"))
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert not d.got.failed_recving
    assert same(p, pblocks, d, dblocks)
    assert d.agent.stats["layers_received"] >= LAYERS
    assert d.agent.stats["pushes_received"] == 1 and p.agent.stats["pushes_sent"] == 1
    wait_for(lambda: "p-req" in p.poll().finished_sending)
    # D's figures for the load are what P's push calls' records say they
    # moved. Registered first, P pushes each chunk as it is computed: blocks
    # 0-1, then 1-2 (the partial block 1 again), two calls a layer; computed
    # first, P pushes all three blocks of every layer in one call once D
    # registers. D's blocks are all apart: one segment a block and tensor.
    pm, dm = p.agent.take_metrics(), d.agent.take_metrics()
    per_layer, calls = (4, 2 * LAYERS) if order == "decode-first" else (3, 1)
    assert pm["calls"]["push_blocks"] == {"ok": calls}, pm
    assert dm["bytes"] == [per_layer * LAYERS * BLOCK_BYTES], dm
    assert dm["descriptors"] == [per_layer * LAYERS], dm
    assert "push_blocks" not in dm["calls"], dm  # D made no push


def test_push_released_before_any_step_frees_at_once(sides: tuple[Side, Side]) -> None:
    # The engine finished the request before it was scheduled here: nothing
    # was pushed, and its blocks are reported sent without waiting.
    p, _ = sides
    p.agent.push_release("x3", "p-req", aborted=True)
    wait_for(lambda: "p-req" in p.poll().finished_sending, timeout=2)


def test_push_nobody_computes_fails_on_time_and_frees(sides: tuple[Side, Side]) -> None:
    p, d = sides
    t0 = time.monotonic()
    d.agent.expect_push("d-req", p.peer, "x2", [1, 2], key=p.agent.push_key("x2"))
    wait_for(lambda: "d-req" in d.poll().finished_recving, timeout=30)
    took = time.monotonic() - t0
    assert d.got.failed_recving == {"d-req"}
    assert d.got.invalid_block_ids == {1, 2}
    assert took < 5.0 + 1.0 + 5.0  # timeout + grace, and some slack for a loaded machine


def test_pull_from_a_dead_peer_fails_within_the_deadline(transport: str) -> None:
    d = Side("decode", transport, timeout=2.0, grace=0.5)
    try:
        t0 = time.monotonic()
        d.agent.pull("d-req", Peer("127.0.0.1", 1, 12345), "p-req", [1], [2])
        wait_for(lambda: "d-req" in d.poll().finished_recving)
        assert d.got.failed_recving == {"d-req"}
        assert time.monotonic() - t0 < 10
    finally:
        d.agent.close()


def test_a_load_after_the_link_went_away_relinks_instead_of_failing() -> None:
    """A decode cached its link task to a prefill for ever: after the link
    went (a heartbeat after a pause, an unlink), one load per broken link failed."""
    import numpy as np

    from aiokvcache import LLMClusterInfo

    class Side:
        def __init__(self, name: str) -> None:
            self.kv = [np.zeros((16, 256), np.uint8) for _ in range(LAYERS)]
            layout = KVLayout(LAYERS, 1, 16, 256, BS, tuple(a.ctypes.data for a in self.kv), "u8")
            self.agent = TransferAgent(
                cluster_id_for(name, 0), layout, transport="tcp", timeout=5.0, grace=1.0
            )
            host, port = self.agent.start().rsplit(":", 1)
            self.peer = Peer(host, int(port), self.agent.cluster_id)

    def wait(cond: Callable[[], bool], timeout: float = 15.0) -> None:
        end = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < end, "timed out"
            time.sleep(0.01)

    p, d = Side("relink-prefill"), Side("relink-decode")
    try:
        got: dict[str, set[str]] = {"ok": set(), "failed": set()}

        def ended(rid: str) -> bool:
            r = d.agent.take_results()
            got["ok"] |= r.finished_recving - r.failed_recving
            got["failed"] |= r.failed_recving
            return rid in got["ok"] | got["failed"]

        for rid in ("p1", "p2"):
            p.agent.hold(rid, 30, [1, 2], UNTIL)
        key = p.agent.grant_key("p1", [1, 2], UNTIL)
        d.agent.pull("d1", p.peer, "p1", [1, 2], [3, 4], key=key, until_ms=UNTIL)
        wait(lambda: ended("d1"))
        assert got["failed"] == set()
        # The prefill side drops the link (as its heartbeat does after a pause).
        info = LLMClusterInfo()
        info.remote_cluster_id = d.agent.cluster_id
        assert p.agent.links.dd is not None and p.agent._loop is not None
        asyncio.run_coroutine_threadsafe(
            p.agent.links.dd.unlink_clusters([info], force=True), p.agent._loop
        ).result(10)
        time.sleep(0.5)
        key = p.agent.grant_key("p2", [1, 2], UNTIL)
        d.agent.pull("d2", p.peer, "p2", [1, 2], [5, 6], key=key, until_ms=UNTIL)
        wait(lambda: ended("d2"))
        assert "d2" in got["ok"], "a load failed only because an old link had gone"
    finally:
        d.agent.close()
        p.agent.close()
