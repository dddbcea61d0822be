"""A model of the SGLang backend's room lifecycle in its data plane
(:class:`aiokvcache.integrations.sglang.engine.RankEngine`), explored by
hypothesis (stateful testing) over two real engines (TCP, or
``AIOKVCACHE_SGLANG_MODEL_TRANSPORT``).

What the scheduler and the control loop do to a room, in any order: chunks
posted (pages, the last with its aux row), some with a page the decode
cannot take (the push fails in the peer's core); the room cancelled (an
abort on either side); the room taken again by a new request (``reopen``,
SGLang's re-bootstrap) while the earlier request's pushes may still run;
the test waiting for everything posted to report.

The promises checked once everything reported:

* each push reports exactly once;
* a push reported landed holds the prefill's bytes, page for page (its aux
  row too);
* a request's last chunk reported landed means every earlier chunk of that
  request landed (no aux row, the first output token, after a lost page);
* a chunk posted after its request was cancelled, or after a chunk of it was
  reported failed, reports failed and writes nothing;
* a request neither cancelled nor given a bad page lands every chunk, whatever
  an earlier request in the same room did;
* once all reported, nothing more is written, and no room's state is left.

``AIOKVCACHE_SGLANG_MODEL_EXAMPLES`` (default 60, about ten seconds) sets how
many runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from support.sglang_rank import Rank

EXAMPLES = int(os.environ.get("AIOKVCACHE_SGLANG_MODEL_EXAMPLES", "60"))
TRANSPORT = os.environ.get("AIOKVCACHE_SGLANG_MODEL_TRANSPORT", "tcp")
pytestmark = pytest.mark.timeout(max(300, EXAMPLES * 10))

LAYERS, PAGES, PAGE = 2, 128, 128
AUX_ROWS, AUX_ITEMS = 48, (32, 96)
ROOMS = 3


def side(seed: int) -> Rank:
    return Rank(seed, TRANSPORT, layers=LAYERS, pages=PAGES, page=PAGE, aux_rows=AUX_ROWS,
                aux_items=AUX_ITEMS)  # fmt: skip


_SIDES: list[Rank] = []


@pytest.fixture(scope="module", autouse=True)
def sides() -> Iterator[None]:
    """One prefill and one decode engine for every example."""
    _SIDES[:] = [side(1), side(2)]
    try:
        yield
    finally:
        for s in _SIDES:
            s.engine.close()
        _SIDES.clear()


@dataclass
class Push:
    room: int
    gen: int
    src: list[int]
    dst: list[int]
    aux: tuple[int, int] | None
    doomed: bool  # the model knows it cannot land (posted to an ended request)
    bad: bool  # a page the decode cannot take
    result: tuple[bool, str, bool] | None = None


@dataclass
class Request:
    """One request's use of a room (a generation)."""

    gen: int
    pushes: list[Push] = field(default_factory=list)
    cancelled: bool = False
    failed_seen: bool = False  # a chunk of it was reported failed (known after a settle)
    finished: bool = False  # its last chunk was posted
    had_bad: bool = False  # a chunk of it had a page the decode cannot take


class RoomLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p, self.d = _SIDES
        self.d.zero()
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.pushes: list[Push] = []
        self.rooms = {r: Request(0) for r in range(ROOMS)}
        self.requests = {(r, 0): req for r, req in self.rooms.items()}
        self.next_page = 0
        self.next_aux = 0
        self.gens = 0

    # ------------------------------------------------------------ rules

    def _on_result(self, push: Push) -> Any:
        def cb(room: int, ok: bool, reason: str, last: bool) -> None:
            with self.lock:
                assert room == push.room
                assert push.result is None, f"a push reported twice: {push}, then {ok, reason}"
                push.result = (ok, reason, last)
                self.done.notify_all()

        return cb

    def _pages(self, n: int) -> list[int] | None:
        if self.next_page + n > PAGES:
            return None
        out = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out

    @rule(
        room=st.integers(0, ROOMS - 1),
        n=st.integers(0, 3),
        last=st.booleans(),
        bad=st.sampled_from([False, False, False, True]),
        src_seed=st.integers(0, 2**16),
    )
    def push(self, room: int, n: int, last: bool, bad: bool, src_seed: int) -> None:
        req = self.rooms[room]
        if req.finished or (bad and n == 0):
            return
        dst = self._pages(n)
        if dst is None or (last and self.next_aux >= AUX_ROWS):
            return
        rng = np.random.default_rng(src_seed)
        src = [int(x) for x in rng.integers(0, PAGES, n)]
        if bad:
            dst = [*dst[:-1], PAGES + 3]  # past the decode's pool: its core refuses it
        aux = None
        if last:
            aux = (int(rng.integers(0, AUX_ROWS)), self.next_aux)
            self.next_aux += 1
            req.finished = True
        doomed = req.cancelled or req.failed_seen
        req.had_bad |= bad
        push = Push(room, req.gen, src, dst, aux, doomed, bad)
        req.pushes.append(push)
        self.pushes.append(push)
        self.p.engine.push(room, self.d.peer, (np.array(src), np.array(dst)), aux,
                           self._on_result(push))  # fmt: skip

    @rule(room=st.integers(0, ROOMS - 1))
    def cancel(self, room: int) -> None:
        self.rooms[room].cancelled = True
        self.p.engine.cancel(room)

    @rule(room=st.integers(0, ROOMS - 1))
    def reopen(self, room: int) -> None:
        """A new request takes the room; the earlier one's pushes may still run."""
        req = self.rooms[room]
        if not (req.cancelled or req.finished):
            return
        self.gens += 1
        self.rooms[room] = self.requests[room, self.gens] = Request(self.gens)
        self.p.engine.reopen(room)

    @initialize(
        chunks=st.lists(st.tuples(st.integers(0, ROOMS - 1), st.integers(1, 3)), min_size=1,
                        max_size=6),
    )  # fmt: skip
    def first_chunks(self, chunks: list[tuple[int, int]]) -> None:
        """Requests under way before anything else happens."""
        for room, n in chunks:
            self.push(room, n, False, False, room * 7 + n)

    @rule()
    def settle(self) -> None:
        self._wait_all()
        for req in self.rooms.values():
            if any(p.result is not None and not p.result[0] for p in req.pushes):
                req.failed_seen = True

    # ------------------------------------------------------------ checks

    def _wait_all(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        with self.lock:
            while any(p.result is None for p in self.pushes):
                left = end - time.monotonic()
                assert left > 0, [p for p in self.pushes if p.result is None]
                self.done.wait(left)

    @invariant()
    def reports_are_well_formed(self) -> None:
        with self.lock:
            for p in self.pushes:
                if p.result is not None:
                    ok, reason, last = p.result
                    assert last == (p.aux is not None)
                    assert ok or reason
                    assert not (ok and (p.doomed or p.bad)), p

    def teardown(self) -> None:
        self._wait_all()
        self._check_landed()
        self._check_requests()
        before = self.d.state()
        time.sleep(0.05)
        self.d.assert_unchanged(before, "written after every push reported")
        assert not self.p.engine._rooms, "a room's pushes outlived their reports"
        kinds = sorted({"ok" if p.result and p.result[0] else "failed" for p in self.pushes})
        event(f"pushes {len(self.pushes)}, results {kinds}")
        for room in range(ROOMS):  # the next example starts with open rooms
            self.p.engine.reopen(room)

    def _check_landed(self) -> None:
        for p in self.pushes:
            assert p.result is not None
            ok = p.result[0]
            for t in range(2 * LAYERS):
                for s, x in zip(p.src, p.dst, strict=True):
                    if x >= PAGES:
                        continue
                    got, want = self.d.kv[t][x], self.p.kv[t][s]
                    if ok:
                        np.testing.assert_array_equal(got, want, f"page {x} of {p}")
                    elif p.doomed:
                        assert not got.any(), f"a doomed push wrote page {x}: {p}"
            if p.aux is not None:
                for i in range(len(AUX_ITEMS)):
                    got = self.d.aux[i][p.aux[1]]
                    if ok:
                        np.testing.assert_array_equal(got, self.p.aux[i][p.aux[0]])
                    elif p.doomed:
                        assert not got.any(), f"a doomed push wrote its aux row: {p}"

    def _check_requests(self) -> None:
        by_request: dict[tuple[int, int], list[Push]] = {}
        for p in self.pushes:
            by_request.setdefault((p.room, p.gen), []).append(p)
        for key, pushes in by_request.items():
            req = self.requests[key]
            if not (req.cancelled or req.had_bad):
                # Nothing ended it: every chunk landed (an earlier request in
                # the room neither holds nor ends this one).
                lost = [p for p in pushes if p.result is None or not p.result[0]]
                assert not lost, f"a request nothing ended lost chunks {lost}"
            for i, p in enumerate(pushes):
                if p.aux is not None and p.result is not None and p.result[0]:
                    lost = [q for q in pushes[:i] if q.result is None or not q.result[0]]
                    assert not lost, f"the last chunk landed after lost chunks {lost}"


RoomLifecycle.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
test_room_lifecycle = RoomLifecycle.TestCase
