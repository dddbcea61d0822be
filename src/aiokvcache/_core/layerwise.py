"""Layer-wise pipelining: ``transfer_cache_async`` and :class:`CacheTask`.

``await cm.transfer_cache_async(...)`` checks every argument and resolves
every destination (remote metadata, bounds) first, so bad input raises
there and nothing moves. Then one asyncio task walks the source layers: for
layer *i* it awaits the layer synchronizer, submits layer *i* to every
config that includes it — one native job per (config, layer) — and goes on
to layer *i + 1* without waiting for those jobs. The native progress thread
moves layer *i* while the caller computes layer *i + 1*. The task awaits all
jobs at the end; cancelling it cancels them natively and waits until the
engine has released them (quiescence) before it ends.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._bridge import OP_PUT, JobGroup, settle
from . import notify
from . import planner as blocks
from .errors import LLMException, LLMStatusCode, LLMTimeoutError, make_error, param_invalid
from .runner import time_left
from .state import Link as _Link
from .state import LocalCache as _LocalCache
from .state import RemoteCache as _RemoteCache
from .transfers import Transfers
from .types import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_int,
    check_uint32,
)

__all__ = ["CacheTask", "transfer_cache_async"]

log = logging.getLogger("aiokvcache")

_TENSORS_PER_LAYER = 2  # transfer_cache_async sends K and V of each layer

Config = TransferConfig | TransferWithCacheKeyConfig


class CacheTask:
    """The handle ``transfer_cache_async`` returns.

    * ``await task`` **[ours]** waits for the whole transfer: returns None
      when every config succeeded, else raises :class:`LLMException` (the
      first failed config's status; the message names every config's
      outcome). Like awaiting an ``asyncio.Task``, cancelling the awaiting
      coroutine cancels the transfer.
    * ``await task.synchronize(timeout_in_millis=None)`` → the first
      non-success status, else ``LLM_SUCCESS``; ``LLM_TIMEOUT`` if the task
      is not done in time (the task goes on).
    * ``await task.get_results(timeout_in_millis=None)`` → one status per
      config, None for a config whose transfer was stopped early because of
      another config's layer (LLM-DataDist's semantics); all ``LLM_TIMEOUT``
      if the task is not done in time.
    * ``task.cancel()``: stops sending, cancels what is in flight and ends
      once nothing can be written any more (quiescent). Unfinished configs
      then read ``LLM_FAILED``.
    """

    def __init__(self, num_configs: int) -> None:
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    def _attach(self, task: asyncio.Task[None]) -> None:
        self._task = task

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        assert self._task is not None
        await self._task
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        """True once the transfer has ended (success, failure or cancellation)."""
        return self._task is not None and self._task.done()

    def cancelled(self) -> bool:
        """True if the transfer ended because it was cancelled."""
        return self._task is not None and self._task.done() and self._task.cancelled()

    def cancel(self) -> bool:
        """Request cancellation (see the class docstring); False if already done."""
        return self._task is not None and self._task.cancel()

    async def _finished(self, timeout_in_millis: int | None) -> bool:
        assert self._task is not None
        timeout = None
        if timeout_in_millis is not None:
            timeout = check_uint32("timeout_in_millis", timeout_in_millis) / 1000
        if self._task.done():
            return True
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        return bool(done)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the transfer; the first non-success status, else ``LLM_SUCCESS``."""
        if not await self._finished(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for r in self._results:
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        return LLMStatusCode.LLM_SUCCESS

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Wait for the transfer; one status (or None) per transfer config."""
        if not await self._finished(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"CacheTask({state}, results={[r and r.name for r in self._results]})"


# --------------------------------------------------------------------------
# one destination, prepared


@dataclass(eq=False)
class _Layer:
    local_addrs: list[int]
    remote_addrs: list[int]
    rkeys: list[int]
    dst_layer: int
    cache_id: int
    batch_index: int | None
    #: The retirement guard of the (first) remote cache it writes.
    guard: tuple[int, int, int, bool] | None = None


@dataclass(eq=False)
class _Target:
    index: int
    config: Config
    link: _Link
    src_range: range
    plan: blocks.SpanPlan
    layers: dict[int, _Layer]  # by source layer
    remotes: list[_RemoteCache]
    tag: str | bytes | None
    block_list: bytes | bool | None = False  # False: not a blocks destination
    groups: list[tuple[JobGroup, str, list[int]]] = field(default_factory=list)
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


def _describe(i: int, config: Config) -> str:
    return f"transfer_configs[{i}] (cluster {config.dst_cluster_id})"


class _Prepare:
    """Checks and resolution for one ``transfer_cache_async`` call."""

    def __init__(
        self,
        cm: Transfers,
        src: _LocalCache,
        src_block_indices: Any,
        dst_block_indices: Any,
        dst_block_memory_size: Any,
    ) -> None:
        self.cm = cm
        self.src = src
        desc = src.desc
        if desc.num_tensors % _TENSORS_PER_LAYER:
            raise param_invalid(
                f"src_cache has {desc.num_tensors} tensors: transfer_cache_async sends K and V "
                "per layer and needs an even number"
            )
        self.num_layers = desc.num_tensors // _TENSORS_PER_LAYER
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
        else:
            if self.src_ids is not None:
                raise param_invalid(
                    "src_block_indices is given but src_cache is not a blocks cache"
                )
            if self.dst_ids is None and self.dst_block is not None:
                raise param_invalid(
                    f"dst_block_memory_size={self.dst_block} is neither None nor 0 while the "
                    "destination is not blocks (no dst_block_indices)"
                )
        if self.dst_ids is not None:
            blocks.check_unique(
                "dst_block_indices", self.dst_ids, int(self.dst_ids.max(initial=0)) + 1
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

    async def target(self, i: int, config: Config, link: _Link) -> _Target:
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
        link: _Link,
        src_range: range,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
    ) -> _Target:
        key = config.cache_key
        cm = self.cm
        if isinstance(key, BlocksCacheKey):
            if self.dst_ids is None:
                raise param_invalid(
                    f"{_describe(i, config)} names a blocks cache: dst_block_indices is required"
                )
            remote = await cm.remote_blocks(link, key, None, "transfer_cache_async")
            rblock = blocks.block_bytes(remote.desc)
            if self.dst_block is not None and self.dst_block != rblock:
                raise param_invalid(
                    f"dst_block_memory_size={self.dst_block} differs from the {rblock}-byte "
                    f"blocks of the cache {_describe(i, config)} names"
                )
            blocks.check_in_range(
                "dst_block_indices",
                self.dst_ids,
                blocks.num_blocks(remote.desc),
                f"the cache {_describe(i, config)} names",
            )
            plan = self._plan(_describe(i, config), s_off, s_len, rblock, None)
            batch: int | None = None
        else:
            assert isinstance(key, CacheKeyByIdAndIndex)
            if self.dst_ids is not None:
                raise param_invalid(
                    f"dst_block_indices is given but {_describe(i, config)} names a contiguous "
                    "cache (CacheKeyByIdAndIndex)"
                )
            remote = await cm.remote_by_id(link, key.cache_id, None, "transfer_cache_async")
            batch = key.batch_index
            if batch >= remote.desc.batch_size:
                raise param_invalid(
                    f"{_describe(i, config)}: cache_key.batch_index={batch} is out of range for "
                    f"the remote batch size {remote.desc.batch_size}"
                )
            plan = self._plan(
                _describe(i, config), s_off, s_len, None, blocks.slot_spans(remote.desc, batch)
            )
        remote_layers = remote.desc.num_tensors // _TENSORS_PER_LAYER
        if remote.desc.num_tensors % _TENSORS_PER_LAYER:
            raise param_invalid(
                f"the cache {_describe(i, config)} names has an odd number of tensors"
            )
        dst_range = config.dst_layer_range
        if dst_range is None:
            dst_range = src_range
        if len(dst_range) != len(src_range):
            raise param_invalid(
                f"{_describe(i, config)}: src_layer_range ({len(src_range)} layers) and "
                f"dst_layer_range ({len(dst_range)} layers) must have the same length"
            )
        if dst_range.stop > remote_layers:
            raise param_invalid(
                f"{_describe(i, config)}: dst_layer_range={dst_range!r} exceeds the "
                f"{remote_layers} layers of the remote cache"
            )
        layers: dict[int, _Layer] = {}
        n = _TENSORS_PER_LAYER
        for sl, dl in zip(src_range, dst_range, strict=True):
            layers[sl] = _Layer(
                self.src.addrs[sl * n : (sl + 1) * n],
                remote.addrs[dl * n : (dl + 1) * n],
                remote.tensor_rkey[dl * n : (dl + 1) * n],
                dl,
                remote.cache_id,
                batch,
                remote.guard,
            )
        return self._target(i, config, link, src_range, plan, layers, [remote])

    async def _by_addrs(
        self,
        i: int,
        config: TransferConfig,
        link: _Link,
        src_range: range,
        s_off: npt.NDArray[np.uint64],
        s_len: int,
    ) -> _Target:
        addrs = config.dst_addrs
        n = _TENSORS_PER_LAYER
        if len(addrs) != n * len(src_range):
            raise param_invalid(
                f"{_describe(i, config)}: expected {n * len(src_range)} dst_addrs "
                f"({n} per layer of src_layer_range={src_range!r}), got {len(addrs)}"
            )
        dst_block = self.dst_block
        if self.src_ids is not None:
            dst_block = self.src_block
        plan = self._plan(_describe(i, config), s_off, s_len, dst_block, None)
        found = await _resolve(self.cm, link, addrs)
        extent = plan.extent(local=False)
        remotes: dict[int, _RemoteCache] = {}
        per_tensor: list[tuple[_RemoteCache, int]] = []
        for j, a in enumerate(addrs):
            hit = found.get(a)
            if hit is None:
                raise param_invalid(
                    f"{_describe(i, config)}.dst_addrs[{j}]={a:#x} is not inside a "
                    f"remote-accessible cache of cluster {link.cluster_id}"
                )
            rc, t = hit
            end = rc.addrs[t] + rc.desc.size
            if a + extent > end:
                raise param_invalid(
                    f"{_describe(i, config)}.dst_addrs[{j}]={a:#x}: {extent} bytes from there "
                    f"run past the end of tensor {t} of remote cache {rc.cache_id} "
                    f"({end - a} bytes left)"
                )
            remotes[rc.cache_id] = rc
            per_tensor.append(hit)
        layers: dict[int, _Layer] = {}
        for k, sl in enumerate(src_range):
            pairs = per_tensor[k * n : (k + 1) * n]
            rc0, t0 = pairs[0]
            batch: int | None = None
            if self.dst_ids is None and rc0.desc.batch_dim_index == 0:
                slot = rc0.desc.size // rc0.desc.batch_size
                rel = addrs[k * n] - rc0.addrs[t0]
                batch = rel // slot if rel % slot == 0 else None
            layers[sl] = _Layer(
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
        link: _Link,
        src_range: range,
        plan: blocks.SpanPlan,
        layers: dict[int, _Layer],
        remotes: list[_RemoteCache],
    ) -> _Target:
        tag = config.tag
        block_list: bytes | bool | None = False
        if self.dst_ids is not None:
            block_list = notify.block_list(tag, self.dst_ids)
        t = _Target(i, config, link, src_range, plan, layers, remotes, tag, block_list)
        # Fail now, not mid-transfer, if the tag does not fit a notification.
        self._payload(t, next(iter(layers.values())))
        return t

    def _payload(self, t: _Target, layer: _Layer) -> bytes:
        if t.block_list is False:
            return notify.payload(t.tag, layer.cache_id, layer.batch_index, layer.dst_layer)
        assert not isinstance(t.block_list, bool)
        return notify.payload(t.tag, layer.cache_id, None, layer.dst_layer, t.block_list)


def _opt_ids(name: str, value: Any) -> npt.NDArray[np.int64] | None:
    if value is None:
        return None
    ids = blocks.block_ids(name, value)
    return ids if ids.size else None


async def _resolve(
    cm: Transfers, link: _Link, addrs: Sequence[int]
) -> dict[int, tuple[_RemoteCache, int]]:
    """Map each address to the remote (cache, tensor) holding it; unknown ones are left out.

    Known remote caches are searched first; the owner is asked about the rest.
    """

    def index() -> tuple[list[int], list[tuple[int, _RemoteCache, int]]]:
        with cm.state.lock:
            known = [rc for rc in link.remote.values() if rc.valid]
        spans = sorted(
            ((base, base + rc.desc.size, id(rc), t), rc)
            for rc in known
            for t, base in enumerate(rc.addrs)
        )
        return [s[0] for s, _ in spans], [(s[1], rc, s[3]) for s, rc in spans]

    def lookup(
        starts: list[int], rest: list[tuple[int, _RemoteCache, int]], a: int
    ) -> tuple[_RemoteCache, int] | None:
        k = bisect.bisect_right(starts, a) - 1
        if k >= 0 and a < rest[k][0]:
            return rest[k][1], rest[k][2]
        return None

    starts, rest = index()
    out: dict[int, tuple[_RemoteCache, int]] = {}
    missing: list[int] = []
    for a in dict.fromkeys(addrs):
        hit = lookup(starts, rest, a)
        if hit is None:
            missing.append(a)
        else:
            out[a] = hit
    if not missing:
        return out
    await cm.service.call(cm.service.remotes_by_addr(link, missing))
    starts, rest = index()
    for a in missing:
        hit = lookup(starts, rest, a)
        if hit is not None:
            out[a] = hit
    return out


# --------------------------------------------------------------------------
# entry point and the pipeline


def _check_synchronizer(layer_synchronizer: Any) -> Any:
    fn = getattr(layer_synchronizer, "synchronize_layer", None)
    if not callable(fn):
        raise TypeError(
            "layer_synchronizer must be a LayerSynchronizer (an object with "
            f"synchronize_layer(layer_index, timeout_in_millis)), got "
            f"{type(layer_synchronizer).__name__}"
        )
    return fn


def _check_configs(transfer_configs: Any) -> list[Config]:
    if not isinstance(transfer_configs, (list, tuple)):
        raise TypeError(
            "transfer_configs must be a list of TransferConfig / TransferWithCacheKeyConfig, "
            f"got {type(transfer_configs).__name__}"
        )
    for i, c in enumerate(transfer_configs):
        if not isinstance(c, (TransferConfig, TransferWithCacheKeyConfig)):
            raise TypeError(
                f"transfer_configs[{i}] must be TransferConfig or TransferWithCacheKeyConfig, "
                f"got {type(c).__name__}"
            )
    return list(transfer_configs)


async def transfer_cache_async(
    cm: Transfers,
    src: _LocalCache,
    layer_synchronizer: Any,
    transfer_configs: Sequence[Config],
    src_block_indices: Any,
    dst_block_indices: Any,
    dst_block_memory_size: Any,
    tmo: float | None,
) -> CacheTask:
    """See ``CacheManager.transfer_cache_async``; ``tmo`` already checked."""
    sync = _check_synchronizer(layer_synchronizer)
    configs = _check_configs(transfer_configs)
    prep = _Prepare(cm, src, src_block_indices, dst_block_indices, dst_block_memory_size)
    if configs:
        cm.require_remote_access("transfer_cache_async")
    links = [cm.state.link_for(c.dst_cluster_id) for c in configs]
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(tmo):
            targets = list(
                await asyncio.gather(
                    *(
                        prep.target(i, c, lk)
                        for i, (c, lk) in enumerate(zip(configs, links, strict=True))
                    )
                )
            )
    except TimeoutError:
        raise LLMTimeoutError(
            "transfer_cache_async timed out looking up the destinations"
        ) from None
    tmo = time_left(tmo, start)
    task = CacheTask(len(configs))
    runner = _Pipeline(cm, prep, src, targets, sync, task, tmo)
    atask = loop.create_task(runner.run(), name="aiokvcache.transfer_cache_async")
    task._attach(atask)
    cm.track(atask)
    return task


class _Pipeline:
    def __init__(
        self,
        cm: Transfers,
        prep: _Prepare,
        src: _LocalCache,
        targets: list[_Target],
        sync: Any,
        task: CacheTask,
        timeout: float | None,
    ) -> None:
        self.cm = cm
        self.prep = prep
        self.src = src
        self.targets = targets
        self.sync = sync
        self.task = task
        self.timeout = timeout
        self.sync_error: Exception | None = None
        self.runner = cm.runner

    async def run(self) -> None:
        deadline = asyncio.timeout(self.timeout)
        try:
            async with deadline:
                await self._send_all()
                await self._wait_all()
        except TimeoutError as exc:
            await self._release_all()
            self._settle(LLMStatusCode.LLM_TIMEOUT)
            # Ours, or the synchronizer's own TimeoutError.
            self.task._error = (
                LLMTimeoutError("transfer_cache_async timed out; " + self._summary())
                if deadline.expired()
                else exc
            )
        except asyncio.CancelledError:
            await self._release_all()
            if self.cm.state.finalized:
                # finalize() stopped us, not the caller: say so.
                self._settle(LLMStatusCode.LLM_ENGINE_FINALIZED)
                self.task._error = make_error(
                    LLMStatusCode.LLM_ENGINE_FINALIZED,
                    "finalized during transfer_cache_async; " + self._summary(),
                )
                return
            self._settle(LLMStatusCode.LLM_FAILED)
            raise
        except Exception as exc:  # the engine went away under us
            await self._release_all()
            code = exc.status_code if isinstance(exc, LLMException) else LLMStatusCode.LLM_FAILED
            self._settle(code)
            self.task._error = exc
        else:
            self._finish()
        finally:
            self._untrack()

    # ------------------------------------------------------------ sending

    async def _send_all(self) -> None:
        per_job_ms = self.cm.state.options.sync_kv_timeout_ms
        for layer in range(self.prep.num_layers):
            concerned = [t for t in self.targets if layer in t.src_range]
            live = [t for t in concerned if not t.stopped and not self._check_failed(t)]
            if not live:
                continue
            try:
                ok = self.sync(layer, None)
                if inspect.isawaitable(ok):
                    ok = await ok
            except Exception as exc:
                # Like False (what was sent may land), but the task re-raises it.
                self.sync_error = exc
                ok = None
            if not ok:
                for t in concerned:
                    if not t.stopped and t.error is None:
                        t.error = (
                            param_invalid(
                                f"layer_synchronizer returned {ok!r} for layer {layer}; "
                                "nothing from that layer on was sent"
                            )
                            if self.sync_error is None
                            else make_error(
                                LLMStatusCode.LLM_FAILED,
                                f"layer_synchronizer raised {self.sync_error!r} for layer "
                                f"{layer}; nothing from that layer on was sent",
                            )
                        )
                for t in self.targets:
                    if t.src_range.stop > layer:
                        t.stopped = True  # layers from this one on are not sent
                log.warning(
                    "aiokvcache: transfer_cache_async stopped at layer %d: %s",
                    layer,
                    f"synchronizer returned {ok!r}"
                    if self.sync_error is None
                    else f"synchronizer raised {self.sync_error!r}",
                )
                return
            for t in live:
                spec = t.layers[layer]
                rows = blocks.layer_rows(t.plan, spec.local_addrs, spec.remote_addrs, spec.rkeys)
                payload = self.prep._payload(t, spec)
                try:
                    group = self.runner.start(
                        [(OP_PUT, t.link.ep, rows, payload, per_job_ms, spec.guard)],
                        None,
                        self.src,
                        t.remotes,
                    )
                except LLMException as exc:  # a cache went away: this destination stops
                    t.error = t.error or exc
                    continue
                t.groups.append((group, f"layer {spec.dst_layer}", group.job_ids))
                t.watch(group)

    def _check_failed(self, t: _Target) -> bool:
        if not t.failed():
            return False
        if not t.cancelled_rest:
            # Stop this destination: what is still in flight for it is cancelled.
            t.cancelled_rest = True
            for g, _, _ in t.groups:
                self.runner.bridge.cancel_group(g)
        return True

    # ------------------------------------------------------------ waiting

    async def _wait_all(self) -> None:
        for t in self.targets:
            for g, label, _ in t.groups:
                try:
                    await self.runner.wait(g, [label])
                except LLMException as exc:
                    if t.error is None:
                        t.error = self.runner.explain(exc, self.src, t.remotes)
                    for g2, _, _ in t.groups:
                        self.runner.bridge.cancel_group(g2)

    async def _release_all(self) -> None:
        groups = [g for t in self.targets for g, _, _ in t.groups]
        for g in groups:
            self.runner.bridge.cancel_group(g)
        interrupted: asyncio.CancelledError | None = None
        for g in groups:  # every group, even if a cancel arrives on the way
            try:
                await settle(g.released)
            except asyncio.CancelledError as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted

    def _untrack(self) -> None:
        for t in self.targets:
            for g, _, _ in t.groups:
                self.runner.release(g)

    # ------------------------------------------------------------ results

    def _landed(self, t: _Target) -> list[str]:
        return [
            label
            for g, label, _ in t.groups
            if g.results and all(r is not None and r.ok for r in g.results)
        ]

    def _finish(self) -> None:
        results = self.task._results
        for t in self.targets:
            if t.error is not None:
                results[t.index] = t.error.status_code
            elif not t.stopped:
                results[t.index] = LLMStatusCode.LLM_SUCCESS
            # else: stopped by another destination's layer → None
        first = next((t for t in self.targets if t.error is not None), None)
        if self.sync_error is not None:
            self.task._error = self.sync_error
        elif first is not None:
            self.task._error = make_error(
                first.error.status_code if first.error else LLMStatusCode.LLM_FAILED,
                f"transfer_cache_async failed; {self._summary()}",
            )

    def _settle(self, code: LLMStatusCode) -> None:
        """After a timeout, cancellation or error: unfinished destinations get ``code``."""
        results = self.task._results
        for t in self.targets:
            if t.error is not None:
                results[t.index] = t.error.status_code
            elif t.groups and len(self._landed(t)) == len(t.src_range):
                results[t.index] = LLMStatusCode.LLM_SUCCESS
            else:
                results[t.index] = code

    def _summary(self) -> str:
        parts = []
        for t in self.targets:
            if t.error is not None:
                state = f"{t.error.status_code.name}: {t.error.message}"
            else:
                state = "stopped" if t.stopped else "ok"
            landed = ", ".join(self._landed(t)) or "none"
            parts.append(f"{_describe(t.index, t.config)}: {state} (landed: {landed})")
        return "; ".join(parts)
