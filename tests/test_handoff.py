"""The vLLM connector's hand-off state machines (``integrations/_handoff.py``)
alone: no vLLM, no network, no clock but the one the tests pass. Duplicated,
reordered and forged messages, and random interleavings checked against the
protocol's invariants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvcache.integrations._handoff import (
    Answer,
    ProtocolError,
    PullHolds,
    Registration,
    blocks_digest,
    grant_key,
)

BLOCKS = [4, 5, 6, 7]
N, D = len(BLOCKS), blocks_digest(BLOCKS)
SECRET = b"s" * 32


def holds(**kw: float) -> PullHolds:
    return PullHolds(SECRET, **kw)  # type: ignore[arg-type]


def key(rid: str, blocks: list[int] = BLOCKS) -> str:
    return grant_key(SECRET, rid, len(blocks), blocks_digest(blocks))


def claim(h: PullHolds, src: int, rid: str, nonce: str, now: float, **kw: Any) -> Answer:
    args: dict[str, Any] = {"key": key(rid), "ttl": 5.0, "first": 0, "last": N, "n": N, "digest": D}
    args.update(kw)
    return h.claim(src, rid, nonce, now=now, **args)


def test_the_key_is_a_mac_of_the_request_and_its_blocks() -> None:
    assert key("r") == key("r") != key("s")
    assert key("r") != key("r", [4, 5, 6, 8]) != key("r", [4, 5, 6])
    assert grant_key(b"t" * 32, "r", N, D) != key("r")
    assert holds().key("r", BLOCKS) == key("r")


def test_grant_then_done_releases_once() -> None:
    h = holds()
    assert h.hold("r", BLOCKS, 10, now=0) is False
    a = claim(h, 1, "r", "n", now=1)
    assert a.kind == "grant" and (a.to, a.rid, a.nonce) == (1, "r", "n")
    assert h.done(1, "r", "n") is True
    assert h.done(1, "r", "n") is False  # duplicated
    assert not h.held("r") and h.tick(100) == []


def test_a_claim_before_the_hand_over_is_granted_and_released_after_it() -> None:
    h = holds()
    assert claim(h, 1, "r", "n", now=0, first=1, last=3).kind == "grant"
    assert h.claims("r") == {(1, "n")} and not h.held("r")
    assert h.done(1, "r", "n") is False  # read, but not handed over: not reported
    assert h.hold("r", BLOCKS, 10, now=1) is True  # released as it arrives


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
    assert h.tick(5) == [] and len(h) == 1
    assert h.next_deadline() == 50
    assert h.tick(50) == [] and len(h) == 0  # dropped, never reported


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
    ],
)
def test_bad_claims_are_refused(bad: dict[str, Any]) -> None:
    h = holds()
    h.hold("r", BLOCKS, 10, now=0)
    assert claim(h, 1, "r", "n", now=0, **bad).kind == "refused"
    assert h.claims("r") == set()
    g = holds()  # and before the hand-over
    assert claim(g, 1, "r", "n", now=0, **bad).kind == "refused"


def test_done_and_free_are_bound_to_the_claimer_and_the_key() -> None:
    h = holds()
    h.hold("r", BLOCKS, 10, now=0)
    claim(h, 1, "r", "n", now=0)
    assert h.done(2, "r", "n") is False  # another cluster
    assert h.done(1, "r", "other") is False  # another claim
    assert h.free(2, "r", "guess", N, D, now=0) is False
    assert h.free(1, "r", key("r"), N, D, now=0) is False  # a claim still reads it
    assert h.held("r")
    assert h.done(1, "r", "n") is True


def test_each_grant_counts() -> None:
    h = holds()
    h.hold("r", BLOCKS, 10, now=0)
    claim(h, 1, "r", "a", now=0)
    claim(h, 1, "r", "b", now=0)
    claim(h, 2, "r", "a", now=0)
    assert not h.done(1, "r", "a") and not h.done(2, "r", "a")
    assert h.done(1, "r", "b")


def test_the_claimers_deadline_holds_past_the_lease_then_expires() -> None:
    h = holds()
    h.hold("r", BLOCKS, 1, now=0)
    claim(h, 1, "r", "n", now=0.5, ttl=30)
    assert h.tick(10) == []
    assert h.next_deadline() == 30.5
    assert h.tick(30.5) == ["r"]
    assert h.expired == 1
    assert claim(h, 1, "r", "m", now=31).kind == "refused"  # late


def test_an_unclaimed_lease_expires_and_free_releases_early() -> None:
    h = holds()
    h.hold("a", BLOCKS, 5, now=0)
    h.hold("b", BLOCKS, 5, now=0)
    assert h.free(9, "b", key("b"), N, D, now=0) is True
    assert h.tick(5) == ["a"]
    assert len(h) == 0 and h.expired == 1


def test_free_before_the_hand_over_releases_with_it() -> None:
    h = holds()
    assert h.free(9, "r", key("r"), N, D, now=0) is False
    assert h.hold("r", BLOCKS, 30, now=1) is True


def test_a_repeated_hold_changes_nothing() -> None:
    h = holds()
    h.hold("r", BLOCKS, 5, now=0)
    assert h.hold("r", [1], 500, now=0) is False
    assert claim(h, 1, "r", "n", now=0).kind == "grant"
    assert h.next_deadline() == 5
    assert h.tick(4.9) == []
    assert h.tick(5) == ["r"]  # the first hold's lease, not 500 s


def test_requests_claimed_before_hand_over_are_bounded() -> None:
    h = holds(max_pending=3)
    for i in range(3):
        assert claim(h, 1, f"r{i}", "n", now=0).kind == "grant"
    assert claim(h, 1, "r9", "n", now=0).kind == "refused" and len(h) == 3
    assert h.free(1, "r8", key("r8"), N, D, now=0) is False and len(h) == 3


def test_released_ids_are_remembered_boundedly() -> None:
    h = holds(max_released=2)
    for rid in "abc":
        h.hold(rid, BLOCKS, 0, now=0)
    assert h.tick(0) == ["a", "b", "c"]
    assert h.hold("a", BLOCKS, 5, now=1) is False
    assert h.held("a")  # forgotten, so a re-used id is a new request
    assert h.hold("c", BLOCKS, 5, now=1) is False and not h.held("c")


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
    has not passed and its done has not come; nothing is granted without the
    request's key, nor after its release."""
    h = holds(pending_ttl=15)
    now = 0.0
    released: set[str] = set()
    handed: set[str] = set()
    live: dict[tuple[int, str, str], float] = {}  # granted claims -> their deadline

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
            if h.hold(rid, BLOCKS, 5, now):
                on_release(rid)
        elif kind == "claim":
            _, src, rid, nonce, good, ttl = op
            a = claim(h, src, rid, nonce, now, ttl=ttl, key=key(rid) if good else "x")
            if a.kind == "grant":
                assert good and rid not in released
                k = (src, rid, nonce)
                live[k] = max(live.get(k, 0.0), now + ttl)
        elif kind == "done":
            _, src, rid, nonce = op
            live.pop((src, rid, nonce), None)
            if h.done(src, rid, nonce):
                on_release(rid)
        elif kind == "free":
            _, src, rid, good = op
            if h.free(src, rid, key(rid) if good else "x", N, D, now):
                on_release(rid)
        else:
            now += op[1]
            for rid in h.tick(now):
                on_release(rid)


# ------------------------------------------------------------------ registration


def test_registration_parts_in_any_order() -> None:
    r = Registration(num_blocks=100, runs_per_part=2)
    assert r.add(5, 1, 2, [[50, 2]]) is None
    assert r.add(5, 0, 2, [[1, 2], [10, 1]]) == [1, 2, 10, 50, 51]


@pytest.mark.parametrize(
    ("part", "parts", "runs", "match"),
    [
        (0, 1, [[0, 10**9]], "outside"),
        (0, 1, [[99, 2]], "outside"),
        (0, 1, [[-1, 1]], "outside"),
        (0, 1, [[0, 0]], "outside"),
        (0, 1, [[0, 60], [60, 60]], "outside|more blocks"),
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
    r = Registration(num_blocks=100, runs_per_part=2)
    with pytest.raises(ProtocolError, match=match):
        r.add(5, part, parts, runs)


def test_registration_is_bound_to_its_first_sender_and_counts_across_parts() -> None:
    r = Registration(num_blocks=10, runs_per_part=4)
    assert r.add(5, 0, 3, [[0, 6]]) is None
    with pytest.raises(ProtocolError, match="another cluster"):
        r.add(6, 1, 3, [[6, 1]])
    with pytest.raises(ProtocolError, match="repeated"):
        r.add(5, 0, 3, [[0, 1]])
    with pytest.raises(ProtocolError, match="part count"):
        r.add(5, 1, 2, [[6, 1]])
    with pytest.raises(ProtocolError, match="more blocks"):
        r.add(5, 1, 3, [[0, 5]])
    assert r.add(5, 1, 3, [[6, 2]]) is None  # the refused part left nothing behind
    assert r.add(5, 2, 3, [[8, 2]]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
