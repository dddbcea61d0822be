"""Copies between caches of this instance: ``copy_cache``, ``copy_blocks``, ``swap_blocks``.

Each is checked against the caches' layouts, then runs in a worker thread
under a lease on the caches it touches (:func:`_in_thread`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..._loader import native
from ..._loopside import LoopSide
from ..memory.state import LocalCache, State
from ..model.errors import LLMStatusCode, make_error, param_invalid
from . import planner

__all__ = ["LocalCopies"]

Pairs = list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]
"""(destination, source) views, one pair per tensor."""


def _block_view(addr: int, nb: int, bs: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(native.buffer_from_address(addr, nb * bs), np.uint8).reshape(nb, bs)


def _copy_blocks_all(pairs: Pairs, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> None:
    for d, s in pairs:
        d[dst] = s[src]


def _copy_all(views: Pairs) -> None:
    for d, s in views:
        np.copyto(d, s)


async def _in_thread(
    state: State, side: LoopSide, holders: Sequence[LocalCache], fn: Any, *args: Any
) -> None:
    """Copy in a worker thread under a lease on ``holders``.

    A retirement of either cache (or finalize) waits for the lease, so memory
    is not released under the copy; a cancelled caller still waits for the
    copy to finish, so nothing is written after we return. A copy one of
    whose caches was deallocated meanwhile ran to its end, into memory not
    yet released, and raises KV_CACHE_NOT_EXIST, as a transfer would.
    """
    lease = state.lease(holders)
    try:
        await side.in_thread(fn, *args)  # returns only once the copy is done
    finally:
        state.end_lease(lease)
    if state.finalized:
        raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "finalized during the copy")
    gone = next((h for h in holders if not h.valid), None)
    if gone is not None:
        raise make_error(
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            f"cache {gone.cache_id} was deallocated during the copy",
        )


def _slot_views(d: LocalCache, s: LocalCache, db: int, sb: int, off: int, size: int) -> Pairs:
    """The bytes ``copy_cache`` moves, per tensor, checked against both slots."""
    s_off, s_len = planner.slot_spans(s.desc, sb)
    d_off, d_len = planner.slot_spans(d.desc, db)
    if len(s_off) != 1 or len(d_off) != 1:
        raise param_invalid("copy_cache needs batch_dim_index 0 on both caches")
    if size != -1 and size <= 0:
        raise param_invalid(f"size must be -1 or > 0, got {size}")
    length = s_len - off if size == -1 else size
    if off + length > s_len or off + length > d_len or length <= 0:
        raise param_invalid(
            f"offset={off} + size={length} exceeds a slot (src {s_len}, dst {d_len} bytes)"
        )
    views = []
    for ts in range(s.desc.num_tensors):
        src_v = np.frombuffer(
            native.buffer_from_address(s.addrs[ts] + int(s_off[0]) + off, length, True),
            np.uint8,
        )
        dst_v = np.frombuffer(
            native.buffer_from_address(d.addrs[ts] + int(d_off[0]) + off, length), np.uint8
        )
        views.append((dst_v, src_v))
    return views


class LocalCopies:
    """The copies between our own caches, each checked and run off the loop."""

    def __init__(self, state: State, side: LoopSide) -> None:
        self.state = state
        self.side = side

    async def copy_slot(
        self, d: LocalCache, s: LocalCache, db: int, sb: int, off: int, size: int
    ) -> None:
        """``copy_cache`` after its argument checks: both slots checked, then copied."""
        if d.desc.num_tensors != s.desc.num_tensors:
            raise param_invalid(
                f"dst has {d.desc.num_tensors} tensors but src has {s.desc.num_tensors}"
            )
        if db >= d.desc.batch_size:
            raise param_invalid(f"dst_batch_index={db} is out of range ({d.desc.batch_size})")
        if sb >= s.desc.batch_size:
            raise param_invalid(f"src_batch_index={sb} is out of range ({s.desc.batch_size})")
        views = _slot_views(d, s, db, sb, off, size)
        await _in_thread(self.state, self.side, (d, s), _copy_all, views)

    async def copy_blocks(self, rec: LocalCache, srcs: list[int], dsts: list[int]) -> None:
        """``copy_blocks`` after its argument checks: blocks inside one cache,
        every tensor, the ids checked against it first."""
        if not rec.cache.is_blocks_cache:
            raise param_invalid("cache is not a blocks cache")
        nb = planner.num_blocks(rec.desc)
        s_ids = np.asarray(srcs, dtype=np.int64)
        d_ids = np.asarray(dsts, dtype=np.int64)
        planner.check_in_range("copy_block_info (source)", s_ids, nb, "cache")
        planner.check_in_range("copy_block_info (destination)", d_ids, nb, "cache")
        planner.check_unique("copy_block_info (destination)", d_ids, nb)
        both = np.intersect1d(s_ids, d_ids)
        if both.size:
            raise param_invalid(
                f"copy_block_info: block {int(both[0])} is both a source and a destination"
            )
        if not srcs:
            return
        bs = planner.block_bytes(rec.desc)
        views = [_block_view(a, nb, bs) for a in rec.addrs]
        pairs = [(v, v) for v in views]
        await _in_thread(self.state, self.side, (rec,), _copy_blocks_all, pairs, s_ids, d_ids)

    async def swap_blocks(
        self, s: LocalCache, d: LocalCache, srcs: list[int], dsts: list[int]
    ) -> None:
        """``swap_blocks`` after its argument checks: blocks of one cache into
        another, both caches and the ids checked first."""
        if not s.cache.is_blocks_cache:
            raise param_invalid("src_cache is not a blocks cache")
        if not d.cache.is_blocks_cache:
            raise param_invalid("dst_cache is not a blocks cache")
        if s is d:
            raise param_invalid("src_cache and dst_cache are the same cache: use copy_blocks")
        if s.desc.num_tensors != d.desc.num_tensors:
            raise param_invalid(
                f"src_cache has {s.desc.num_tensors} tensors but dst_cache has {d.desc.num_tensors}"
            )
        bs = planner.check_block_sizes(s.desc, d.desc, "src_cache", "dst_cache")
        s_nb, d_nb = planner.num_blocks(s.desc), planner.num_blocks(d.desc)
        s_ids = np.asarray(srcs, dtype=np.int64)
        d_ids = np.asarray(dsts, dtype=np.int64)
        planner.check_in_range("src_to_dst (source)", s_ids, s_nb, "src_cache")
        planner.check_in_range("src_to_dst (destination)", d_ids, d_nb, "dst_cache")
        planner.check_unique("src_to_dst (destination)", d_ids, d_nb)
        if not srcs:
            return
        pairs = [
            (_block_view(da, d_nb, bs), _block_view(sa, s_nb, bs))
            for da, sa in zip(d.addrs, s.addrs, strict=True)
        ]
        await _in_thread(self.state, self.side, (s, d), _copy_blocks_all, pairs, s_ids, d_ids)
