"""Scenarios of tests/test_lifetimes.py that may crash the process running them.

``python tests/support/lt_victim.py SCENARIO TRANSPORT [ARGS...]`` runs one
scenario and prints one line ``RESULT {json}``; the test asserts on that
line and on the exit status (a crash is -11 / -7...). Only the public API
(``import aiokvcache as kv``).

Scenarios:

``copy OP SIDE``
    A local copy (``copy_cache``, ``copy_blocks`` or ``swap_blocks``) of
    large caches runs in its worker thread while another thread
    deallocates the copy's ``src`` or ``dst`` cache; new caches filled with a
    canary byte are allocated as soon as the retired memory is released
    (same sizes: the addresses are likely reused).

``unlink HOW FREEZE [BYTES]``
    A peer pushes into our cache X in a loop; we unlink it (plain /
    force), deallocate X at once and allocate canary caches; see
    :func:`unlink_scenario`.

``stress SECONDS``
    Two processes alternating allocate / push both ways / unlink /
    deallocate / re-link / finalize + init, with canaries; see
    :func:`stress_scenario`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import aiokvcache as kv

CANARY = 0xA5
# Run as a script: the suite's support package is beside this file's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def result(**obj: Any) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


async def wait_regions(cm: kv.CacheManager, below: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cm.stats()["regions"] < below:
            return True
        await asyncio.sleep(0.0005)
    return False


async def copy_scenario(transport: str, op: str, side: str) -> None:
    cfg = kv.LLMConfig()
    cfg.transport = transport
    async with kv.LLMDataDist(kv.LLMRole.PROMPT, 1) as dd:
        await dd.init(cfg.generate_options())
        cm = dd.cache_manager
        tensors, blocks, block = 2, 64, 4 << 20  # 256 MiB per tensor
        if op == "copy_cache":
            desc = kv.CacheDesc(
                tensors, [1, blocks * block], kv.DataType.DT_UINT8, kv.Placement.HOST
            )
            src, dst = cm.allocate_cache(desc), cm.allocate_cache(desc)
            free = cm.deallocate_cache
        else:
            desc = kv.CacheDesc(tensors, [blocks, block], kv.DataType.DT_UINT8, kv.Placement.HOST)
            src = cm.allocate_blocks_cache(desc)
            dst = src if op == "copy_blocks" else cm.allocate_blocks_cache(desc)
            free = cm.deallocate_blocks_cache
        for t in src.tensors:
            t[...] = 7
        # dst is left untouched (fresh zero pages): the copy then takes its
        # page faults too, a longer window for the deallocation to land in.
        if op == "copy_cache":
            copy = cm.copy_cache(dst, src)
            watch = dst.tensors[0].reshape(-1)[:1]
        elif op == "copy_blocks":
            half = blocks // 2
            copy = cm.copy_blocks(src, {i: [i + half] for i in range(half)})
            watch = None
        else:
            copy = cm.swap_blocks(src, dst, {i: i for i in range(blocks)})
            watch = None
        victim = src if side == "src" else dst
        keep = dst if victim is src and dst is not src else None
        regions = cm.stats()["regions"]
        task = asyncio.ensure_future(copy)
        # The copy runs in a worker thread now (or is about to).
        await asyncio.sleep(0)
        if watch is not None:
            end = time.monotonic() + 2
            while watch[0] == 0 and time.monotonic() < end:  # noqa: ASYNC110 - polls memory
                await asyncio.sleep(0.0005)
        else:
            await asyncio.sleep(0.005)
        started_copying = not task.done()
        # deallocate_*: documented as callable from any thread.
        thread = threading.Thread(target=free, args=(victim,))
        thread.start()
        thread.join()
        released = await wait_regions(cm, regions, 5)
        canaries = []
        for _ in range(2):
            c = cm.allocate_cache(
                kv.CacheDesc(tensors, [1, blocks * block], kv.DataType.DT_UINT8, kv.Placement.HOST)
            )
            for t in c.tensors:
                t[...] = CANARY
            canaries.append(c)
        status = "LLM_SUCCESS"
        try:
            await task
        except kv.LLMException as exc:
            status = exc.status_code.name
        returned_snapshot = None if keep is None else [t.copy() for t in keep.tensors]
        await asyncio.sleep(0.2)
        written_after = keep is not None and not all(
            np.array_equal(a, t) for a, t in zip(returned_snapshot or [], keep.tensors, strict=True)
        )
        bad = sum(int(np.count_nonzero(t != CANARY)) for c in canaries for t in c.tensors)
        result(
            status=status,
            started_copying=started_copying,
            released=released,
            canary_bytes_changed=bad,
            written_after_return=written_after,
        )


async def unlink_scenario(
    transport: str, how: str, freeze: str, nbytes: str = str(16 << 20)
) -> None:
    """A peer (child) pushes a large cache into our cache X in a loop; we
    unlink it (``how``: plain or force), deallocate X at once and allocate
    canary caches of X's size (likely at X's addresses). ``freeze``:
    "frozen" stops the peer (SIGSTOP) just before our unlink and continues
    it once the canaries are in place; "running" leaves it alone."""
    from aiokvcache.testing import cluster_info
    from support.harness import AsyncPeer

    # Small socket buffers on both sides (the peer inherits them): a TCP
    # sender then holds most of its posted, unconfirmed puts itself instead
    # of the kernel's buffers, as it does on any link slower than its window.
    os.environ.setdefault("UCX_TCP_SNDBUF", "8k")
    os.environ.setdefault("UCX_TCP_RCVBUF", "8k")
    size = int(nbytes)
    cfg = kv.LLMConfig()
    cfg.transport = transport
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.sync_kv_timeout = 60_000
    async with kv.LLMDataDist(kv.LLMRole.DECODER, 2) as dd:
        await dd.init(cfg.generate_options())
        cm = dd.cache_manager
        desc = kv.CacheDesc(2, [1, size], kv.DataType.DT_UINT8, kv.Placement.HOST)
        x = cm.allocate_cache(desc)
        async with AsyncPeer("prefill", transport, lifetime=120) as peer:
            ln = await peer.call("link", address=dd.listen_address, cluster_id=2, timeout_ms=5000)
            assert ln["per"] == ["LLM_SUCCESS"], ln
            await peer.call("alloc", name="s", tensors=2, bytes=size, seed=1)
            await peer.call(
                "loop", loop="l", cluster_id=2, cache_id=x.cache_id, src="s",
                seconds=30, stop_on_error=True, call_timeout=30,
            )  # fmt: skip
            # Pushing now: wait until one landed.
            end = time.monotonic() + 20
            while time.monotonic() < end:
                st = await peer.call("loop_status", loop="l")
                if st["ok"] >= 1 or not st["running"]:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # mid-push
            regions = cm.stats()["regions"]
            # The peer does not listen: only its cluster id matters here.
            info = cluster_info("127.0.0.1:1", 1)
            link = dd._links.get(1)
            live_at_unlink = link is not None and not link.broken
            x_spans = [(a, size) for a in x.tensor_addrs]
            if freeze == "frozen":
                peer.signal(signal.SIGSTOP)
            rc, per = await dd.unlink_clusters([info], timeout=1000, force=how == "force")
            cm.deallocate_cache(x)
            released_early = await wait_regions(cm, regions, 1.0)
            canaries = []
            for _ in range(4):
                c = cm.allocate_cache(desc)
                for t in c.tensors:
                    t[...] = CANARY
                canaries.append(c)
            if freeze == "frozen":
                await asyncio.sleep(0.2)
                peer.signal(signal.SIGCONT)
            released = await wait_regions(cm, regions + len(canaries), 15)
            await asyncio.sleep(1.0)
            bad = sum(int(np.count_nonzero(t != CANARY)) for c in canaries for t in c.tensors)
            summary = await peer.call("loop_join", loop="l", wait=60)
            quarantined = int(cm.stats()["quarantined_bytes"])
            # Quarantined, X's addresses still map (inert) memory: what the
            # peer wrote after the unlink landed there, harmlessly.
            late = 0
            if quarantined:
                from aiokvcache import _native

                for a, n in x_spans:
                    view = np.frombuffer(_native.buffer_from_address(a, n), np.uint8)
                    late += int(np.count_nonzero(view))
        result(
            live_at_unlink=live_at_unlink,
            late_bytes_in_quarantine=late,
            unlink=[rc.name, [s.name for s in per]],
            quarantined=quarantined,
            released_before_thaw=released_early,
            released=released,
            canary_bytes_changed=bad,
            pushes_ok=summary["ok"],
            last=summary["last"],
        )


async def stress_scenario(transport: str, seconds: str) -> None:
    """Rounds, for ``seconds``: allocate, push both ways, unlink (plain or
    forced, by either side, sometimes while the peer pushes), deallocate,
    re-link, and every third round finalize + a fresh LLMDataDist. Every
    freshly allocated region of ours starts with a canary pattern; the
    bystander caches (never transferred) are checked at the end of each
    round and before they are freed; destinations are checked after each
    transfer."""
    import hashlib

    from aiokvcache.testing import cluster_info
    from support.harness import LIFETIMES, AsyncPeer

    def sha(cache: kv.Cache) -> str:
        h = hashlib.sha256()
        for t in cache.tensors:
            h.update(t.tobytes())
        return h.hexdigest()

    def canary(cache: kv.Cache, r: int) -> None:
        for i, t in enumerate(cache.tensors):
            t.reshape(-1)[:] = np.arange(t.size, dtype=np.uint64).astype(np.uint8) ^ (
                (r + i) & 0xFF
            )

    def canary_ok(cache: kv.Cache, r: int) -> int:
        bad = 0
        for i, t in enumerate(cache.tensors):
            want = np.arange(t.size, dtype=np.uint64).astype(np.uint8) ^ ((r + i) & 0xFF)
            bad += int(np.count_nonzero(t.reshape(-1) != want))
        return bad

    cfg = kv.LLMConfig()
    cfg.transport = transport
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.sync_kv_timeout = 60_000
    size = 1 << 20
    desc = kv.CacheDesc(2, [1, size], kv.DataType.DT_UINT8, kv.Placement.HOST)
    stats = {"rounds": 0, "pushes_in": 0, "pushes_out": 0, "relinks": 0, "reinits": 0}
    problems: list[str] = []
    canary_bad = 0
    end = time.monotonic() + float(seconds)
    dd: kv.LLMDataDist | None = None
    async with AsyncPeer("prefill", transport, "--cluster-id=1", ops=LIFETIMES) as peer:
        await peer.call("alloc", name="z", tensors=2, bytes=size, fill=0)
        await peer.call("alloc", name="s", tensors=2, bytes=size, seed=11)
        src_sha = (await peer.call("hash", name="s"))["sha"]
        linked = False
        r = 0
        while time.monotonic() < end and not problems:
            r += 1
            if dd is None:
                dd = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
                await dd.init(cfg.generate_options())
                linked = False
            cm = dd.cache_manager
            if not linked:
                ln = await peer.call("link", address=dd.listen_address, cluster_id=2)
                if ln["per"] != ["LLM_SUCCESS"]:
                    problems.append(f"round {r}: link {ln}")
                    break
                linked = True
                stats["relinks"] += 1
            bystanders = [cm.allocate_cache(desc) for _ in range(2)]
            for i, b in enumerate(bystanders):
                canary(b, r + 7 * i)
            x = cm.allocate_cache(desc)
            canary(x, r + 100)
            res = await peer.call("push", cluster_id=2, cache_id=x.cache_id, src="s")
            if res["status"] != "LLM_SUCCESS" or sha(x) != src_sha:
                problems.append(f"round {r}: push into us {res['status']}")
            stats["pushes_in"] += 1
            y = cm.allocate_cache(desc)
            canary(y, r + 200)
            z_id = 1  # the peer's first cache
            try:
                await cm.push_cache(kv.CacheKeyByIdAndIndex(1, z_id, 0), y, timeout=10)
                if (await peer.call("hash", name="z"))["sha"] != sha(y):
                    problems.append(f"round {r}: push to the peer landed wrong bytes")
                stats["pushes_out"] += 1
            except kv.LLMException as exc:
                problems.append(f"round {r}: push to the peer {exc.status_code.name}")
            # Unlink, sometimes while the peer pushes into x, then retire x.
            busy = r % 2 == 0
            if busy:
                await peer.call(
                    "rloop", loop="l", cluster_id=2, cache_id=x.cache_id, src="s", seconds=2
                )
                await asyncio.sleep(0.02)
            how = ("plain", "force", "peer")[r % 3]
            if how == "peer":
                await peer.call("unlink", address=dd.listen_address, cluster_id=2)
            else:
                await dd.unlink_clusters(
                    [cluster_info("127.0.0.1:1", 1)], timeout=2000, force=how == "force"
                )
            cm.deallocate_cache(x)
            fresh = [cm.allocate_cache(desc) for _ in range(2)]
            for i, b in enumerate(fresh):
                canary(b, r + 300 + i)
            if busy:
                await peer.call("rloop_join", loop="l", at=0.0, timeout=30)
            if how != "peer" and how == "force":
                # The peer keeps its broken side until it unlinks too.
                await peer.call("unlink", address=dd.listen_address, cluster_id=2, force=True)
            linked = False
            await asyncio.sleep(0.05)
            for i, b in enumerate(bystanders):
                canary_bad += canary_ok(b, r + 7 * i)
            for i, b in enumerate(fresh):
                canary_bad += canary_ok(b, r + 300 + i)
            if canary_bad:
                problems.append(f"round {r}: {canary_bad} canary bytes changed")
            for b in bystanders + fresh + [y]:
                cm.deallocate_cache(b)
            if r % 3 == 0:
                await dd.finalize()
                dd = None
                stats["reinits"] += 1
            stats["rounds"] = r
        if dd is not None:
            await dd.finalize()
    result(problems=problems, canary_bytes_changed=canary_bad, **stats)


def main(argv: list[str]) -> None:
    scenario, transport, *rest = argv
    if scenario == "copy":
        asyncio.run(copy_scenario(transport, *rest))
    elif scenario == "unlink":
        asyncio.run(unlink_scenario(transport, *rest))
    elif scenario == "stress":
        asyncio.run(stress_scenario(transport, *rest))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
