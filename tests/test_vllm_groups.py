"""``aiokvcache.integrations._vllm_groups``: which blocks of each vLLM KV cache
group move, and how a decode request's blocks pair with the prefill's. No vLLM
here: the specs are stand-ins with vLLM's class names."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvcache.integrations._vllm_groups import KVGroups, block_groups, flat_blocks

BS = 32


@dataclass
class FullAttentionSpec:
    block_size: int = BS


@dataclass
class SlidingWindowSpec:
    sliding_window: int
    block_size: int = BS


@dataclass
class MambaSpec:
    block_size: int = BS


def config(*specs: Any) -> Any:
    return SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_one_full_attention_group_is_plain_and_its_digest_part_empty() -> None:
    g = KVGroups.of(config(FullAttentionSpec()), BS)
    assert g.plain and g.described == "" and g.windows == (0,)
    assert KVGroups.of(None, BS).plain


def test_a_sliding_window_keeps_its_last_blocks_and_drops_freed_ones() -> None:
    g = KVGroups.of(config(SlidingWindowSpec(2 * BS), FullAttentionSpec()), BS)
    assert not g.plain and g.described == "sw64,full" and g.windows == (3, 0)
    # vLLM freed the out-of-window blocks (null, id 0) before the hand-over.
    assert g.clip([[0, 0, 0, 6, 2, 1], [3, 4, 7, 8, 9, 10]]) == [[6, 2, 1], [3, 4, 7, 8, 9, 10]]
    assert g.clip([[0, 0, 0, 0, 2, 1], [3, 4, 7, 8, 9, 10]]) == [[2, 1], [3, 4, 7, 8, 9, 10]]
    assert g.clip([[5], [6]]) == [[5], [6]]
    with pytest.raises(ValueError, match="1 block lists for 2 KV cache groups"):
        g.clip([[1, 2]])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (MambaSpec(), "this model has a MambaSpec group"),
        (FullAttentionSpec(block_size=16), "block size 16"),
    ],
)
def test_groups_it_cannot_move_are_refused_naming_them(spec: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVGroups.of(config(FullAttentionSpec(), spec), BS)


def test_pair_full_attention_by_position_and_a_window_from_the_end() -> None:
    g = KVGroups.of(config(SlidingWindowSpec(2 * BS), FullAttentionSpec()), BS)
    remote = [[16, 12, 11], [13, 14, 17, 18, 19, 20]]
    # The decode's own lists: its first block is in its prefix cache (first=1),
    # and its allocator kept four window blocks, one more than the prefill's.
    local = [[0, 0, 35, 32, 31, 30], [40, 41, 42, 43, 44, 45]]
    flat, picks, into = g.pair(local, 1, 6, remote)
    assert flat == [16, 12, 11, 13, 14, 17, 18, 19, 20]
    assert [flat[i] for i in picks] == [16, 12, 11, 14, 17, 18, 19, 20]
    assert into == [32, 31, 30, 41, 42, 43, 44, 45]


def test_pair_refuses_blocks_the_prefill_does_not_have() -> None:
    g = KVGroups.of(config(SlidingWindowSpec(2 * BS), FullAttentionSpec()), BS)
    with pytest.raises(ValueError, match="are 1 KV cache groups, this instance's 2"):
        g.pair([[1], [2]], 0, 1, [[5, 6]])
    with pytest.raises(ValueError, match=r"blocks \[0, 3\) of a request of 2 remote blocks"):
        g.pair([[1, 2, 3], [4, 5, 6]], 0, 3, [[7], [8, 9]])


@pytest.mark.parametrize(
    "bad",
    ["1,2", [[1], "2"], [1, "2"], [1, True], [1, -1], [1, 2.0], [[1, 2], [3, None]], [1 << 62]],
)
def test_a_peers_block_ids_of_any_other_shape_are_refused(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        block_groups(bad)


def test_block_ids_flat_or_per_group() -> None:
    assert block_groups([1, 2]) == [[1, 2]] and block_groups([]) == [[]]
    assert block_groups(([1], [2, 3])) == [[1], [2, 3]]
    assert flat_blocks([[1], [2, 3]]) == [1, 2, 3] == flat_blocks((1, 2, 3))


ids = st.lists(st.integers(1, 500), max_size=12, unique=True)


@settings(max_examples=200, deadline=None)
@given(
    windows=st.lists(st.sampled_from([0, 0, 2, 3, 5]), min_size=1, max_size=3),
    data=st.data(),
)
def test_pair_reads_each_local_block_once_from_the_prefills_own_list(
    windows: list[int], data: st.DataObject
) -> None:
    """Whatever the lists, each picked index is in the prefill's flat list and
    within its own group, and the picks and their destinations line up: a
    full-attention group reads position for position, a window group the
    prefill's last blocks into the decode's last ones, never more than the
    window's."""
    specs = [SlidingWindowSpec((w - 1) * BS) if w else FullAttentionSpec() for w in windows]
    g = KVGroups.of(config(*specs), BS)
    n = data.draw(st.integers(1, 10))
    first = data.draw(st.integers(0, n - 1))
    local = [data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n)) for _ in windows]
    remote = [data.draw(ids) for _ in windows]
    try:
        flat, picks, into = g.pair(local, first, n, remote)
    except ValueError:
        assert any(not w and len(r) < n for w, r in zip(windows, remote, strict=True))
        return
    assert flat == [b for r in remote for b in r]
    assert len(picks) == len(into)
    off = 0
    got = 0
    for w, r, mine in zip(windows, remote, local, strict=True):
        sel = [i - off for i in picks[got:] if off <= i < off + len(r)]
        if not w:
            assert sel == list(range(first, n)) and into[got : got + len(sel)] == mine[first:n]
        else:
            assert sel == list(range(len(r) - len(sel), len(r)))
            assert len(sel) <= w and into[got : got + len(sel)] == mine[first:n][-len(sel) or n :]
        got += len(sel)
        off += len(r)
    assert got == len(picks)
