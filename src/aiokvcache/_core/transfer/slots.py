"""Batch-slot transfers: what one asks for, its checked plan, and the inline copy.

A :class:`SlotTransfer` names one slot move between a local and a remote
cache; :func:`slot_plan` turns it into segment tables (checked once per
shape, then cached on the remote record); :func:`copy_inline` moves a small
same-host plan on the caller's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import monotonic_ns
from typing import Any

import numpy as np
import numpy.typing as npt

from ... import _telemetry
from ..._bridge import OP_PUT
from ..._loader import native
from ..memory.state import Link, LocalCache, RemoteCache, State
from ..model.errors import LLMStatusCode, make_error, param_invalid
from . import planner
from .runner import engine_finalized

__all__ = ["INLINE_COPY_MAX", "MAX_PLANS", "Plan", "SlotTransfer", "copy_inline", "slot_plan"]

Offsets = npt.NDArray[np.uint64]

#: Plans kept per remote cache record (then the record's plans start over).
MAX_PLANS = 256

#: A tagless transfer of at most this many bytes whose every segment maps
#: the peer's memory (same host, direct copy) is copied on the caller's
#: thread: no job, no thread crossing, done when the call returns.
INLINE_COPY_MAX = 64 * 1024


@dataclass(slots=True)
class SlotTransfer:
    """One batch slot to move between a local and a remote cache, a job per layer.

    ``op`` OP_PUT pushes local -> remote, OP_GET pulls remote -> local; the
    layer ranges keep their source/destination meaning. ``size``: bytes per
    tensor, -1 for the whole slot. ``remote_batch_name`` is how an error
    names ``remote_batch``. Not frozen: one is built per call on the hot
    path, and a frozen dataclass's ``__init__`` costs about 2 us more.
    """

    op: int
    local: LocalCache
    local_batch: int
    remote: RemoteCache
    remote_batch: int
    remote_batch_name: str
    n: int
    src_range: range | None
    dst_range: range | None
    size: int = -1

    @property
    def push(self) -> bool:
        """Whether bytes go from the local cache to the remote one."""
        return self.op == OP_PUT

    def plan_key(self) -> tuple[Any, ...]:
        """What a plan depends on besides the two caches' records."""
        src, dst = self.src_range, self.dst_range
        return (
            self.op, self.local.cache_id, self.local_batch, self.remote_batch, self.n, self.size,
            None if src is None else (src.start, src.stop),
            None if dst is None else (dst.start, dst.stop),
        )  # fmt: skip


@dataclass(eq=False)
class Plan:
    """One slot transfer's checked segment tables: (rows, destination layer)
    per layer job, the jobs' labels, and whether it copies inline (None:
    not tried yet; a plan that could not once never can: its keys do not map)."""

    local: LocalCache
    layers: tuple[tuple[Any, int], ...]
    labels: tuple[str, ...]
    nbytes: int
    inline: bool | None = None


def _layer_pairs(t: SlotTransfer) -> list[tuple[int, int]]:
    """(source layer, destination layer) of every job, checked against both caches."""
    if t.push:
        return planner.layer_pairs(
            t.n, t.local.desc, t.remote.desc, t.src_range, t.dst_range,
            "src_cache", "the remote cache",
        )  # fmt: skip
    return planner.layer_pairs(
        t.n, t.remote.desc, t.local.desc, t.src_range, t.dst_range, "the remote cache", "cache"
    )


def _spans(t: SlotTransfer) -> tuple[Offsets, Offsets, int]:
    """(local offsets, remote offsets, length) of the slot's spans in each tensor."""
    if t.push:
        return planner.pair_spans(
            t.local.desc, t.local_batch, t.remote.desc, t.remote_batch, t.size
        )
    r_off, l_off, length = planner.pair_spans(
        t.remote.desc, t.remote_batch, t.local.desc, t.local_batch, t.size
    )
    return l_off, r_off, length


def _build(t: SlotTransfer) -> Plan:
    """Check ``t`` against both caches and build its segment tables."""
    local, remote, n = t.local, t.remote, t.n
    if t.remote_batch >= remote.desc.batch_size:
        raise param_invalid(
            f"{t.remote_batch_name}={t.remote_batch} is out of range for the remote batch size "
            f"{remote.desc.batch_size}"
        )
    pairs = _layer_pairs(t)
    l_off, r_off, length = _spans(t)
    layers = []
    for src_layer, dst_layer in pairs:
        local_layer, remote_layer = (src_layer, dst_layer) if t.push else (dst_layer, src_layer)
        rows = planner.slot_layer_rows(
            local.addrs,
            remote.addrs,
            remote.tensor_rkey,
            range(local_layer * n, (local_layer + 1) * n),
            range(remote_layer * n, (remote_layer + 1) * n),
            l_off,
            r_off,
            length,
        )
        rows.setflags(write=False)  # shared by every call of this shape
        layers.append((rows, dst_layer))
    return Plan(
        local,
        tuple(layers),
        tuple(f"layer {d}" for _, d in pairs),
        sum(int(rows[:, 2].sum()) for rows, _ in layers),
    )


def slot_plan(t: SlotTransfer) -> Plan:
    """The checked segment tables of ``t``, cached on its remote record.

    A plan depends only on the two caches (whose addresses and keys never
    change), the batch indices, the layer ranges and the size; it goes
    with the remote record (dropped on invalidation or unlink) and is
    only built, never changed, so a hit skips every check it made.
    """
    key = t.plan_key()
    plans = t.remote.plans
    plan: Plan | None = plans.get(key)
    if plan is not None and plan.local is t.local:
        return plan
    plan = _build(t)
    if len(plans) >= MAX_PLANS:
        plans.clear()  # a bound, not an LRU: shapes per peer cache are few
    plans[key] = plan
    return plan


def copy_inline(state: State, op: int, link: Link, plan: Plan, remote: RemoteCache) -> bool:
    """Copy a small same-host transfer now, inside the lease's critical
    section (so no retirement can free either side meanwhile); False: use
    jobs."""
    if plan.nbytes > INLINE_COPY_MAX:
        plan.inline = False
        return False
    outcome: int = native.INLINE_NO
    began = monotonic_ns() if _telemetry.active else 0

    def copy() -> list[int]:
        nonlocal outcome
        if link.broken:
            return []  # the job path reports it
        outcome = int(
            state.engine.copy_inline(
                op, link.ep, [rows for rows, _ in plan.layers], INLINE_COPY_MAX, remote.guard
            )
        )
        return []

    try:
        state.lease((plan.local, remote), copy)
    except native.EngineClosedError as exc:
        raise engine_finalized() from exc
    except native.NativeError as exc:  # the peer's memory vanished under the copy
        raise make_error(
            LLMStatusCode.LLM_LINK_FAILED,
            f"link to cluster {link.cluster_id} failed during a copy: {exc}",
        ) from None
    if outcome == native.INLINE_RETIRED:
        raise make_error(
            LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            f"the remote cache {remote.cache_id} was deallocated",
        )
    done = outcome == native.INLINE_COPIED
    if done and began:
        _telemetry.copied(began, plan.nbytes, sum(len(rows) for rows, _ in plan.layers))
    if plan.inline is None:
        plan.inline = done
    return done
