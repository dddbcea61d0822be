"""Paged (blocks) caches: block-id checks and the byte spans a transfer moves.

Everything here is vectorized NumPy: a list of 100,000 block ids costs a
handful of array operations, never a Python loop per block.

A transfer is described by a :class:`SpanPlan` — byte offsets inside one
local tensor, the matching offsets inside one remote tensor, and lengths —
computed once per call. :func:`layer_rows` then turns it into the native
engine's ``(local addr, remote addr, len, rkey id)`` row table for the
tensors of one layer. Runs of blocks that are consecutive on both sides are
merged into one span before any row exists.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import param_invalid
from .types import CacheDesc

__all__ = [
    "MAX_NOTIFY_BLOCKS",
    "SpanPlan",
    "block_bytes",
    "block_ids",
    "blocks_plan",
    "check_in_range",
    "check_unique",
    "decode_block_ids",
    "encode_block_ids",
    "layer_rows",
    "num_blocks",
    "slot_blocks_plan",
    "slot_plan",
]

U64 = np.uint64
#: Most block ids a notification carries (sender and receiver both apply it).
MAX_NOTIFY_BLOCKS = 1 << 20

_EMPTY = np.zeros(0, dtype=np.int64)


def num_blocks(desc: CacheDesc) -> int:
    """Blocks in a blocks cache: ``shape[0]``."""
    return desc.shape[0]


def block_bytes(desc: CacheDesc) -> int:
    """Bytes of one block of one tensor: tensor size / number of blocks."""
    return desc.size // desc.shape[0]


def block_ids(name: str, value: Any) -> npt.NDArray[np.int64]:
    """Block ids from a list, tuple, ``range`` or 1-D NumPy integer array.

    Returns an int64 array (no copy for an int64 array). A wrong container or
    element type raises ``TypeError`` (in a list, ``bool`` counts as the int
    it is); a negative id or one beyond int64 ``ValueError``. Bounds against
    a cache are :func:`check_in_range`'s job.
    """
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, range):
        if value.step != 1 and len(value) > 1:
            arr = np.arange(value.start, value.stop, value.step, dtype=np.int64)
        else:
            arr = np.arange(value.start, value.start + len(value), dtype=np.int64)
    elif isinstance(value, (list, tuple)):
        if not value:
            return _EMPTY
        # array.array converts in C and, unlike NumPy, refuses floats and
        # strings instead of truncating them; bool is an int here.
        try:
            arr = np.frombuffer(array.array("q", value), dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name} holds an id out of the int64 range") from None
        except TypeError:
            raise TypeError(f"{name} must hold ints only") from None
    else:
        raise TypeError(
            f"{name} must be a list, tuple, range or NumPy integer array of block ids, "
            f"got {type(value).__name__}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return _EMPTY
    if arr.dtype.kind == "u":
        if arr.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} holds an id out of the int64 range")
    elif arr.min() < 0:
        raise ValueError(f"{name} holds a negative block id ({int(arr.min())})")
    return arr.astype(np.int64, copy=False)


def check_in_range(name: str, ids: npt.NDArray[np.int64], limit: int, what: str) -> None:
    """``LLM_PARAM_INVALID`` unless every id is below ``limit`` (blocks of ``what``)."""
    if ids.size and int(ids.max()) >= limit:
        bad = int(ids[np.argmax(ids >= limit)])
        raise param_invalid(
            f"{name} holds block id {bad}, out of range for the {limit} blocks of {what}"
        )


def check_unique(name: str, ids: npt.NDArray[np.int64], limit: int) -> None:
    """``LLM_PARAM_INVALID`` if an id appears twice (ids already in ``[0, limit)``)."""
    n = ids.size
    if n < 2:
        return
    if limit <= 8 * n + (1 << 20):
        counts = np.bincount(ids, minlength=0)
        if counts.max() > 1:
            raise param_invalid(f"{name} names block {int(np.argmax(counts > 1))} more than once")
        return
    s = np.sort(ids)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise param_invalid(f"{name} names block {int(s[dup[0]])} more than once")


def _runs(
    a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Maximal runs where both ``a`` and ``b`` go up by one: (a start, b start, length)."""
    n = a.size
    if n == 0:
        return _EMPTY, _EMPTY, _EMPTY
    go_on = np.diff(a) == 1
    go_on &= np.diff(b) == 1
    if not go_on.any():  # nothing to merge: skip the gathers
        return a, b, np.ones(n, dtype=np.int64)
    brk = np.flatnonzero(~go_on)
    brk += 1
    starts = np.empty(brk.size + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = brk
    lengths = np.empty_like(starts)
    lengths[:-1] = brk
    lengths[-1] = n
    lengths -= starts
    return a[starts], b[starts], lengths


def _bytes(ids: npt.NDArray[np.int64], size: int) -> npt.NDArray[np.uint64]:
    """``ids * size`` as uint64 (ids and offsets are non-negative int64)."""
    out = np.multiply(ids, size, dtype=np.int64)
    return out.view(np.uint64)


@dataclass(frozen=True, slots=True)
class SpanPlan:
    """Matching byte spans inside one local and one remote tensor."""

    local_off: npt.NDArray[np.uint64]
    remote_off: npt.NDArray[np.uint64]
    length: npt.NDArray[np.uint64]

    @property
    def segments(self) -> int:
        """Spans per tensor pair."""
        return int(self.length.size)

    def extent(self, local: bool) -> int:
        """One past the last byte touched, relative to the tensor start."""
        off = self.local_off if local else self.remote_off
        if off.size == 0:
            return 0
        return int((off + self.length).max())


def blocks_plan(
    local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64], block: int
) -> SpanPlan:
    """Local block ``local_ids[i]`` ↔ remote block ``remote_ids[i]``, ``block`` bytes each."""
    la, ra, cnt = _runs(local_ids, remote_ids)
    return SpanPlan(_bytes(la, block), _bytes(ra, block), _bytes(cnt, block))


def slot_blocks_plan(
    slot_off: int,
    slot_len: int,
    ids: npt.NDArray[np.int64],
    block: int,
    blocks_local: bool,
) -> SpanPlan:
    """A contiguous batch slot of ``slot_len`` bytes split over blocks ``ids``.

    Slot bytes ``[j*block, (j+1)*block)`` go to (or come from) block
    ``ids[j]``; the last block may be partly used. The caller checked
    ``len(ids) == ceil(slot_len / block)``.
    """
    j = np.arange(ids.size, dtype=np.int64)
    ia, ja, cnt = _runs(ids, j)
    b = U64(block)
    start = ja.astype(U64) * b
    end = np.minimum((ja + cnt).astype(U64) * b, U64(slot_len))
    block_off = ia.astype(U64) * b
    slot_side = start + U64(slot_off)
    length = end - start
    if blocks_local:
        return SpanPlan(block_off, slot_side, length)
    return SpanPlan(slot_side, block_off, length)


def slot_plan(
    local_off: npt.NDArray[np.uint64], remote_off: npt.NDArray[np.uint64], length: int
) -> SpanPlan:
    """Batch-slot spans (see ``cache_manager._slot_spans``) as a plan."""
    return SpanPlan(local_off, remote_off, np.full(local_off.size, length, dtype=U64))


def layer_rows(
    plan: SpanPlan,
    local_addrs: Sequence[int],
    remote_addrs: Sequence[int],
    rkeys: Sequence[int],
) -> npt.NDArray[np.uint64]:
    """The native row table for one layer: every span of every tensor pair.

    ``local_addrs[k]`` / ``remote_addrs[k]`` / ``rkeys[k]`` describe the
    k-th tensor pair of the layer.
    """
    m = plan.segments
    k = len(local_addrs)
    rows = np.empty((k, m, 4), dtype=U64)
    rows[:, :, 0] = np.asarray(local_addrs, dtype=U64)[:, None] + plan.local_off[None, :]
    rows[:, :, 1] = np.asarray(remote_addrs, dtype=U64)[:, None] + plan.remote_off[None, :]
    rows[:, :, 2] = plan.length[None, :]
    rows[:, :, 3] = np.asarray(rkeys, dtype=U64)[:, None]
    return rows.reshape(k * m, 4)


# ------------------------------------------------------------ notifications

_FMT_IDS = 1  # little-endian uint32 ids
_FMT_RUNS = 2  # little-endian uint32 (start, count) pairs


def encode_block_ids(ids: npt.NDArray[np.int64], budget: int) -> bytes | None:
    """The shorter of two compact forms of ``ids``, or None if neither fits ``budget``."""
    if ids.size > MAX_NOTIFY_BLOCKS or (ids.size and int(ids.max()) >= 1 << 32):
        return None
    if ids.size == 0:
        return bytes([_FMT_IDS])
    starts, _, counts = _runs(ids, np.arange(ids.size, dtype=np.int64))
    if starts.size * 8 < ids.size * 4:
        pairs = np.empty((starts.size, 2), dtype="<u4")
        pairs[:, 0] = starts
        pairs[:, 1] = counts
        out = bytes([_FMT_RUNS]) + pairs.tobytes()
    else:
        out = bytes([_FMT_IDS]) + ids.astype("<u4").tobytes()
    return out if len(out) <= budget else None


def decode_block_ids(data: bytes) -> tuple[int, ...]:
    """Inverse of :func:`encode_block_ids`; ``ValueError`` on malformed input."""
    if not data:
        raise ValueError("empty block list")
    fmt, body = data[0], data[1:]
    if len(body) % 4:
        raise ValueError("block list is not whole uint32s")
    words = np.frombuffer(body, dtype="<u4").astype(np.int64)
    if fmt == _FMT_IDS:
        if words.size > MAX_NOTIFY_BLOCKS:
            raise ValueError("too many block ids")
        return tuple(words.tolist())
    if fmt != _FMT_RUNS or words.size % 2:
        raise ValueError("unknown block list format")
    starts, counts = words[0::2], words[1::2]
    total = int(counts.sum())
    if total > MAX_NOTIFY_BLOCKS:
        raise ValueError("too many block ids")
    # ids = start of the run + position inside it
    first = np.cumsum(counts) - counts
    ids = np.arange(total, dtype=np.int64) + np.repeat(starts - first, counts)
    return tuple(ids.tolist())
