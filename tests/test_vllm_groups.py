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
        g.pair([[1, 2, 3], [4, 5, 6]], 0, 3, [[7, 8], [8, 9]], remote_blocks=3)
    with pytest.raises(ValueError, match="3 window blocks of a request of 2"):
        g.pair([[1, 2], [4, 5]], 0, 2, [[7, 8, 9], [8, 9]])
    # The prefill ran past the decode (5 blocks to its 3): its window no
    # longer holds positions 1 and 2, which the decode's window needs.
    with pytest.raises(ValueError, match=r"window block 1: the prefill holds positions \[3, 5\)"):
        g.pair([[1, 2, 3], [4, 5, 6]], 0, 3, [[7, 8], [9, 10, 11, 12, 13]])


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


def pos_id(side: int, g: int, p: int) -> int:
    """A block id that names its side (1: prefill, 2: decode), group and position."""
    return side * 100_000 + g * 1000 + p + 1


@settings(max_examples=300, deadline=None)
@given(
    windows=st.lists(st.sampled_from([0, 0, 2, 3, 5]), min_size=1, max_size=3),
    data=st.data(),
)
def test_pair_reads_each_position_from_the_prefills_block_of_that_position(
    windows: list[int], data: st.DataObject
) -> None:
    """Whatever the lists' lengths (the prefill's ending at its own last
    position, which may be past the decode's; a window kept whole or cut
    short, a decode with freed blocks), every block read lands in the decode's
    block of the same group and position; a full-attention group reads every
    position of ``[first, last)``, a window group at most its window. A load
    that does not fail reads every window position the decode's first window
    needs; one that fails had such a position the prefill no longer holds."""
    specs = [SlidingWindowSpec((w - 1) * BS) if w else FullAttentionSpec() for w in windows]
    g = KVGroups.of(config(*specs), BS)
    last = data.draw(st.integers(1, 10))
    first = data.draw(st.integers(0, last - 1))
    rblocks = last + data.draw(st.sampled_from([0, 0, 0, 1, 2]))  # the prefill's positions
    end = data.draw(st.integers((last - 1) * BS + 1, last * BS))  # the decode's tokens
    remote, local = [], []
    for gi, w in enumerate(windows):
        if w:
            held = data.draw(st.integers(0, min(w, rblocks)))
            remote.append([pos_id(1, gi, p) for p in range(rblocks - held, rblocks)])
            freed = data.draw(st.integers(0, last))  # the decode's own null blocks at the front
            local.append([0 if p < freed else pos_id(2, gi, p) for p in range(last)])
        else:
            remote.append([pos_id(1, gi, p) for p in range(rblocks)])
            local.append([pos_id(2, gi, p) for p in range(last)])
    try:
        flat, picks, into = g.pair(local, first, last, remote, rblocks, end)
    except ValueError:
        failed = True
    else:
        failed = False
        assert flat == [b for r in remote for b in r] and len(picks) == len(into)
        for i, dst in zip(picks, into, strict=True):
            assert flat[i] - 100_000 == dst - 200_000, (flat[i], dst)  # group and position
    for gi, w in enumerate(windows):
        got = into if not failed else []
        mine = [(b - 200_000) % 1000 - 1 for b in got if b // 1000 % 100 == gi]
        if not w:
            assert failed or mine == list(range(first, last))
            continue
        kept = [p for p in range(first, last) if local[gi][p]][-w:]
        held = {(b - 100_000) % 1000 - 1 for b in remote[gi]}
        need = max(0, end - (w - 1) * BS) // BS
        missing = [p for p in kept if p >= need and p not in held]
        if failed:
            continue
        assert not missing and mine == [p for p in kept if p in held]
    if failed:
        assert any(
            p >= max(0, end - (w - 1) * BS) // BS and p not in {(b - 100_000) % 1000 - 1 for b in r}
            for w, r, loc in zip(windows, remote, local, strict=True)
            if w
            for p in [q for q in range(first, last) if loc[q]][-w:]
        )


def test_pair_a_window_by_position_when_the_prefill_holds_blocks_past_the_decodes_last() -> None:
    """A prefill request that finished with more blocks than the decode loads
    (it generated past a block boundary: max_tokens > 1 with a prompt of whole
    blocks, or a lookahead/speculative slot; or params whose
    ``remote_num_tokens`` is below the prefill's block count) hands over a
    window group clipped from *its* end. Pairing that from the decode's end
    shifts every window block by the difference: decode position p gets the
    prefill's position p + 1, and the load is reported fine.

    Block ids below encode their position: full ``10 + p``, window ``20 + p``
    (prefill), ``100 + p`` / ``200 + p`` (decode)."""
    g = KVGroups.of(config(FullAttentionSpec(), SlidingWindowSpec(BS)), BS)  # window: 2 blocks
    remote = [[10, 11, 12, 13, 14], [23, 24]]  # 5 blocks; the window kept positions 3, 4
    local = [[100, 101, 102, 103], [0, 0, 202, 203]]  # the decode loads positions [0, 4)
    flat, picks, into = g.pair(local, 0, 4, remote)
    for i, dst in zip(picks, into, strict=True):
        src = flat[i]
        src_pos = src - 10 if src < 20 else src - 20
        dst_pos = dst - 100 if dst < 200 else dst - 200
        assert src_pos == dst_pos, f"decode position {dst_pos} reads prefill position {src_pos}"


def test_push_registers_the_window_from_the_block_the_next_token_attends_to() -> None:
    """Push: a full-attention group from the prefix-cache hit, a window of 8
    tokens (blocks of 4) from ``(end - 8 + 1) // 4``: the blocks vLLM keeps
    until the prefill request ends, and all the decode's next token reads."""
    g = KVGroups((3, 0), "sw8,full", (8, 0), 4)
    local = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]
    assert g.push_spans(local, 0, 6, 22) == ([13, 14, 15, *local[1]], [[3, 3], [0, 6]])
    assert g.push_spans(local, 0, 6, 23) == ([14, 15, *local[1]], [[4, 2], [0, 6]])
    # A prefix hit past the window's start: both groups from the hit.
    assert g.push_spans(local, 4, 6, 22) == ([14, 15, 24, 25], [[4, 2], [4, 2]])
    assert g.push_spans(local, 0, 2, 5) == ([10, 11, 20, 21], [[0, 2], [0, 2]])
    with pytest.raises(ValueError, match="no block of its own"):
        g.push_spans([[10, 11, 12, 0, 14, 15], local[1]], 0, 6, 22)
    with pytest.raises(ValueError, match="block lists"):
        g.push_spans(local[:1], 0, 6, 22)
