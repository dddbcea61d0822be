"""The checks and resolution ``transfer_cache_async`` runs before any byte moves.

:class:`Prepare` checks the call's block arguments once, then turns each
transfer config into a :class:`Target`: the destination's layers
(:class:`LayerPlan`: addresses, rkeys, notification fields) and the span plan
every layer shares. Bad input raises here; the pipeline in
:mod:`.layerwise` only sends what was resolved.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..._bridge import JobGroup
from ..memory.state import Link, LocalCache, RemoteCache
from ..model.errors import LLMException, param_invalid
from ..model.types import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_int,
)
from . import notify
from . import planner as blocks
from .transfers import Transfers

__all__ = ["TENSORS_PER_LAYER", "Config", "LayerPlan", "Prepare", "Target", "describe"]

TENSORS_PER_LAYER = 2  # transfer_cache_async sends K and V of each layer

Config = TransferConfig | TransferWithCacheKeyConfig


@dataclass(eq=False)
class LayerPlan:
    local_addrs: list[int]
    remote_addrs: list[int]
    rkeys: list[int]
    dst_layer: int
    cache_id: int
    batch_index: int | None
    #: The retirement guard of the (first) remote cache it writes.
    guard: tuple[int, int, int, bool] | None = None


@dataclass(eq=False)
class Target:
    index: int
    config: Config
    link: Link
    src_range: range
    plan: blocks.SpanPlan
    layers: dict[int, LayerPlan]  # by source layer
    remotes: list[RemoteCache]
    tag: str | bytes | None
    block_list: bytes | bool | None = False  # False: not a blocks destination
    #: (group, destination layer, its job ids), one per layer sent.
    groups: list[tuple[JobGroup, int, list[int]]] = field(default_factory=list)
    error: LLMException | None = None
    stopped: bool = False
    cancelled_rest: bool = False
    job_failed: bool = False  # set by a group's done-callback

    def failed(self) -> bool:
        return self.error is not None or self.job_failed

    def watch(self, group: JobGroup) -> None:
        """Note a failed layer as soon as the bridge resolves it (no polling)."""

        def done(_: Any) -> None:
            if group.failed():
                self.job_failed = True

        group.first.add_done_callback(done)

    def payload(self, layer: LayerPlan) -> bytes:
        """The notification the destination gets once ``layer`` landed."""
        if self.block_list is False:
            return notify.payload(self.tag, layer.cache_id, layer.batch_index, layer.dst_layer)
        assert not isinstance(self.block_list, bool)
        return notify.payload(self.tag, layer.cache_id, None, layer.dst_layer, self.block_list)


def describe(i: int, config: Config) -> str:
    return f"transfer_configs[{i}] (cluster {config.dst_cluster_id})"


class Prepare:
    """Checks and resolution for one ``transfer_cache_async`` call."""

    def __init__(
        self,
        cm: Transfers,
        src: LocalCache,
        src_block_indices: Any,
        dst_block_indices: Any,
        dst_block_memory_size: Any,
    ) -> None:
        self.cm = cm
        self.src = src
        desc = src.desc
        if desc.num_tensors % TENSORS_PER_LAYER:
            raise param_invalid(
                f"src_cache has {desc.num_tensors} tensors: transfer_cache_async sends K and V "
                "per layer and needs an even number"
            )
        self.num_layers = desc.num_tensors // TENSORS_PER_LAYER
        self.src_ids = _opt_ids("src_block_indices", src_block_indices)
        self.dst_ids = _opt_ids("dst_block_indices", dst_block_indices)
        self.dst_block = (
            None
            if dst_block_memory_size is None
            else check_int("dst_block_memory_size", dst_block_memory_size, 0, 2**63 - 1)
        ) or None
        is_blocks = src.cache.is_blocks_cache
        if is_blocks and self.src_ids is None and self.dst_ids is None:
            # LLM-DataDist sends no block lists then, and its engine copies
            # the source's first block (a blocks cache's one "batch slot")
            # into the destination's first block: the same, said plainly.
            self.src_ids = np.zeros(1, np.int64)
            self.dst_ids = np.zeros(1, np.int64)
        if is_blocks:
            self._check_blocks_source()
        else:
            self._check_contiguous_source()
        if self.dst_ids is not None:
            blocks.check_unique(
                "dst_block_indices", self.dst_ids, int(self.dst_ids.max(initial=0)) + 1
            )

    def _check_blocks_source(self) -> None:
        """A blocks ``src_cache``: both block lists, of one length, in range."""
        desc = self.src.desc
        if self.src_ids is None:
            raise param_invalid("src_cache is a blocks cache: src_block_indices is required")
        if self.dst_ids is None:
            raise param_invalid(
                "transfer from blocks to a contiguous cache is not supported: "
                "dst_block_indices is required"
            )
        if self.src_ids.size != self.dst_ids.size:
            raise param_invalid(
                f"src_block_indices has {self.src_ids.size} blocks but dst_block_indices "
                f"has {self.dst_ids.size}"
            )
        blocks.check_in_range(
            "src_block_indices", self.src_ids, blocks.num_blocks(desc), "src_cache"
        )
        self.src_block = blocks.block_bytes(desc)
        if self.dst_block is not None and self.dst_block != self.src_block:
            raise param_invalid(
                f"dst_block_memory_size={self.dst_block} differs from src_cache's "
                f"{self.src_block}-byte blocks"
            )

    def _check_contiguous_source(self) -> None:
        """A contiguous ``src_cache``: no source blocks; a block size only with blocks."""
        if self.src_ids is not None:
            raise param_invalid("src_block_indices is given but src_cache is not a blocks cache")
        if self.dst_ids is None and self.dst_block is not None:
            raise param_invalid(
                f"dst_block_memory_size={self.dst_block} is neither None nor 0 while the "
                "destination is not blocks (no dst_block_indices)"
            )

    # ---------------------------------------------------------- per config

    def _src_slot(self, i: int, config: Config) -> tuple[npt.NDArray[np.uint64], int]:
        desc = self.src.desc
        sb = config.src_batch_index
        if self.src.cache.is_blocks_cache:
            if sb != 0:
                raise param_invalid(
                    f"transfer_configs[{i}].src_batch_index must be 0 when src_cache is a "
                    f"blocks cache, got {sb}"
                )
            return np.zeros(1, dtype=np.uint64), 0
        if sb >= desc.batch_size:
            raise param_invalid(
                f"transfer_configs[{i}].src_batch_index={sb} is out of range for a batch "
                f"size of {desc.batch_size}"
            )
        return blocks.slot_spans(desc, sb)

    def _src_range(self, i: int, config: Config) -> range:
        r = config.src_layer_range
        r = r if r is not None else range(self.num_layers)
        if r.stop > self.num_layers:
            raise param_invalid(
                f"transfer_configs[{i}].src_layer_range={r!r} exceeds the {self.num_layers} "
                "layers of src_cache"
            )
        return r

    async def target(self, i: int, config: Config, link: Link) -> Target:
        src_range = self._src_range(i, config)
        s_off, s_len = self._src_slot(i, config)
        if isinstance(config, TransferConfig):
            return await self._by_addrs(i, config, link, src_range, s_off, s_len)
        return await self._by_key(i, config, link, src_range, s_off, s_len)

    def _plan(
        self,
        where: str,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
        dst_block: int | None,
        dst_slot: tuple[npt.NDArray[np.uint64], int] | None,
    ) -> blocks.SpanPlan:
        """Spans relative to a source tensor and to the destination tensor address."""
        if self.src_ids is not None:  # blocks → blocks
            assert self.dst_ids is not None
            if dst_block is not None and dst_block != self.src_block:
                raise param_invalid(
                    f"{where}: the destination has {dst_block}-byte "
                    f"blocks but src_cache has {self.src_block}-byte blocks"
                )
            return blocks.blocks_plan(self.src_ids, self.dst_ids, self.src_block)
        if len(s_off) != 1 and (self.dst_ids is not None or dst_slot is None):
            raise param_invalid(
                f"{where}: src_cache's batch slots are not contiguous "
                f"(batch_dim_index {self.src.desc.batch_dim_index}); only a cache key "
                "destination with the same layout can take them"
            )
        if self.dst_ids is not None:  # cache slot → blocks
            if dst_block is None:
                raise param_invalid(
                    "dst_block_memory_size must be set when transferring a cache to blocks "
                    "by address"
                )
            need = -(-s_len // dst_block)
            if self.dst_ids.size != need:
                raise param_invalid(
                    f"dst_block_indices has {self.dst_ids.size} blocks but a batch slot of "
                    f"{s_len} bytes fills {need} blocks of {dst_block} bytes"
                )
            return blocks.slot_blocks_plan(
                int(s_off[0]), s_len, self.dst_ids, dst_block, blocks_local=False
            )
        if dst_slot is None:  # raw address of a slot
            return blocks.slot_plan(s_off, np.zeros(1, dtype=np.uint64), s_len)
        d_off, d_len = dst_slot
        if len(s_off) != len(d_off) or s_len != d_len:
            if len(s_off) == 1 and len(d_off) == 1 and s_len <= d_len:
                return blocks.slot_plan(s_off, d_off, s_len)
            raise param_invalid(
                f"{where}: source and destination batch slots have "
                f"different layouts ({s_len} / {d_len} bytes in {len(s_off)} / {len(d_off)} spans)"
            )
        return blocks.slot_plan(s_off, d_off, s_len)

    async def _by_key(
        self,
        i: int,
        config: TransferWithCacheKeyConfig,
        link: Link,
        src_range: range,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
    ) -> Target:
        key = config.cache_key
        if isinstance(key, BlocksCacheKey):
            remote, plan = await self._blocks_key(i, config, key, link, s_off, s_len)
            batch: int | None = None
        else:
            assert isinstance(key, CacheKeyByIdAndIndex)
            remote, plan = await self._slot_key(i, config, key, link, s_off, s_len)
            batch = key.batch_index
        dst_range = self._dst_range(i, config, remote, src_range)
        layers: dict[int, LayerPlan] = {}
        n = TENSORS_PER_LAYER
        for sl, dl in zip(src_range, dst_range, strict=True):
            layers[sl] = LayerPlan(
                self.src.addrs[sl * n : (sl + 1) * n],
                remote.addrs[dl * n : (dl + 1) * n],
                remote.tensor_rkey[dl * n : (dl + 1) * n],
                dl,
                remote.cache_id,
                batch,
                remote.guard,
            )
        return self._target(i, config, link, src_range, plan, layers, [remote])

    async def _blocks_key(
        self,
        i: int,
        config: TransferWithCacheKeyConfig,
        key: BlocksCacheKey,
        link: Link,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
    ) -> tuple[RemoteCache, blocks.SpanPlan]:
        """The blocks cache ``key`` names, and the plan into its ``dst_block_indices``."""
        if self.dst_ids is None:
            raise param_invalid(
                f"{describe(i, config)} names a blocks cache: dst_block_indices is required"
            )
        remote = await self.cm.remote_blocks(link, key, None, "transfer_cache_async")
        rblock = blocks.block_bytes(remote.desc)
        if self.dst_block is not None and self.dst_block != rblock:
            raise param_invalid(
                f"dst_block_memory_size={self.dst_block} differs from the {rblock}-byte "
                f"blocks of the cache {describe(i, config)} names"
            )
        blocks.check_in_range(
            "dst_block_indices",
            self.dst_ids,
            blocks.num_blocks(remote.desc),
            f"the cache {describe(i, config)} names",
        )
        return remote, self._plan(describe(i, config), s_off, s_len, rblock, None)

    async def _slot_key(
        self,
        i: int,
        config: TransferWithCacheKeyConfig,
        key: CacheKeyByIdAndIndex,
        link: Link,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
    ) -> tuple[RemoteCache, blocks.SpanPlan]:
        """The contiguous cache ``key`` names, and the plan into its batch slot."""
        if self.dst_ids is not None:
            raise param_invalid(
                f"dst_block_indices is given but {describe(i, config)} names a contiguous "
                "cache (CacheKeyByIdAndIndex)"
            )
        remote = await self.cm.remote_by_id(link, key.cache_id, None, "transfer_cache_async")
        batch = key.batch_index
        if batch >= remote.desc.batch_size:
            raise param_invalid(
                f"{describe(i, config)}: cache_key.batch_index={batch} is out of range for "
                f"the remote batch size {remote.desc.batch_size}"
            )
        plan = self._plan(
            describe(i, config), s_off, s_len, None, blocks.slot_spans(remote.desc, batch)
        )
        return remote, plan

    @staticmethod
    def _dst_range(
        i: int, config: TransferWithCacheKeyConfig, remote: RemoteCache, src_range: range
    ) -> range:
        """The destination layers: as many as ``src_range``, inside the remote cache."""
        remote_layers = remote.desc.num_tensors // TENSORS_PER_LAYER
        if remote.desc.num_tensors % TENSORS_PER_LAYER:
            raise param_invalid(
                f"the cache {describe(i, config)} names has an odd number of tensors"
            )
        dst_range = config.dst_layer_range
        if dst_range is None:
            dst_range = src_range
        if len(dst_range) != len(src_range):
            raise param_invalid(
                f"{describe(i, config)}: src_layer_range ({len(src_range)} layers) and "
                f"dst_layer_range ({len(dst_range)} layers) must have the same length"
            )
        if dst_range.stop > remote_layers:
            raise param_invalid(
                f"{describe(i, config)}: dst_layer_range={dst_range!r} exceeds the "
                f"{remote_layers} layers of the remote cache"
            )
        return dst_range

    async def _by_addrs(
        self,
        i: int,
        config: TransferConfig,
        link: Link,
        src_range: range,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
    ) -> Target:
        addrs = config.dst_addrs
        n = TENSORS_PER_LAYER
        if len(addrs) != n * len(src_range):
            raise param_invalid(
                f"{describe(i, config)}: expected {n * len(src_range)} dst_addrs "
                f"({n} per layer of src_layer_range={src_range!r}), got {len(addrs)}"
            )
        dst_block = self.dst_block
        if self.src_ids is not None:
            dst_block = self.src_block
        plan = self._plan(describe(i, config), s_off, s_len, dst_block, None)
        found = await _resolve(self.cm, link, addrs)
        extent = plan.extent(local=False)
        remotes: dict[int, RemoteCache] = {}
        per_tensor: list[tuple[RemoteCache, int]] = []
        for j, a in enumerate(addrs):
            hit = found.get(a)
            if hit is None:
                raise param_invalid(
                    f"{describe(i, config)}.dst_addrs[{j}]={a:#x} is not inside a "
                    f"remote-accessible cache of cluster {link.cluster_id}"
                )
            rc, t = hit
            end = rc.addrs[t] + rc.desc.size
            if a + extent > end:
                raise param_invalid(
                    f"{describe(i, config)}.dst_addrs[{j}]={a:#x}: {extent} bytes from there "
                    f"run past the end of tensor {t} of remote cache {rc.cache_id} "
                    f"({end - a} bytes left)"
                )
            remotes[rc.cache_id] = rc
            per_tensor.append(hit)
        layers: dict[int, LayerPlan] = {}
        for k, sl in enumerate(src_range):
            pairs = per_tensor[k * n : (k + 1) * n]
            rc0, t0 = pairs[0]
            batch: int | None = None
            if self.dst_ids is None and rc0.desc.batch_dim_index == 0:
                slot = rc0.desc.size // rc0.desc.batch_size
                rel = addrs[k * n] - rc0.addrs[t0]
                batch = rel // slot if rel % slot == 0 else None
            layers[sl] = LayerPlan(
                self.src.addrs[sl * n : (sl + 1) * n],
                addrs[k * n : (k + 1) * n],
                [rc.tensor_rkey[t] for rc, t in pairs],
                t0 // n,
                rc0.cache_id,
                batch,
                rc0.guard,
            )
        return self._target(i, config, link, src_range, plan, layers, list(remotes.values()))

    def _target(
        self,
        i: int,
        config: Config,
        link: Link,
        src_range: range,
        plan: blocks.SpanPlan,
        layers: dict[int, LayerPlan],
        remotes: list[RemoteCache],
    ) -> Target:
        tag = config.tag
        block_list: bytes | bool | None = False
        if self.dst_ids is not None:
            block_list = notify.block_list(tag, self.dst_ids)
        t = Target(i, config, link, src_range, plan, layers, remotes, tag, block_list)
        # Fail now, not mid-transfer, if the tag does not fit a notification.
        t.payload(next(iter(layers.values())))
        return t


def _opt_ids(name: str, value: Any) -> npt.NDArray[np.int64] | None:
    if value is None:
        return None
    ids = blocks.block_ids(name, value)
    return ids if ids.size else None


async def _resolve(
    cm: Transfers, link: Link, addrs: Sequence[int]
) -> dict[int, tuple[RemoteCache, int]]:
    """Map each address to the remote (cache, tensor) holding it; unknown ones are left out.

    Known remote caches are searched first; the owner is asked about the rest.
    """

    def index() -> tuple[list[int], list[tuple[int, RemoteCache, int]]]:
        with cm.state.lock:
            known = [rc for rc in link.remote.values() if rc.valid]
        spans = sorted(
            ((base, base + rc.desc.size, id(rc), t), rc)
            for rc in known
            for t, base in enumerate(rc.addrs)
        )
        return [s[0] for s, _ in spans], [(s[1], rc, s[3]) for s, rc in spans]

    def lookup(
        starts: list[int], rest: list[tuple[int, RemoteCache, int]], a: int
    ) -> tuple[RemoteCache, int] | None:
        k = bisect.bisect_right(starts, a) - 1
        if k >= 0 and a < rest[k][0]:
            return rest[k][1], rest[k][2]
        return None

    starts, rest = index()
    out: dict[int, tuple[RemoteCache, int]] = {}
    missing: list[int] = []
    for a in dict.fromkeys(addrs):
        hit = lookup(starts, rest, a)
        if hit is None:
            missing.append(a)
        else:
            out[a] = hit
    if not missing:
        return out
    await cm.on_service(cm.lookups.remotes_by_addr(link, missing))
    starts, rest = index()
    for a in missing:
        hit = lookup(starts, rest, a)
        if hit is not None:
            out[a] = hit
    return out
