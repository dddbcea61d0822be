"""Cache metadata on the wire: what we tell peers of our caches, what we keep of theirs.

Serving side: :func:`metadata` describes a local cache (addresses,
descriptor, packed keys). Using side: :func:`install_remote` checks a peer's
description and unpacks its keys into a :class:`~.state.RemoteCache` on the
link. Both run on the service thread; table updates take the state lock.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..._loader import native
from ..model.errors import LLMException, LLMStatusCode, make_error
from ..model.types import CacheDesc, DataType, Placement
from .state import Link, LocalCache, RemoteCache, State

__all__ = ["desc_from_wire", "desc_to_wire", "forget_link", "install_remote", "metadata"]


def desc_to_wire(desc: CacheDesc) -> dict[str, Any]:
    """A descriptor as the control protocol carries it."""
    return {
        "num_tensors": desc.num_tensors,
        "shape": list(desc.shape),
        "dtype": desc.data_type.value,
        "batch_dim_index": desc.batch_dim_index,
        "seq_len_dim_index": desc.seq_len_dim_index,
    }


def desc_from_wire(d: dict[str, Any]) -> CacheDesc:
    """Inverse of :func:`desc_to_wire`; the descriptor's own checks apply."""
    return CacheDesc(
        d["num_tensors"],
        list(d["shape"]),
        DataType(d["dtype"]),
        Placement.HOST,
        d["batch_dim_index"],
        d["seq_len_dim_index"],
    )


def metadata(state: State, rec: LocalCache) -> dict[str, Any]:
    """What a peer needs to use ``rec``: addresses, descriptor, packed keys,
    and where its retirement word is (in our control region)."""
    rkeys = rec.rkeys
    if rkeys is None:
        # Packing waits for the progress thread: outside the lock.
        rkeys = [state.engine.rkey_pack(rid) for rid, _, _ in rec.regions]
        rec.rkeys = rkeys
    return {
        "cache_id": rec.cache_id,
        "desc": desc_to_wire(rec.desc),
        "is_blocks": rec.is_blocks,
        "addrs": list(rec.addrs),
        "regions": [
            {"base": base, "len": length, "rkey": rk}
            for (_, base, length), rk in zip(rec.regions, rkeys, strict=True)
        ],
        "tensor_region": list(rec.tensor_region),
        # Registered memory goes back to its owner when unregister returns:
        # a peer's job reads the word before its bytes move (strict).
        "guard": {
            "addr": state.ctl.guard_addr(rec.guard_slot),
            "word": rec.cache_id,
            "strict": not rec.allocated,
        },
    }


def _u64(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < 2**64:
        raise ValueError(f"{what} must be an unsigned 64-bit int")
    return value


def _parse(
    link: Link, meta: Any
) -> tuple[int, CacheDesc, list[int], list[dict[str, Any]], list[int], bool, tuple[int, int, bool]]:
    """A peer's cache metadata, checked field by field (ValueError otherwise)."""
    if not isinstance(meta, dict):
        raise ValueError("not a dict")
    cid = _u64(meta.get("cache_id"), "cache_id")
    d = meta.get("desc")
    if not isinstance(d, dict):
        raise ValueError("desc must be a dict")
    desc = desc_from_wire(d)
    if any(dim < 1 for dim in desc.shape) or desc.size < 1:
        raise ValueError(f"desc.shape {list(desc.shape)} has an empty dimension")
    raw_addrs, raw_regions, raw_map = (meta.get(k) for k in ("addrs", "regions", "tensor_region"))
    if not (
        isinstance(raw_addrs, list) and isinstance(raw_regions, list) and isinstance(raw_map, list)
    ):
        raise ValueError("addrs, regions and tensor_region must be lists")
    addrs = [_u64(a, "addrs[]") for a in raw_addrs]
    tensor_region = [_u64(i, "tensor_region[]") for i in raw_map]
    is_blocks = meta.get("is_blocks", False)
    if not isinstance(is_blocks, bool):
        raise ValueError("is_blocks must be a bool")
    if len(addrs) != desc.num_tensors or len(tensor_region) != desc.num_tensors:
        raise ValueError("tensor count mismatch")
    if not raw_regions or len(raw_regions) > desc.num_tensors:
        raise ValueError("bad region count")
    regions = []
    for reg in raw_regions:
        if not isinstance(reg, dict) or not isinstance(reg.get("rkey"), bytes) or not reg["rkey"]:
            raise ValueError("a region must be {base, len, rkey}")
        base, length = _u64(reg.get("base"), "region base"), _u64(reg.get("len"), "region len")
        if length == 0 or base == 0 or base + length >= 2**64:
            raise ValueError("a region is empty or wraps")
        regions.append({"base": base, "len": length, "rkey": reg["rkey"]})
    for a, r in zip(addrs, tensor_region, strict=True):
        if r >= len(regions):
            raise ValueError("tensor_region names no region")
        reg = regions[r]
        if not reg["base"] <= a or a + desc.size > reg["base"] + reg["len"]:
            raise ValueError("tensor outside its region")
    guard = meta.get("guard")
    if not isinstance(guard, dict):
        raise ValueError("guard must be a dict")
    addr, value = _u64(guard.get("addr"), "guard addr"), _u64(guard.get("word"), "guard word")
    base, span = link.ctl_span
    if link.ctl_rkey is None:  # installed before every lookup (Lookups.ensure_ctl)
        raise ValueError("no key to the peer's control region")
    if not (base <= addr and addr + 8 <= base + span) or value == 0:
        raise ValueError("guard outside the peer's control region")
    strict = guard.get("strict", False)
    if not isinstance(strict, bool):
        raise ValueError("guard strict must be a bool")
    word = (addr, value, strict)
    return cid, desc, addrs, regions, tensor_region, is_blocks, word


def install_remote(state: State, link: Link, meta: dict[str, Any]) -> RemoteCache:
    """Check a peer's cache metadata, unpack its keys, record it on the link.

    A cache already recorded is returned as it is (its keys are not unpacked
    twice). Bad metadata raises LLM_FAILED (a malformed key or a region its
    key does not cover included), a broken link LLM_LINK_FAILED.
    """
    try:
        cid, desc, addrs, regions, tensor_region, is_blocks, word = _parse(link, meta)
    except Exception as exc:  # whatever a hostile peer sends: an LLM error, never a crash
        raise make_error(
            LLMStatusCode.LLM_FAILED,
            f"cluster {link.cluster_id} sent bad cache metadata: {exc}",
        ) from None
    with state.lock:
        if link.broken:
            raise make_error(
                LLMStatusCode.LLM_LINK_FAILED, f"link to cluster {link.cluster_id} broke"
            )
        existing = link.remote.get(cid)
        if existing is None and cid in link.retired:
            raise _retired(link, cid)
    if existing is not None:
        return existing
    rkey_ids = _unpack_keys(state, link, regions)
    rc = RemoteCache(
        cid, desc, addrs, [rkey_ids[r] for r in tensor_region], rkey_ids, bool(is_blocks)
    )
    with state.lock:
        ctl = link.ctl_rkey
        existing = link.remote.get(cid)
        retired = cid in link.retired
        stored = existing is None and not link.broken and ctl is not None and not retired
        if stored:
            assert ctl is not None
            rc.guard = (ctl, word[0], word[1], word[2])
            link.remote[cid] = rc
    if existing is not None:  # a concurrent install won
        release_keys(state, rkey_ids)
        return existing
    if not stored:
        release_keys(state, rkey_ids)
        if retired:
            raise _retired(link, cid)
        raise make_error(LLMStatusCode.LLM_LINK_FAILED, f"link to cluster {link.cluster_id} broke")
    return rc


def _retired(link: Link, cid: int) -> LLMException:
    """A cache the peer retired (``Link.retired``): never recorded again."""
    return make_error(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        f"cache {cid} of cluster {link.cluster_id} was retired",
    )


def _unpack_keys(state: State, link: Link, regions: list[dict[str, Any]]) -> list[int]:
    """The native ids of ``regions``' keys, unpacked (and, same-host, mapped)."""
    engine = state.engine
    rkey_ids: list[int] = []
    try:
        for reg in regions:
            rkey_ids.append(engine.rkey_unpack(link.ep, reg["rkey"], reg["base"], reg["len"]))
    except (native.PeerInputError, OverflowError) as exc:
        # The key's bytes, or the region it claims: the peer's metadata is
        # bad (the engine refused it before UCX read it); the link stays.
        release_keys(state, rkey_ids)
        raise make_error(
            LLMStatusCode.LLM_FAILED, f"cluster {link.cluster_id} sent a malformed key: {exc}"
        ) from None
    except native.NativeError as exc:
        release_keys(state, rkey_ids)
        raise make_error(
            LLMStatusCode.LLM_LINK_FAILED, f"cannot use cluster {link.cluster_id}'s keys: {exc}"
        ) from exc
    return rkey_ids


def release_keys(state: State, rkey_ids: list[int]) -> None:
    """Release native remote keys; the engine destroys each once no job uses it."""
    for k in rkey_ids:
        # Closed engine: every key went with it; unknown id: released already.
        with contextlib.suppress(native.EngineClosedError, native.InvalidArgumentError):
            state.engine.rkey_release(k)


def retire_remote(state: State, rc: RemoteCache) -> None:
    """Stop using a remote cache's keys (idempotent; call with the lock NOT held)."""
    with state.lock:
        rc.valid = False
        ids, rc.rkey_ids = rc.rkey_ids, []
    release_keys(state, ids)


def forget_link(state: State, link: Link) -> None:
    """The link is gone: every remote cache of it becomes unusable."""
    with state.lock:
        remotes = list(link.remote.values())
        link.remote.clear()
        ctl, link.ctl_rkey = link.ctl_rkey, None
    for rc in remotes:
        retire_remote(state, rc)
    if ctl is not None:
        release_keys(state, [ctl])
