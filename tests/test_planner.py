"""The transfer planner on its own: segment tables from descriptors, no engine.

Each table is checked against a reference computed byte by byte: the rows
must move exactly the bytes the API says (the slot, the layers, the blocks)
and nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiokvcache._core.model.errors import LLMException, LLMStatusCode
from aiokvcache._core.model.types import CacheDesc, DataType, Placement
from aiokvcache._core.transfer import planner

LOCAL_BASE = 1 << 40
REMOTE_BASE = 1 << 41


def desc(shape: list[int], tensors: int = 4, batch_dim: int = 0) -> CacheDesc:
    return CacheDesc(tensors, shape, DataType.DT_FLOAT16, Placement.HOST, batch_dim)


def covered(rows: np.ndarray, col: int) -> set[int]:
    """Every address the rows touch on one side (column 0 local, 1 remote)."""
    out: set[int] = set()
    for r in rows:
        out.update(range(int(r[col]), int(r[col] + r[2])))
    return out


def slot_bytes(d: CacheDesc, base: int, batch: int) -> set[int]:
    """Reference: the bytes of batch slot ``batch`` of a tensor at ``base``."""
    idx = np.arange(d.size // 2).reshape(d.shape)  # fp16 element indices
    sel = np.take(idx, [batch], axis=d.batch_dim_index).ravel()
    return {base + 2 * int(e) + k for e in sel for k in (0, 1)}


def test_slot_spans_batch_first_is_one_span() -> None:
    d = desc([4, 3, 8])  # 4 slots of 3*8*2 = 48 bytes
    off, length = planner.slot_spans(d, 2)
    assert off.tolist() == [96] and length == 48


@pytest.mark.parametrize("batch_dim", [1, 2])
def test_slot_spans_inner_batch_dim_matches_the_reference(batch_dim: int) -> None:
    d = desc([2, 3, 4], batch_dim=batch_dim)
    for b in range(d.shape[batch_dim]):
        off, length = planner.slot_spans(d, b)
        got = {0 + int(o) + k for o in off for k in range(length)}
        assert got == slot_bytes(d, 0, b)


def test_layer_pairs_defaults_and_one_range_given() -> None:
    s, d = desc([2, 8], tensors=8), desc([2, 8], tensors=12)
    assert planner.layer_pairs(2, s, s, None, None, "s", "d") == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert planner.layer_pairs(2, s, d, range(1, 3), None, "s", "d") == [(1, 1), (2, 2)]
    assert planner.layer_pairs(2, d, d, None, range(4, 6), "s", "d") == [(4, 4), (5, 5)]
    assert planner.layer_pairs(2, s, d, range(0, 2), range(4, 6), "s", "d") == [(0, 4), (1, 5)]


@pytest.mark.parametrize(
    "n,src,dst,match",
    [
        (3, None, None, "must divide"),
        (2, range(0, 5), None, "exceeds the 4 layers of s"),
        (2, range(0, 2), range(0, 3), "same length"),
        (2, range(0, 2), range(3, 5), "exceeds the 4 layers of d"),
    ],
)
def test_layer_pairs_refuses_bad_ranges(
    n: int, src: range | None, dst: range | None, match: str
) -> None:
    s = desc([2, 8], tensors=8)
    with pytest.raises(LLMException, match=match) as ei:
        planner.layer_pairs(n, s, s, src, dst, "s", "d")
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_slot_layer_rows_move_exactly_the_slot_of_each_tensor(batch_dim: int) -> None:
    src = desc([3, 4, 8], tensors=4, batch_dim=batch_dim)
    dst = desc([3, 4, 8], tensors=6, batch_dim=batch_dim)
    s_addrs = [LOCAL_BASE + i * src.size for i in range(4)]
    d_addrs = [REMOTE_BASE + i * dst.size for i in range(6)]
    l_off, r_off, length = planner.pair_spans(src, 1, dst, 2, -1)
    # source layer 1 (tensors 2, 3) -> destination layer 2 (tensors 4, 5)
    rows = planner.slot_layer_rows(
        s_addrs, d_addrs, [7] * 6, range(2, 4), range(4, 6), l_off, r_off, length
    )
    assert rows.dtype == np.uint64 and rows.shape[1] == 4
    assert set(rows[:, 3].tolist()) == {7}
    assert covered(rows, 0) == slot_bytes(src, s_addrs[2], 1) | slot_bytes(src, s_addrs[3], 1)
    assert covered(rows, 1) == slot_bytes(dst, d_addrs[4], 2) | slot_bytes(dst, d_addrs[5], 2)
    # byte k of the source slot lands on byte k of the destination slot
    moved = {int(r[0]) + k: int(r[1]) + k for r in rows for k in range(int(r[2]))}
    for lt, rt in ((2, 4), (3, 5)):
        want = zip(
            sorted(slot_bytes(src, s_addrs[lt], 1)),
            sorted(slot_bytes(dst, d_addrs[rt], 2)),
            strict=True,
        )
        assert all(moved[a] == b for a, b in want)


def test_pair_spans_size_and_layout_checks() -> None:
    a, b = desc([2, 16]), desc([2, 8])
    _, _, length = planner.pair_spans(b, 0, a, 1, -1)
    assert length == 16
    with pytest.raises(LLMException, match="does not fit"):
        planner.pair_spans(a, 0, b, 0, -1)
    with pytest.raises(LLMException, match="different layouts"):
        planner.pair_spans(desc([2, 3, 4], batch_dim=1), 0, desc([2, 4, 3], batch_dim=1), 0, -1)


def test_blocks_plan_merges_runs_consecutive_on_both_sides() -> None:
    src = np.array([0, 1, 2, 7, 9], dtype=np.int64)
    dst = np.array([4, 5, 6, 1, 2], dtype=np.int64)
    plan = planner.blocks_plan(src, dst, 64)
    assert plan.local_off.tolist() == [0, 7 * 64, 9 * 64]
    assert plan.remote_off.tolist() == [4 * 64, 64, 128]
    assert plan.length.tolist() == [192, 64, 64]


def test_blocks_layer_rows_match_the_block_mapping() -> None:
    nb, bs = 16, 32
    rng = np.random.default_rng(5)
    src = rng.permutation(nb)[:10].astype(np.int64)
    dst = rng.permutation(nb)[:10].astype(np.int64)
    plan = planner.blocks_plan(src, dst, bs)
    rows = planner.layer_rows(plan, [LOCAL_BASE, LOCAL_BASE + nb * bs], [REMOTE_BASE] * 2, [1, 2])
    moved = {}
    for r in rows:
        for k in range(int(r[2])):
            moved[int(r[0]) + k] = (int(r[1]) + k, int(r[3]))
    for t, key in ((0, 1), (1, 2)):
        for s_b, d_b in zip(src, dst, strict=True):
            for k in range(bs):
                local = LOCAL_BASE + t * nb * bs + int(s_b) * bs + k
                assert moved.pop(local) == (REMOTE_BASE + int(d_b) * bs + k, key)
    assert not moved  # nothing beyond the listed blocks


def test_slot_blocks_plan_splits_a_slot_over_blocks_last_one_partial() -> None:
    ids = np.array([3, 4, 0], dtype=np.int64)
    plan = planner.slot_blocks_plan(100, 70, ids, 32, blocks_local=False)
    # slot bytes [0,64) -> blocks 3,4 (one run), [64,70) -> block 0
    assert plan.local_off.tolist() == [100, 164]
    assert plan.remote_off.tolist() == [96, 0]
    assert plan.length.tolist() == [64, 6]
    flipped = planner.slot_blocks_plan(100, 70, ids, 32, blocks_local=True)
    assert flipped.local_off.tolist() == plan.remote_off.tolist()
    assert flipped.remote_off.tolist() == plan.local_off.tolist()


def test_block_checks_name_the_argument() -> None:
    ids = planner.block_ids("dst_blocks", [1, 2, 2])
    with pytest.raises(LLMException, match="dst_blocks names block 2 more than once"):
        planner.check_unique("dst_blocks", ids, 8)
    with pytest.raises(LLMException, match="src_blocks holds block id 9"):
        planner.check_in_range("src_blocks", np.array([1, 9]), 8, "src_cache")
    with pytest.raises(LLMException, match="fills 3 blocks"):
        planner.check_block_count("dst_blocks", ids[:2], 70, 32)
    with pytest.raises(TypeError, match="src_blocks"):
        planner.block_ids("src_blocks", [1.5])
    with pytest.raises(LLMException, match="blocks of 16 bytes"):
        planner.check_block_sizes(desc([4, 8]), desc([2, 4]), "src_cache", "dst_cache")


def test_slot_span_refuses_non_contiguous_slots() -> None:
    with pytest.raises(LLMException, match="not contiguous"):
        planner.slot_span(desc([2, 3, 4], batch_dim=1), 0, "the remote cache")
    assert planner.slot_span(desc([3, 8]), 2, "x") == (32, 16)
