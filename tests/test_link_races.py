"""Links set up against each other: the acceptor's link is up only once both
halves of the data path worked, simultaneous links both succeed and stay, a
link cancelled mid-way leaves no half link behind to answer the next call, and
a dial for another cluster at a linked peer's address fails without touching
that peer's links.

Two in-process instances; a probe or a handshake is held (a gate) to force
the interleaving. No test asserts a duration: waits are bounded only so that
a test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

import aiokvcache as kv
from aiokvcache._core.wire import control
from aiokvcache.testing import cluster_info, options
from support.instances import instance, is_up, link_of, runtime, wait_event, wait_for

# ------------------------------------------------------- the two halves


async def test_the_acceptor_is_up_only_once_both_halves_worked() -> None:
    """With the two probes at once, the acceptor called the link up as soon
    as its own half worked, while the initiator's half could still fail."""
    victim = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    initiator = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    gate = threading.Event()
    try:
        await victim.init(options("tcp", listen=True))
        await initiator.init(options("tcp"))
        # The initiator's prober serves only its own half here (nobody asks
        # it for a probe_back): that half is held, then fails.
        prober = runtime(initiator).service.prober

        async def our_half_fails(link: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            await wait_event(gate)
            return "our half failed (injected)", 0

        prober.half = our_half_fails
        task = asyncio.ensure_future(initiator.link_clusters([cluster_info(victim)], timeout=10000))
        up_early = await wait_for(lambda: is_up(victim, 1), 5.0)
        gate.set()
        _, per = await task
        assert per == [kv.LLMStatusCode.LLM_LINK_FAILED], per
        assert not up_early, "the acceptor called the link up while the initiator's half failed"
    finally:
        gate.set()
        await initiator.finalize()
        await victim.finalize()


async def test_simultaneous_links_both_succeed_and_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The side that called its link up too early refused the winning
    connection: one call answered LINK_FAILED, the other SUCCESS, no link stayed."""
    # Cluster 1's link to cluster 2 is on its way (its handshake held) when
    # cluster 2's link to 1 arrives; 1 answers 2's probe_back, then 1's
    # handshake completes while 2's own probe still runs. Links.on_connected's
    # rule (the connection initiated by the lower id wins) must leave one
    # link, up on both sides, and neither call may fail.
    one = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    two = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    gate_two = threading.Event()  # cluster 2's own half may run
    gate_one = threading.Event()  # cluster 1's handshake may run
    one_probed = threading.Event()
    try:
        await one.init(options("tcp", listen=True))
        await two.init(options("tcp", listen=True))
        real_connect = control.connect

        async def held_connect(host: str, port: int, local: Any, *args: Any, **kw: Any) -> Any:
            if local.cluster_id == 1:
                await wait_event(gate_one)
            return await real_connect(host, port, local, *args, **kw)

        monkeypatch.setattr(control, "connect", held_connect)
        prober2 = runtime(two).service.prober
        real_half = prober2.half

        async def held_half(link: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            if link.conn.initiator:  # 2's own half of its own link
                await wait_event(gate_two)
            return await real_half(link, timeout, nonce)

        prober2.half = held_half
        prober1 = runtime(one).service.prober
        real_probe = prober1.half

        async def noted_probe(link: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            try:
                return await real_probe(link, timeout, nonce)
            finally:
                one_probed.set()

        prober1.half = noted_probe

        t1 = asyncio.ensure_future(one.link_clusters([cluster_info(two)], timeout=10000))
        await asyncio.sleep(0.05)  # 1 claimed the link and waits in held_connect
        t2 = asyncio.ensure_future(two.link_clusters([cluster_info(one)], timeout=10000))
        await wait_event(one_probed, 5.0)  # 1 answered 2's probe_back
        gate_one.set()

        def replaced_at_two() -> bool:
            link = link_of(two, 1)
            return link is not None and not link.conn.initiator

        await wait_for(replaced_at_two, 5.0)  # 1's connection won at 2
        gate_two.set()
        (_, per1), (_, per2) = await asyncio.gather(t1, t2)
        settled = await wait_for(lambda: is_up(one, 2) and is_up(two, 1), 5.0)
        ok = [kv.LLMStatusCode.LLM_SUCCESS]
        # Without the fix: ([SUCCESS], [LINK_FAILED], False): 1 said SUCCESS
        # for a link that 2 closed a moment later.
        assert (per1, per2, settled) == (ok, ok, True)
    finally:
        gate_one.set()
        gate_two.set()
        await one.finalize()
        await two.finalize()


# ------------------------------------------------------- a cancelled link


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_link_right_after_a_cancelled_one_succeeds(transport: str) -> None:
    """A cancelled link took several loop turns to drop its half link: a
    retry right after (as after wait_for's timeout) found it "being set up"
    and answered LINK_FAILED."""
    decoder = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    prompt = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    probing = threading.Event()
    try:
        await decoder.init(options(transport, listen=True))
        await prompt.init(options(transport))
        prober = runtime(prompt).service.prober
        real_probe = prober.half
        calls = 0

        async def first_hangs(link: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            nonlocal calls
            calls += 1
            if calls == 1:  # the link to be cancelled: its own half hangs
                probing.set()
                await asyncio.Event().wait()
            return await real_probe(link, timeout, nonce)

        prober.half = first_hangs
        info = cluster_info(decoder)
        task = asyncio.ensure_future(prompt.link_clusters([info], timeout=10000))
        assert await wait_event(probing)
        # The service loop is held while the cancel and the retry reach it,
        # so that it sees them in that order in one turn whatever the two
        # threads' scheduling (the order a caller that retries at once, as
        # after asyncio.wait_for's timeout, gets most of the time).
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            release.wait(10)

        runtime(prompt).service.thread.loop.call_soon_threadsafe(hold)
        try:
            assert await wait_event(held)
            task.cancel()
            retry = asyncio.ensure_future(prompt.link_clusters([info], timeout=10000))
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)  # the retry's call is queued too
        finally:
            release.set()
        _, per = await retry
        assert per == [kv.LLMStatusCode.LLM_SUCCESS], per
    finally:
        await prompt.finalize()
        await decoder.finalize()


async def test_a_cancelled_link_clusters_leaves_no_link_that_never_comes_up(
    transport: str,
) -> None:
    """A link_clusters cancelled by its caller while the link was probed left
    the half-set-up link behind, never up: every later call to that cluster
    waited for it and timed out, for as long as both processes lived."""
    async with instance(transport, 1, listen=False) as a, instance(transport, 2) as b:
        handler = runtime(b).service.handler
        gate = threading.Event()
        real = handler.handle_request

        async def slow(conn: Any, op: str, body: dict[str, Any]) -> dict[str, Any]:
            if op == "probe_back":  # a peer slow to check its half of the data path
                await asyncio.to_thread(gate.wait)
            return await real(conn, op, body)  # type: ignore[no-any-return]

        handler.handle_request = slow
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await a.link_clusters([cluster_info(b)], timeout=10000)
        finally:
            gate.set()
        await asyncio.sleep(0.3)  # b finished its probe
        again, _ = await a.link_clusters([cluster_info(b)], timeout=2000)
        assert again in (kv.LLMStatusCode.LLM_SUCCESS, kv.LLMStatusCode.LLM_ALREADY_LINK), (
            f"link_clusters after a cancelled one: {again.name} (the half-set-up link stays, "
            f"never up: every later call waits for it and times out)"
        )


# ------------------------------------------------------- a dial for another cluster


def _wrong_id_at(target: kv.LLMDataDist, cid: int) -> kv.LLMClusterInfo:
    """``target``'s address, but a cluster id that is not its own (a stale
    or mistyped address book)."""
    address = target.listen_address
    assert address is not None
    return cluster_info(str(address), cid)


async def test_a_wrong_cluster_at_an_address_we_are_linked_to_is_link_failed() -> None:
    """Without a token the acceptor's refusal (ALREADY_LINK) went out in
    HELLO_REPLY's place, so the initiator never checked the id: link_clusters
    answered ALREADY_LINK, after retrying for its whole timeout, for a cluster
    no link went to."""
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
    """The acceptor admitted an eager initiator before it had checked the id:
    by the simultaneous-link rule its own link in set-up was dropped for a
    connection closed at once, and its link_clusters failed."""
    # Cluster 2 is setting up its link to cluster 1 (its data-path check
    # held) when cluster 1 dials cluster 3 at cluster 2's address.
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
