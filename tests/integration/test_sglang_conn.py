"""The SGLang backend's prefill manager (:mod:`aiokvcache.integrations.sglang.conn`)
against SGLang's own ``CommonKVManager`` code, without servers: a manager
built around two real rank engines over NumPy buffers, its ZMQ sends
recorded. What a decode's frames can do to it (malformed, hostile, out of
order), and when it says Failed, Success and ``ABORT_ACK``.

Needs SGLang (run in the SGLang venv, as ``.ci/run`` does); skipped otherwise.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here (see .ci/run)", allow_module_level=True)

with warnings.catch_warnings():  # SGLang's imports warn (torch's deprecations)
    warnings.simplefilter("ignore")
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG

    from aiokvcache.integrations.sglang import conn
from aiokvcache.integrations.sglang.engine import RankEngine
from support.sglang_rank import Rank

PAGES, PAGE, LAYERS, AUX_ROWS = 32, 256, 2, 8
ROOM = 4242


def side(seed: int) -> Rank:
    return Rank(seed, "tcp", layers=LAYERS, pages=PAGES, page=PAGE, aux_rows=AUX_ROWS,
                aux_items=(64, 64), aux_low=1)  # fmt: skip


class Prefill(conn.AioKVManager):
    """An ``AioKVManager`` with the state SGLang's ``CommonKVManager``
    constructor would set (not run: it needs a server), its sends recorded."""

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine
        self.request_status: dict[int, Any] = {}
        self.transfer_infos: dict[int, Any] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.failure_records: dict[int, str] = {}
        self.failure_lock = threading.Lock()
        self._staging_outstanding: dict[int, int] = collections.defaultdict(int)
        self._deferred_ack_targets: dict[int, Any] = {}
        self._deferred_ack_poisoned_rooms: set[int] = set()
        self.deferred_bootstrap = None
        self.attn_tp_rank = self.pp_rank = self.attn_cp_rank = 0
        self.pp_size = self.attn_cp_size = 1
        self._lock = threading.Lock()
        self._waiting_last: dict[int, int] = {}
        self._status = concurrent.futures.ThreadPoolExecutor(1)
        self._registrations: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._aborted: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._requests: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._stopped = False
        self.sent: list[tuple[float, str, list[bytes]]] = []

    def _send_multipart_locked(self, endpoint: str, frames: list[bytes], **_: Any) -> None:
        self.sent.append((time.monotonic(), endpoint, [bytes(f) for f in frames]))

    def statuses(self) -> list[tuple[int, int]]:
        """(room, status) of each status message sent."""
        return [(int(f[0]), int(f[1])) for _, _, f in self.sent if f[0] != ABORT_ACK_TAG]

    def acks(self) -> list[float]:
        return [t for t, _, f in self.sent if f[0] == ABORT_ACK_TAG]

    def settle(self) -> None:
        self._status.submit(lambda: None).result(10)


@pytest.fixture
def sides() -> Iterator[tuple[Prefill, Rank, Rank]]:
    p, d = side(1), side(2)
    mgr = Prefill(p.engine)
    try:
        yield mgr, p, d
    finally:
        mgr._status.shutdown(wait=True)
        p.engine.close()
        d.engine.close()


def registration(d: Rank, session: bytes = b"127.0.0.1:5000", shape: Any = None) -> list[bytes]:
    host, port = d.engine.address.rsplit(":", 1)
    body = shape if shape is not None else json.dumps(
        {"kv": [PAGE] * 2 * LAYERS, "aux": [64, 64], "rows": [PAGES, AUX_ROWS]}
    ).encode()  # fmt: skip
    ip, _, rank_port = session.partition(b":")
    return [conn.REG_TAG, ip, rank_port, session, host.encode(), port.encode(),
            str(d.engine.cluster_id).encode(), body]  # fmt: skip


def metadata(
    room: int, pages: list[int], aux: int, session: bytes = b"127.0.0.1:5000"
) -> list[bytes]:
    ip, _, port = session.partition(b":")
    return [str(room).encode(), ip, port, session, np.array(pages, np.int32).tobytes(),
            str(aux).encode(), b"1", b"0"]  # fmt: skip


def run_loop(mgr: Prefill, msgs: list[list[bytes]]) -> None:
    """The prefill's control loop over ``msgs``; it must come back alive."""
    queue = list(msgs)

    def make_recv(_sock: Any) -> Any:
        def recv() -> Any:
            if not queue:
                mgr._stopped = True
                return None
            return queue.pop(0)

        return recv

    mgr._make_worker_recv = make_recv  # type: ignore[method-assign]
    mgr.server_socket = None
    mgr._stopped = False
    t = threading.Thread(target=mgr._prefill_loop)
    t.start()
    t.join(20)
    assert not t.is_alive()
    assert mgr._stopped and not queue, "the control loop ended before reading every message"


def wait_status(mgr: Prefill, room: int, status: int, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while (room, int(status)) not in mgr.statuses() and time.monotonic() < end:
        time.sleep(0.02)
    assert (room, int(status)) in mgr.statuses(), mgr.statuses()


def open_room(mgr: Prefill, d: Rank, pages: list[int], aux: int = 3) -> None:
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    run_loop(mgr, [registration(d), metadata(ROOM, pages, aux)])
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput


def test_mangled_frames_are_dropped_and_the_control_loop_goes_on(sides: Any) -> None:
    """Nested JSON 200,000 deep, wrong frame counts, bad numbers, a session
    that is not its address, an oversized shape: each dropped, and the
    registration after them is taken."""
    mgr, _, d = sides
    bad = [
        registration(d, shape=b"[" * 200_000),
        registration(d, shape=b"{" * 70_000),
        registration(d, shape=b'{"kv": 1}'),
        registration(d)[:5],
        [conn.REG_TAG, b"x", b"notaport", b"x:1", b"h", b"p", b"c", b"{}"],
        [*registration(d, session=b"10.9.9.9:1")[:3], b"127.0.0.1:5000", *registration(d)[4:]],
        metadata(ROOM, [1], 0)[:4],
        [b"notaroom", b"", b"", b"", b"", b"", b"", b""],
        [b"ABORT", b"x"],
        [],
    ]
    run_loop(mgr, [*bad, registration(d)])
    assert list(mgr._registrations) == ["127.0.0.1:5000"]


def test_a_layout_that_differs_is_refused_and_its_rooms_fail(sides: Any) -> None:
    mgr, _, d = sides
    other = json.dumps({"kv": [PAGE * 2] * 2 * LAYERS, "aux": [64, 64], "rows": [8, 8]}).encode()
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    run_loop(mgr, [registration(d, shape=other), metadata(ROOM, [1, 2], 3)])
    before = d.state()
    mgr.add_transfer_request(ROOM, np.array([4, 5]), slice(0, 2), True, aux_index=0)
    mgr.settle()
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert (ROOM, int(KVPoll.Failed)) in mgr.statuses()
    assert "not laid out" in mgr.failure_records[ROOM]
    time.sleep(0.2)
    for a, b in zip((*d.kv, *d.aux), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_success_is_sent_once_every_chunk_and_the_aux_row_landed(sides: Any) -> None:
    mgr, p, d = sides
    open_room(mgr, d, [7, 8, 9, 20], aux=3)
    mgr.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), False)
    mgr.add_transfer_request(ROOM, np.array([5, 6]), slice(2, 4), True, aux_index=1)
    end = time.monotonic() + 20
    while (ROOM, int(KVPoll.Success)) not in mgr.statuses() and time.monotonic() < end:
        time.sleep(0.02)
    assert mgr.statuses() == [(ROOM, int(KVPoll.Success))]
    for t in range(2 * LAYERS):
        for s, x in ((1, 7), (2, 8), (5, 9), (6, 20)):
            np.testing.assert_array_equal(d.kv[t][x], p.kv[t][s])
    np.testing.assert_array_equal(d.aux[0][3], p.aux[0][1])


def test_an_abort_ack_never_precedes_a_push_that_can_still_write(sides: Any) -> None:
    """The decode's ABORT and the scheduler's chunk race, in both orders and
    interleaved: the ACK goes out only once no push of the room can write,
    so the decode's pages do not change after it."""
    mgr, p, d = sides
    for round_ in range(20):
        room = ROOM + round_
        mgr.update_status(room, KVPoll.Bootstrapping)
        run_loop(mgr, [registration(d), metadata(room, list(range(PAGES)), 3)])
        abort = [b"ABORT", str(room).encode(), b"127.0.0.1", b"5000", str(round_ + 1).encode()]
        chunk = threading.Thread(
            target=mgr.add_transfer_request,
            args=(room, np.arange(PAGES), slice(0, PAGES), True),
            kwargs={"aux_index": 2},
        )
        mgr.sent.clear()
        if round_ % 2:
            chunk.start()
            run_loop(mgr, [abort])
        else:
            run_loop(mgr, [abort])
            chunk.start()
        chunk.join(10)
        end = time.monotonic() + 20
        while not mgr.acks() and time.monotonic() < end:
            time.sleep(0.005)
        assert mgr.acks(), f"round {round_}: no ABORT_ACK"
        assert not p.engine.busy(room)
        after = d.state()
        time.sleep(0.1)
        for a, b in zip((*d.kv, *d.aux), after, strict=True):
            np.testing.assert_array_equal(a, b)


class Gate:
    """A GPU event stand-in: ``synchronize`` waits until the test lets it go."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.entered.set()
        self.go.wait(10)


def test_an_abort_while_the_scheduler_waits_on_its_chunk_writes_nothing_after_the_ack(
    sides: Any,
) -> None:
    """The scheduler is inside ``add_transfer_request`` waiting for its
    chunk's event when the decode's ABORT is handled: the chunk is then not
    pushed at all, so the decode's pages never change after the ACK."""
    mgr, _, d = sides
    open_room(mgr, d, list(range(PAGES)), aux=3)
    before = d.state()
    gate = Gate()
    chunk = threading.Thread(
        target=mgr.add_transfer_request,
        args=(ROOM, np.arange(PAGES), slice(0, PAGES), True),
        kwargs={"aux_index": 2, "wait_event": gate},
    )
    chunk.start()
    assert gate.entered.wait(10)
    run_loop(mgr, [[b"ABORT", str(ROOM).encode(), b"127.0.0.1", b"5000", b"1"]])
    mgr.settle()
    assert mgr.acks()
    gate.go.set()
    chunk.join(10)
    time.sleep(0.3)
    for a, b in zip((*d.kv, *d.aux), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_failure_reaches_the_decode_even_if_the_room_is_cleared_at_once(sides: Any) -> None:
    """A chunk the decode's registration cannot take fails the room; the
    scheduler clears it right away (as it does on Failed): the decode is
    still told, not left to its 300 s timeout."""
    mgr, _, d = sides
    open_room(mgr, d, [1, 2], aux=3)
    mgr._registrations["127.0.0.1:5000"].refused = "refused"
    hold = threading.Lock()
    hold.acquire()
    mgr._status.submit(hold.acquire)  # the status thread is busy meanwhile
    mgr.add_transfer_request(ROOM, np.array([4, 5]), slice(0, 2), True, aux_index=0)
    mgr.request_status.pop(ROOM, None)  # the sender's clear()
    mgr.transfer_infos.pop(ROOM, None)
    hold.release()
    mgr.settle()
    assert (ROOM, int(KVPoll.Failed)) in mgr.statuses()


def test_metadata_after_a_prefill_side_abort_is_answered_failed(sides: Any) -> None:
    mgr, _, d = sides
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.aborted(ROOM)
    run_loop(mgr, [registration(d), metadata(ROOM, [1], 0)])
    mgr.settle()
    assert mgr.statuses() == [(ROOM, int(KVPoll.Failed))]
    assert ROOM not in mgr.transfer_infos


def test_a_second_decode_claiming_a_room_is_ignored(sides: Any) -> None:
    """The first decode rank to send a room's metadata keeps it: a replay or
    another claimant neither redirects the pushes nor adds a destination."""
    mgr, _, d = sides
    open_room(mgr, d, [1, 2], aux=3)
    other = b"127.0.0.1:6000"
    run_loop(mgr, [registration(d, session=other), metadata(ROOM, [9, 10], 4, session=other)])
    assert list(mgr.transfer_infos[ROOM]) == ["127.0.0.1:5000"]
    replay = metadata(ROOM, [11, 12], 5)  # the same session, other pages
    three = metadata(ROOM, [1, 2], 3)
    three[6] = b"3"  # more destinations
    run_loop(mgr, [replay, three])
    assert list(mgr.transfer_infos[ROOM]) == ["127.0.0.1:5000"]
    dest = mgr.transfer_infos[ROOM]["127.0.0.1:5000"]
    assert (list(dest.kv), dest.aux, dest.required_dst_info_num) == ([1, 2], 3, 1)


def test_a_decode_rank_registered_again_under_a_new_engine_drops_the_old_link(
    sides: Any,
) -> None:
    """A decode rank that restarted registers its session again with a new
    engine: the prefill's link to the old one is dropped (links do not pile
    up with restarts), the new one serves the next request."""
    mgr, p, d = sides
    open_room(mgr, d, [1, 2], aux=3)
    mgr.add_transfer_request(ROOM, np.array([5, 6]), slice(0, 2), True, aux_index=1)
    wait_status(mgr, ROOM, KVPoll.Success)
    old = d.engine.cluster_id
    assert p.engine.links.alive(old)
    d2 = side(3)
    try:
        room = ROOM + 1
        mgr.update_status(room, KVPoll.Bootstrapping)
        run_loop(mgr, [registration(d2), metadata(room, [7], 2)])
        links = p.engine.links
        deadline = time.monotonic() + 10
        while (old in links._links or links.alive(old)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the unlink is posted to the engine's thread
        assert old not in links._links and not links.alive(old)
        mgr.add_transfer_request(room, np.array([4]), slice(0, 1), True, aux_index=0)
        wait_status(mgr, room, KVPoll.Success)
        np.testing.assert_array_equal(d2.kv[0][7], p.kv[0][4])
    finally:
        d2.engine.close()


def _mutated(rng: np.random.Generator, frames: list[bytes]) -> list[bytes]:
    """``frames`` with one to three mutations: a frame dropped, added,
    replaced by random bytes, truncated, or a number in it changed."""
    out = list(frames)
    for _ in range(int(rng.integers(1, 4))):
        pick = int(rng.integers(6))
        i = int(rng.integers(len(out))) if out else 0
        if pick == 0 and out:
            del out[i]
        elif pick == 1:
            out.insert(i, rng.bytes(int(rng.integers(0, 40))))
        elif pick == 2 and out:
            out[i] = rng.bytes(int(rng.integers(0, 300)))
        elif pick == 3 and out:
            out[i] = out[i][: int(rng.integers(0, len(out[i]) + 1))]
        elif out:
            out[i] = str(int(rng.choice([-1, 0, 1, 2**31, 2**63, 10**30]))).encode()
    return out


FUZZ_ROUNDS = int(os.environ.get("AIOKVCACHE_SGLANG_FUZZ_ROUNDS", "300"))


def test_fuzzed_frames_leave_the_prefill_serving_and_push_nowhere_unasked(sides: Any) -> None:
    """Mutated registrations, metadata and ABORTs (``AIOKVCACHE_SGLANG_FUZZ_ROUNDS``
    rounds, seeded by ``AIOKVCACHE_FUZZ_SEED``): the control loop survives
    each, the decode's memory is untouched (no chunk was posted), the
    bookkeeping stays bounded, and a legitimate request still lands."""
    mgr, p, d = sides
    seed = int(os.environ.get("AIOKVCACHE_FUZZ_SEED", "0")) or int(
        np.random.SeedSequence().entropy % 2**32
    )
    rng = np.random.default_rng(seed)
    valid = [
        registration(d),
        metadata(ROOM + 1, [1, 2, 3], 4),
        [b"ABORT", str(ROOM + 1).encode(), b"127.0.0.1", b"5000", b"7"],
    ]
    before = d.state()
    for _ in range(FUZZ_ROUNDS):
        run_loop(mgr, [_mutated(rng, valid[int(rng.integers(len(valid)))]) for _ in range(8)])
    mgr.settle()
    for a, b in zip((*d.kv, *d.aux), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(mgr._registrations) <= conn.MAX_REGISTRATIONS, seed
    mgr._registrations.clear()
    mgr.transfer_infos.clear()
    mgr.request_status.clear()
    open_room(mgr, d, [7, 8], aux=3)
    mgr.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=1)
    end = time.monotonic() + 20
    while (ROOM, int(KVPoll.Success)) not in mgr.statuses() and time.monotonic() < end:
        time.sleep(0.02)
    assert (ROOM, int(KVPoll.Success)) in mgr.statuses(), seed
    np.testing.assert_array_equal(d.kv[0][7], p.kv[0][1])


# ---------------------------------------------------------------- a room taken again


class SlowQuiesce:
    """Wraps the prefill engine's ``links.relink``: the first ``n`` pushes
    wait at a gate each; cancelled meanwhile, each reports only once its
    gate opens (a core push's cancellation is quiescent: it may take the
    core's graces, seconds)."""

    def __init__(self, engine: RankEngine, n: int) -> None:
        self.real = engine.links.relink
        self.gates = [threading.Event() for _ in range(n)]
        self.calls = 0
        engine.links.relink = self  # type: ignore[method-assign]

    async def __call__(self, peer: Any) -> None:
        import asyncio

        i, self.calls = self.calls, self.calls + 1
        if i < len(self.gates):
            gate = self.gates[i]
            try:
                while not gate.is_set():  # noqa: ASYNC110 (a thread's Event)
                    await asyncio.sleep(0.005)
            except asyncio.CancelledError:
                while not gate.is_set():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(0.005)
                raise
        await self.real(peer)

    def wait_calls(self, n: int) -> None:
        end = time.monotonic() + 10
        while self.calls < n and time.monotonic() < end:
            time.sleep(0.005)
        assert self.calls >= n


def _wait_tasks(engine: RankEngine, n: int) -> None:
    end = time.monotonic() + 10
    while len(engine._tasks) > n and time.monotonic() < end:
        time.sleep(0.005)
    assert len(engine._tasks) <= n


def _take_room_again(mgr: Prefill, p: Rank, d: Rank, pages: list[int], aux: int) -> None:
    """The earlier request's sender is cleared (AioKVSender.clear: cancel, as
    it did not succeed; SGLang's clear pops the room), then a new request's
    sender takes the room (AioKVSender.__init__: reopen; CommonKVSender:
    Bootstrapping), and its decode's metadata comes."""
    p.engine.cancel(ROOM)
    mgr.request_status.pop(ROOM, None)
    mgr.transfer_infos.pop(ROOM, None)
    mgr.req_to_decode_prefix_len.pop(ROOM, None)
    mgr.new_request(ROOM)
    open_room(mgr, d, pages, aux)


def _room_taken_again_with_a_push_in_flight(
    mgr: Prefill, p: Rank, d: Rank, gated: int
) -> SlowQuiesce:
    """ROOM's first request has a chunk pushing (held at the gate), then a
    new request takes the room; the first ``gated`` pushes wait at gates."""
    open_room(mgr, d, [1, 2], aux=3)
    gate = SlowQuiesce(p.engine, gated)
    mgr.add_transfer_request(ROOM, np.array([4, 5]), slice(0, 2), False)
    gate.wait_calls(1)
    _take_room_again(mgr, p, d, [10, 11], aux=4)
    return gate


def test_the_earlier_requests_cancelled_push_does_not_fail_the_new_request(
    sides: Any,
) -> None:
    """A room taken again by a new request (SGLang's re-bootstrap): the
    earlier request's cancelled push, reporting after that, neither
    concludes the new request Failed nor tells its decode (``_on_result``
    was keyed by the room alone)."""
    mgr, p, d = sides
    gate = _room_taken_again_with_a_push_in_flight(mgr, p, d, gated=1)
    mgr.settle()
    mgr.sent.clear()
    gate.gates[0].set()  # the earlier request's push is quiescent now: it reports
    _wait_tasks(p.engine, 0)
    mgr.settle()
    assert mgr.request_status[ROOM] != KVPoll.Failed, mgr.failure_records.get(ROOM)
    assert (ROOM, int(KVPoll.Failed)) not in mgr.statuses()


def test_no_abort_ack_while_the_new_requests_push_can_still_write(sides: Any) -> None:
    """SGLang's update_status(Bootstrapping) resets the room's outstanding
    count for the new request; the earlier request's push, reporting after
    that, must not count the new one's down (it did: the count reached 0
    with the new request's push in flight, and the decode's ABORT was ACKed
    at once, freeing pages a push could still write)."""
    mgr, p, d = sides
    gate = _room_taken_again_with_a_push_in_flight(mgr, p, d, gated=2)
    mgr.add_transfer_request(ROOM, np.array([6, 7]), slice(0, 2), False)  # the new one's
    gate.wait_calls(2)
    gate.gates[0].set()  # the earlier request's push reports
    _wait_tasks(p.engine, 1)
    mgr.settle()
    mgr.sent.clear()
    run_loop(mgr, [[b"ABORT", str(ROOM).encode(), b"127.0.0.1", b"5000", b"1"]])
    mgr.settle()
    try:
        assert not mgr.acks(), "ABORT_ACK sent while the new request's push had not reported"
    finally:
        gate.gates[1].set()
