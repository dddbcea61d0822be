"""The vLLM connector's hand-off state machines (``integrations/_handoff.py``)
alone: no vLLM, no network, no clock but the one the tests pass. Duplicated,
reordered and forged messages, and random interleavings checked against the
protocol's invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvcache.integrations._handoff import (
    ProtocolError,
    PullHolds,
    Registration,
    blocks_digest,
)

BLOCKS = [4, 5, 6, 7]
D = blocks_digest(BLOCKS)


def holds(**kw: float) -> PullHolds:
    return PullHolds(claim_wait=kw.pop("claim_wait", 1.0), **kw)  # type: ignore[arg-type]


def test_grant_then_done_releases_once() -> None:
    h = holds()
    assert h.hold("r", BLOCKS, "k", 10, now=0) == []
    a = h.claim(1, "r", "n", "k", 5, 0, 4, D, now=1)
    assert a is not None and a.kind == "grant" and (a.to, a.rid, a.nonce) == (1, "r", "n")
    assert h.done(1, "r", "n") is True
    assert h.done(1, "r", "n") is False  # duplicated
    assert not h.held("r") and h.tick(100) == ([], [])


def test_a_claim_before_the_hold_waits_and_is_answered_by_it() -> None:
    h = holds(claim_wait=2)
    assert h.claim(1, "r", "n", "k", 5, 1, 3, D, now=0) is None
    (a,) = h.hold("r", BLOCKS, "k", 10, now=1)
    assert a.kind == "grant"
    assert h.claims("r") == {(1, "n")}


def test_a_claim_waits_at_most_claim_wait_then_is_refused() -> None:
    h = holds(claim_wait=2)
    assert h.claim(1, "r", "n", "k", 5, 0, 4, D, now=0) is None
    assert h.next_deadline() == 2
    released, refused = h.tick(2)
    assert released == [] and [a.kind for a in refused] == ["refused"]
    assert h.hold("r", BLOCKS, "k", 10, now=3) == []  # nobody waits any more


def test_a_claim_waits_no_longer_than_its_own_deadline() -> None:
    h = holds(claim_wait=30)
    assert h.claim(1, "r", "n", "k", 0.5, 0, 4, D, now=0) is None
    assert h.next_deadline() == 0.5


@pytest.mark.parametrize(
    ("key", "first", "last", "digest", "ttl"),
    [
        ("guess", 0, 4, D, 5),
        ("k", 0, 4, blocks_digest([4, 5, 6, 8]), 5),
        ("k", 0, 5, D, 5),
        ("k", 2, 2, D, 5),
        ("k", -1, 2, D, 5),
        ("k", 0, 4, D, 0),
        ("k", 0, 4, D, float("inf")),
        ("k", 0, 4, D, float("nan")),
        ("k", 0, 4, D, 10**9),
        ("k", 0.0, 4, D, 5),
    ],
)
def test_bad_claims_are_refused(key: str, first: int, last: int, digest: str, ttl: float) -> None:
    h = holds()
    h.hold("r", BLOCKS, "k", 10, now=0)
    a = h.claim(1, "r", "n", key, ttl, first, last, digest, now=0)
    assert a is not None and a.kind == "refused", a
    assert h.claims("r") == set()


def test_done_and_free_are_bound_to_the_claimer_and_the_key() -> None:
    h = holds()
    h.hold("r", BLOCKS, "k", 10, now=0)
    h.claim(1, "r", "n", "k", 5, 0, 4, D, now=0)
    assert h.done(2, "r", "n") is False  # another cluster
    assert h.done(1, "r", "other") is False  # another claim
    assert h.free(2, "r", "guess") is False
    assert h.free(1, "r", "k") is False  # a claim still reads it
    assert h.held("r")
    assert h.done(1, "r", "n") is True


def test_each_grant_counts() -> None:
    h = holds()
    h.hold("r", BLOCKS, "k", 10, now=0)
    h.claim(1, "r", "a", "k", 5, 0, 4, D, now=0)
    h.claim(1, "r", "b", "k", 5, 0, 4, D, now=0)
    h.claim(2, "r", "a", "k", 5, 0, 4, D, now=0)
    assert not h.done(1, "r", "a") and not h.done(2, "r", "a")
    assert h.done(1, "r", "b")


def test_the_claimers_deadline_holds_past_the_lease_then_expires() -> None:
    h = holds()
    h.hold("r", BLOCKS, "k", 1, now=0)
    h.claim(1, "r", "n", "k", 30, 0, 4, D, now=0.5)
    assert h.tick(10) == ([], [])
    assert h.next_deadline() == 30.5
    assert h.tick(30.5) == (["r"], [])
    assert h.expired == 1
    late = h.claim(1, "r", "m", "k", 5, 0, 4, D, now=31)
    assert late is not None and late.kind == "refused"


def test_an_unclaimed_lease_expires_and_free_releases_early() -> None:
    h = holds()
    h.hold("a", BLOCKS, "k", 5, now=0)
    h.hold("b", BLOCKS, "k2", 5, now=0)
    assert h.free(9, "b", "k2") is True
    assert h.tick(5) == (["a"], [])
    assert len(h) == 0


def test_a_repeated_hold_changes_nothing() -> None:
    h = holds()
    h.hold("r", BLOCKS, "k", 5, now=0)
    h.hold("r", [1], "other", 500, now=0)
    a = h.claim(1, "r", "n", "k", 5, 0, 4, D, now=0)
    assert a is not None and a.kind == "grant"
    assert h.next_deadline() == 5
    assert h.tick(4.9) == ([], [])
    assert h.tick(5) == (["r"], [])  # the first hold's lease, not 500 s


def test_waiting_claims_are_bounded() -> None:
    h = holds(claim_wait=60, max_waiting=3)
    for i in range(3):
        assert h.claim(1, f"r{i}", "n", "k", 5, 0, 4, D, now=0) is None
    a = h.claim(1, "r9", "n", "k", 5, 0, 4, D, now=0)
    assert a is not None and a.kind == "refused" and len(h) == 3


def test_released_ids_are_remembered_boundedly() -> None:
    h = holds(max_released=2)
    for rid in "abc":
        h.hold(rid, BLOCKS, "k", 0, now=0)
    assert h.tick(0)[0] == ["a", "b", "c"]
    assert h.hold("a", BLOCKS, "k", 5, now=1) == []
    assert h.held("a")  # forgotten, so a re-used id is a new request
    assert not h.held("c") and h.hold("c", BLOCKS, "k", 5, now=1) == [] and not h.held("c")


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


@settings(max_examples=300, deadline=None)
@given(ops)
def test_invariants_under_any_interleaving(seq: list[tuple]) -> None:  # type: ignore[type-arg]
    """Whatever arrives in whatever order: a request is released at most once,
    never while a granted claim's deadline has not passed and its done has not
    come, and never granted without its hold and its key, nor after release."""
    h = holds(claim_wait=3)
    now = 0.0
    released: set[str] = set()
    held: set[str] = set()
    live: dict[tuple[int, str, str], float] = {}  # granted claims -> their deadline
    asked: dict[tuple[int, str, str], float] = {}  # claims made -> their deadline

    def on_release(rid: str) -> None:
        assert rid not in released, f"{rid} released twice"
        pinned = [k for k, end in live.items() if k[1] == rid and end > now]
        assert not pinned, f"{rid} released under live grants {pinned}"
        released.add(rid)
        held.discard(rid)

    def on_answers(answers: list) -> None:  # type: ignore[type-arg]
        for a in answers:
            k = (a.to, a.rid, a.nonce)
            if a.kind == "grant":
                assert a.rid in held and a.rid not in released
                live[k] = max(live.get(k, 0.0), asked[k])

    for op in seq:
        kind = op[0]
        if kind == "hold":
            rid = op[1]
            if rid not in released:
                held.add(rid)
            on_answers(h.hold(rid, BLOCKS, "k" + rid, 5, now))
        elif kind == "claim":
            _, src, rid, nonce, good, ttl = op
            asked[src, rid, nonce] = now + ttl
            a = h.claim(src, rid, nonce, ("k" + rid) if good else "x", ttl, 0, 4, D, now)
            if a is not None:
                assert a.kind == "refused" or good
                on_answers([a])
        elif kind == "done":
            _, src, rid, nonce = op
            live.pop((src, rid, nonce), None)
            if h.done(src, rid, nonce):
                on_release(rid)
        elif kind == "free":
            _, src, rid, good = op
            if h.free(src, rid, ("k" + rid) if good else "x"):
                on_release(rid)
        else:
            now += op[1]
            rel, answers = h.tick(now)
            for rid in rel:
                on_release(rid)
            on_answers(answers)


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
