"""The SGLang backend's data plane (:mod:`aiokvcache.integrations.sglang.engine`),
without SGLang: two rank engines over NumPy buffers laid out as SGLang's
``KVArgs`` lists them (K of each layer, then V; aux buffers of two row sizes).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiokvcache import LLMClusterInfo
from aiokvcache.integrations.sglang.engine import Buffers
from support import sglang_rank as support

LAYERS, PAGES, PAGE = 2, 16, 256
AUX_ROWS, AUX_ITEMS = 8, (64, 64, 512)


def rank(seed: int, transport: str, timeout: float = 10.0) -> support.Rank:
    return support.Rank(seed, transport, layers=LAYERS, pages=PAGES, page=PAGE,
                        aux_rows=AUX_ROWS, aux_items=AUX_ITEMS, timeout=timeout)  # fmt: skip


@pytest.fixture
def pair(transport: str) -> Iterator[tuple[support.Rank, support.Rank]]:
    p, d = rank(1, transport), rank(2, transport)
    try:
        yield p, d
    finally:
        p.engine.close()
        d.engine.close()


class Results:
    """``on_result`` calls, as a queue."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[int, bool, str, bool]] = queue.Queue()

    def __call__(self, room: int, ok: bool, reason: str, last: bool) -> None:
        self.q.put((room, ok, reason, last))

    def next(self, timeout: float = 20) -> tuple[int, bool, str, bool]:
        return self.q.get(timeout=timeout)


def test_a_request_lands_page_for_page_then_its_aux_row(pair: Any) -> None:
    """Two chunks (runs and single pages, out of order), then the last with
    the aux row: each page is the prefill's, the aux row too, nothing else moved."""
    p, d = pair
    before = [a.copy() for a in d.kv], [a.copy() for a in d.aux]
    res = Results()
    chunks = [([1, 2, 3], [9, 10, 11]), ([7], [2])]
    for src, dst in chunks:
        p.engine.push(5, d.peer, (np.array(src), np.array(dst)), None, res)
    p.engine.push(5, d.peer, (np.array([4, 5]), np.array([0, 14])), (3, 6), res)
    got = [res.next() for _ in range(3)]
    assert all(ok for _, ok, _, _ in got), got
    assert got[-1][3] is True  # the last chunk reports last, after the others
    pairs = [(1, 9), (2, 10), (3, 11), (7, 2), (4, 0), (5, 14)]
    for t in range(2 * LAYERS):
        want = before[0][t].copy()
        for s, x in pairs:
            want[x] = p.kv[t][s]
        np.testing.assert_array_equal(d.kv[t], want)
    for i in range(len(AUX_ITEMS)):
        want = before[1][i].copy()
        want[6] = p.aux[i][3]
        np.testing.assert_array_equal(d.aux[i], want)


def test_a_push_to_a_gone_decode_fails_within_its_deadline(transport: str) -> None:
    p, d = rank(1, transport, timeout=3.0), rank(2, transport)
    try:
        peer = d.peer
        d.engine.close()
        res = Results()
        start = time.monotonic()
        p.engine.push(1, peer, (np.array([0]), np.array([0])), (0, 0), res)
        room, ok, reason, last = res.next()
        assert (room, ok, last) == (1, False, True) and reason, reason
        assert time.monotonic() - start < 15
    finally:
        p.engine.close()


@pytest.mark.parametrize(
    "dst", [[3, PAGES], [-1, 2], [5, 5]], ids=["past-the-end", "negative", "twice"]
)
def test_pages_a_peer_cannot_take_fail_the_push_and_move_nothing(pair: Any, dst: Any) -> None:
    """Without the peer's counts the core checks the pages against the
    peer's cache before any byte moves."""
    p, d = pair
    before = d.state()
    res = Results()
    p.engine.push(2, d.peer, (np.array([0, 1]), np.array(dst)), (0, 0), res)
    _, ok, reason, _ = res.next()
    assert not ok and reason
    d.assert_unchanged(before)


@pytest.mark.parametrize(
    "pages, aux",
    [
        (([1, 2], [1, PAGES]), (0, 0)),
        (([1, 2], [1, 2]), (0, -1)),
        (([1, 2], [1, 2]), (0, 2**70)),
        (([1, 2], [1, 2]), (0, AUX_ROWS)),
        (([1, PAGES], [1, 2]), (0, 0)),
        (([1, 2], [1, 2]), (AUX_ROWS, 0)),
        (([1, 2, 3], [1, 2]), (0, 0)),
    ],
    ids=["dst-page", "dst-aux-negative", "dst-aux-huge", "dst-aux-past", "src-page", "src-aux",
         "counts"],
)  # fmt: skip
def test_pages_or_aux_rows_out_of_either_side_are_refused_before_any_byte_moves(
    pair: Any, pages: Any, aux: Any
) -> None:
    """With the peer's page and aux-row counts (its registration's), a bad
    page or aux row is a ``ValueError`` at once: the KV pages never land
    ahead of an aux row that would then fail."""
    p, d = pair
    before = d.state()
    with pytest.raises(ValueError):
        src, dst = (np.array(x) for x in pages)
        p.engine.push(2, d.peer, (src, dst), aux, Results(), (PAGES, AUX_ROWS))
    time.sleep(0.2)
    d.assert_unchanged(before)


def test_a_push_posted_after_its_room_was_cancelled_moves_nothing(pair: Any) -> None:
    """A cancel is remembered: a push the scheduler posts after the decode's
    abort was handled reports cancelled and writes nothing; the room taken
    again (``reopen``) pushes again."""
    p, d = pair
    before = d.state()
    res = Results()
    p.engine.cancel(7)
    p.engine.push(7, d.peer, (np.array([3, 4]), np.array([5, 6])), (1, 2), res)
    assert res.next()[:2] == (7, False)
    time.sleep(0.2)
    d.assert_unchanged(before)
    p.engine.reopen(7)
    p.engine.push(7, d.peer, (np.array([3]), np.array([5])), (1, 2), res)
    assert res.next()[:2] == (7, True)
    np.testing.assert_array_equal(d.kv[0][5], p.kv[0][3])


def test_a_decode_whose_link_broke_is_linked_again(pair: Any) -> None:
    """A link that was up and broke (here the decode force-unlinks, as a
    heartbeat declaring a starved peer dead does) is made again by the next
    push: the next requests to that live decode land."""
    p, d = pair
    res = Results()
    p.engine.push(1, d.peer, (np.array([1]), np.array([1])), (0, 0), res)
    assert res.next()[1]
    info = LLMClusterInfo()
    info.remote_cluster_id = p.engine.cluster_id
    assert d.engine.links.dd is not None
    d.run(d.engine.links.dd.unlink_clusters([info], force=True))
    time.sleep(0.5)
    p.engine.push(2, d.peer, (np.array([2]), np.array([2])), (0, 0), res)
    res.next()  # this one may see the break
    p.engine.push(3, d.peer, (np.array([3]), np.array([3])), (0, 0), res)
    _, ok, reason, _ = res.next()
    assert ok, reason
    np.testing.assert_array_equal(d.kv[1][3], p.kv[1][3])


def test_a_push_to_a_closed_engine_is_refused(transport: str) -> None:
    """After ``close``, ``push`` raises ``RuntimeError`` (the manager counts
    a push only once it was posted) instead of posting one that never reports."""
    p, d = rank(1, transport), rank(2, transport)
    try:
        p.engine.close()
        with pytest.raises(RuntimeError):
            p.engine.push(1, d.peer, (np.array([1]), np.array([1])), (0, 0), Results())
    finally:
        d.engine.close()


def test_a_cancelled_request_reports_and_writes_nothing_after(pair: Any) -> None:
    """Cancel right after posting: every chunk reports (cancelled or landed),
    and once all reported, the decode's pages no longer change."""
    p, d = pair
    res = Results()
    for _ in range(4):
        p.engine.push(3, d.peer, (np.arange(PAGES), np.arange(PAGES)), None, res)
    p.engine.cancel(3)
    got = [res.next() for _ in range(4)]
    assert all(room == 3 for room, *_ in got)
    assert not p.engine.busy(3)
    after = [a.copy() for a in d.kv]
    time.sleep(0.3)
    for a, b in zip(d.kv, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_buffers_refuse_what_cannot_be_a_layout() -> None:
    with pytest.raises(ValueError):
        Buffers.of([1, 2], [64], [64])
    with pytest.raises(ValueError):
        Buffers.of([1], [32], [64])
    assert Buffers.of([1, 2, 3], [128, 64, 128], [64, 32, 64]).groups() == [(64, [0, 2]), (32, [1])]


def test_a_failed_chunk_fails_its_request_and_later_chunks_move_nothing(pair: Any) -> None:
    """A chunk the decode's core refuses ends the request: the last chunk,
    posted after that failure was reported, reports failed and writes neither
    its pages nor its aux row (the first output token never lands after a
    lost page); the room taken again pushes again."""
    p, d = pair
    res = Results()
    p.engine.push(4, d.peer, (np.array([1, 2]), np.array([3, PAGES])), None, res)
    assert res.next()[:2] == (4, False)
    before = d.state()
    p.engine.push(4, d.peer, (np.array([5]), np.array([6])), (2, 3), res)
    room, ok, reason, last = res.next()
    assert (room, ok, last) == (4, False, True) and "earlier chunk" in reason, reason
    time.sleep(0.2)
    d.assert_unchanged(before)
    p.engine.reopen(4)
    p.engine.push(4, d.peer, (np.array([5]), np.array([6])), (2, 3), res)
    assert res.next()[:2] == (4, True)
    np.testing.assert_array_equal(d.aux[0][3], p.aux[0][2])


def test_a_room_taken_again_does_not_wait_for_the_earlier_requests_pushes(pair: Any) -> None:
    """SGLang reuses a room on a re-bootstrap: the new request's last chunk
    neither waits for nor fails with the cancelled pushes of the earlier one."""
    p, d = pair
    old, new = Results(), Results()
    for _ in range(4):
        p.engine.push(8, d.peer, (np.arange(PAGES), np.arange(PAGES)), None, old)
    p.engine.cancel(8)
    p.engine.reopen(8)
    p.engine.push(8, d.peer, (np.array([1]), np.array([1])), (4, 5), new)
    room, ok, reason, _ = new.next()
    assert (room, ok) == (8, True), reason
    np.testing.assert_array_equal(d.aux[1][5], p.aux[1][4])
    assert all(old.next()[0] == 8 for _ in range(4))


def test_a_failed_request_stays_ended_while_other_rooms_end(pair: Any) -> None:
    """The engine remembers the last ``ENDED_ROOMS`` rooms that ended (the
    manager's Failed status guards beyond: it posts no chunk of a failed
    request): a failed room stays ended while that many others end after it."""
    from aiokvcache.integrations.sglang import engine as eng

    p, d = pair
    res = Results()
    p.engine.push(4, d.peer, (np.array([1, 2]), np.array([3, PAGES])), None, res)
    assert res.next()[:2] == (4, False)
    before = d.state()
    for other in range(10_000, 10_000 + eng.ENDED_ROOMS - 1):
        p.engine.cancel(other)
    p.engine.push(4, d.peer, (np.array([5]), np.array([6])), (2, 3), res)
    room, ok, _, last = res.next()
    assert (room, ok, last) == (4, False, True), "a chunk of a failed request landed"
    time.sleep(0.2)
    d.assert_unchanged(before)
