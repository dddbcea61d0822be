"""Second review of the vLLM connector's hand-off (``integrations/_kvlink.py``):
each test names the defect it showed; each failed because of it before the
fix that followed. The agent is
driven on the test's loop through tests/support/kvlink_harness.py."""

from __future__ import annotations

import asyncio
import time

from aiokvcache import LLMException, LLMStatusCode
from aiokvcache.integrations._kvtypes import Peer
from support.kvlink_harness import P_ID, close_agent, make_agent, until

# ---------------------------------------------------------------------------
# Defect A (_kvlink.py _expect_push's finally, with _shutdown): close() while a
# push-mode load is in flight. _shutdown cancels every task at once, the
# listener included; the load's finally then waits for P's "pushfail" -- a
# notification the cancelled listener can never deliver -- until the load's
# deadline (timeout, 30 s by default). close() joins for 10 s only, so it
# returns with the loop thread still running and the engine not finalized.
# ---------------------------------------------------------------------------


async def test_shutdown_does_not_wait_a_push_load_deadline_for_a_message_it_cannot_get() -> None:
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


# ---------------------------------------------------------------------------
# Defect B (_kvlink.py _expect_push's finally: contextlib.suppress(BaseException)
# around the abort-wait; _recv_done): a load whose registration failed (link
# error) waits, in that finally, for the prefill's word or its deadline. An
# engine abort (cancel_recv) that lands in this wait is swallowed: the load is
# reported as a *link failure* (failed_recving + invalid blocks for a request
# the scheduler already finished) instead of aborted, and its id stays in
# _aborted forever (one entry leaked per such request).
# ---------------------------------------------------------------------------


async def test_an_abort_during_the_abort_wait_is_reported_as_an_abort_and_not_leaked() -> None:
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
