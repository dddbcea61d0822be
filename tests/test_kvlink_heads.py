"""The vLLM connector's ``TransferAgent`` between instances of different
tensor-parallel sizes: a decode worker reads the KV heads it owns, from every
prefill worker that holds some, into its part of each block; a prefill worker
read by several decode workers holds the blocks until each is done. Real
agents over tcp and shared memory, NumPy "KV caches" in a head-major layout
(each block: its heads one after another, as vLLM's CPU backend)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from aiokvcache.integrations.agent.kvtypes import HeadSpan, KVLayout, Peer, Source
from support.agent_pair import BS, LAYERS, Side, fill, wait_for
from support.kvlink_harness import D_ID, close_agent, make_agent, reg_args, step_all, until

UNIT = 128  # bytes of one head of one block
UNTIL = int((time.time() + 3600) * 1000)
REMOTE, LOCAL = [1, 2, 7], [5, 6, 3]


def side(name: str, transport: str, heads: int) -> Side:
    return Side(name, transport, block_bytes=heads * UNIT, heads=heads, total_heads=2, timeout=5.0)


def test_a_decode_of_one_worker_reads_both_prefill_workers_into_its_halves(
    transport: str,
) -> None:
    """Prefill TP 2 (one head a block each), decode TP 1 (two): the decode
    worker's block gets prefill worker 0's head in its first half and
    worker 1's in its second; each prefill worker is done with its blocks."""
    p0, p1 = side("p0", transport, 1), side("p1", transport, 1)
    d = side("d", transport, 2)
    try:
        fill(p0, REMOTE, 1)
        fill(p1, REMOTE, 2)
        sources = [
            Source(p.peer, p.agent.grant_key("p-req", REMOTE, UNTIL), HeadSpan(1, 0, i, 1))
            for i, p in enumerate((p0, p1))
        ]
        digest = p0.agent.layout.digest()
        assert digest == d.agent.layout.digest()  # one model, two sizes
        d.agent.pull("d-req", None, "p-req", REMOTE, LOCAL, digest, until_ms=UNTIL, sources=sources)
        wait_for(lambda: "d-req" in d.poll().finished_recving)
        assert not d.got.failed_recving
        for layer in range(LAYERS):
            got = d.kv[layer][LOCAL]
            assert np.array_equal(got[:, :UNIT], p0.kv[layer][REMOTE])
            assert np.array_equal(got[:, UNIT:], p1.kv[layer][REMOTE])
        for p in (p0, p1):
            p.agent.hold("p-req", 30, REMOTE, UNTIL)
            wait_for(lambda p=p: "p-req" in p.poll().finished_sending)
    finally:
        for s in (d, p0, p1):
            s.agent.close()


def holds_head(d: Side, p: Side, r: int) -> None:
    """Decode worker ``d`` (one head a block) loaded head ``r`` of each of
    prefill ``p``'s blocks, every layer."""
    wait_for(lambda: "d-req" in d.poll().finished_recving)
    assert not d.got.failed_recving
    for layer in range(LAYERS):
        want = p.kv[layer][REMOTE][:, r * UNIT : (r + 1) * UNIT]
        assert np.array_equal(d.kv[layer][LOCAL], want)


def test_a_prefill_read_by_two_decode_workers_holds_until_both_are_done(
    transport: str,
) -> None:
    """Prefill TP 1 (two heads a block), decode TP 2: decode worker r reads
    head r of each block; the prefill frees the blocks only once both read."""
    p = side("p", transport, 2)
    d0, d1 = side("d0", transport, 1), side("d1", transport, 1)
    try:
        fill(p, REMOTE, 3)
        p.agent.hold("p-req", 30, REMOTE, UNTIL)
        key = p.agent.grant_key("p-req", REMOTE, UNTIL)
        for r, d in enumerate((d0, d1)):
            src = Source(p.peer, key, HeadSpan(2, r, 0, 1), readers=2)
            d.agent.pull("d-req", None, "p-req", REMOTE, LOCAL, until_ms=UNTIL, sources=[src])
            holds_head(d, p, r)
            if r == 0:
                time.sleep(0.3)
                assert not p.poll().finished_sending, "freed before the second reader"
        wait_for(lambda: "p-req" in p.poll().finished_sending)
    finally:
        for s in (d0, d1, p):
            s.agent.close()


def test_one_failed_prefill_worker_fails_the_load_once_the_other_is_quiescent(
    transport: str,
) -> None:
    """The decode reads two prefill workers; one refuses (a wrong key): the
    load fails, its blocks reported invalid, and the other read is stopped
    before that is reported."""
    p0, p1 = side("p0", transport, 1), side("p1", transport, 1)
    d = side("d", transport, 2)
    try:
        fill(p0, REMOTE, 1)
        sources = [
            Source(p0.peer, p0.agent.grant_key("p-req", REMOTE, UNTIL), HeadSpan(1, 0, 0, 1)),
            Source(p1.peer, "forged", HeadSpan(1, 0, 1, 1)),
        ]
        d.agent.pull("d-req", None, "p-req", REMOTE, LOCAL, until_ms=UNTIL, sources=sources)
        wait_for(lambda: "d-req" in d.poll().failed_recving)
        assert d.got.invalid_block_ids == set(LOCAL)
        assert d.agent.pending() == 0
    finally:
        for s in (d, p0, p1):
            s.agent.close()


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ------------------------------------------------------------ push


def computed(p: Side, xid: str, blocks: list[int], release: bool = True) -> None:
    """Prefill worker ``p`` computes transfer ``xid`` (every layer of 10
    tokens in ``blocks``) and the engine releases the request."""
    p.agent.push_step(xid, "p-req", blocks, BS, 10, final=True)
    for layer in range(LAYERS):
        p.agent.layer_saved([xid], layer)
    if release:
        p.agent.push_release(xid, "p-req")


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
def test_a_decode_of_one_worker_takes_both_prefill_workers_pushes_into_its_halves(
    transport: str, order: str
) -> None:
    """Prefill TP 2 pushes to decode TP 1: prefill worker r pushes its head
    of each block, under its own transfer id ``x/r``, into head r of the
    decode's block; the load ends received once both landed."""
    p0, p1 = side("p0", transport, 1), side("p1", transport, 1)
    d = side("d", transport, 2)
    try:
        fill(p0, REMOTE, 1)
        fill(p1, REMOTE, 2)
        sources = [
            Source(p.peer, p.agent.push_key(f"x/{r}"), HeadSpan(1, 0, r, 1), rank=r)
            for r, p in enumerate((p0, p1))
        ]
        layout = p0.agent.layout.digest()
        if order == "decode-first":
            d.agent.expect_push("d-req", None, "x", LOCAL, layout=layout, sources=sources)
            time.sleep(0.2)
        for r, p in enumerate((p0, p1)):
            computed(p, f"x/{r}", REMOTE)
        if order == "prefill-first":
            d.agent.expect_push("d-req", None, "x", LOCAL, layout=layout, sources=sources)
        wait_for(lambda: "d-req" in d.poll().finished_recving)
        assert not d.got.failed_recving
        for layer in range(LAYERS):
            got = d.kv[layer][LOCAL]
            assert np.array_equal(got[:, :UNIT], p0.kv[layer][REMOTE])
            assert np.array_equal(got[:, UNIT:], p1.kv[layer][REMOTE])
        for p in (p0, p1):
            wait_for(lambda p=p: "p-req" in p.poll().finished_sending)
            assert p.agent.pending() == 0
    finally:
        for s in (d, p0, p1):
            s.agent.close()


def test_a_prefill_pushing_to_two_decode_workers_holds_until_both_registered(
    transport: str,
) -> None:
    """Prefill TP 1 pushes to decode TP 2 (prefill first): decode worker r
    takes head r of each block. The prefill's blocks are not reported sent
    when the first decode worker's load ended: the second registers later
    and still gets its heads."""
    p = side("p", transport, 2)
    d0, d1 = side("d0", transport, 1), side("d1", transport, 1)
    try:
        fill(p, REMOTE, 3)
        computed(p, "x/0", REMOTE)
        layout = p.agent.layout.digest()
        key = p.agent.push_key("x/0")
        for r, d in enumerate((d0, d1)):
            src = Source(p.peer, key, HeadSpan(2, r, 0, 1), readers=2, rank=0)
            d.agent.expect_push("d-req", None, "x", LOCAL, layout=layout, sources=[src])
            holds_head(d, p, r)
            if r == 0:
                time.sleep(0.3)
                assert "p-req" not in p.poll().finished_sending
        wait_for(lambda: "p-req" in p.poll().finished_sending)
    finally:
        for s in (d0, d1, p):
            s.agent.close()


def test_decode_workers_that_drop_a_push_free_the_prefill_once_all_said_so(
    transport: str,
) -> None:
    """Both decode workers of a TP-2 decode drop a TP-1 prefill's push (a
    prefix hit): the prefill's blocks go back once both dropped, not at the
    first."""
    p = side("p", transport, 2)
    d0, d1 = side("d0", transport, 1), side("d1", transport, 1)
    try:
        computed(p, "x/0", REMOTE)
        key = p.agent.push_key("x/0")
        for r, d in enumerate((d0, d1)):
            src = Source(p.peer, key, HeadSpan(2, r, 0, 1), readers=2, rank=0)
            d.agent.drop_push(p.peer, "x/0", key, src)
            if r == 0:
                time.sleep(0.3)
                assert "p-req" not in p.poll().finished_sending
        wait_for(lambda: "p-req" in p.poll().finished_sending)
    finally:
        for s in (d0, d1, p):
            s.agent.close()


@pytest.mark.parametrize(
    ("heads", "why"),
    [
        ([1, 0, 1, 2, 0], "hold 1 KV heads; they hold 2"),  # lies about the prefill's heads
        ([2, 1, 2, 2, 0], "heads [1, 3) of a block of 2"),
        ([2, 0, 1, 1, 1], "heads [1, 2) of a decode block of 1"),
        ([2, 0, 1, 4, 0], "heads [0, 1) of a decode block of 4"),  # more than the model's
        ([2, 0, 0, 1, 0], "heads [0, 0) of a block of 2"),
        ([2, -1, 1, 1, 0], "heads [-1, 0) of a block of 2"),
        ([2, 0, 1, 1], "a registration's heads"),
        ("2,0,1,1,0", "a registration's heads"),
        ([2, 0, True, 1, 0], "a registration's heads"),
        ({"p": 2}, "a registration's heads"),
    ],
)
async def test_a_push_registration_whose_heads_do_not_fit_is_refused(heads: Any, why: str) -> None:
    """The heads a decode worker registers for are checked against the
    prefill worker's blocks and the model's heads: a registration that does
    not fit is answered ``pushfail`` naming why, and nothing is pushed."""
    agent, rec = await make_agent(heads=2, total_heads=2)
    try:
        args = reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0], layout=agent.layout.digest())
        agent.deliver(D_ID, "reg", [*args, heads, 1])
        step_all(agent)
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        got = next(m for c, m in rec.sent if m[0] == "pushfail")[3]
        assert why in got and not rec.pushes
    finally:
        await close_agent(agent)


@pytest.mark.parametrize(
    ("digest", "heads", "readers"),
    [
        ("per_rank", [2, 0, 1, 1, 0], 2),  # the whole-block digest with heads
        ("plain", None, 1),  # heads missing: whole blocks need the per-rank digest
        ("plain", [2, 0, 1, 1, 0], 0),
        ("plain", [2, 0, 1, 1, 0], 65),
        ("plain", [2, 0, 1, 1, 0], "2"),
    ],
)
async def test_a_push_registration_with_the_wrong_digest_or_readers_is_refused(
    digest: str, heads: Any, readers: Any
) -> None:
    agent, rec = await make_agent(heads=2, total_heads=2)
    try:
        layout = agent.layout.digest(per_rank=digest == "per_rank")
        args = reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0], layout=layout)
        agent.deliver(D_ID, "reg", [*args, heads, readers])
        step_all(agent)
        await until(lambda: "pushfail" in rec.kinds(D_ID))
        assert not rec.pushes
    finally:
        await close_agent(agent)


async def test_a_push_of_a_head_range_writes_those_units_only() -> None:
    """What the prefill asks of aiokvcache for a decode worker that takes
    head 1 of each two-head block into its one-head blocks: source units
    ``2b + 1``, destination units the decode's block ids."""
    agent, rec = await make_agent(heads=2, total_heads=2)
    calls: list[tuple[list[int], list[int]]] = []
    push = rec.push_blocks

    async def record(key: Any, cache: Any, src: Any, dst: Any, **kw: Any) -> None:
        calls.append((list(src), list(dst)))
        await push(key, cache, src, dst, **kw)

    rec.push_blocks = record  # type: ignore[method-assign]
    try:
        args = reg_args(agent, ["x", 0, 1, [[10, 3]], 0, 5.0], layout=agent.layout.digest())
        agent.deliver(D_ID, "reg", [*args, [2, 1, 1, 1, 0], 2])
        step_all(agent)
        await until(lambda: "pushed" in rec.kinds(D_ID))
        assert calls and all(c == ([3, 5, 7], [10, 11, 12]) for c in calls)
    finally:
        await close_agent(agent)


# ------------------------------------------------------------ attack review of push across sizes


def _route(frm: Any, frm_id: int, to: Any, to_id: int) -> None:
    """What agent ``frm`` (cluster ``frm_id``) notifies to cluster ``to_id``
    reaches agent ``to`` once its Recorder took it (after its delay)."""
    rec = frm.links.cm
    sent = rec.notify

    async def notify(cluster: int, tag: str, timeout: float | None = None) -> None:
        await sent(cluster, tag, timeout)
        if cluster == to_id:
            msg = json.loads(tag)[1:]
            to.deliver(frm_id, msg[0], msg[1:])

    rec.notify = notify


async def _half_agent() -> tuple[Any, Any]:
    """A harness agent of one head a block of a two-head model, its heads
    as long as those of ``make_agent(heads=2, total_heads=2)``'s (the same
    model at twice the tensor-parallel size)."""
    agent, rec = await make_agent(heads=1, total_heads=2)
    lay = agent.layout
    half = KVLayout(
        LAYERS, 1, lay.num_blocks, 32, lay.block_size, lay.addrs, "u8", heads=1, total_heads=2
    )
    agent.layout = agent.push_sender.layout = agent.receiver.layout = half
    return agent, rec


async def test_a_registration_cut_off_by_the_other_workers_failure_neither_hangs_nor_unlinks() -> (
    None
):
    """Decode TP 1 registers with prefill workers 0 and 1 (P2 -> D1). Worker
    0 refuses at once (a wrong key) while the registration to worker 1 is
    still being sent (its notification not yet taken: a busy link). The
    task group cancels that send: worker 1 never hears of the load, drops
    the decode's ``cancel`` (a load it does not know), and the decode waits
    its whole deadline and grace, then unlinks worker 1 (every other
    transfer on that link fails with it). The load should fail at once."""
    d, drec = await make_agent(timeout=3.0, grace=1.0, heads=2, total_heads=2)
    p0, _ = await _half_agent()
    p1, _ = await _half_agent()
    unlinked: list[int] = []

    async def quiesce(cluster_id: int) -> None:
        unlinked.append(cluster_id)

    d.links.quiesce = quiesce  # type: ignore[method-assign]
    P0, P1 = 11, 33
    _route(d, D_ID, p0, P0)
    _route(d, D_ID, p1, P1)
    _route(p0, P0, d, D_ID)
    _route(p1, P1, d, D_ID)
    drec.notify_delay = lambda m: 0.5 if m[0] == "reg" and m[1] == "x/1" else 0.0
    try:
        step_all(p0, "x/0")
        step_all(p1, "x/1")
        sources = [
            Source(Peer("h", 1, P0), "forged", HeadSpan(1, 0, 0, 1), rank=0),
            Source(Peer("h", 2, P1), p1.push_key("x/1"), HeadSpan(1, 0, 1, 1), rank=1),
        ]
        t0 = time.monotonic()
        d.expect_push("d-req", None, "x", [5, 6, 3], layout=d.layout.digest(), sources=sources)
        failed: set[str] = set()

        def reported() -> bool:
            failed.update(d.take_results().failed_recving)
            return "d-req" in failed

        await until(reported)
        took = time.monotonic() - t0
        assert not unlinked, f"prefill worker 1 unlinked after {took:.1f} s"
        assert took < 2.0, f"the load failed only after {took:.1f} s (deadline + grace)"
    finally:
        for a in (d, p0, p1):
            await close_agent(a)


@pytest.mark.parametrize(
    ("heads", "children"),
    [(4, 5), (32, 1)],
    ids=["P1-D4-n5", "P1-D32"],
)
async def test_a_prefill_pushing_to_k_decode_workers_takes_every_load(
    heads: int, children: int
) -> None:
    """Prefill TP 1 pushes to decode TP k (``readers`` k, each decode worker
    its head): P takes loads until k clusters registered and ended. With
    vLLM's ``n > 1`` children (the same params, one load each) a transfer
    gets k x n loads; readers up to 64 are accepted, but the prefill takes
    at most MAX_LOADS (16) loads a transfer and answers the rest "too many
    loads of one transfer": with equal sizes n children took n loads."""
    agent, rec = await make_agent(heads=heads, total_heads=heads)
    try:
        step_all(agent)
        n = 0
        for r in range(heads):
            for c in range(children):
                args = reg_args(
                    agent,
                    ["x", 0, 1, [[3 * c, 3]], 0, 5.0],
                    f"n{r}-{c}",
                    layout=agent.layout.digest(),
                )
                agent.deliver(100 + r, "reg", [*args, [heads, r, 1, 1, 0], heads])
                n += 1
        await until(lambda: len([m for c, m in rec.sent if m[0] in ("pushed", "pushfail")]) >= n)
        fails = [m[3] for c, m in rec.sent if m[0] == "pushfail"]
        assert not fails, f"{len(fails)} of {n} loads refused: {fails[0]}"
    finally:
        await close_agent(agent)


async def test_registration_parts_that_disagree_on_their_heads_are_refused() -> None:
    """A registration's parts each say its heads (and readers); a part count
    that changes between parts is refused, but heads that change are not:
    the load takes whatever the part that came last said (here head 1 of
    each block, where part 0 asked for head 0), and is pushed."""
    agent, rec = await make_agent(heads=2, total_heads=2)
    try:
        step_all(agent)
        lay = agent.layout.digest()
        a0 = reg_args(agent, ["x", 0, 2, [[10, 1]], 0, 5.0], layout=lay)
        a1 = reg_args(agent, ["x", 1, 2, [[20, 2]], 0, 5.0], layout=lay)
        agent.deliver(D_ID, "reg", [*a0, [2, 0, 1, 1, 0], 2])
        agent.deliver(D_ID, "reg", [*a1, [2, 1, 1, 1, 0], 1])
        await until(lambda: bool({"pushed", "pushfail"} & set(rec.kinds(D_ID))))
        assert "pushfail" in rec.kinds(D_ID) and not rec.pushes, rec.kinds(D_ID)
    finally:
        await close_agent(agent)
