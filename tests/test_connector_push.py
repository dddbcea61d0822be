"""The vLLM connector's push mode (``integrations/agent/prefill_push.py`` and the
push half of ``integrations/agent/decode.py``): each load of a transfer its own,
the decode's blocks given back only on the prefill's word (an abort and a
shutdown included), the push key and the KV layout checked, a load bound to
its link, preemption, and the prefill's end of a push (reported sent once,
pushed however long the prefill took).

Two kinds of test: a ``TransferAgent`` on the test's loop whose aiokvcache
calls a :class:`Recorder` stands in for (support/kvlink_harness.py), and two
real agents moving NumPy "KV caches" (support/agent_pair.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiokvcache import LLMException, LLMStatusCode
from aiokvcache.integrations.agent.kvtypes import Peer
from support.agent_pair import BS, LAYERS, Side, agent_pair, fill, same, wait_for
from support.kvlink_harness import (
    BLOCKS,
    D_ID,
    EVIL,
    P_ID,
    close_agent,
    load_nonce,
    make_agent,
    reg_args,
    step_all,
    until,
)

PEER = Peer("h", 1, P_ID)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


# ------------------------------------------------------------ loads of one transfer


@pytest.fixture
def sides(transport: str) -> Iterator[tuple[Side, Side]]:
    with agent_pair(transport) as pair:
        yield pair


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
def test_two_loads_of_one_transfer_each_hold_the_prefills_bytes(
    sides: tuple[Side, Side], order: str
) -> None:
    """vLLM's ``n > 1`` children (and a proxy's retry) carry the same params:
    two loads of one transfer on one decode worker. Each is its own load:
    both end received, each holding the prefill's bytes (before, one ended
    failed holding them and the other OK holding nothing)."""
    p, d = sides
    pblocks, d1, d2 = [2, 3, 4], [9, 1, 12], [5, 6, 7]
    fill(p, pblocks, 7)
    key = p.agent.push_key("x")

    def expect() -> None:
        d.agent.expect_push("c0", p.peer, "x", d1, key=key)
        d.agent.expect_push("c1", p.peer, "x", d2, key=key)

    if order == "decode-first":
        expect()
        time.sleep(0.2)
    p.agent.push_step("x", "p-req", pblocks, BS, 10, final=True)
    for layer in range(LAYERS):
        p.agent.layer_saved(["x"], layer)
    p.agent.push_release("x", "p-req")
    if order == "prefill-first":
        expect()
    wait_for(lambda: {"c0", "c1"} <= d.poll().finished_recving)
    assert not d.got.failed_recving, d.got
    assert same(p, pblocks, d, d1) and same(p, pblocks, d, d2)
    wait_for(lambda: "p-req" in p.poll().finished_sending)
    assert p.agent.pending() == 0 and d.agent.pending() == 0


async def test_each_load_hears_only_its_own_answer() -> None:
    """P's ``pushed`` for one load ends that load only: the other, on the same
    transfer, still waits for its own."""
    agent, rec = await make_agent()
    try:
        agent.expect_push("c0", PEER, "x", [7, 8, 9], key="k")
        agent.expect_push("c1", PEER, "x", [4, 5, 6], key="k")
        await until(lambda: rec.kinds(P_ID).count("reg") == 2)
        n0, n1 = (m[7] for c, m in rec.sent if m[0] == "reg")
        assert n0 != n1
        agent.deliver(P_ID, "pushed", ["x", n0])
        await until(lambda: "c0" in agent.take_results().finished_recving)
        await asyncio.sleep(0.1)
        assert agent.receiver.pending() == 1  # c1 still waits for its own word
        agent.deliver(P_ID, "pushfail", ["x", n1, "no"])
        await until(lambda: "c1" in agent.take_results().failed_recving)
    finally:
        await close_agent(agent)


# ------------------------------------------------------------ no write after a failure


async def test_a_timed_out_load_gives_its_blocks_back_only_on_the_prefills_word() -> None:
    """D's timeout passes while P's Python is starved: D cancels and keeps
    the blocks until P answers that its pushes to the load stopped (before,
    it gave them back at its own deadline, and P's pushes landed after)."""
    agent, rec = await make_agent(timeout=1.0, grace=2.0)
    try:
        agent.expect_push("d-req", PEER, "x", [7, 8, 9], key="k")
        await until(lambda: "reg" in rec.kinds(P_ID))
        nonce = load_nonce(rec, P_ID, "x")
        await asyncio.sleep(1.4)  # past D's timeout, within its grace
        got = agent.take_results()
        assert "d-req" not in got.failed_recving | got.finished_recving, got
        assert ["cancel", "x", nonce] in [m for c, m in rec.sent if c == P_ID]
        agent.deliver(P_ID, "pushfail", ["x", nonce, "the decode side cancelled it"])
        await until(lambda: "d-req" in agent.take_results().failed_recving)
    finally:
        await close_agent(agent)


async def test_a_prefill_that_never_answers_is_unlinked_before_the_blocks_go_back() -> None:
    """No word from P by D's deadline and grace: D unlinks P (its engine
    confirms once its transfers on the link were released) before it gives
    the blocks back."""
    agent, _ = await make_agent(timeout=0.5, grace=0.5)
    events: list[str] = []

    async def quiesce(cluster_id: int) -> None:
        events.append(f"unlink {cluster_id}")

    agent.links.quiesce = quiesce  # type: ignore[method-assign]
    try:
        agent.expect_push("d-req", PEER, "x", [7, 8, 9], key="k")
        await until(lambda: "d-req" in agent.take_results().failed_recving, timeout=5)
        assert events == [f"unlink {P_ID}"]
    finally:
        await close_agent(agent)


async def test_an_aborted_push_load_is_not_reported_before_the_prefill_stopped() -> None:
    """An abort reported the load received at once: vLLM handed its blocks to
    another request while the prefill still pushed into them."""
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


async def test_an_abort_during_the_abort_wait_is_reported_as_an_abort_and_not_leaked() -> None:
    """A load whose registration failed waits for the prefill's word; an abort
    swallowed there was reported as a link failure, and its id kept for ever."""
    agent, rec = await make_agent(timeout=2.0, grace=1.0)

    async def notify(cluster: int, tag: str, timeout: float | None = None) -> None:
        if '"reg"' in tag:
            raise LLMException(LLMStatusCode.LLM_LINK_FAILED, "link went away")
        rec.sent.append((cluster, [tag]))

    rec.notify = notify  # type: ignore[method-assign]
    try:
        agent.expect_push("d-req", Peer("h", 1, P_ID), "x", [7, 8, 9])
        await asyncio.sleep(0.2)  # registration failed; D waits for P's word
        agent.cancel_recv("d-req")  # the engine aborts the request meanwhile
        got = None  # reported at P's word or the deadline (2 s), not before
        for _ in range(200):
            r = agent.take_results()
            if r.finished_recving:
                got = r
                break
            await asyncio.sleep(0.02)
        assert got is not None and "d-req" in got.finished_recving
        await asyncio.sleep(0.05)
        assert not agent.receiver.aborted, f"abort swallowed, id leaked: {agent.receiver.aborted}"
        assert "d-req" not in got.failed_recving, "an aborted load reported as a failed one"
    finally:
        await close_agent(agent)


async def test_shutdown_does_not_wait_a_push_load_deadline_for_a_message_it_cannot_get() -> None:
    """Shutdown cancels the listener too: a push load's abort wait then sat
    to its deadline for a word nobody could deliver, past close()'s join."""
    agent, rec = await make_agent(timeout=8.0, grace=1.0)
    try:
        agent.expect_push("d-req", Peer("h", 1, P_ID), "x", [7, 8, 9])
        await until(lambda: "reg" in rec.kinds(P_ID))
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(agent._shutdown(), 3.0)  # what close() runs
        except TimeoutError:
            raise AssertionError(
                f"shutdown still waiting after {time.monotonic() - t0:.1f} s "
                "(the push load's abort-wait runs to its deadline)"
            ) from None
    finally:
        await close_agent(agent)


def test_no_push_lands_after_the_decode_reported_the_load_failed(transport: str) -> None:
    """Real agents. D's timeout is 2 s; P's loop is starved while the
    registration arrives (1.2 s) and again across D's deadline while the
    engine saves every layer. Once D reports the load failed, the test writes
    a canary into its blocks: no byte of it may change afterwards."""
    with agent_pair(transport, decode={"timeout": 2.0, "grace": 3.0}) as (p, d):
        pblocks, dblocks = [2, 3, 4], [9, 1, 12]
        fill(p, pblocks, 3)
        loop = p.agent._loop
        assert loop is not None
        t0 = time.monotonic()
        d.agent.expect_push("d-req", p.peer, "x", dblocks, key="client-key")
        loop.call_soon_threadsafe(time.sleep, 1.2)  # starved as the registration arrives
        p.agent.push_step("x", "p-req", pblocks, BS, 10, True, client_key="client-key")
        time.sleep(max(0.0, t0 + 1.6 - time.monotonic()))
        loop.call_soon_threadsafe(time.sleep, 1.0)  # starved again, across D's deadline
        for layer in range(LAYERS):
            p.agent.layer_saved(["x"], layer)
        p.agent.push_release("x", "p-req")
        wait_for(lambda: "d-req" in d.poll().failed_recving, timeout=15)
        for layer in d.kv:  # vLLM gives the blocks to another request
            layer[dblocks] = 0xEE
        wait_for(lambda: "p-req" in p.poll().finished_sending, timeout=15)
        time.sleep(0.3)
        for layer in d.kv:
            assert (layer[dblocks] == 0xEE).all(), "a push landed after the load was reported"


# ------------------------------------------------------------ who may register


async def test_a_registration_without_the_push_key_gets_nothing() -> None:
    agent, rec = await make_agent()
    try:
        agent.deliver(EVIL, "reg", reg_args(agent, ["x", 0, 1, [[40, 3]], 0, 5.0], key="f" * 32))
        step_all(agent)
        await until(lambda: "pushfail" in rec.kinds(EVIL))
        assert not rec.pushes
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]))
        await until(lambda: "pushed" in rec.kinds(D_ID))
        assert {c for c, _ in rec.pushes} == {D_ID}
    finally:
        await close_agent(agent)


async def test_an_empty_registration_without_the_key_frees_nothing() -> None:
    """Prefill first: the request is computed and released, its blocks wait
    for the decode. A peer's empty registration (what a decode that needs
    nothing sends) without the key does not free them; the decode's does."""
    agent, rec = await make_agent()
    try:
        step_all(agent)
        agent.push_sender.release("x", "p-req", False)
        agent.deliver(EVIL, "reg", reg_args(agent, ["x", 0, 1, [], 0, 5.0], key="f" * 32))
        await settle()
        assert "p-req" not in agent.take_results().finished_sending
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [], 0, 5.0], nonce="n2"))
        await until(lambda: "p-req" in agent.take_results().finished_sending)
        assert not rec.pushes
    finally:
        await close_agent(agent)


async def test_decode_first_registrations_wait_for_the_clients_key() -> None:
    """Decode first: registrations come before the engine steps the request;
    the one with the key the client gave both requests is pushed to once the
    step brings it, the other refused then."""
    agent, rec = await make_agent()
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0], key="ck"))
        agent.deliver(EVIL, "reg", reg_args(agent, ["x", 0, 1, [[40, 3]], 0, 5.0], key="xx"))
        await settle()
        assert not rec.sent and not rec.pushes  # neither checked yet
        step_all(agent, key="ck")
        await until(lambda: "pushed" in rec.kinds(D_ID) and "pushfail" in rec.kinds(EVIL))
        assert {c for c, _ in rec.pushes} == {D_ID}
    finally:
        await close_agent(agent)


async def test_a_registration_for_another_kv_layout_is_refused() -> None:
    agent, rec = await make_agent()
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0], layout="0" * 16))
        step_all(agent)
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        why = next(m for c, m in rec.sent if m[0] == "pushfail")[3]
        assert "layout" in why and not rec.pushes
    finally:
        await close_agent(agent)


async def test_a_push_to_a_decode_side_with_more_blocks_than_the_prefill_lands() -> None:
    """A registration names the decode's blocks: checked against the prefill's
    block count, every push to a larger decode instance failed."""
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


async def test_a_decode_load_with_another_layout_in_its_params_fails_before_registering() -> None:
    agent, rec = await make_agent()
    try:
        agent.expect_push("d-req", PEER, "x", [7, 8, 9], key="k", layout="0" * 16)
        await until(lambda: "d-req" in agent.take_results().failed_recving)
        assert "reg" not in rec.kinds()
    finally:
        await close_agent(agent)


# ------------------------------------------------------------ the link a load came on


async def test_a_load_is_pushed_to_only_over_the_link_it_registered_on() -> None:
    """The decode restarted with the same cluster id (its link made anew):
    the old load's pushes are not written into the new instance's blocks;
    and a registration that waited in the queue while the link was made anew
    is never bound to the new link."""
    agent, rec = await make_agent()
    link = ["old"]
    agent.links.current = lambda cluster_id: link[0]  # type: ignore[method-assign]
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]), link="old")
        link[0] = "new"
        step_all(agent)
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        assert not rec.pushes and "pushed" not in rec.kinds()
        # A registration that came on the old link, handled once the new one is up.
        stale = reg_args(agent, ["y", 0, 1, [[10, 3]], 0, 5.0], nonce="n2")
        agent.deliver(D_ID, "reg", stale, link="old")
        step_all(agent, xid="y")
        await until(lambda: rec.kinds(D_ID).count("pushfail") == 2)
        assert not rec.pushes
    finally:
        await close_agent(agent)


# ------------------------------------------------------------ preemption


async def test_preempted_pushes_are_quiescent_when_preempt_returns_then_pushed_again() -> None:
    """vLLM frees a preempted request's blocks for the next step: its pushes
    are cancelled and over before ``preempt`` returns; the recompute saves
    and pushes every layer again, and only then is the load told pushed."""
    agent, rec = await make_agent()
    running: list[int] = []
    gate = asyncio.Event()

    async def push(layer: int) -> None:
        running.append(layer)
        try:
            await gate.wait()
        finally:
            running.remove(layer)

    rec.push = push
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]))
        agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 4, False)
        agent.push_sender.layer_saved(["x"], 0)
        await until(lambda: running == [0])
        await agent.push_sender.preempt(["x"])
        assert running == [], "a push still reads the preempted request's blocks"
        gate.set()
        before = len(rec.pushes)
        step_all(agent)  # recomputed from the start, in new blocks
        await until(lambda: "pushed" in rec.kinds(D_ID))
        assert sorted(layer for _, layer in rec.pushes[before:]) == list(range(LAYERS))
        assert "pushfail" not in rec.kinds()
    finally:
        await close_agent(agent)


def test_push_preempt_blocks_the_engine_thread_until_quiescent(sides: tuple[Side, Side]) -> None:
    """``TransferAgent.push_preempt`` (what the connector's
    ``handle_preemptions`` calls from vLLM's thread) returns once done."""
    p, d = sides
    key = p.agent.push_key("x")
    d.agent.expect_push("d-req", p.peer, "x", [9, 1, 12], key=key)
    time.sleep(0.2)
    p.agent.push_step("x", "p-req", [2, 3, 4], BS, 4, final=False)
    p.agent.layer_saved(["x"], 0)
    p.agent.push_preempt(["x"])
    fill(p, [5, 6, 7], 11)  # the recompute, in other blocks
    p.agent.push_step("x", "p-req", [5, 6, 7], BS, 10, final=True)
    for layer in range(LAYERS):
        p.agent.layer_saved(["x"], layer)
    p.agent.push_release("x", "p-req")
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert same(p, [5, 6, 7], d, [9, 1, 12])
    assert np.array_equal(d.kv[0][[9, 1, 12]], p.kv[0][[5, 6, 7]])


# ------------------------------------------------------------ the prefill's end of a push


async def test_an_aborted_push_is_reported_sent_exactly_once() -> None:
    """A push aborted while its "pushfail" was still on its way was reported
    sent twice: vLLM's scheduler asserts on the second report and dies."""
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


async def test_a_long_prefill_is_still_pushed_when_the_decode_side_registers_after_it() -> None:
    """The push's deadline ran from the prefill's first step: a prefill longer
    than timeout + grace dropped the registration that came after it."""
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


# ------------------------------------------------------------ what pushed means


async def test_a_load_registering_blocks_the_request_lacks_is_never_told_pushed() -> None:
    """A load that registered more blocks than the request has (or from past
    its first) would hold blocks nothing wrote: it fails, never "pushed"."""
    agent, rec = await make_agent()
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 5]], 0, 5.0]))
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[20, 3]], 5, 5.0], nonce="n2"))
        step_all(agent)  # 12 tokens: 3 blocks
        await until(lambda: rec.kinds(D_ID).count("pushfail") == 2)
        assert "pushed" not in rec.kinds(D_ID), rec.sent
    finally:
        await close_agent(agent)


async def test_one_peer_cannot_take_every_place_of_a_decode_first_transfer() -> None:
    """Decode first, before the engine steps the request, a registration's key
    cannot be checked yet: it waits. A peer without the key sends many: only
    a couple of them wait, and the decode's own load still gets in."""
    agent, rec = await make_agent()
    try:
        for i in range(40):
            agent.deliver(
                EVIL, "reg", reg_args(agent, ["x", 0, 1, [[40, 3]], 0, 5.0], nonce=f"e{i}", key="w")
            )
        for i in range(40):  # and transfers nobody computes
            agent.deliver(EVIL, "reg", reg_args(agent, [f"y{i}", 0, 1, [[0, 60]], 0, 5.0], key="w"))
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0], key="ck"))
        step_all(agent, key="ck")
        await until(lambda: "pushed" in rec.kinds(D_ID))
        assert {c for c, _ in rec.pushes} == {D_ID}
    finally:
        await close_agent(agent)


async def test_a_registration_that_waited_for_its_key_keeps_its_deadline() -> None:
    """Decode first: a load whose key could be checked only after a while
    still ends by the deadline it carried, counted from its arrival (not
    from the check)."""
    agent, _ = await make_agent()
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 1.0], key="ck"))
        await asyncio.sleep(0.3)
        agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 4, False, "ck")  # not final
        (ld,) = agent.push_sender.transfers["x"].loads.values()
        assert ld.accepted and ld.deadline == ld.arrived + 1.0, (ld.deadline, ld.arrived)
    finally:
        await close_agent(agent)


# ------------------------------------------------------------ KV cache groups (hybrid models)

#: A window group of 8 tokens (2 blocks of 4) beside a full-attention one; a
#: prompt of 22 tokens (6 blocks): the decode's next token attends to tokens
#: 15..22, positions from (22 - 8 + 1) // 4 = 3 of the window group.
WINDOWS, PROMPT = (8, 0), 22
P_GROUPS = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]


def record_units(rec: Any) -> list[tuple[list[int], list[int]]]:
    """Make ``rec`` record each push's source and destination units."""
    calls: list[tuple[list[int], list[int]]] = []
    push = rec.push_blocks

    async def record(key: Any, cache: Any, src: Any, dst: Any, **kw: Any) -> None:
        calls.append((list(src), list(dst)))
        await push(key, cache, src, dst, **kw)

    rec.push_blocks = record
    return calls


def step_groups(agent: Any, groups: list[list[int]], xid: str = "x") -> None:
    """The engine computes the whole prompt in one step, every layer."""
    agent.push_sender.step(xid, "p-req", groups[0], BS, PROMPT, True, None, groups, PROMPT)
    for layer in range(LAYERS):
        agent.push_sender.layer_saved([xid], layer)


def reg_groups(agent: Any, runs: list[list[int]], groups: Any, nonce: str = "n1") -> list[Any]:
    args = reg_args(agent, ["x", 0, 1, runs, 0, 5.0], nonce=nonce)
    return [*args, None, 1, groups]


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
async def test_each_group_pushes_its_positions_into_the_decodes_blocks(order: str) -> None:
    """A registration of both groups: the window's positions from where the
    decode's next token attends, every full-attention position. Each layer
    is one push of both groups' pairs, then ``pushed``."""
    agent, rec = await make_agent(windows=WINDOWS)
    calls = record_units(rec)
    try:
        reg = reg_groups(agent, [[40, 3], [50, 6]], [[3, 3], [0, 6]])
        if order == "decode-first":
            agent.deliver(D_ID, "reg", reg)
            step_groups(agent, P_GROUPS)
        else:
            step_groups(agent, P_GROUPS)
            agent.deliver(D_ID, "reg", reg)
        await until(lambda: "pushed" in rec.kinds(D_ID))
        want = ([13, 14, 15, *P_GROUPS[1]], [40, 41, 42, *range(50, 56)])
        assert calls and all(c == want for c in calls), calls
    finally:
        await close_agent(agent)


@pytest.mark.parametrize(
    ("runs", "groups", "why"),
    [
        # The window from position 2: the prefill pushes from 3, block 2 would hold nothing.
        ([[39, 4], [50, 6]], [[2, 4], [0, 6]], "its window from block 3"),
        ([[40, 3], [50, 5]], [[3, 3], [0, 5]], "6 needed"),  # one block short
        ([[40, 3], [50, 6]], [[3, 3], [0, 5]], "6 needed"),  # counts that lie
    ],
)
async def test_a_registration_whose_groups_do_not_cover_the_request_is_never_told_pushed(
    runs: list[list[int]], groups: list[list[int]], why: str
) -> None:
    agent, rec = await make_agent(windows=WINDOWS)
    try:
        agent.deliver(D_ID, "reg", reg_groups(agent, runs, groups))
        step_groups(agent, P_GROUPS)
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        got = next(m for c, m in rec.sent if m[0] == "pushfail")[3]
        assert why in got and "pushed" not in rec.kinds(D_ID)
    finally:
        await close_agent(agent)


@pytest.mark.parametrize(
    "groups",
    [None, [[3, 3]], [[3, 3], [0, 6], [0, 0]], [[3, 3], [0, "6"]], [[3, 3], [0, -1]], "3,3"],
)
async def test_a_registration_without_its_groups_positions_is_refused(groups: Any) -> None:
    """A model of two groups takes only registrations that give both groups'
    positions, as ``[first, count]`` ints."""
    agent, rec = await make_agent(windows=WINDOWS)
    try:
        agent.deliver(D_ID, "reg", reg_groups(agent, [[40, 3], [50, 6]], groups))
        step_groups(agent, P_GROUPS)
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        assert not rec.pushes
    finally:
        await close_agent(agent)


async def test_window_blocks_the_prefill_freed_as_it_finished_are_never_pushed() -> None:
    """Prefill first, after a request that decoded on past its prompt: vLLM
    freed window position 3 as it finished (null block 0 in the lists the
    release carries). A decode that needs it gets ``pushfail``; nothing is
    read from the freed block."""
    agent, rec = await make_agent(windows=WINDOWS)
    try:
        step_groups(agent, P_GROUPS)
        freed = [[0, 0, 0, 0, 14, 15], P_GROUPS[1]]
        agent.push_sender.release("x", "p-req", False, freed)
        agent.deliver(D_ID, "reg", reg_groups(agent, [[40, 3], [50, 6]], [[3, 3], [0, 6]]))
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        assert not rec.pushes
    finally:
        await close_agent(agent)


async def test_settle_returns_once_the_running_pushes_ended() -> None:
    """What the engine's thread waits for before a step that may reuse a
    transfer's freed window blocks: the pushes running now, not cancelled."""
    agent, rec = await make_agent(windows=WINDOWS)
    gate = asyncio.Event()

    async def held(layer: int) -> None:
        await gate.wait()

    rec.push = held
    try:
        agent.deliver(D_ID, "reg", reg_groups(agent, [[40, 3], [50, 6]], [[3, 3], [0, 6]]))
        step_groups(agent, P_GROUPS)
        await until(lambda: len(rec.pushes) >= 1)
        settle = asyncio.ensure_future(agent.push_sender.settle(["x"]))
        await asyncio.sleep(0.2)
        assert not settle.done()
        gate.set()
        await asyncio.wait_for(settle, 5)
        await until(lambda: "pushed" in rec.kinds(D_ID))  # none was cancelled
    finally:
        await close_agent(agent)


async def test_a_chunked_prefill_pushes_each_chunk_of_both_groups() -> None:
    """Decode first, the prompt computed in two chunks (vLLM's chunked
    prefill: 8 tokens, then the rest). The first chunk's blocks (positions
    0 and 1) end before the window's first registered position (3): its push
    moves the full-attention group's two pairs and no window pair. Every
    push pairs as many sources as destinations (aiokvcache refuses any
    other call), and the load is told ``pushed``.

    Before, the window group (listed first) took ``reg_ids[0 : 2 - 3]``, a
    negative end: 8 destination ids for no source. Each first-chunk push
    had 2 sources and 10 destinations, aiokvcache refused it, and the load
    failed: push of a hybrid model failed whenever a chunk ended before
    the window (every prompt longer than the step's token budget)."""
    agent, rec = await make_agent(windows=WINDOWS)
    calls = record_units(rec)
    push = rec.push_blocks

    async def checked(key: Any, cache: Any, src: Any, dst: Any, **kw: Any) -> None:
        if len(src) != len(dst):  # what CacheManager.push_blocks raises
            raise LLMException(
                f"src_blocks has {len(src)} blocks but dst_blocks has {len(dst)}",
                LLMStatusCode.LLM_PARAM_INVALID,
            )
        await push(key, cache, src, dst, **kw)

    rec.push_blocks = checked
    try:
        agent.deliver(D_ID, "reg", reg_groups(agent, [[40, 3], [50, 6]], [[3, 3], [0, 6]]))
        await settle()
        s = agent.push_sender
        s.step("x", "p-req", P_GROUPS[0], BS, 8, False, None, P_GROUPS, PROMPT)
        for layer in range(LAYERS):
            s.layer_saved(["x"], layer)
        await until(lambda: len(calls) >= LAYERS or "pushfail" in rec.kinds(D_ID))
        s.step("x", "p-req", P_GROUPS[0], BS, PROMPT, True, None, P_GROUPS, PROMPT)
        for layer in range(LAYERS):
            s.layer_saved(["x"], layer)
        await until(lambda: {"pushed", "pushfail"} & set(rec.kinds(D_ID)))
        assert "pushfail" not in rec.kinds(D_ID), [m for _, m in rec.sent]
        assert all(len(a) == len(b) for a, b in calls), calls
        assert calls[0] == ([20, 21], [50, 51]), calls[0]
    finally:
        await close_agent(agent)
