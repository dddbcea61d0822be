"""Review of the vLLM connector's hand-off (``integrations/_handoff.py``,
``integrations/_kvlink.py``) and of the native keep-alive liveness, by a
reader who did not write them. Each test names the defect it proved; each
failed because of it (not because of an API mismatch) before the fixes that
followed the review. The agent tests drive a ``TransferAgent`` on the test's own loop,
its aiokvcache calls replaced by a recorder (the approach of
``tests/test_kvlink_protocol.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiokvcache.integrations._handoff import PullHolds, blocks_digest
from aiokvcache.integrations._kvlink import TransferAgent
from aiokvcache.integrations._kvtypes import KVLayout, Peer
from support.kvlink_harness import (
    BLOCKS,
    BS,
    D_ID,
    EVIL,
    LAYERS,
    P_ID,
    UNTIL,
    close_agent,
    load_nonce,
    make_agent,
    reg_args,
    until,
)

# ---------------------------------------------------------------------------
# Defect 1: a push that ends while the
# engine releases the request is reported sent TWICE. _push_release reports it
# (and pops it) as soon as no push is running, and _quiesce_push, which was
# spawned by _end_push and is still sending "pushfail" to D, reports the same
# request again when that send returns. vLLM's scheduler then asserts
# ``req_id in self.requests`` on the second finished_sending (the first one
# already freed it): the prefill engine dies. The window is the pushfail
# notification: up to link_timeout (5 s) when D is the one that died.
# ---------------------------------------------------------------------------


async def test_an_aborted_push_is_reported_sent_exactly_once() -> None:
    agent, rec = await make_agent()
    # D's side is slow or dead: the pushfail notification takes a while.
    rec.notify_delay = lambda msg: 0.3 if msg[0] == "pushfail" else 0.0
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]))
        agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 8, False)  # first chunk
        for layer in range(LAYERS):
            agent.push_sender.layer_saved(["x"], layer)
        await until(lambda: len(rec.pushes) == LAYERS)
        await asyncio.sleep(0.05)  # those pushes landed; none is running now
        agent.push_sender.release("x", "p-req", True)  # the client aborted it
        reports = []
        # vLLM's worker collects results once per engine step.
        for _ in range(60):
            reports += list(agent.take_results().finished_sending)
            await asyncio.sleep(0.01)
        assert reports.count("p-req") == 1, f"reported sent {reports.count('p-req')}x: {reports}"
    finally:
        await close_agent(agent)


# ---------------------------------------------------------------------------
# Defect 2: an abort of a push-mode load on
# D reports the request received at once, while P may still be pushing into
# its blocks. cancel_recv cancels D's wait; _expect_push's finally only
# *spawns* a "cancel" to P, and _recv_done reports finished_recving right
# away. vLLM (scheduler, WAITING_FOR_REMOTE_KVS) frees the blocks on that
# report and hands them to another request, and P's layer pushes (bounded
# only by P's own deadline, timeout from the registration) land in them.
# docs/vllm.md: "one aborted while its KV loads stops the load, and vLLM gets
# its blocks back once the load is quiescent" -- true for pull only.
# ---------------------------------------------------------------------------


async def test_an_aborted_push_load_is_not_reported_before_the_prefill_stopped() -> None:
    agent, rec = await make_agent(timeout=5.0, grace=1.0)
    try:
        agent.expect_push("d-req", Peer("h", 1, P_ID), "x", [7, 8, 9])
        await until(lambda: "reg" in rec.kinds(P_ID))
        agent.cancel_recv("d-req")
        await asyncio.sleep(0.3)  # P has not answered: not "pushfail", not "pushed"
        got = agent.take_results()
        assert "d-req" not in got.finished_recving, (
            "the blocks were given back while the prefill may still push into them"
        )
        # P's word that its pushes are quiescent (its answer to the cancel).
        nonce = load_nonce(rec, P_ID, "x")
        agent.deliver(P_ID, "pushfail", ["x", nonce, "the decode side cancelled it"])
        await until(lambda: "d-req" in agent.take_results().finished_recving, timeout=2)
    finally:
        await close_agent(agent)


# ---------------------------------------------------------------------------
# Defect 3 (_handoff.py): once a released request id falls
# out of the bounded ``_released`` memory (max_released = 65536 by default),
# a claim with that request's (still valid) grant key is *granted*: the
# unknown-id path takes it for a claim before the hand-over. The blocks were
# freed and reused long ago, so the decode side reads another request's KV
# and reports it loaded. docs/vllm.md: "a decode request with stale params
# cannot read blocks that were reused". (A retried decode request, or one
# that waited in D's queue while P served 65536 others, has such params.)
# ---------------------------------------------------------------------------


def test_a_stale_claim_after_the_released_memory_evicted_it_is_refused() -> None:
    h = PullHolds(b"s" * 32)  # the agent's defaults
    blocks = [4, 5, 6]
    key = h.key("old", blocks, UNTIL)
    assert not h.hold("old", blocks, 30.0, UNTIL, now=0.0)
    assert h.free(D_ID, "old", key, 3, blocks_digest(blocks), UNTIL, 0.0, 0)  # released
    # The prefill serves more requests (each handed over and read).
    for i in range(65536):
        rid = f"r{i}"
        h.hold(rid, [1], 30.0, UNTIL, now=1.0)
        h.free(D_ID, rid, h.key(rid, [1], UNTIL), 1, blocks_digest([1]), UNTIL, 1.0, 0)
    h.tick(1.5, 0)
    # A decode request with the old params claims it now.
    a = h.claim(D_ID, "old", "n", key, 5.0, 0, 3, 3, blocks_digest(blocks), UNTIL, 2.0, 0)
    assert a.kind == "refused", "granted a read of blocks released (and reused) long ago"


# ---------------------------------------------------------------------------
# Defect 4: a push registration is
# checked against the *prefill's* block count, but its ids are the *decode*
# side's blocks. KVLayout.digest() deliberately leaves the block count out
# (instances may differ), and a decode instance usually has more KV memory
# than a prefill: every push whose decode blocks include an id >= P's
# num_blocks ends with "bad registration" and the decode request fails.
# ---------------------------------------------------------------------------


async def test_a_push_to_a_decode_side_with_more_blocks_than_the_prefill_lands() -> None:
    agent, rec = await make_agent(blocks=BLOCKS)  # P: 64 blocks; D has 256
    try:
        agent.deliver(
            D_ID, "reg", reg_args(agent, ["x", 0, 1, [[100, 3]], 0, 5.0])
        )  # D's blocks 100..102
        agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 12, True)
        for layer in range(LAYERS):
            agent.push_sender.layer_saved(["x"], layer)
        await until(lambda: bool({"pushed", "pushfail"} & set(rec.kinds(D_ID))))
        assert rec.kinds(D_ID) == ["pushed"], rec.sent
    finally:
        await close_agent(agent)


# ---------------------------------------------------------------------------
# Defect 5: the reaper of a push transfer runs
# timeout + grace from the engine's *first step* of the request, not from the
# hand-over. In the prefill-first flow the decode side can only register
# after the prefill finished, so a prefill whose computation (chunked, under
# load) takes longer than timeout + grace (35 s by default) is ended as "no
# decode instance registered", its blocks reported sent, and the decode
# side's registration that follows is dropped silently (no pushfail): D waits
# its whole timeout + grace and fails.
# ---------------------------------------------------------------------------


async def test_a_long_prefill_is_still_pushed_when_the_decode_side_registers_after_it() -> None:
    agent, rec = await make_agent(timeout=0.5, grace=0.2)
    try:
        agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 4, False)  # chunk 1
        for layer in range(LAYERS):
            agent.push_sender.layer_saved(["x"], layer)
        await asyncio.sleep(0.9)  # the prefill is still computing (chunked, busy engine)
        agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 12, True)  # last chunk
        for layer in range(LAYERS):
            agent.push_sender.layer_saved(["x"], layer)
        agent.push_sender.release("x", "p-req", False)  # finished: the proxy now calls D
        await asyncio.sleep(0.05)
        agent.deliver(
            D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0])
        )  # D registers at once
        await asyncio.sleep(0.3)  # well within P's timeout from the registration
        assert "pushed" in rec.kinds(D_ID), (
            f"D registered right after the prefill ended and got {rec.kinds(D_ID)}"
        )
    finally:
        await close_agent(agent)


# ---------------------------------------------------------------------------
# Defect 6: every connector
# message P receives (claim, done, free: no key needed for "done") runs
# PullHolds.tick and next_deadline, each a scan of every held request, and
# re-arms the timer. Any linked peer can make P's loop thread (the one that
# serves every transfer) spend O(held requests) per message it sends; a busy
# prefill also pays O(n) per hold/claim/done of its own (O(n^2) overall).
# ---------------------------------------------------------------------------


async def test_a_bogus_done_costs_the_same_whatever_the_prefill_holds() -> None:
    """Counted, not timed: forged messages must not walk the held requests."""

    class Counting(dict):  # type: ignore[type-arg]
        walks = 0

        def items(self):  # type: ignore[no-untyped-def]
            Counting.walks += 1
            return super().items()

        def values(self):  # type: ignore[no-untyped-def]
            Counting.walks += 1
            return super().values()

        def __iter__(self):  # type: ignore[no-untyped-def]
            Counting.walks += 1
            return super().__iter__()

    agent, _ = await make_agent()
    try:
        loop = asyncio.get_running_loop()
        for i in range(5000):  # the state machine directly: no tick each
            agent.pull_server.holds.hold(f"h{i}", [i % BLOCKS], 600.0, UNTIL, loop.time())
        agent.pull_server.holds._holds = Counting(agent.pull_server.holds._holds)
        for i in range(200):
            agent.deliver(EVIL, "done", [f"nobody{i}", "n"])  # no key, changes nothing
            agent.deliver(EVIL, "free", [f"nobody{i}", "k", 1, "d", UNTIL])
        assert Counting.walks == 0, f"{Counting.walks} walks of 5000 held requests"
    finally:
        await close_agent(agent)


# Defect 7 (ext/progress.cpp): an idle progress thread slept up to 100 ms
# whatever the keep-alive interval, so a peer whose Python threads were
# starved (no command woke it) sent keep-alives every ~100 ms, not every
# quarter of peer_timeout. Shown by measuring a GIL-starved peer's silence
# with peer_timeout 100 ms (median 51 ms, max 105 ms before; under the
# review's thresholds of 35 / 75 ms after, run alone). A timing, so not kept
# as a test (the suite never asserts timings); tests/test_liveness.py keeps a
# starved peer linked.


# ---------------------------------------------------------------------------
# Defect 8: D's link task to a prefill worker is cached
# for ever once it succeeded. When that link later goes (the prefill's
# heartbeat broke it after a pause, the prefill unlinked or restarted on the
# same cluster id), the next load does not link again: its claim's notify
# fails (LLM_NOT_YET_LINK), and only then does _relink forget the task. So
# one decode request per broken link fails ("link") although the prefill is
# up and reachable.
# ---------------------------------------------------------------------------


def test_a_load_after_the_link_went_away_relinks_instead_of_failing() -> None:
    import numpy as np

    from aiokvcache import LLMClusterInfo
    from aiokvcache.integrations._kvlink import cluster_id_for

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

    p, d = Side("review-prefill"), Side("review-decode")
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


# ---------------------------------------------------------------------------
# Defect 9, minor: a pull's deadline does not bound the
# claim's own send. ttl is computed before ``_send(claim)``, whose notify may
# take up to link_timeout (5 s: a frozen prefill's engine does not take it),
# and the grant is then awaited for the whole ttl again. A load on a frozen
# prefill fails after timeout + link_timeout, not "within timeout (pull)"
# (docs/vllm.md, Failures).
# ---------------------------------------------------------------------------


async def test_a_pull_fails_within_its_timeout_when_the_claim_is_slow_to_go() -> None:
    agent, rec = await make_agent(timeout=1.0, grace=0.2)
    rec.notify_delay = lambda msg: 1.0 if msg[0] == "claim" else 0.0  # a frozen P
    try:
        t0 = time.monotonic()
        agent.pull("d-req", Peer("h", 1, P_ID), "r", [1, 2, 3], [7, 8, 9], key="k" * 32)
        failed: set[str] = set()

        def done() -> bool:
            failed.update(agent.take_results().failed_recving)
            return "d-req" in failed

        await until(done, timeout=10)
        took = time.monotonic() - t0
        assert took < 1.0 + 0.3, f"a pull with timeout 1 s failed after {took:.2f} s"
    finally:
        await close_agent(agent)


# Defect 10 (the "descriptors" metric counted the local block runs only) is
# held by tests/test_kvlink.py::test_the_load_metrics_are_what_the_pull_moved,
# on real agents: the figure now comes from the transfer calls' own records.
