"""The vLLM connector's ``TransferAgent`` between instances of different
tensor-parallel sizes: a decode worker reads the KV heads it owns, from every
prefill worker that holds some, into its part of each block; a prefill worker
read by several decode workers holds the blocks until each is done. Real
agents over tcp and shared memory, NumPy "KV caches" in a head-major layout
(each block: its heads one after another, as vLLM's CPU backend)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from aiokvcache.integrations.agent.kvtypes import HeadSpan, Source
from support.agent_pair import LAYERS, Side, fill, wait_for

UNIT = 128  # bytes of one head of one block
UNTIL = int((time.time() + 3600) * 1000)
REMOTE, LOCAL = [1, 2, 7], [5, 6, 3]


def side(name: str, transport: str, heads: int) -> Side:
    return Side(
        name, transport, block_bytes=heads * UNIT, heads=heads, total_heads=2, timeout=5.0
    )


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
        d.agent.pull(
            "d-req", None, "p-req", REMOTE, LOCAL, digest, until_ms=UNTIL, sources=sources
        )
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
            wait_for(lambda d=d: "d-req" in d.poll().finished_recving)
            assert not d.got.failed_recving
            for layer in range(LAYERS):
                want = p.kv[layer][REMOTE][:, r * UNIT : (r + 1) * UNIT]
                assert np.array_equal(d.kv[layer][LOCAL], want)
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


@pytest.mark.parametrize("said_tp", [0, 1], ids=["tp_size-absent", "tp_size-lies-1"])
def test_params_that_hide_the_prefills_size_do_not_load_other_blocks_as_this_ones(
    said_tp: int,
) -> None:
    """Prefill TP 2 (one head a block each), decode TP 1 (two heads). The
    layout digest is the same at every size (by design), so only the params'
    ``tp_size`` tells the decode how many heads a prefill block holds. Params
    without it (a proxy that drops unknown fields, a client's) or with a false
    one, listing one worker, take the same-size path: the decode reads units
    ``b*2, b*2+1`` of a cache registered one head a block, i.e. prefill blocks
    ``2b`` and ``2b+1`` (other requests' KV, outside the grant), and reports the
    load fine. It must fail (or read the right bytes)."""
    from aiokvcache.integrations._vllm_worker import WorkerBinding

    p0 = side("p0", "tcp", 1)
    d = side("d", "tcp", 2)
    try:
        fill(p0, list(range(16)), 1)
        key = p0.agent.grant_key("p-req", REMOTE, UNTIL)
        binding = WorkerBinding(0, 4, 30.0, tp_size=1, heads=2, total_heads=2)
        peers = [[p0.peer.host, p0.peer.port, p0.peer.cluster_id]]
        sources = binding.sources(peers, said_tp, [key])
        digest = p0.agent.layout.digest()  # the params' aiokv_layout
        d.agent.pull(
            "d-req", None, "p-req", REMOTE, LOCAL, digest, until_ms=UNTIL, sources=sources
        )
        wait_for(lambda: d.poll().finished_recving or d.got.failed_recving)
        if d.got.failed_recving:
            return
        for layer in range(LAYERS):
            got = d.kv[layer][LOCAL]
            assert np.array_equal(got[:, :UNIT], p0.kv[layer][REMOTE]), (
                "loaded fine, but head 0 of each block is another prefill block's"
            )
    finally:
        for s in (d, p0):
            s.agent.close()
