"""The transfer planner: the byte spans a transfer moves, as native segment tables.

Pure functions of descriptors, ids and ranges: no engine, no I/O, so it is
unit-tested on its own. Batch slots, layer ranges and paged blocks all come
down to a :class:`SpanPlan` per tensor pair and :func:`layer_rows`.

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
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..model.errors import param_invalid
from ..model.types import CacheDesc, check_int

__all__ = [
    "SpanPlan",
    "block_bytes",
    "block_ids",
    "block_mapping",
    "blocks_plan",
    "check_block_count",
    "check_block_sizes",
    "check_in_range",
    "check_unique",
    "layer_pairs",
    "layer_rows",
    "num_blocks",
    "pair_spans",
    "runs",
    "slot_blocks_plan",
    "slot_layer_rows",
    "slot_plan",
    "slot_span",
    "slot_spans",
]

U64 = np.uint64

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
            ids = array.array("q", value)
        except OverflowError:
            raise ValueError(f"{name} holds an id out of the int64 range") from None
        except TypeError:
            raise TypeError(f"{name} must hold ints only") from None
        # A request's few block ids: Python's min over the C array beats a
        # NumPy reduction (a per-layer call pays this twice).
        if len(ids) <= 256:
            low = min(ids)
            if low < 0:
                raise ValueError(f"{name} holds a negative block id ({low})")
            return np.frombuffer(ids, dtype=np.int64)
        arr = np.frombuffer(ids, dtype=np.int64)
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


def block_mapping(name: str, value: Any, many: bool) -> tuple[list[int], list[int]]:
    """``{src: [dst, ...]}`` (many) or ``{src: dst}`` as parallel id lists.

    A wrong container or element type raises ``TypeError``, a negative id
    ``ValueError``; bounds against a cache are :func:`check_in_range`'s job.
    """
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    srcs: list[int] = []
    dsts: list[int] = []
    for k, v in value.items():
        src = check_int(f"{name} key", k, 0, 2**63 - 1)
        if many:
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"{name}[{src}] must be a list of ints, got {type(v).__name__}")
            for d in v:
                dsts.append(check_int(f"{name}[{src}][]", d, 0, 2**63 - 1))
                srcs.append(src)
        else:
            dsts.append(check_int(f"{name}[{src}]", v, 0, 2**63 - 1))
            srcs.append(src)
    return srcs, dsts


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


def runs(
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
    la, ra, cnt = runs(local_ids, remote_ids)
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
    ia, ja, cnt = runs(ids, j)
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
    """Batch-slot spans (see :func:`slot_spans`) as a plan."""
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


# ------------------------------------------------------------ batch slots and layers


def slot_spans(desc: CacheDesc, batch_index: int) -> tuple[npt.NDArray[np.uint64], int]:
    """Byte offsets of one batch slot inside a tensor, and the span length.

    With the batch dimension first a slot is one contiguous span; otherwise
    it is one span per index of the dimensions before it.
    """
    shape = desc.shape
    bdi = desc.batch_dim_index
    inner = math.prod(shape[bdi + 1 :]) * desc.data_type.itemsize
    outer = math.prod(shape[:bdi])
    batch = shape[bdi]
    starts = (np.arange(outer, dtype=U64) * U64(batch) + U64(batch_index)) * U64(inner)
    return starts, inner


def slot_span(desc: CacheDesc, batch_index: int, what: str) -> tuple[int, int]:
    """(offset, length) of a batch slot that must be one contiguous span."""
    off, length = slot_spans(desc, batch_index)
    if len(off) != 1:
        raise param_invalid(
            f"{what}'s batch slots are not contiguous (shape {list(desc.shape)}, "
            f"batch_dim_index {desc.batch_dim_index}): it cannot be split into blocks"
        )
    return int(off[0]), length


def layer_pairs(
    n: int,
    src_desc: CacheDesc,
    dst_desc: CacheDesc,
    src_range: range | None,
    dst_range: range | None,
    src_name: str,
    dst_name: str,
) -> list[tuple[int, int]]:
    """(source layer, destination layer) pairs, all bounds checked.

    Layer *l* is tensors ``[l*n, (l+1)*n)``; one range given means the other
    is the same (LLM-DataDist wants them equal); none means every layer.
    """
    for name, desc in ((src_name, src_desc), (dst_name, dst_desc)):
        if n > desc.num_tensors or desc.num_tensors % n:
            raise param_invalid(
                f"tensor_num_per_layer={n} must divide {name}'s num_tensors={desc.num_tensors}"
            )
    src_layers = src_desc.num_tensors // n
    dst_layers = dst_desc.num_tensors // n
    src_r = src_range if src_range is not None else dst_range
    dst_r = dst_range if dst_range is not None else src_range
    src_r = src_r if src_r is not None else range(src_layers)
    dst_r = dst_r if dst_r is not None else range(dst_layers)
    if src_r.stop > src_layers:
        raise param_invalid(
            f"src_layer_range={src_r!r} exceeds the {src_layers} layers of {src_name}"
        )
    if dst_r.stop > dst_layers:
        raise param_invalid(
            f"dst_layer_range={dst_r!r} exceeds the {dst_layers} layers of {dst_name}"
        )
    if len(src_r) != len(dst_r):
        raise param_invalid(
            f"src_layer_range ({len(src_r)} layers) and dst_layer_range ({len(dst_r)} layers) "
            "must have the same length"
        )
    return list(zip(src_r, dst_r, strict=True))


def pair_spans(
    src_desc: CacheDesc,
    src_batch: int,
    dst_desc: CacheDesc,
    dst_batch: int,
    size: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], int]:
    """Matching byte spans of a source slot and a destination slot (``size`` -1: whole)."""
    s_off, s_len = slot_spans(src_desc, src_batch)
    d_off, d_len = slot_spans(dst_desc, dst_batch)
    if len(s_off) == 1 and len(d_off) == 1:
        length = s_len if size < 0 else size
        if length > min(s_len, d_len):
            raise param_invalid(
                f"a batch slot of {length} bytes does not fit: source slot {s_len} bytes, "
                f"destination slot {d_len} bytes"
            )
        return s_off, d_off, length
    if len(s_off) != len(d_off) or s_len != d_len or (size >= 0 and size != s_len * len(s_off)):
        raise param_invalid(
            "source and destination batch slots have different layouts "
            f"(shapes {src_desc.shape} / {dst_desc.shape}, batch_dim_index "
            f"{src_desc.batch_dim_index} / {dst_desc.batch_dim_index})"
        )
    return s_off, d_off, s_len


def slot_layer_rows(
    local_addrs: Sequence[int],
    remote_addrs: Sequence[int],
    remote_rkeys: Sequence[int],
    local_tensors: range,
    remote_tensors: range,
    local_off: npt.NDArray[np.uint64],
    remote_off: npt.NDArray[np.uint64],
    length: int,
) -> npt.NDArray[np.uint64]:
    """The native row table of one layer of a batch-slot transfer."""
    m = len(local_off)
    rows = np.empty((len(local_tensors) * m, 4), dtype=U64)
    for k, (lt, rt) in enumerate(zip(local_tensors, remote_tensors, strict=True)):
        block = rows[k * m : (k + 1) * m]
        block[:, 0] = local_off + U64(local_addrs[lt])
        block[:, 1] = remote_off + U64(remote_addrs[rt])
        block[:, 2] = length
        block[:, 3] = remote_rkeys[rt]
    return rows


def check_block_count(name: str, ids: npt.NDArray[np.int64], slot_len: int, block: int) -> None:
    """A batch slot of ``slot_len`` bytes fills exactly ``len(ids)`` blocks."""
    need = -(-slot_len // block)
    if ids.size != need:
        raise param_invalid(
            f"{name} has {ids.size} blocks but a batch slot of {slot_len} bytes fills "
            f"{need} blocks of {block} bytes"
        )


def check_block_sizes(src_desc: CacheDesc, dst_desc: CacheDesc, src: str, dst: str) -> int:
    """Both blocks caches have the same block size; returns it."""
    sb, db = block_bytes(src_desc), block_bytes(dst_desc)
    if sb != db:
        raise param_invalid(f"{src} has blocks of {sb} bytes but {dst} has {db}-byte blocks")
    return sb
