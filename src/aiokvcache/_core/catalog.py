"""Cache metadata on the wire: what we tell peers of our caches, what we keep of theirs.

Serving side: :func:`metadata` describes a local cache (addresses,
descriptor, packed keys). Using side: :func:`install_remote` checks a peer's
description and unpacks its keys into a :class:`~.state.RemoteCache` on the
link. Both run on the service thread; table updates take the state lock.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .._loader import native
from .errors import LLMException, LLMStatusCode, make_error
from .state import Link, LocalCache, RemoteCache, State
from .types import CacheDesc, DataType, Placement

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
    """What a peer needs to use ``rec``: addresses, descriptor, packed keys."""
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
    }


def install_remote(state: State, link: Link, meta: dict[str, Any]) -> RemoteCache:
    """Check a peer's cache metadata, unpack its keys, record it on the link.

    A cache already recorded is returned as it is (its keys are not unpacked
    twice). Bad metadata raises LLM_FAILED, a broken link LLM_LINK_FAILED.
    """
    try:
        cid = int(meta["cache_id"])
        desc = desc_from_wire(meta["desc"])
        addrs = [int(a) for a in meta["addrs"]]
        regions = meta["regions"]
        tensor_region = [int(i) for i in meta["tensor_region"]]
        is_blocks = meta.get("is_blocks", False)
        if not isinstance(is_blocks, bool):
            raise ValueError("is_blocks must be a bool")
        if len(addrs) != desc.num_tensors or len(tensor_region) != desc.num_tensors:
            raise ValueError("tensor count mismatch")
        for a, r in zip(addrs, tensor_region, strict=True):
            reg = regions[r]
            if not reg["base"] <= a or a + desc.size > reg["base"] + reg["len"]:
                raise ValueError("tensor outside its region")
    except (KeyError, TypeError, ValueError, IndexError, LLMException) as exc:
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
    if existing is not None:
        return existing
    engine = state.engine
    rkey_ids: list[int] = []
    try:
        for reg in regions:
            rkey_ids.append(engine.rkey_unpack(link.ep, reg["rkey"], reg["base"], reg["len"]))
    except native.NativeError as exc:
        release_keys(state, rkey_ids)
        raise make_error(
            LLMStatusCode.LLM_LINK_FAILED, f"cannot use cluster {link.cluster_id}'s keys: {exc}"
        ) from exc
    rc = RemoteCache(
        cid, desc, addrs, [rkey_ids[r] for r in tensor_region], rkey_ids, bool(is_blocks)
    )
    with state.lock:
        existing = link.remote.get(cid)
        if existing is None and not link.broken:
            link.remote[cid] = rc
    if existing is not None:  # a concurrent install won
        release_keys(state, rkey_ids)
        return existing
    return rc


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
    for rc in remotes:
        retire_remote(state, rc)
