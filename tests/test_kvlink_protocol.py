"""The vLLM connector's hand-off protocol against hostile, duplicated and
reordered messages and a slow peer, one agent at a time: a ``TransferAgent`` driven on the
test's own loop, its aiokvcache calls replaced by a recorder (no network, no
vLLM). Each test names the defect it proves: what a connector without the
state machines of ``integrations/agent/handoff.py`` did:

| test | without them |
|---|---|
| failed layer never reported pushed | "pushed" sent beside "pushfail" |
| claim without the key P's scheduler made | granted at once |
| wrong key / other blocks | granted |
| done from another cluster | released the hold |
| grant lasts D's deadline | released at P's timeout + grace |
| two claims, one done | released at the first done |
| cancel / registration from another cluster | cancelled / redirected |
| decode-first, released before any step | never reported sent |
| huge registration | built the whole id list |
| unknown registrations / claims | grew without bound, never reaped |
| abort during a pull | no way to stop it |
| grant from another cluster | accepted |
| free after a local prefix hit | blocks held until the lease ended |

Besides: a forged message costs the prefill's loop the same however many
requests it holds, and a pull fails within its timeout however slow its claim
is to go.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from typing import Any

import pytest

from aiokvcache.integrations.agent import kvlink as _kvlink
from aiokvcache.integrations.agent.kvlink import TransferAgent
from aiokvcache.integrations.agent.kvtypes import Peer
from support.kvlink_harness import (
    BLOCKS,
    BS,
    D_ID,
    EVIL,
    LAYERS,
    P_ID,
    UNTIL,
    Recorder,
    close_agent,
    make_agent,
    reg_args,
    until,
)

FORGED = "f" * 32


def digest(ids: list[int]) -> str:
    from aiokvcache.integrations.agent.handoff import blocks_digest

    return blocks_digest(ids)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def claim(
    agent: TransferAgent,
    rid: str,
    nonce: str,
    key: str | None = None,
    ttl: float = 5.0,
    blocks: list[int] | None = None,
) -> list[Any]:
    """A claim of blocks [0, 3) of ``rid``'s ``blocks`` (default [1, 2, 3]),
    with the key P's scheduler would have put in the params, or ``key``."""
    ids = [1, 2, 3] if blocks is None else blocks
    good = agent.grant_key(rid, ids, UNTIL)
    return [rid, nonce, good if key is None else key, ttl, 0, 3, len(ids), digest(ids), UNTIL]


def answers(rec: Recorder, to: int) -> list[list[Any]]:
    return [m for c, m in rec.sent if c == to and m[0] in ("grant", "refused", "expired")]


def sent_rids(agent: TransferAgent) -> set[str]:
    return agent.take_results().finished_sending


# ------------------------------------------------------------------ push


async def test_a_failed_layer_is_never_reported_pushed() -> None:
    agent, rec = await make_agent()

    async def push(layer: int) -> None:
        await asyncio.sleep(0.05)  # layer 1 fails as layer 2 lands, same loop turn
        if layer == 1:
            raise RuntimeError("link failed")

    rec.push = push
    agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]))
    agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 12, True)
    for layer in range(LAYERS):
        agent.push_sender.layer_saved(["x"], layer)
    agent.push_sender.release("x", "p-req", False)
    await until(lambda: {"pushed", "pushfail"} & set(rec.kinds(D_ID)))
    await asyncio.sleep(0.2)
    assert rec.kinds(D_ID) == ["pushfail"], rec.sent
    await until(lambda: "p-req" in sent_rids(agent))  # its blocks go back once quiescent


async def test_a_cancel_from_a_cluster_that_did_not_register_is_ignored() -> None:
    agent, rec = await make_agent()
    agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]))
    agent.deliver(EVIL, "cancel", ["x", "n1"])
    agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 12, True)
    for layer in range(LAYERS):
        agent.push_sender.layer_saved(["x"], layer)
    await until(lambda: "pushed" in rec.kinds(D_ID))
    assert "pushfail" not in rec.kinds(D_ID)


async def test_a_registration_part_from_another_cluster_cannot_redirect_the_push() -> None:
    agent, rec = await make_agent()
    agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 2, [[10, 2]], 0, 5.0]))
    agent.deliver(
        EVIL, "reg", reg_args(agent, ["x", 1, 2, [[40, 1]], 0, 5.0])
    )  # completes it, from elsewhere
    agent.push_sender.step("x", "p-req", [1, 2, 3], BS, 12, True)
    for layer in range(LAYERS):
        agent.push_sender.layer_saved(["x"], layer)
    await settle()
    assert not rec.pushes and "pushed" not in rec.kinds(), rec.sent
    agent.deliver(D_ID, "reg", reg_args(agent, ["x", 1, 2, [[20, 1]], 0, 5.0]))
    await until(lambda: "pushed" in rec.kinds(D_ID))
    assert {c for c, _ in rec.pushes} == {D_ID}
    assert not [m for c, m in rec.sent if c == EVIL]


async def test_decode_first_registered_then_released_before_any_step_is_reported_sent() -> None:
    agent, _ = await make_agent()
    agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0]))
    agent.push_sender.release("x", "p-req", True)  # the engine never stepped it here
    await until(lambda: "p-req" in sent_rids(agent), timeout=3)


async def test_a_huge_registration_is_refused_before_anything_is_built() -> None:
    agent, rec = await make_agent()
    tracemalloc.start()
    try:
        agent.deliver(D_ID, "reg", reg_args(agent, ["x", 0, 1, [[0, 20_000_000]], 0, 5.0]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 << 20, f"{peak / 2**20:.0f} MiB for one registration"
    await until(lambda: "pushfail" in rec.kinds(D_ID))


async def test_registrations_nobody_computes_are_bounded_and_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kvlink, "MAX_UNKNOWN", 50, raising=False)
    agent, _ = await make_agent(timeout=0.5, grace=0.3)
    for i in range(80):
        agent.deliver(EVIL, "reg", reg_args(agent, [f"x{i}", 0, 1, [[i % BLOCKS, 1]], 0, 5.0]))
    assert len(agent.push_sender.transfers) <= 50
    await until(lambda: not agent.push_sender.transfers, timeout=5)


# ------------------------------------------------------------------ pull, prefill side


async def test_a_claim_without_the_key_the_prefills_scheduler_made_is_refused() -> None:
    agent, rec = await make_agent()
    agent.deliver(EVIL, "claim", claim(agent, "ghost", "n1", key=FORGED))
    await until(lambda: bool(answers(rec, EVIL)), timeout=5)
    assert answers(rec, EVIL)[0][0] == "refused", rec.sent
    assert agent.pending() == 0


async def test_a_claim_before_the_hand_over_is_granted_and_released_only_after_it() -> None:
    agent, rec = await make_agent()
    agent.deliver(D_ID, "claim", claim(agent, "r", "n1"))
    await until(lambda: bool(answers(rec, D_ID)))
    assert answers(rec, D_ID)[0][:3] == ["grant", "r", "n1"]
    agent.deliver(D_ID, "done", ["r", "n1"])
    await settle()
    assert "r" not in sent_rids(agent)  # the engine has not handed it over yet
    agent.pull_server.hold("r", 30.0, [1, 2, 3], UNTIL)
    await until(lambda: "r" in sent_rids(agent))


@pytest.mark.parametrize("bad", ["key", "blocks", "range"])
async def test_a_claim_with_a_wrong_key_or_other_blocks_is_refused(bad: str) -> None:
    agent, rec = await make_agent()
    agent.pull_server.hold("r", 30.0, [1, 2, 3], UNTIL)
    msg = claim(agent, "r", "n1")
    if bad == "key":
        msg[2] = FORGED
    elif bad == "blocks":
        msg[7] = digest([1, 2, 4])  # the key was made for [1, 2, 3]
    else:
        msg[5] = 4  # past the request's 3 blocks
    agent.deliver(EVIL, "claim", msg)
    await until(lambda: bool(answers(rec, EVIL)))
    assert answers(rec, EVIL)[0][0] == "refused", rec.sent


async def test_done_from_another_cluster_does_not_release() -> None:
    agent, rec = await make_agent()
    agent.pull_server.hold("r", 30.0, [1, 2, 3], UNTIL)
    agent.deliver(D_ID, "claim", claim(agent, "r", "n1"))
    await until(lambda: bool(answers(rec, D_ID)))
    agent.deliver(EVIL, "done", ["r", "n1"])
    agent.deliver(EVIL, "free", ["r", FORGED, 3, digest([1, 2, 3]), UNTIL])
    await settle()
    assert "r" not in sent_rids(agent)
    agent.deliver(D_ID, "done", ["r", "n1"])
    await until(lambda: "r" in sent_rids(agent))


async def test_the_first_of_two_claims_done_does_not_release() -> None:
    agent, rec = await make_agent()
    agent.pull_server.hold("r", 30.0, [1, 2, 3], UNTIL)
    agent.deliver(D_ID, "claim", claim(agent, "r", "n1"))
    agent.deliver(EVIL, "claim", claim(agent, "r", "n2"))
    await until(lambda: bool(answers(rec, D_ID)) and bool(answers(rec, EVIL)))
    agent.deliver(D_ID, "done", ["r", "n1"])
    agent.deliver(D_ID, "done", ["r", "n1"])  # duplicated
    await settle()
    assert "r" not in sent_rids(agent)
    agent.deliver(EVIL, "done", ["r", "n2"])
    await until(lambda: "r" in sent_rids(agent))
    agent.deliver(D_ID, "claim", claim(agent, "r", "n3"))  # late: refused, never granted
    await until(lambda: len(answers(rec, D_ID)) == 2)
    assert answers(rec, D_ID)[1][0] == "refused"


async def test_a_grant_lasts_the_claimers_deadline_not_the_prefill_timeout() -> None:
    agent, rec = await make_agent(timeout=0.5, grace=0.2)
    agent.pull_server.hold("r", 0.1, [1, 2, 3], UNTIL)
    agent.deliver(D_ID, "claim", claim(agent, "r", "n1", ttl=2.5))
    await until(lambda: bool(answers(rec, D_ID)))
    await asyncio.sleep(1.5)  # past P's timeout + grace and the lease
    assert "r" not in sent_rids(agent)
    await until(lambda: "r" in sent_rids(agent), timeout=5)
    assert agent.stats["leases_expired"] == 1


async def test_claims_before_hand_over_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kvlink, "MAX_UNKNOWN", 50, raising=False)
    agent, rec = await make_agent()
    for i in range(80):
        agent.deliver(EVIL, "claim", claim(agent, f"f{i}", "n", key=FORGED))
    assert agent.pending() == 0  # forged keys leave nothing behind
    for i in range(80):
        agent.deliver(D_ID, "claim", claim(agent, f"r{i}", "n"))
    await settle()
    assert agent.pending() <= 50
    assert [a[0] for a in answers(rec, D_ID)].count("refused") == 30


async def test_free_with_the_key_releases_at_once() -> None:
    agent, _ = await make_agent()
    agent.pull_server.hold("r", 30.0, [1, 2, 3], UNTIL)
    key = agent.grant_key("r", [1, 2, 3], UNTIL)
    agent.deliver(D_ID, "free", ["r", key, 3, digest([1, 2, 3]), UNTIL])
    await until(lambda: "r" in sent_rids(agent))


async def test_a_bogus_done_costs_the_same_whatever_the_prefill_holds() -> None:
    """Counted, not timed: a message that needs no key walked every held
    request, so any linked peer could make P's loop thread spend O(held) each."""

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


# ------------------------------------------------------------------ pull, decode side


async def test_an_abort_cancels_an_in_flight_pull_and_reports_it_once_quiescent() -> None:
    agent, rec = await make_agent()
    entered, quiescent = asyncio.Event(), asyncio.Event()

    async def pull() -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        finally:
            quiescent.set()

    rec.pull = pull
    agent.pull("d-req", Peer("h", 1, P_ID), "r", [1, 2, 3], [7, 8, 9], key=FORGED)
    await until(lambda: "claim" in rec.kinds(P_ID))
    nonce = next(m for c, m in rec.sent if m[0] == "claim")[2]
    agent.deliver(P_ID, "grant", ["r", nonce])
    await asyncio.wait_for(entered.wait(), 5)
    agent.cancel_recv("d-req")
    await until(lambda: quiescent.is_set())
    got = agent.take_results()
    await until(lambda: "done" in rec.kinds(P_ID))
    got.finished_recving |= agent.take_results().finished_recving
    assert "d-req" in got.finished_recving and not got.failed_recving


async def test_a_grant_from_another_cluster_is_ignored() -> None:
    agent, rec = await make_agent(timeout=1.0)
    agent.pull("d-req", Peer("h", 1, P_ID), "r", [1, 2, 3], [7, 8, 9], key=FORGED)
    await until(lambda: "claim" in rec.kinds(P_ID))
    nonce = next(m for c, m in rec.sent if m[0] == "claim")[2]
    agent.deliver(EVIL, "grant", ["r", nonce])
    await until(lambda: bool(agent.take_results().failed_recving), timeout=5)
    assert agent.stats["pulls"] == 0


async def test_a_pull_fails_within_its_timeout_when_the_claim_is_slow_to_go() -> None:
    """The deadline was counted after the claim's send, which a frozen prefill
    holds up to link_timeout: the load failed after timeout + link_timeout."""
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


def test_pushed_counts_from_a_peer_are_trusted_only_as_counts() -> None:
    # P's push records ride on "pushed" to feed D's metrics; anything but a
    # count in [0, 2**63) (or an older P that sends none) reads as -1, and D
    # falls back to its own blocks' figures.
    from aiokvcache.integrations.agent.wire import Pushed, decode

    assert decode(Pushed("x", "n", 4096, 12).encode()) == Pushed("x", "n", 4096, 12)
    assert decode('["aiokv","pushed","x","n"]') == Pushed("x", "n", -1, -1)
    for bad in ("true", "-1", "1.5", '"7"', "[1]", str(2**63), '{"a":1}'):
        m = decode(f'["aiokv","pushed","x","n",{bad},{bad}]')
        assert (m.nbytes, m.segments) == (-1, -1), bad


async def test_a_decode_renews_the_prefills_hold_until_its_load_starts() -> None:
    """D holds a request's params (vLLM's scheduler has it, its load not
    started): its agent renews P's hold every ``every`` seconds with the
    request's key, until told to stop; P's hold then outlives its lease."""
    d, drec = await make_agent()
    p, _ = await make_agent()
    try:
        ids = [1, 2, 3]
        key = p.grant_key("r", ids, UNTIL)
        p.pull_server.hold("r", 0.3, ids, UNTIL)
        d.renew_start("d-req", Peer("h", 1, P_ID), "r", key, UNTIL, ids, 0.1)
        await until(lambda: drec.kinds(P_ID).count("renew") >= 2)
        for _, m in drec.sent:  # P gets them
            p.deliver(D_ID, m[0], m[1:])
        drec.sent.clear()
        await asyncio.sleep(0.25)
        for _, m in drec.sent:
            p.deliver(D_ID, m[0], m[1:])
        await asyncio.sleep(0.15)  # past the 0.3 s lease: renewed
        assert p.pull_server.holds.held("r")
        d.renew_stop("d-req")
        await asyncio.sleep(0.15)
        drec.sent.clear()
        await asyncio.sleep(0.3)
        assert "renew" not in drec.kinds(), drec.sent
        await until(lambda: "r" in sent_rids(p), timeout=2)  # the lease ends, unrenewed
    finally:
        await close_agent(d)
        await close_agent(p)
