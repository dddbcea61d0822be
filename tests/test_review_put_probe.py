# ruff: noqa: E501  (the defect table is kept whole)
"""Review of cf0839f..0202f12 (progress spin, Engine.connect with keys, the
one-round-trip handshake without a token, put probes).

Each test here pins a behaviour that should hold and fails on the reviewed
code. No test asserts a duration: waits are bounded only so that a test ends.

| # | defect | test |
|---|--------|------|
| D1 | Eager handshake: the acceptor's on_connected refusal (ALREADY_LINK, ENGINE_FINALIZED) goes out in HELLO_REPLY's place, so the initiator never checks the cluster id: a link to cluster 3 at cluster 2's address answers ALREADY_LINK (retried for the whole timeout) instead of LINK_FAILED | ``test_a_wrong_cluster_at_an_address_we_are_linked_to_is_link_failed`` |
| D2 | Eager handshake: the acceptor admits the connection (Links.on_connected: a link, an endpoint, the simultaneous-link rule) before the initiator checked its id; a dial for another cluster replaces the acceptor's own link in set-up, and leaves a broken link behind | ``test_a_dial_for_another_cluster_leaves_the_acceptors_own_link_alone`` |
| D3 | ProbeResult.decode raises BadReply (a ValueError) for a malformed nonce/slot; _check_data_path catches only LLMException: link_clusters raises | ``test_a_malformed_probe_result_fails_that_link_only`` |
| D4 | A linked peer may hold any number of put-probe polls on one link (up to 1024 requests x 30 s, renewable, no freeze needed) | ``test_a_peer_cannot_hold_many_put_probe_waits_on_one_link`` |
| D5 | control.py's module docstring and Linker._try_link's still describe the old handshake / read-back probe | ``test_the_docstrings_say_what_the_handshake_and_the_probe_do`` |
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiokvcache as kv
from aiokvcache.testing import cluster_info, options
from support.instances import is_up, link_of, runtime, wait_for


def _wrong_id_at(target: kv.LLMDataDist, cid: int) -> kv.LLMClusterInfo:
    """``target``'s address, but a cluster id that is not its own (a stale
    or mistyped address book)."""
    address = target.listen_address
    assert address is not None
    return cluster_info(str(address), cid)


# ---------------------------------------------------------------- handshake


async def test_a_wrong_cluster_at_an_address_we_are_linked_to_is_link_failed() -> None:
    """Cluster 1 is linked to cluster 2 and dials cluster 3 at cluster 2's
    address. The initiator names the cluster it dials and refuses an acceptor
    that claims another id (LINK_FAILED, control.connect's docstring). Without
    a token the eager HELLO+AUTH makes cluster 2 admit the connection first:
    its on_connected refuses it (ALREADY_LINK, cluster 1 is linked) and that
    refusal goes out *in HELLO_REPLY's place*, so the initiator never looks at
    the cluster id. link_clusters then answers ALREADY_LINK for cluster 3, to
    which no link exists (after retrying it for the whole timeout)."""
    two = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    one = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    try:
        await two.init(options("tcp", listen=True))
        await one.init(options("tcp"))
        rc, per = await one.link_clusters([cluster_info(two)], timeout=5000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        _, per = await one.link_clusters([_wrong_id_at(two, 3)], timeout=1000)
        assert link_of(one, 3) is None
        assert per == [kv.LLMStatusCode.LLM_LINK_FAILED], per
    finally:
        await one.finalize()
        await two.finalize()


async def test_a_dial_for_another_cluster_leaves_the_acceptors_own_link_alone() -> None:
    """Cluster 2 is setting up its link to cluster 1 (its data-path check
    held) when cluster 1 dials cluster 3 at cluster 2's address. Cluster 1
    refuses cluster 2 once it sees its id, and before 72b0f66 cluster 2 never
    heard more than HELLO. Now cluster 2 runs on_connected for the eager
    initiator before cluster 1 has checked anything: by Links.on_connected's
    simultaneous-link rule the connection initiated by the lower id wins, so
    cluster 2 drops its own link in set-up for a connection that cluster 1
    closes at once. Cluster 2's link_clusters fails, and cluster 1's side of
    it is broken."""
    one = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    two = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    gate = threading.Event()
    held = threading.Event()
    try:
        await one.init(options("tcp", listen=True))
        await two.init(options("tcp", listen=True))
        linker = runtime(two).service.linker
        real = linker._check_data_path

        async def held_check(*args: Any) -> Any:
            held.set()
            await wait_for(gate.is_set, 30.0)
            return await real(*args)

        linker._check_data_path = held_check
        task = asyncio.ensure_future(two.link_clusters([cluster_info(one)], timeout=10000))
        assert await wait_for(held.is_set, 5.0)
        _, per_wrong = await one.link_clusters([_wrong_id_at(two, 3)], timeout=2000)
        assert per_wrong == [kv.LLMStatusCode.LLM_LINK_FAILED], per_wrong
        gate.set()
        _, per = await task
        assert per == [kv.LLMStatusCode.LLM_SUCCESS], per
        assert await wait_for(lambda: is_up(one, 2) and is_up(two, 1), 5.0)
    finally:
        gate.set()
        await one.finalize()
        await two.finalize()


# --------------------------------------------------------------- put probes


async def test_a_malformed_probe_result_fails_that_link_only() -> None:
    """A linked acceptor (hostile, or of some other version) answers the put
    probe's probe_back with a nonce that is not 16 bytes. ProbeResult.decode
    raises BadReply, a ValueError that _check_data_path's ``except
    LLMException`` does not catch: link_clusters raises it instead of
    answering LINK_FAILED for that cluster (before 0202f12 no probe result
    could fail to decode)."""
    from aiokvcache._core.wire import messages as wire

    two = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    one = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    try:
        await two.init(options("tcp", listen=True))
        await one.init(options("tcp"))
        handler = runtime(two).service.handler

        async def bad_answer(link: Any, timeout: float, nonce: bytes, slot: int) -> Any:
            return wire.ProbeResult("", b"short", slot)

        handler._probe_back = bad_answer
        got: list[Any]
        try:
            _, got = await one.link_clusters([cluster_info(two)], timeout=3000)
        except Exception as exc:  # the reviewed code: BadReply escapes
            got = [f"raised {type(exc).__name__}: {exc}"]
        assert got == [kv.LLMStatusCode.LLM_LINK_FAILED], got
    finally:
        await one.finalize()
        await two.finalize()


async def test_a_peer_cannot_hold_many_put_probe_waits_on_one_link() -> None:
    """A linked peer sends 200 put-probe probe_backs at once (a valid slot of
    the victim's, a fresh nonce each) and never puts. Each makes the victim
    put to it and then poll its own memory for up to the asked timeout (30 s
    at most): all 200 polls run at once, on the victim's service loop. One
    link needs one put probe (its set-up asks once). Measured with 1000 such
    requests held 5 s: the victim's service thread used 2.9 CPU-s and read
    its slot 238600 times (a read-back probe_back flood: 0.24 CPU-s, the
    requests end at once). The peer stays live (heartbeats answered) and
    renews them at will: it only has to not put. Before 0202f12 a held
    probe_back either awaited a probe_info answer (a future, no polling) or
    needed a peer whose jobs hang (a frozen one, which the heartbeat cuts)."""
    import os

    victim = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    peer = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    try:
        await victim.init(options("tcp", listen=True))
        await peer.init(options("tcp"))
        rc, per = await peer.link_clusters([cluster_info(victim)], timeout=5000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        prober = runtime(victim).service.prober
        real = prober.nonce_arrived
        waiting, most = 0, 0

        async def counted(*args: Any) -> Any:
            nonlocal waiting, most
            waiting += 1
            most = max(most, waiting)
            try:
                return await real(*args)
            finally:
                waiting -= 1

        prober.nonce_arrived = counted
        slot = int(runtime(victim).state.ctl.base)  # a probe slot of the victim's
        conn = link_of(peer, 2).conn

        async def flood() -> list[Any]:
            return await asyncio.gather(
                *(
                    conn.request(
                        "probe_back",
                        {"timeout": 1.0, "nonce": os.urandom(16), "slot": slot},
                        timeout=10.0,
                    )
                    for _ in range(200)
                ),
                return_exceptions=True,
            )

        await asyncio.wrap_future(runtime(peer).service.thread.call(flood()))
        assert most <= 8, f"{most} put-probe waits of one peer ran at once on the victim"
    finally:
        await peer.finalize()
        await victim.finalize()


# --------------------------------------------------------------------- docs


def test_the_docstrings_say_what_the_handshake_and_the_probe_do() -> None:
    """docs/design.md was updated for 72b0f66 and 0202f12 ("with a token it
    sends nothing but HELLO to an acceptor that claims another id"; put
    probes), the code's own docstrings were not: control.py's module
    docstring still says the initiator sends nothing but HELLO to an acceptor
    that claims another id, unconditionally (without a token AUTH goes with
    HELLO), and Linker._try_link's that each side puts a nonce and reads it
    back (with a new peer, each side only puts)."""
    from aiokvcache._core.peers import linker
    from aiokvcache._core.wire import control

    def flat(text: str | None) -> str:
        return " ".join((text or "").split())

    stale = []
    if "and sends nothing but HELLO to an acceptor that claims another id" in flat(control.__doc__):
        stale.append("control: 'sends nothing but HELLO' (true with a token only)")
    if "into the peer's memory and read it back over our endpoint" in flat(
        linker.Linker._try_link.__doc__
    ):
        stale.append("Linker._try_link: 'read it back' (a put probe only puts)")
    assert not stale, stale
