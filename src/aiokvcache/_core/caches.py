"""This instance's own caches: memory, records, keys and their retirement.

:class:`LocalCaches` turns engine memory or user memory into a cache record
(:class:`.state.LocalCache`) in the cache table, checks keys before they are
bound, finds live records for the public calls and hands a cache that goes
to :class:`.retire.Retirement`, which tells linked peers before memory goes.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._loader import native
from .memory.state import Lease, LocalCache, State
from .model.cachedesc import invalidate_cache
from .model.errors import LLMStatusCode, make_error, param_invalid
from .model.types import BlocksCacheKey, Cache, CacheDesc, CacheKey, check_int, check_isinstance
from .peers.retire import Retirement

__all__ = ["LocalCaches"]

Regions = list[tuple[int, int, int]]
"""(region id, base, length) per registered region."""


def _views(desc: CacheDesc, addrs: list[int]) -> list[npt.NDArray[Any]]:
    dtype = desc.data_type.to_numpy()
    return [
        np.frombuffer(native.buffer_from_address(a, desc.size), dtype=dtype).reshape(desc.shape)
        for a in addrs
    ]


def _as_array(name: str, obj: Any) -> npt.NDArray[Any]:
    """A NumPy view of a buffer-protocol or DLPack object, checked for use as memory."""
    try:
        arr = np.asarray(memoryview(obj))
    except TypeError:
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(
                f"{name} must be an int address or an object with the buffer protocol or "
                f"DLPack, got {type(obj).__name__}"
            ) from None
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise make_error(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{name}: cannot view it as host memory ({exc})",
            ) from None
    if not arr.flags.c_contiguous:
        raise param_invalid(f"{name} must be C-contiguous")
    if not arr.flags.writeable:
        raise param_invalid(f"{name} must be writable")
    return arr


def _user_memory(desc: CacheDesc, addrs: Sequence[Any]) -> tuple[list[int], list[Any], list[Any]]:
    """``register_cache``'s ``addrs`` checked: the addresses, the objects that
    own them (kept alive by the Cache) and, per tensor, the array whose
    buffer the engine registers (None for a plain address)."""
    if not isinstance(addrs, (list, tuple)):
        raise TypeError(f"addrs must be a list, got {type(addrs).__name__}")
    if len(addrs) != desc.num_tensors:
        raise param_invalid(
            f"addrs has {len(addrs)} entries but cache_desc.num_tensors is {desc.num_tensors}"
        )
    addr_list: list[int] = []
    owners: list[Any] = []
    # An exported buffer is registered with the export held, so it cannot be
    # resized or freed while registered.
    exports: list[Any] = []
    for i, a in enumerate(addrs):
        if isinstance(a, numbers.Integral) and not isinstance(a, bool):
            v = check_int(f"addrs[{i}]", a, 0, 2**64 - 1)
            if v == 0:
                raise param_invalid(f"addrs[{i}] is 0")
            addr_list.append(v)
            exports.append(None)
        else:
            arr = _as_array(f"addrs[{i}]", a)
            if arr.nbytes != desc.size:
                raise param_invalid(
                    f"addrs[{i}] has {arr.nbytes} bytes, cache_desc.size is {desc.size}"
                )
            owners.append(a)
            addr_list.append(int(arr.ctypes.data))
            exports.append(arr)
    return addr_list, owners, exports


def _release(engine: Any, regions: Regions) -> None:
    """Give back regions nobody saw yet."""
    for rid, _, _ in regions:
        with contextlib.suppress(native.NativeError):
            engine.mem_release(rid)


def _register_regions(engine: Any, size: int, addrs: list[int], exports: list[Any]) -> Regions:
    """One engine region per tensor; on failure none is left registered."""
    regions: Regions = []
    try:
        for a, arr in zip(addrs, exports, strict=True):
            if arr is None:
                regions.append((engine.mem_register(a, size), a, size))
            else:
                # The engine keeps a memoryview of it until the region is
                # released: the export outlives every use of the memory.
                rid, _, _ = engine.mem_register_buffer(arr)
                regions.append((rid, a, size))
    except BaseException as exc:
        _release(engine, regions)
        if isinstance(exc, native.EngineClosedError):
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "engine is finalized") from exc
        if isinstance(exc, native.NativeError):
            raise make_error(LLMStatusCode.LLM_FAILED, f"register_cache failed: {exc}") from exc
        raise
    return regions


class LocalCaches:
    """Allocation, registration, lookup, keys and retirement of our own caches."""

    def __init__(self, state: State, retirement: Retirement) -> None:
        self.state = state
        self.retirement = retirement

    def local(self, name: str, cache: Any) -> LocalCache:
        """The live record of ``cache``, or KV_CACHE_NOT_EXIST naming ``name``."""
        if not isinstance(cache, Cache):
            raise TypeError(f"{name} must be Cache, got {type(cache).__name__}")
        with self.state.lock:
            rec = self.state.cache_table.caches.get(cache.cache_id)
        if rec is None or rec.cache is not cache:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{name} (cache {cache.cache_id}) is not a live cache of this cache manager",
            )
        return rec

    def counts(self) -> tuple[int, int]:
        """How many caches are live, and the bytes allocated for them."""
        with self.state.lock:
            return len(self.state.cache_table.caches), self.state.cache_table.allocated_bytes

    def allocate(
        self,
        what: str,
        desc: CacheDesc,
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
        is_blocks: bool,
    ) -> Cache:
        """Memory from the engine that same-host peers can map, as a new cache."""
        st = self.state
        total = desc.size * desc.num_tensors
        cap = st.options.host_mem_pool_bytes
        with st.lock:
            in_use = st.cache_table.allocated_bytes
        if cap is not None and in_use + total > cap:
            raise make_error(
                LLMStatusCode.LLM_OUT_OF_MEMORY,
                f"{what}: {total} bytes would exceed the host memory pool "
                f"({in_use} of {cap} bytes in use)",
            )
        try:
            region, base = st.engine.mem_alloc(total)
        except native.EngineClosedError as exc:
            raise make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "engine is finalized") from exc
        except native.NativeError as exc:
            raise make_error(LLMStatusCode.LLM_OUT_OF_MEMORY, f"{what} failed: {exc}") from exc
        if st.options.prefault:
            # Its pages now, not in its first transfer (both sides faulted
            # each one in then: about 25x slower than the next).
            native.prefault(base, total, allocated=True)
        addrs = [base + i * desc.size for i in range(desc.num_tensors)]
        regions = [(region, base, total)]

        def record(cache_id: int) -> LocalCache:
            cache = Cache(cache_id, desc, addrs, is_blocks, arrays=_views(desc, addrs))
            return LocalCache(cache, desc, addrs, regions, [0] * desc.num_tensors, True, True)

        return self._add(record, regions, keys, blocks_key)

    def register(
        self,
        desc: CacheDesc,
        addrs: Sequence[Any],
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
        is_blocks: bool,
        remote_accessible: bool | None,
    ) -> Cache:
        """User memory (addresses or buffer objects, one per tensor) as a new cache."""
        addr_list, owners, exports = _user_memory(desc, addrs)
        regions = _register_regions(self.state.engine, desc.size, addr_list, exports)
        if self.state.options.prefault:
            for a in addr_list:  # the user's pages, as allocate does for ours
                native.prefault(a, desc.size)
        arrays = _views(desc, addr_list)

        def record(cache_id: int) -> LocalCache:
            cache = Cache(cache_id, desc, addr_list, is_blocks, arrays=arrays, owner=owners)
            return LocalCache(
                cache,
                desc,
                addr_list,
                regions,
                list(range(desc.num_tensors)),
                remote_accessible is not False,
                False,
            )

        return self._add(record, regions, keys, blocks_key)

    def _add(
        self,
        record: Callable[[int], LocalCache],
        regions: Regions,
        keys: list[CacheKey],
        blocks_key: BlocksCacheKey | None,
    ) -> Cache:
        """Enter the record ``record(cache_id)`` builds, with its retirement
        word and keys, in one critical section; on failure its memory goes
        back to the engine (nobody saw it yet)."""
        st = self.state
        try:
            with st.lock:
                cache_id = st.cache_table.new_cache_id()
                slot = st.ctl.guard_alloc(cache_id)
                rec = record(cache_id)
                rec.guard_slot = slot
                st.cache_table.add(rec, keys, blocks_key)
        except BaseException:
            _release(st.engine, regions)
            raise
        return rec.cache

    def check_keys(self, cache_keys: Any, batch_size: int) -> list[CacheKey]:
        """``cache_keys`` as a list; duplicates and keys bound elsewhere refused."""
        if not isinstance(cache_keys, (list, tuple)):
            raise TypeError(
                f"cache_keys must be a list of CacheKey, got {type(cache_keys).__name__}"
            )
        keys = [check_isinstance(f"cache_keys[{i}]", k, CacheKey) for i, k in enumerate(cache_keys)]
        if len(keys) > batch_size:
            raise param_invalid(
                f"cache_keys has {len(keys)} keys but the cache's batch size is {batch_size}"
            )
        seen: set[CacheKey] = set()
        with self.state.lock:
            bound = self.state.cache_table.keys
            for i, k in enumerate(keys):
                if k.is_placeholder:
                    continue
                if k in seen:
                    raise param_invalid(f"cache_keys[{i}] = {k!r} appears twice")
                if k in bound:
                    raise param_invalid(f"cache_keys[{i}] = {k!r} is already bound to a cache")
                seen.add(k)
        return keys

    def check_blocks_key(self, key: Any) -> BlocksCacheKey | None:
        """A BlocksCacheKey not bound yet, or None."""
        if key is None:
            return None
        check_isinstance("blocks_cache_key", key, BlocksCacheKey)
        with self.state.lock:
            if key in self.state.cache_table.blocks_keys:
                raise param_invalid(f"blocks_cache_key = {key!r} is already bound to a cache")
        result: BlocksCacheKey = key
        return result

    def remove_key(self, cache_key: CacheKey) -> None:
        """Unbind a CacheKey from its cache (no-op when it is not bound)."""
        with self.state.lock:
            bound = self.state.cache_table.keys.pop(cache_key, None)
            if bound is not None:
                rec = self.state.cache_table.caches.get(bound[0])
                if rec is not None:
                    rec.keys.pop(cache_key, None)

    def deallocate(self, cache: Any, blocks: bool) -> None:
        """``deallocate_cache`` (``blocks`` False) or ``deallocate_blocks_cache``:
        the cache checked to be of that kind, then retired."""
        rec = self.local("cache", cache)
        if blocks:
            if not rec.cache.is_blocks_cache:
                raise param_invalid(
                    f"cache {cache.cache_id} is not a blocks cache: use deallocate_cache"
                )
        else:
            if rec.cache.is_blocks_cache:
                raise param_invalid(
                    f"cache {cache.cache_id} is a blocks cache: use deallocate_blocks_cache"
                )
            if not rec.allocated:
                raise param_invalid(f"cache {cache.cache_id} was registered: use unregister_cache")
        self.retire(rec)

    def unregister(self, cache_id: int) -> None:
        """``unregister_cache``: the registered cache ``cache_id``, retired."""
        with self.state.lock:
            rec = self.state.cache_table.caches.get(cache_id)
        if rec is None:
            raise make_error(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache_id {cache_id} is not registered"
            )
        if rec.allocated:
            raise param_invalid(f"cache {cache_id} was allocated: use deallocate_cache")
        self.retire(rec)

    def retire(self, rec: LocalCache) -> None:
        """Deallocate / unregister: see :meth:`.retire.Retirement.retire_local`."""
        self.retirement.retire_local(rec)

    # ------------------------------------------------------------ finalize

    def invalidate_all(self) -> None:
        """Mark every cache retired (finalize): no new use of any can start."""
        st = self.state
        with st.lock:
            for rec in st.cache_table.caches.values():
                rec.valid = False
                st.ctl.guard_retire(rec.guard_slot)

    def copy_leases(self) -> list[Lease]:
        """The leases of local copies still running in worker threads."""
        with self.state.lock:
            return [
                lease
                for rec in self.state.cache_table.caches.values()
                for lease in rec.leases
                if lease.done is not None
            ]

    def drop_all(self) -> None:
        """Forget every cache and key, their Cache objects closed (finalize,
        once the engine is closed)."""
        reg = self.state.cache_table
        with self.state.lock:
            recs = list(reg.caches.values())
            reg.caches.clear()
            reg.keys.clear()
            reg.blocks_keys.clear()
        for rec in recs:
            invalidate_cache(rec.cache)
