"""The vLLM connector's hand-off state machines (``integrations/agent/handoff.py``)
alone: no vLLM, no network, no clock but the one the tests pass. Duplicated,
reordered and forged messages, and random interleavings checked against the
protocol's invariants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvcache.integrations.agent.handoff import (
    Answer,
    BadMessage,
    PullHolds,
    Registration,
    blocks_digest,
    grant_key,
)

BLOCKS = [4, 5, 6, 7]
N, D = len(BLOCKS), blocks_digest(BLOCKS)
SECRET = b"s" * 32
UNTIL = 10**13  # the keys' expiry (wall clock, ms): far ahead unless a test says
WALL = 0  # the wall clock the tests pass (ms)


def holds(**kw: float) -> PullHolds:
    return PullHolds(SECRET, **kw)  # type: ignore[arg-type]


def key(rid: str, blocks: list[int] = BLOCKS, until: int = UNTIL) -> str:
    return grant_key(SECRET, rid, len(blocks), blocks_digest(blocks), until)


def claim(h: PullHolds, src: int, rid: str, nonce: str, now: float, **kw: Any) -> Answer:
    args: dict[str, Any] = {
        "key": key(rid),
        "ttl": 5.0,
        "first": 0,
        "last": N,
        "n": N,
        "digest": D,
        "until_ms": UNTIL,
        "wall_ms": WALL,
    }
    args.update(kw)
    return h.claim(src, rid, nonce, now=now, **args)


def hold(h: PullHolds, rid: str, lease: float, now: float, blocks: list[int] = BLOCKS) -> bool:
    return h.hold(rid, blocks, lease, UNTIL, now)


def free(h: PullHolds, src: int, rid: str, k: str, now: float = 0) -> bool:
    return h.free(src, rid, k, N, D, UNTIL, now, WALL)


def tick(h: PullHolds, now: float) -> list[str]:
    return h.tick(now, WALL)


def test_the_key_is_a_mac_of_the_request_and_its_blocks() -> None:
    assert key("r") == key("r") != key("s")
    assert key("r") != key("r", [4, 5, 6, 8]) != key("r", [4, 5, 6])
    assert grant_key(b"t" * 32, "r", N, D, UNTIL) != key("r") != key("r", until=UNTIL + 1)
    assert holds().key("r", BLOCKS, UNTIL) == key("r")


def test_grant_then_done_releases_once() -> None:
    h = holds()
    assert hold(h, "r", 10, 0) is False
    a = claim(h, 1, "r", "n", now=1)
    assert a.kind == "grant" and (a.to, a.rid, a.nonce) == (1, "r", "n")
    assert h.done(1, "r", "n") is True
    assert h.done(1, "r", "n") is False  # duplicated
    assert not h.held("r") and tick(h, 100) == []


def test_a_claim_before_the_hand_over_is_granted_and_released_after_it() -> None:
    h = holds()
    assert claim(h, 1, "r", "n", now=0, first=1, last=3).kind == "grant"
    assert h.claims("r") == {(1, "n")} and not h.held("r")
    assert h.done(1, "r", "n") is False  # read, but not handed over: not reported
    assert hold(h, "r", 10, 1) is True  # released as it arrives


def test_a_claim_before_the_hand_over_needs_the_key() -> None:
    h = holds()
    assert claim(h, 1, "r", "n", now=0, key="f" * 32).kind == "refused"
    assert claim(h, 1, "r", "n", now=0, key=key("other")).kind == "refused"
    assert claim(h, 1, "r", "n", now=0, n=N + 1).kind == "refused"  # key made for N
    assert len(h) == 0


def test_a_record_claimed_but_never_handed_over_is_dropped_later() -> None:
    h = holds(pending_ttl=50)
    claim(h, 1, "r", "n", now=0, ttl=5)
    assert h.next_deadline() == 5
    assert tick(h, 5) == [] and len(h) == 1
    assert h.next_deadline() == 50
    assert tick(h, 50) == [] and len(h) == 0  # dropped, never reported


@pytest.mark.parametrize(
    "bad",
    [
        {"key": "guess"},
        {"digest": blocks_digest([4, 5, 6, 8])},
        {"n": N + 1},
        {"last": N + 1},
        {"first": 2, "last": 2},
        {"first": -1, "last": 2},
        {"ttl": 0},
        {"ttl": float("inf")},
        {"ttl": float("nan")},
        {"ttl": 10**9},
        {"first": 0.0},
        {"n": "4"},
        {"key": None},
        {"readers": 0},
        {"readers": 65},
        {"readers": "2"},
        {"readers": True},
    ],
)
def test_bad_claims_are_refused(bad: dict[str, Any]) -> None:
    h = holds()
    hold(h, "r", 10, 0)
    assert claim(h, 1, "r", "n", now=0, **bad).kind == "refused"
    assert h.claims("r") == set()
    g = holds()  # and before the hand-over
    assert claim(g, 1, "r", "n", now=0, **bad).kind == "refused"


def test_blocks_read_by_several_decode_workers_are_held_until_each_is_done() -> None:
    """A decode of a larger tensor-parallel size reads a prefill worker's
    blocks from each of its workers (each its heads): held until as many
    clusters as the claims said are done, whatever order they come in; a
    worker that never comes leaves the blocks to the lease."""
    h = holds()
    hold(h, "r", 10, 0)
    assert claim(h, 1, "r", "a", now=0, readers=2).kind == "grant"
    assert not h.done(1, "r", "a")  # the other worker has not read yet
    assert claim(h, 2, "r", "b", now=1, readers=2).kind == "grant"
    assert h.done(2, "r", "b")
    g = holds()
    hold(g, "r", 10, 0)
    assert claim(g, 1, "r", "a", now=0, readers=2).kind == "grant"
    assert claim(g, 1, "r", "c", now=0, readers=2).kind == "grant"  # the same worker again
    assert not g.done(1, "r", "a") and not g.done(1, "r", "c")
    assert tick(g, 5.1) == [] and tick(g, 10.1) == ["r"]  # the lease, then


def test_done_and_free_are_bound_to_the_claimer_and_the_key() -> None:
    h = holds()
    hold(h, "r", 10, 0)
    claim(h, 1, "r", "n", now=0)
    assert h.done(2, "r", "n") is False  # another cluster
    assert h.done(1, "r", "other") is False  # another claim
    assert free(h, 2, "r", "guess", 0) is False
    assert free(h, 1, "r", key("r"), 0) is False  # a claim still reads it
    assert h.held("r")
    assert h.done(1, "r", "n") is True


def test_each_grant_counts() -> None:
    h = holds()
    hold(h, "r", 10, 0)
    claim(h, 1, "r", "a", now=0)
    claim(h, 1, "r", "b", now=0)
    claim(h, 2, "r", "a", now=0)
    assert not h.done(1, "r", "a") and not h.done(2, "r", "a")
    assert h.done(1, "r", "b")


def test_the_claimers_deadline_holds_past_the_lease_then_expires() -> None:
    h = holds()
    hold(h, "r", 1, 0)
    claim(h, 1, "r", "n", now=0.5, ttl=30)
    assert tick(h, 10) == []
    assert h.next_deadline() == 30.5
    assert tick(h, 30.5) == ["r"]
    assert h.expired == 1
    assert claim(h, 1, "r", "m", now=31).kind == "refused"  # late


def test_an_unclaimed_lease_expires_and_free_releases_early() -> None:
    h = holds()
    hold(h, "a", 5, 0)
    hold(h, "b", 5, 0)
    assert free(h, 9, "b", key("b"), 0) is True
    assert tick(h, 5) == ["a"]
    assert len(h) == 0 and h.expired == 1


def test_free_before_the_hand_over_releases_with_it() -> None:
    h = holds()
    assert free(h, 9, "r", key("r"), 0) is False
    assert hold(h, "r", 30, 1) is True


def test_a_repeated_hold_changes_nothing() -> None:
    h = holds()
    hold(h, "r", 5, 0)
    assert h.hold("r", [1], 500, UNTIL, 0) is False
    assert claim(h, 1, "r", "n", now=0).kind == "grant"
    assert h.next_deadline() == 5
    assert tick(h, 4.9) == []
    assert tick(h, 5) == ["r"]  # the first hold's lease, not 500 s


def test_requests_claimed_before_hand_over_are_bounded() -> None:
    h = holds(max_pending=3)
    for i in range(3):
        assert claim(h, 1, f"r{i}", "n", now=0).kind == "grant"
    assert claim(h, 1, "r9", "n", now=0).kind == "refused" and len(h) == 3
    assert free(h, 1, "r8", key("r8"), 0) is False and len(h) == 3


def test_a_released_id_is_remembered_until_its_key_expires() -> None:
    h = holds()
    until = 1000  # ms
    blocks = [1, 2]
    k = grant_key(SECRET, "old", 2, blocks_digest(blocks), until)
    h.hold("old", blocks, 0, until, 0)
    assert h.tick(0, wall_ms=0) == ["old"]
    for i in range(70_000):  # many releases since: it is not forgotten for them
        h.hold(f"r{i}", [1], 0, until + 10**6, 0)
    h.tick(0, wall_ms=0)
    a = h.claim(1, "old", "n", k, 5, 0, 2, 2, blocks_digest(blocks), until, 1, wall_ms=999)
    assert a.kind == "refused"
    assert h.released_count() == 70_001
    h.tick(2, wall_ms=1000)  # its key expired: forgotten, and refused all the same
    assert h.released_count() == 70_000
    a = h.claim(1, "old", "n", k, 5, 0, 2, 2, blocks_digest(blocks), until, 2, wall_ms=1000)
    assert a.kind == "refused" and len(h) == 0


def test_a_stale_claim_after_the_released_memory_evicted_it_is_refused() -> None:
    """Once a released id fell out of a bounded memory, a claim with its still
    valid key was granted: a read of blocks freed and reused long ago."""
    h = holds()  # the agent's defaults
    d_id = 22  # the decode's cluster
    blocks = [4, 5, 6]
    k = h.key("old", blocks, UNTIL)
    assert not h.hold("old", blocks, 30.0, UNTIL, now=0.0)
    assert h.free(d_id, "old", k, 3, blocks_digest(blocks), UNTIL, 0.0, 0)  # released
    # The prefill serves more requests (each handed over and read).
    for i in range(65536):
        rid = f"r{i}"
        h.hold(rid, [1], 30.0, UNTIL, now=1.0)
        h.free(d_id, rid, h.key(rid, [1], UNTIL), 1, blocks_digest([1]), UNTIL, 1.0, 0)
    h.tick(1.5, 0)
    # A decode request with the old params claims it now.
    a = h.claim(d_id, "old", "n", k, 5.0, 0, 3, 3, blocks_digest(blocks), UNTIL, 2.0, 0)
    assert a.kind == "refused", "granted a read of blocks released (and reused) long ago"


def test_an_expired_key_is_refused_before_the_hand_over() -> None:
    h = holds()
    a = claim(h, 1, "r", "n", now=0, key=key("r", until=500), until_ms=500, wall_ms=500)
    assert a.kind == "refused" and len(h) == 0
    a = claim(h, 1, "r", "n", now=0, key=key("r", until=500), until_ms=500, wall_ms=499)
    assert a.kind == "grant"


def test_one_bogus_message_costs_little_whatever_is_held() -> None:
    """Deadlines are a heap: a done that matches nothing, or a tick with nothing
    due, touches no held request."""
    h = holds()
    for i in range(20_000):
        hold(h, f"h{i}", 600, 0)
    ops = 0
    real = h._schedule

    def counting(rid: str, when: float) -> None:
        nonlocal ops
        ops += 1
        real(rid, when)

    h._schedule = counting  # type: ignore[method-assign]
    assert h.done(9, "nobody", "n") is False and tick(h, 1) == [] and ops == 0


# ------------------------------------------------------------------ random interleavings

ops = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), st.sampled_from("rs")),
        st.tuples(
            st.just("claim"),
            st.sampled_from([1, 2]),
            st.sampled_from("rs"),
            st.sampled_from("ab"),
            st.booleans(),
            st.floats(0.1, 20),
            st.sampled_from([1, 1, 2]),
        ),
        st.tuples(
            st.just("done"), st.sampled_from([1, 2]), st.sampled_from("rs"), st.sampled_from("ab")
        ),
        st.tuples(st.just("free"), st.sampled_from([1, 2]), st.sampled_from("rs"), st.booleans()),
        st.tuples(st.just("tick"), st.floats(0, 10)),
    ),
    max_size=40,
)


@settings(max_examples=1500, deadline=None)
@given(ops)
def test_invariants_under_any_interleaving(seq: list[tuple]) -> None:  # type: ignore[type-arg]
    """Whatever arrives in whatever order: a request is reported released at
    most once, only after its hand-over, never while a granted claim's deadline
    has not passed and its done has not come, and (but for its lease running
    out) never before as many clusters as a claim said read it were done or
    freed it; nothing is granted without the request's key, nor after its
    release."""
    h = holds(pending_ttl=15)
    now = 0.0
    released: set[str] = set()
    handed: set[str] = set()
    live: dict[tuple[int, str, str], float] = {}  # granted claims -> their deadline
    readers: dict[str, int] = {}  # the most readers a granted claim said
    ended: dict[str, set[int]] = {}  # clusters done with (or freeing) a request

    def on_early_release(rid: str) -> None:
        got = ended.get(rid, set())
        assert len(got) >= readers.get(rid, 1), f"{rid} released after {got} of {readers}"
        on_release(rid)

    def on_release(rid: str) -> None:
        assert rid not in released, f"{rid} released twice"
        assert rid in handed, f"{rid} released before its hand-over"
        pinned = [k for k, end in live.items() if k[1] == rid and end > now]
        assert not pinned, f"{rid} released under live grants {pinned}"
        released.add(rid)

    for op in seq:
        kind = op[0]
        if kind == "hold":
            rid = op[1]
            if rid not in released:
                handed.add(rid)
            if hold(h, rid, 5, now):
                on_early_release(rid)
        elif kind == "claim":
            _, src, rid, nonce, good, ttl, n = op
            a = claim(
                h, src, rid, nonce, now, ttl=ttl, key=key(rid) if good else "x", readers=n
            )
            if a.kind == "grant":
                assert good and rid not in released
                k = (src, rid, nonce)
                live[k] = max(live.get(k, 0.0), now + ttl)
                if rid in handed:  # (a record never handed over may be dropped: pending_ttl)
                    readers[rid] = max(readers.get(rid, 1), n)
        elif kind == "done":
            _, src, rid, nonce = op
            if live.pop((src, rid, nonce), None) is not None and rid not in released:
                ended.setdefault(rid, set()).add(src)
            if h.done(src, rid, nonce):
                on_early_release(rid)
        elif kind == "free":
            _, src, rid, good = op
            if good and rid not in released:
                ended.setdefault(rid, set()).add(src)
            if free(h, src, rid, key(rid) if good else "x", now):
                on_early_release(rid)
        else:
            now += op[1]
            for rid in tick(h, now):
                on_release(rid)


# ------------------------------------------------------------------ registration


def test_registration_parts_in_any_order() -> None:
    r = Registration(max_blocks=100, runs_per_part=2)
    assert r.add(5, 1, 2, [[50, 2]]) is None
    assert r.add(5, 0, 2, [[1, 2], [10, 1]]) == [1, 2, 10, 50, 51]


@pytest.mark.parametrize(
    ("part", "parts", "runs", "match"),
    [
        (0, 1, [[0, 10**9]], "more blocks"),
        (0, 1, [[2**40, 1]], "outside"),
        (0, 1, [[-1, 1]], "outside"),
        (0, 1, [[0, 0]], "outside"),
        (0, 1, [[0, 60], [60, 60]], "more blocks"),
        (0, 1, [[0, 1]] * 3, "at most"),
        (0, 10**6, [[0, 1]], "parts"),
        (0, 0, [], "parts"),
        (1, 1, [[0, 1]], "out of range"),
        (0, 1, [["0", 1]], "run"),
        (0, 1, [[0.0, 1]], "run"),
        (0, 1, "x", "at most"),
        ("0", 1, [[0, 1]], "out of range"),
    ],
)
def test_registration_refuses_bad_parts(
    part: object, parts: object, runs: object, match: str
) -> None:
    r = Registration(max_blocks=100, runs_per_part=2)
    with pytest.raises(BadMessage, match=match):
        r.add(5, part, parts, runs)


def test_registration_is_bound_to_its_first_sender_and_counts_across_parts() -> None:
    r = Registration(max_blocks=10, runs_per_part=4)
    assert r.add(5, 0, 3, [[0, 6]]) is None
    with pytest.raises(BadMessage, match="another cluster"):
        r.add(6, 1, 3, [[6, 1]])
    with pytest.raises(BadMessage, match="repeated"):
        r.add(5, 0, 3, [[0, 1]])
    with pytest.raises(BadMessage, match="part count"):
        r.add(5, 1, 2, [[6, 1]])
    with pytest.raises(BadMessage, match="more blocks"):
        r.add(5, 1, 3, [[0, 5]])
    assert r.add(5, 1, 3, [[6, 2]]) is None  # the refused part left nothing behind
    assert r.add(5, 2, 3, [[8, 2]]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_a_request_id_handed_over_again_is_a_new_hand_over() -> None:
    """A released request id handed over again (a resubmitted request, or
    vLLM without request id randomization) is held, granted and reported
    sent like any other; a late claim with the first hand-over's key is
    still refused (before, the second hold was ignored: never reported sent,
    every claim refused)."""
    h = holds()
    assert hold(h, "r", 10, 0) is False
    assert claim(h, 1, "r", "n1", now=1).kind == "grant"
    assert h.done(1, "r", "n1") is True  # the first hand-over: read, released
    until2 = UNTIL + 1
    assert h.hold("r", BLOCKS, 10, until2, 2) is False  # held again
    assert h.held("r")
    a = claim(h, 1, "r", "n2", now=3, key=key("r", until=until2), until_ms=until2)
    assert a.kind == "grant", a
    stale = claim(h, 1, "r", "n3", now=3)  # the first hand-over's params
    assert stale.kind == "refused", stale
    assert h.done(1, "r", "n2") is True  # reported sent again


def renew(
    h: PullHolds, src: int, rid: str, now: float, until: int = UNTIL, wall: int = WALL
) -> bool:
    return h.renew(src, rid, key(rid, until=until), N, D, until, now, wall)


def test_a_decode_holding_the_params_keeps_the_hold_alive() -> None:
    """Renewals (the decode holds the params and will claim) extend the lease
    by a full lease each, from when they come; without them it ends on time."""
    h = holds()
    assert hold(h, "r", 10, 0) is False
    assert renew(h, 1, "r", now=8) is True
    assert tick(h, 12) == []  # past the first lease: renewed
    assert renew(h, 2, "r", now=17) is True  # any holder of the params
    assert tick(h, 26) == [] and h.held("r")
    assert tick(h, 27.5) == ["r"]  # no renewal for a lease: released
    assert h.expired == 1
    assert renew(h, 1, "r", now=28) is False  # released stays released
    assert claim(h, 1, "r", "n", now=28).kind == "refused"


def test_a_renewal_needs_the_key_and_never_passes_its_expiry() -> None:
    h = holds()
    until = 15_000  # the key's expiry: 15 s of wall clock from WALL = 0
    assert h.hold("r", BLOCKS, 10, until, 0) is False
    bad = h.renew(1, "r", "f" * 32, N, D, until, 8, WALL)
    assert bad is False
    assert renew(h, 1, "r", now=8, until=until, wall=8000) is True  # to 18, capped at 15
    assert tick(h, 14.9) == [] and tick(h, 15.1) == ["r"]
    assert renew(h, 1, "x", now=1) is False  # never handed over here: nothing
