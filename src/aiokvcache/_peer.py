"""The peer program of :mod:`aiokvcache.testing`: ``python -m aiokvcache._peer MODE ...``.

One process on the far side of a test, a benchmark or ``python -m aiokvcache
bench``. It prints one JSON object when it is ready (its hello), then
answers each JSON request line ``{"op": ..., ...}`` on stdin with one JSON
line (``{"error": ...}`` when the request failed) until ``{"op": "exit"}``
or end of input. The modes and their requests are listed in
:mod:`aiokvcache.testing`; :class:`aiokvcache.testing.Peer` and
:class:`~aiokvcache.testing.AsyncPeer` start it and speak to it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from . import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
    bench,
)
from .options import KEY_LISTEN_IP_INFO, TRANSPORTS
from .testing import DECODER_ID, cluster_info, options

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def _serve(handle: Handler) -> None:
    """Answer request lines until ``exit`` or end of input."""
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            return
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ValueError(f"not a request: {line.strip()!r}")
        except ValueError as exc:
            _say({"error": str(exc)})
            continue
        if req["op"] == "exit":
            return
        try:
            reply = await handle(req)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _say(reply)


def _unknown(req: dict[str, Any]) -> dict[str, Any]:
    return {"error": f"unknown op {req['op']!r}"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------ decode


async def _decode(args: argparse.Namespace) -> None:
    """The decode side of ``python -m aiokvcache bench``."""
    shape = bench.shape_of(args)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(bench.engine_options(args.transport, True, args.max_inflight))
        cm = dd.cache_manager
        if shape.block_tokens:
            cache = cm.allocate_blocks_cache(shape.desc, BlocksCacheKey(DECODER_ID))
        else:
            cache = cm.allocate_cache(shape.desc)
        # When each layer's notification reached this process (monotonic
        # clock, shared by both processes on one host): the bench's timeline.
        arrivals: dict[str, dict[int, float]] = {}

        async def record() -> None:
            async for note in cm.notifications():
                arrivals.setdefault(str(note.tag), {})[note.layer] = time.monotonic()

        recorder = asyncio.create_task(record())
        _say({"address": dd.listen_address, "cache_id": cache.cache_id})

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            if req["op"] == "wait":
                # Every layer of this tag announced itself: the bytes are
                # in memory now.
                tag = str(req["tag"])
                await cm.wait_for_layers(tag, range(shape.layers), timeout=120)
                await asyncio.sleep(0)  # the recorder sees the last note too
                seen = arrivals.pop(tag, {})
                return {"landed": tag, "arrivals": {str(k): v for k, v in seen.items()}}
            if req["op"] == "digest":
                index = bench.block_order(shape) if shape.block_tokens else 0
                return {"sha": bench.digest(cache, index)}
            return _unknown(req)

        try:
            await _serve(handle)
        finally:
            recorder.cancel()


# ------------------------------------------------------------------ blocks


def blocks_pattern(tensors: int, blocks: int, block_bytes: int) -> np.ndarray:
    """What the ``blocks`` mode's ``BlocksCacheKey(2, 1)`` cache holds."""
    rng = np.random.default_rng(99)
    return rng.integers(0, 256, (tensors, blocks, block_bytes), dtype=np.uint8)


async def _blocks(args: argparse.Namespace) -> None:
    """Blocks caches to push into (key 0, zeroed) and pull from (key 1, patterned)."""
    cfg = options(args.transport, True, sync_kv_timeout=60_000)
    desc = CacheDesc(
        args.tensors, [args.blocks, args.block_bytes], DataType.DT_UINT8, Placement.HOST
    )
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(cfg)
        cm = dd.cache_manager
        caches = [cm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 0))]
        if args.pattern:
            caches.append(cm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 1)))
            src = blocks_pattern(args.tensors, args.blocks, args.block_bytes)
            for t, arr in enumerate(caches[1].tensors):
                arr[...] = src[t]
        _say({"address": dd.listen_address})

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            if req["op"] == "hash":
                ids = [int(i) for i in req.get("blocks", [])]
                tensor = caches[int(req["cache"])].tensors[int(req["tensor"])]
                return {"sha": _sha(tensor[ids].tobytes())}
            return _unknown(req)

        await _serve(handle)


# ------------------------------------------------------------------ blocked

#: The ``blocked`` mode's caches: 8 fp16 tensors of 64 KiB.
BLOCKED_SHAPE = [1, 64, 8, 64]
BLOCKED_TENSORS = 8
#: The ``blocked`` mode's pull source is bound to this key.
BLOCKED_PULL_KEY = CacheKey(DECODER_ID, req_id=7)


def blocked_pattern(tensor: int, nbytes: int) -> np.ndarray:
    """What tensor ``tensor`` of the ``blocked`` mode's pull source holds."""
    return np.arange(nbytes, dtype=np.uint64).astype(np.uint8) ^ tensor


def _block_loop(how: str, seconds: float) -> None:
    """Block the calling thread's event loop the way a model step or barrier would."""
    if how == "sleep":
        time.sleep(seconds)  # a syscall: the GIL is free
        return
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:  # pure Python: the GIL changes hands at switches
        x = (x * 1103515245 + 12345) % 2**31


async def _blocked(args: argparse.Namespace) -> None:
    """A decoder that blocks its own event loop on request (``block``).

    Caches: ``push`` (a push target), ``pull`` (bound to BLOCKED_PULL_KEY,
    filled with :func:`blocked_pattern`), ``gone`` (deallocated on request).
    ``{"op": "block", "how": "sleep"|"busy", "seconds": S}`` answers
    ``{"blocking": true}`` at once, blocks the loop for S seconds, then
    answers ``{"unblocked_at": time.time(), "sha": sha256 of push}``. While
    it blocks, a ``{"op": "dealloc"}`` line is taken by a helper thread,
    which deallocates ``gone`` from there and answers ``{"released": true}``
    once the engine gave the memory back.
    """
    cfg = options(args.transport, True)
    desc = CacheDesc(BLOCKED_TENSORS, BLOCKED_SHAPE, DataType.DT_FLOAT16, Placement.HOST)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(cfg)
        cm = dd.cache_manager
        push = cm.allocate_cache(desc)
        pull = cm.allocate_cache(desc, [BLOCKED_PULL_KEY])
        gone = cm.allocate_cache(desc)
        for i, t in enumerate(pull.tensors):
            t.view(np.uint8).reshape(-1)[:] = blocked_pattern(i, t.nbytes)
        _say(
            {
                "address": dd.listen_address,
                "push": push.cache_id,
                "pull": pull.cache_id,
                "gone": gone.cache_id,
            }
        )

        def helper() -> None:
            line = sys.stdin.readline()
            if not line or json.loads(line).get("op") != "dealloc":
                return
            before = int(cm.stats()["regions"])
            cm.deallocate_cache(gone)  # from this thread, the loop being blocked
            while int(cm.stats()["regions"]) >= before:
                time.sleep(0.01)
            _say({"released": True})

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            if req["op"] == "block":
                thread = threading.Thread(target=helper, name="dealloc", daemon=True)
                thread.start()
                _say({"blocking": True})
                _block_loop(str(req["how"]), float(req["seconds"]))
                unblocked_at = time.time()
                thread.join()
                data = b"".join(t.tobytes() for t in push.tensors)
                return {"unblocked_at": unblocked_at, "sha": _sha(data)}
            return _unknown(req)

        await _serve(handle)


# ------------------------------------------------------------------ engine


async def _engine(args: argparse.Namespace) -> None:
    """A bare native engine owning one region (for engine tests and bench_put)."""
    from ._loader import native

    size = args.size
    ucx_options = json.loads(args.ucx_options)
    kw: dict[str, Any] = {"ucx_options": ucx_options} if ucx_options else {}
    eng = native.Engine(args.transport, **kw)
    try:
        rid, addr = eng.mem_alloc(size)
        mem = np.frombuffer(native.buffer_from_address(addr, size), dtype=np.uint8)
        mem[:] = 0  # every page touched now: none faults in later
        _say(
            {
                "worker": eng.worker_address.hex(),
                "addr": addr,
                "size": size,
                "rkey": eng.rkey_pack(rid).hex(),
                "pid": os.getpid(),
            }
        )
        notes: list[str] = []

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            op = req["op"]
            if op == "hash":
                off, n = int(req["offset"]), int(req["length"])
                return {"sha": _sha(mem[off : off + n].tobytes())}
            if op == "fill":
                rng = np.random.default_rng(int(req["seed"]))
                mem[:] = rng.integers(0, 256, size, dtype=np.uint8)
                return {"ok": True}
            if op == "accept_notes":
                # Notifications carrying this key come from the caller (a
                # bare engine attributes them by key, as a link does).
                back = eng.connect(bytes.fromhex(str(req["worker"])), False)
                eng.set_note_keys(
                    back, os.urandom(native.NOTE_KEY_LEN), bytes.fromhex(str(req["key"])), 1
                )
                return {"ok": True}
            if op == "notes":
                want = int(req["count"])
                deadline = time.monotonic() + 10
                while len(notes) < want and time.monotonic() < deadline:
                    for kind, _id, _st, _ucs, _n, payload in eng.drain():
                        if kind == native.KIND_NOTIFY:
                            # The bytes must be there when the notification is.
                            at, length, sha = payload.decode().split(":")
                            got = _sha(mem[int(at) : int(at) + int(length)].tobytes())
                            notes.append("ok" if got == sha else "early")
                    await asyncio.sleep(0.001)
                return {"notes": notes}
            return _unknown(req)

        await _serve(handle)
    finally:
        eng.close()


# ------------------------------------------------------------------ prefill / decoder


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _node_options(args: argparse.Namespace) -> dict[str, str]:
    extra: dict[str, Any] = {"sync_kv_timeout": args.sync_kv_timeout}
    if args.auth_token:
        extra["auth_token"] = args.auth_token
    if args.net_devices:
        extra["net_devices"] = args.net_devices
    cfg = options(args.transport, **extra)
    if args.listen:
        cfg[KEY_LISTEN_IP_INFO] = args.listen
    return cfg


async def _timed_status(aw: Awaitable[Any]) -> dict[str, Any]:
    """Run ``aw``: its status name, start and end (``time.monotonic()``)."""
    start = time.monotonic()
    try:
        await aw
        status, error = "LLM_SUCCESS", None
    except LLMException as exc:
        status, error = exc.status_code.name, str(exc)
    except Exception as exc:
        status, error = "EXCEPTION", f"{type(exc).__name__}: {exc}"
    end = time.monotonic()
    out: dict[str, Any] = {"status": status, "start": start, "end": end, "seconds": end - start}
    if error is not None:
        out["message"] = error[:500]
    return out


def _summary(done: list[dict[str, Any]]) -> dict[str, Any]:
    """What a push loop did so far."""
    failed = [r for r in done if r["status"] != "LLM_SUCCESS"]
    return {
        "done": len(done),
        "ok": len(done) - len(failed),
        "failed": failed[:5],
        "last": done[-1] if done else None,
        "last_ok_src": next((r["src"] for r in reversed(done) if r not in failed), None),
        "max_seconds": max((r["seconds"] for r in done), default=0.0),
    }


def _key_of(req: dict[str, Any]) -> CacheKeyByIdAndIndex:
    return CacheKeyByIdAndIndex(
        int(req["cluster_id"]), int(req["cache_id"]), int(req.get("index", 0))
    )


def _cache_sha(cache: Cache) -> str:
    return _sha(b"".join(t.tobytes() for t in cache.tensors))


def _fill(cache: Cache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)


class _Node:
    """An LLMDataDist driven op by op: the caches and push loops it owns, one
    method per request op (see :data:`_NODE_OPS`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.role = LLMRole.PROMPT if args.mode == "prefill" else LLMRole.DECODER
        self.cfg = _node_options(args)
        self.dd = LLMDataDist(self.role, args.cluster_id)
        self.caches: dict[str, Cache] = {}
        self.loops: dict[str, asyncio.Task[list[dict[str, Any]]]] = {}
        self.progress: dict[str, list[dict[str, Any]]] = {}

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = _NODE_OPS.get(req["op"])
        if op is None:
            return _unknown(req)
        return await op(self, req)

    def stop_loops(self) -> None:
        for task in self.loops.values():
            task.cancel()

    # ------------------------------------------------------------ caches

    async def alloc(self, req: dict[str, Any]) -> dict[str, Any]:
        desc = CacheDesc(
            int(req["tensors"]), [1, int(req["bytes"])], DataType.DT_UINT8, Placement.HOST
        )
        cache = self.dd.cache_manager.allocate_cache(desc)
        if req.get("seed") is not None:
            _fill(cache, int(req["seed"]))
        self.caches[str(req["name"])] = cache
        return {
            "cache_id": cache.cache_id,
            "addrs": cache.tensor_addrs,
            "tensor_bytes": int(req["bytes"]),
            "sha": _cache_sha(cache),
        }

    async def fill(self, req: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(req["name"])]
        _fill(cache, int(req["seed"]))
        return {"sha": _cache_sha(cache)}

    async def hash(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"sha": _cache_sha(self.caches[str(req["name"])])}

    async def free(self, req: dict[str, Any]) -> dict[str, Any]:
        self.dd.cache_manager.deallocate_cache(self.caches.pop(str(req["name"])))
        return {"freed": True}

    # ------------------------------------------------------------ links

    async def link(self, req: dict[str, Any]) -> dict[str, Any]:
        info = cluster_info(str(req["address"]), int(req["cluster_id"]))
        start = time.monotonic()
        timeout = int(req.get("timeout_ms", 3000))
        if req["op"] == "link":
            rc, per = await self.dd.link_clusters([info], timeout=timeout)
        else:
            rc, per = await self.dd.unlink_clusters(
                [info], timeout=timeout, force=bool(req.get("force"))
            )
        return {
            "status": rc.name,
            "per": [s.name for s in per],
            "seconds": time.monotonic() - start,
        }

    # ------------------------------------------------------------ transfers

    def _push_of(self, req: dict[str, Any], src: str | None = None) -> Awaitable[None]:
        return self.dd.cache_manager.push_cache(
            _key_of(req),
            self.caches[src or str(req["src"])],
            timeout=float(req.get("call_timeout", 5)),
        )

    async def push(self, req: dict[str, Any]) -> dict[str, Any]:
        return await _timed_status(self._push_of(req))

    async def pull(self, req: dict[str, Any]) -> dict[str, Any]:
        dst = self.caches[str(req["dst"])]
        timeout = float(req.get("call_timeout", 5))
        return await _timed_status(
            self.dd.cache_manager.pull_cache(_key_of(req), dst, timeout=timeout)
        )

    async def _push_loop(
        self, req: dict[str, Any], done: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        # Pushes back to back, from "srcs" in turn (or "src"), for "count"
        # pushes or "seconds", stopping at the first error if "stop_on_error".
        deadline = time.monotonic() + float(req.get("seconds", 60))
        count = int(req.get("count", 1 << 30))
        stop_on_error = bool(req.get("stop_on_error", True))
        srcs = [str(x) for x in req.get("srcs", [req.get("src")])]
        while len(done) < count and time.monotonic() < deadline:
            src = srcs[len(done) % len(srcs)]
            res = await _timed_status(self._push_of(req, src))
            res["src"] = src
            done.append(res)
            if res["status"] != "LLM_SUCCESS" and stop_on_error:
                break
        return done

    async def loop(self, req: dict[str, Any]) -> dict[str, Any]:
        name = str(req["loop"])
        self.progress[name] = []
        self.loops[name] = asyncio.create_task(self._push_loop(req, self.progress[name]))
        return {"started": name}

    async def loop_status(self, req: dict[str, Any]) -> dict[str, Any]:
        name = str(req["loop"])
        return {"running": not self.loops[name].done(), **_summary(self.progress[name])}

    async def loop_join(self, req: dict[str, Any]) -> dict[str, Any]:
        name = str(req["loop"])
        async with asyncio.timeout(float(req.get("wait", 60))):
            done = await self.loops.pop(name)
        return _summary(done)

    # ------------------------------------------------------------ the instance

    async def reinit(self, req: dict[str, Any]) -> dict[str, Any]:
        # A fresh LLMDataDist (new engine, new links); caches are gone.
        start = time.monotonic()
        self.stop_loops()
        self.loops.clear()
        self.caches.clear()
        await self.dd.finalize()
        self.dd = LLMDataDist(self.role, self.args.cluster_id)
        await self.dd.init(self.cfg)
        return {"seconds": time.monotonic() - start, "address": self.dd.listen_address}

    async def rss(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"rss_kb": _rss_kb()}

    async def stats(self, req: dict[str, Any]) -> dict[str, Any]:
        return {k: int(v) for k, v in self.dd.cache_manager.stats().items()}


#: The requests a prefill / decoder node answers, by op.
_NODE_OPS: dict[str, Callable[[_Node, dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    "alloc": _Node.alloc,
    "fill": _Node.fill,
    "hash": _Node.hash,
    "free": _Node.free,
    "link": _Node.link,
    "unlink": _Node.link,
    "push": _Node.push,
    "pull": _Node.pull,
    "loop": _Node.loop,
    "loop_status": _Node.loop_status,
    "loop_join": _Node.loop_join,
    "reinit": _Node.reinit,
    "rss": _Node.rss,
    "stats": _Node.stats,
}


async def _node(args: argparse.Namespace) -> None:
    """An LLMDataDist driven op by op: ``prefill`` and ``decoder`` modes."""
    node = _Node(args)
    await node.dd.init(node.cfg)
    _say(
        {
            "address": node.dd.listen_address,
            "pid": os.getpid(),
            "cluster_id": args.cluster_id,
            "rss_kb": _rss_kb(),
        }
    )
    try:
        await _serve(node.handle)
    finally:
        node.stop_loops()
        await node.dd.finalize()


# ------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--lifetime", type=float, default=None, help="exit after this many seconds, whatever"
    )
    p = argparse.ArgumentParser(prog="python -m aiokvcache._peer", description=__doc__)
    sub = p.add_subparsers(dest="mode", required=True)
    dec = sub.add_parser("decode", parents=[common], help="the bench's decode side")
    bench.add_shape_arguments(dec)
    blk = sub.add_parser("blocks", parents=[common], help="blocks caches to push into, pull from")
    blk.add_argument("transport", choices=TRANSPORTS)
    blk.add_argument("tensors", type=int)
    blk.add_argument("blocks", type=int)
    blk.add_argument("block_bytes", type=int)
    blk.add_argument(
        "--pattern",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also own BlocksCacheKey(2, 1), filled from seed 99 (default on)",
    )
    bl = sub.add_parser("blocked", parents=[common], help="a decoder that blocks its event loop")
    bl.add_argument("transport", choices=TRANSPORTS)
    eng = sub.add_parser("engine", parents=[common], help="a bare engine owning one region")
    eng.add_argument("transport", choices=TRANSPORTS)
    eng.add_argument("size", type=int)
    eng.add_argument("--ucx-options", default="{}", help="UCX options, a JSON object")
    for mode, cid, what in (
        ("prefill", 1, "a prompt LLMDataDist that links, pushes and pulls on request"),
        ("decoder", 2, "a listening decoder LLMDataDist driven op by op"),
    ):
        node = sub.add_parser(mode, parents=[common], help=what)
        node.add_argument("transport", choices=TRANSPORTS)
        node.add_argument("--cluster-id", type=int, default=cid)
        node.add_argument(
            "--listen",
            default="127.0.0.1:0" if mode == "decoder" else None,
            help="control-plane listen address ip:port",
        )
        node.add_argument("--auth-token", default=None)
        node.add_argument("--net-devices", default=None, help="the data plane's interfaces")
        node.add_argument("--sync-kv-timeout", type=int, default=60_000, help="ms per layer")
    return p


MODES: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, None]]] = {
    "decode": _decode,
    "blocks": _blocks,
    "blocked": _blocked,
    "engine": _engine,
    "prefill": _node,
    "decoder": _node,
}


def _watchdog(seconds: float) -> None:
    def run() -> None:
        time.sleep(seconds)
        os._exit(124)

    threading.Thread(target=run, name="lifetime", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Run one mode until told to exit."""
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    if args.lifetime is not None:
        _watchdog(args.lifetime)
    asyncio.run(MODES[args.mode](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
