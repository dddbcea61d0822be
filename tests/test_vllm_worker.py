"""The vLLM connector's worker side (``integrations/_vllm_worker.py``, no vLLM
import): which prefill worker a decode rank loads from, as the request's
params name it, checked and never guessed; and a load whose params name none
is reported failed, its blocks invalid, without asking any peer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from aiokvcache.integrations._vllm_worker import WorkerBinding
from aiokvcache.integrations.agent.kvtypes import HeadSpan, Peer
from support.kvlink_harness import close_agent, make_agent, until

PEERS = [["10.0.0.1", 7000, 50], ["10.0.0.2", 7100, 60]]


def binding(rank: int, tp: int) -> WorkerBinding:
    return WorkerBinding(rank, 16, 30.0, tp)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_from_the_prefill_rank_of_its_own_number(rank: int) -> None:
    host, port, cid = PEERS[rank]
    assert binding(rank, 2).peer(PEERS, 2) == Peer(str(host), int(port), int(cid))
    assert binding(rank, 2).peer(PEERS) == Peer(str(host), int(port), int(cid))


def test_one_address_without_a_size_follows_the_config_rule() -> None:
    """A client's decode-first params name the prefill's rank 0 only: rank
    r is at port + r with cluster id + r (docs/vllm.md)."""
    assert binding(1, 2).peer([PEERS[0]]) == Peer("10.0.0.1", 7001, 51)


@pytest.mark.parametrize(
    "rank, tp, peers, remote_tp, says",
    [
        (1, 2, [PEERS[0]], 1, "tensor parallel size 1 and this decode instance 2"),
        (0, 1, PEERS, 2, "tensor parallel size 2 and this decode instance 1"),
        (0, 2, PEERS, 4, "tensor parallel size 4 and this decode instance 2"),
        (0, 1, PEERS, 0, "2 prefill workers"),
        (1, 4, PEERS, 0, "2 prefill workers"),
        (0, 2, [], 0, "0 prefill workers"),
        (0, 1, PEERS, -1, "not a tensor-parallel size"),
        (0, 1, [["h", "port", 1]], 0, "invalid literal"),
        (0, 1, [["h"]], 0, "bad"),
        (0, 1, [None], 0, "bad"),
    ],
)
def test_params_that_name_no_prefill_worker_for_this_rank_are_refused(
    rank: int, tp: int, peers: Any, remote_tp: int, says: str
) -> None:
    """Before, rank r >= the prefill's size guessed ``port + r``: a process
    that may not be the prefill's at all."""
    with pytest.raises(ValueError, match=says):
        binding(rank, tp).peer(peers, remote_tp)


@dataclass
class _Recv:
    mode: str
    peers: list[list[Any]]
    tp_size: int
    local_block_ids: list[int] = field(default_factory=lambda: [4, 5])
    remote_request_id: str = "p-req"
    remote_block_ids: list[int] = field(default_factory=lambda: [1, 2])
    first: int = 0
    transfer_id: str = "x"
    layout: str | None = None
    grant_keys: list[str] = field(default_factory=list)
    grant_until: int = 0
    push_keys: list[str] = field(default_factory=list)
    transfer_key: str = ""
    error: str = ""


@dataclass
class _Meta:
    recv: dict[str, _Recv]
    holds: dict[str, Any] = field(default_factory=dict)
    push_steps: dict[str, Any] = field(default_factory=dict)
    push_release: dict[str, Any] = field(default_factory=dict)
    push_settle: dict[str, Any] = field(default_factory=dict)
    cancel_recv: set[str] = field(default_factory=set)
    renew_start: dict[str, Any] = field(default_factory=dict)
    renew_stop: set[str] = field(default_factory=set)
    drops: list[Any] = field(default_factory=list)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "recv",
    [{"tp_size": 2}, {"tp_size": 0, "error": "the params cannot be read"}],
    ids=["another-tp-size", "unreadable"],
)
async def test_a_load_whose_params_name_no_prefill_worker_fails_and_asks_no_peer(
    mode: str, recv: dict[str, Any]
) -> None:
    agent, rec = await make_agent()
    try:
        meta = _Meta({"d-req": _Recv(mode, PEERS, **recv)})
        assert binding(0, 1).bind(agent, meta) == []
        failed: set[str] = set()
        invalid: set[int] = set()

        def reported() -> bool:
            r = agent.take_results()
            failed.update(r.failed_recving)
            invalid.update(r.invalid_block_ids)
            return "d-req" in failed

        await until(reported)
        assert invalid == {4, 5}
        assert not rec.sent and not rec.pushes, "a peer was asked"
    finally:
        await close_agent(agent)


# ---------------------------------------------------------------- hostile params
# kv_transfer_params come from the prefill through the client/proxy: any JSON
# value. ``peer`` promises ``ValueError`` for params that name no prefill
# worker, and the worker's ``_loads`` / ``_renewals`` / ``_drops`` catch only
# that: anything else escapes into vLLM's worker (bind_connector_metadata).


@pytest.mark.parametrize(
    "peers",
    [
        {"0": ["h", 1, 2]},  # a JSON object of one entry for a TP-1 decode
        [{"host": "h", "port": 1, "cluster_id": 2}],  # each worker an object
        [["h", float("inf"), 2]],  # JSON 1e400 parses to inf: int(inf) -> OverflowError
        [["h", 1, float("-inf")]],
    ],
    ids=["peers-object", "peer-object", "port-1e400", "cluster-minus-1e400"],
)
def test_any_json_as_the_prefill_workers_is_refused_as_a_value_error(peers: Any) -> None:
    """A JSON object where a list is expected, or a number past a float
    (``int(inf)``): ``ValueError``, which the worker turns into a refused
    load (before, ``KeyError`` and ``OverflowError`` escaped into vLLM)."""
    with pytest.raises(ValueError):
        binding(0, 1).peer(peers, 0)


@dataclass
class _DropRef:
    peers: Any
    mode: str = "pull"
    remote_request_id: str = "p-req"
    remote_block_ids: list[int] = field(default_factory=lambda: [1, 2])
    transfer_id: str = "x"
    grant_keys: list[str] = field(default_factory=lambda: ["k"])
    grant_until: int = 0
    push_keys: list[str] = field(default_factory=list)
    transfer_key: str = ""
    lease: float = 0.0
    tp_size: int = 0


class _NoAgent:
    """Any call on it is a bug here: the params name no prefill worker."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"agent.{name} called for params that name no worker")


@pytest.mark.parametrize("where", ["drops", "renew_start"])
def test_a_drop_or_renewal_whose_params_name_no_worker_is_skipped(
    where: str,
) -> None:
    """``_Drop.from_params`` keeps ``aiokv_peers`` as the params give it; a
    JSON object there is skipped (logged), asking no peer, instead of raising
    out of ``bind`` (vLLM's ``bind_connector_metadata``: the worker dies)."""
    ref = _DropRef({"0": ["h", 1, 2]})
    meta = _Meta({})
    if where == "drops":
        meta.drops = [ref]
    else:
        meta.renew_start = {"d-req": ref}
    binding(0, 1).bind(_NoAgent(), meta)  # type: ignore[arg-type]


# ---------------------------------------------------------------- other tensor-parallel sizes

PEERS4 = [[f"10.0.0.{i}", 7000 + i, 50 + i] for i in range(4)]


def heads_binding(rank: int, tp: int, total: int = 4) -> WorkerBinding:
    return WorkerBinding(rank, 16, 30.0, tp, heads=total // tp, total_heads=total)


Span = tuple[int, tuple[int, ...], int]


def spans(rank: int, tp: int, remote_tp: int, total: int = 4) -> list[Span]:
    """(prefill rank, (its heads a block, first head read, first head written, heads), readers)."""
    got = heads_binding(rank, tp, total).sources(PEERS4[:remote_tp], remote_tp, list("abcd"))
    out = []
    for s in got:
        assert s.span is not None
        i = PEERS4.index([s.peer.host, s.peer.port, s.peer.cluster_id])
        assert s.key == "abcd"[i]  # each prefill worker's own grant key
        sp = s.span
        out.append((i, (sp.remote_heads, sp.remote_head, sp.local_head, sp.count), s.readers))
    return out


def test_a_smaller_decode_reads_each_prefill_workers_heads_into_its_part_of_the_block() -> None:
    """Prefill TP 2, decode TP 1, 4 KV heads: the decode's worker reads both
    prefill workers, each whole block (2 heads) into its half of its own."""
    assert spans(0, 1, 2) == [(0, (2, 0, 0, 2), 1), (1, (2, 0, 2, 2), 1)]
    assert spans(1, 2, 4) == [(2, (1, 0, 0, 1), 1), (3, (1, 0, 1, 1), 1)]


def test_a_larger_decode_reads_its_heads_of_one_prefill_worker() -> None:
    """Prefill TP 1, decode TP 2: decode rank r reads heads [2r, 2r + 2) of
    the prefill's blocks; the prefill holds them until both are done."""
    assert spans(0, 2, 1) == [(0, (4, 0, 0, 2), 2)]
    assert spans(1, 2, 1) == [(0, (4, 2, 0, 2), 2)]
    assert spans(3, 4, 2) == [(1, (2, 1, 0, 1), 2)]
    # One size: the rank of its own number, whole blocks.
    same = heads_binding(1, 2).sources(PEERS4[:2], 2, ["a", "b"])
    assert [(s.peer.cluster_id, s.key, s.span, s.readers) for s in same] == [(51, "b", None, 1)]


@pytest.mark.parametrize(
    "tp, remote_tp, total, peers, says",
    [
        (1, 4, 2, PEERS4, "replicates the model's KV heads"),  # prefill TP over its heads
        (4, 1, 2, PEERS4[:1], "replicates the model's KV heads"),  # decode TP over them
        (2, 3, 6, PEERS4[:3], "one divides the other"),
        (1, 2, 0, PEERS4[:2], r"KV heads \(unknown"),  # not head-major
        (1, 2, 4, PEERS4[:1], "1 prefill workers for tensor parallel size 2"),
        (1, 2, 4, {"0": 1}, "dict prefill workers"),
        (1, 2, 4, [PEERS4[0], ["h", "x", 1]], "address in the params is bad"),
    ],
)
def test_sizes_it_cannot_read_across_are_refused_naming_both(
    tp: int, remote_tp: int, total: int, peers: Any, says: str
) -> None:
    b = WorkerBinding(0, 16, 30.0, tp, heads=max(1, total // tp), total_heads=total)
    if total and total % tp:  # this decode replicates heads: its layout says total 0
        b = WorkerBinding(0, 16, 30.0, tp)
    with pytest.raises(ValueError, match=says):
        b.sources(peers, remote_tp, [])


def test_a_push_takes_each_prefill_workers_heads_under_its_transfer_id_and_key() -> None:
    """Push across sizes: the same prefill workers and heads as a pull, each
    with its own push key (prefill first) or the client's (decode first),
    and its rank (the transfer id ``xid/rank`` it pushes under)."""
    b = heads_binding(0, 1)  # decode TP 1, 4 heads; prefill TP 2
    got = b.push_sources(PEERS4[:2], 2, ["k0", "k1"], "")
    assert [(s.rank, s.key, s.span) for s in got] == [
        (0, "k0", HeadSpan(2, 0, 0, 2)),
        (1, "k1", HeadSpan(2, 0, 2, 2)),
    ]
    client = b.push_sources(PEERS4[:2], 2, [], "client-key")
    assert [(s.rank, s.key) for s in client] == [(0, "client-key"), (1, "client-key")]
    one = heads_binding(1, 2).push_sources(PEERS4[:2], 2, [], "client-key")
    assert [(s.rank, s.key, s.span) for s in one] == [(1, "client-key", None)]


async def test_push_params_that_list_one_prefill_worker_for_two_ranks_fail_at_once() -> None:
    """Decode TP 1, prefill TP 2: params whose ``aiokv_peers`` name worker 0
    twice (a sloppy client or proxy) have the right length, so the decode
    registers with worker 0 twice, once under ``x/1`` with worker 1's key.
    Worker 0 never computes ``x/1``: the load fails only at its deadline
    ("not pushed within"), worker 0 holds a registration it cannot serve
    and worker 1's blocks wait for a load that never comes. Like a list of
    the wrong length, it should fail at once, asking no peer."""
    agent, rec = await make_agent(heads=4, total_heads=4)
    try:
        r = _Recv("push", [PEERS4[0], PEERS4[0]], 2, push_keys=["k0", "k1"])
        heads_binding(0, 1).bind(agent, _Meta({"d-req": r}))
        failed: set[str] = set()

        def reported() -> bool:
            failed.update(agent.take_results().failed_recving)
            return "d-req" in failed

        await asyncio.sleep(0.5)
        regs = [(c, m[1]) for c, m in rec.sent if m[0] == "reg"]
        assert reported() and not regs, f"not refused; registered {regs}"
    finally:
        await close_agent(agent)
