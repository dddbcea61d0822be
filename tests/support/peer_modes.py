"""The test suite's peer program: ``python tests/support/peer_modes.py MODE ...``.

One process on the far side of a test or a benchmark. It prints one JSON
object when it is ready (its hello), then answers each JSON request line
``{"op": ..., ...}`` on stdin with one JSON line (``{"error": ...}`` when the
request failed) until ``{"op": "exit"}`` or end of input. Its modes:

``prefill TRANSPORT`` / ``decoder TRANSPORT``
    the public peer program, :mod:`aiokvcache.testing.peer` (an
    ``LLMDataDist`` driven op by op; see there).
``decode``
    the decode side of ``python -m aiokvcache bench``
    (:mod:`aiokvcache._benchpeer`; the bench's shape options).
``blocks TRANSPORT TENSORS BLOCKS BLOCK_BYTES``
    a decoder owning two uint8 blocks caches, ``BlocksCacheKey(2, 0)``
    zeroed and ``BlocksCacheKey(2, 1)`` filled from seed 99 (unless
    ``--no-pattern``); ``hello = {"address"}``; op ``hash`` (``cache``,
    ``tensor``, ``blocks``).
``blocked TRANSPORT``
    a decoder that blocks its own event loop on request (``time.sleep``
    or a pure-Python busy loop), to show that peers are served meanwhile;
    ``hello = {"address", "push", "pull", "gone"}`` (cache ids); ops
    ``block`` (``how``, ``seconds``: answers ``{"blocking": true}``, then
    ``{"unblocked_at", "sha"}``) and, while blocked, ``dealloc``.
``agent TRANSPORT``
    the vLLM connector's ``TransferAgent`` over NumPy KV (no vLLM);
    ``hello = {"address", "cluster_id", "pid"}``; ops ``hold`` (P: ``req_id``,
    ``blocks``, ``seed``: answers the grant ``key``, ``until_ms``, ``digest``),
    ``expect_push`` (D: ``req_id``, ``address``, ``cluster_id``, ``xid``,
    ``blocks``), ``results``, ``state`` (``pending``, ``stats``),
    ``health`` (``loop_errors``, ``service_errors``).
``engine TRANSPORT SIZE``
    a bare native engine owning one zeroed region; ``hello = {"worker",
    "addr", "size", "rkey", "pid"}``; ops ``hash`` (``offset``,
    ``length``), ``fill`` (``seed``), ``notes`` (``count``).

Every mode exits on ``{"op": "exit"}`` or end of input, ignores SIGINT
(its parent decides when it ends) and takes ``--lifetime SECONDS``.
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
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from aiokvcache import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMRole,
    Placement,
    _benchpeer,
    bench,
)
from aiokvcache._child import say, serve, unknown
from aiokvcache._loader import native
from aiokvcache.options import TRANSPORTS
from aiokvcache.testing import DECODER_ID, options
from aiokvcache.testing import peer as testing_peer


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
        say({"address": dd.listen_address})

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            if req["op"] == "hash":
                ids = [int(i) for i in req.get("blocks", [])]
                tensor = caches[int(req["cache"])].tensors[int(req["tensor"])]
                return {"sha": _sha(tensor[ids].tobytes())}
            return unknown(req)

        await serve(handle)


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
        say(
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
            say({"released": True})

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            if req["op"] == "block":
                thread = threading.Thread(target=helper, name="dealloc", daemon=True)
                thread.start()
                say({"blocking": True})
                _block_loop(str(req["how"]), float(req["seconds"]))
                unblocked_at = time.time()
                thread.join()
                data = b"".join(t.tobytes() for t in push.tensors)
                return {"unblocked_at": unblocked_at, "sha": _sha(data)}
            return unknown(req)

        await serve(handle)


# ------------------------------------------------------------------ engine


async def _engine(args: argparse.Namespace) -> None:
    """A bare native engine owning one region (for engine tests and bench_put)."""
    size = args.size
    ucx_options = json.loads(args.ucx_options)
    kw: dict[str, Any] = {"ucx_options": ucx_options} if ucx_options else {}
    eng = native.Engine(args.transport, **kw)
    try:
        rid, addr = eng.mem_alloc(size)
        mem = np.frombuffer(native.buffer_from_address(addr, size), dtype=np.uint8)
        mem[:] = 0  # every page touched now: none faults in later
        say(
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
                    for kind, _id, _st, _ucs, _n, payload, *_ in eng.drain():
                        if kind == native.KIND_NOTIFY:
                            # The bytes must be there when the notification is.
                            at, length, sha = payload.decode().split(":")
                            got = _sha(mem[int(at) : int(at) + int(length)].tobytes())
                            notes.append("ok" if got == sha else "early")
                    await asyncio.sleep(0.001)
                return {"notes": notes}
            return unknown(req)

        await serve(handle)
    finally:
        eng.close()


# ------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--lifetime", type=float, default=None, help="exit after this many seconds, whatever"
    )
    p = argparse.ArgumentParser(prog="peer_modes.py", description=__doc__)
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
    ag = sub.add_parser("agent", parents=[common], help="the vLLM connector's TransferAgent")
    ag.add_argument("transport", choices=TRANSPORTS)
    ag.add_argument("--cluster-id", type=int, default=3)
    eng = sub.add_parser("engine", parents=[common], help="a bare engine owning one region")
    eng.add_argument("transport", choices=TRANSPORTS)
    eng.add_argument("size", type=int)
    eng.add_argument("--ucx-options", default="{}", help="UCX options, a JSON object")
    return p


async def _decode(args: argparse.Namespace) -> None:
    await _benchpeer._decode(args)


# ------------------------------------------------------------------ agent

#: The ``agent`` mode's KV: layers of [blocks, block bytes] uint8, block size 4.
AGENT_LAYERS, AGENT_BLOCKS, AGENT_BLOCK_BYTES, AGENT_BS = 2, 32, 256, 4


def agent_layout(addrs: tuple[int, ...]) -> Any:
    """The ``agent`` mode's KV layout over ``addrs`` (one tensor a layer)."""
    from aiokvcache.integrations.agent.kvtypes import KVLayout

    return KVLayout(AGENT_LAYERS, 1, AGENT_BLOCKS, AGENT_BLOCK_BYTES, AGENT_BS, addrs, "u8")


async def _agent(args: argparse.Namespace) -> None:
    """The vLLM connector's TransferAgent over NumPy KV, no vLLM (its messages
    are a fuzz target): ops ``hold``, ``expect_push``, ``results``, ``state``,
    ``health``."""
    from aiokvcache.integrations.agent.kvlink import TransferAgent
    from aiokvcache.integrations.agent.kvtypes import Peer

    kv = [np.zeros((AGENT_BLOCKS, AGENT_BLOCK_BYTES), np.uint8) for _ in range(AGENT_LAYERS)]
    layout = agent_layout(tuple(a.ctypes.data for a in kv))
    agent = TransferAgent(args.cluster_id, layout, transport=args.transport, timeout=5.0, grace=1.0)
    address = await asyncio.to_thread(agent.start)
    errors: list[str] = []
    loop = agent._loop
    assert loop is not None
    loop.call_soon_threadsafe(
        loop.set_exception_handler, lambda _l, ctx: errors.append(str(ctx.get("message"))[:300])
    )
    testing_peer.watch_service_errors()
    say({"address": address, "cluster_id": agent.cluster_id, "pid": os.getpid()})

    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "hold":  # P: a finished request's blocks, filled from seed, held
            blocks = [int(b) for b in req["blocks"]]
            rng = np.random.default_rng(int(req["seed"]))
            for layer in kv:
                layer[blocks] = rng.integers(1, 255, (len(blocks), AGENT_BLOCK_BYTES), np.uint8)
            until_ms = int((time.time() + 3600) * 1000)
            key = agent.grant_key(str(req["req_id"]), blocks, until_ms)
            agent.hold(str(req["req_id"]), float(req.get("lease", 30)), blocks, until_ms)
            return {"key": key, "until_ms": until_ms, "digest": agent.block_digest(blocks)}
        if op == "expect_push":  # D: wait for a push transfer from a peer
            host, port = str(req["address"]).rsplit(":", 1)
            peer = Peer(host, int(port), int(req["cluster_id"]))
            agent.expect_push(
                str(req["req_id"]),
                peer,
                str(req["xid"]),
                req["blocks"],
                key=str(req.get("key", "")),
            )
            return {"expecting": True}
        if op == "results":
            got = agent.take_results()
            return {k: sorted(map(str, v)) for k, v in vars(got).items()}
        if op == "state":
            return {"pending": agent.pending(), "stats": dict(agent.stats)}
        if op == "health":
            return {"loop_errors": errors, "service_errors": testing_peer.service_errors()}
        return unknown(req)

    try:
        await serve(handle)
    finally:
        agent.close()


MODES: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, None]]] = {
    "decode": _decode,
    "blocks": _blocks,
    "blocked": _blocked,
    "engine": _engine,
    "agent": _agent,
}


def main(argv: list[str] | None = None) -> int:
    """Run one mode until told to exit."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    if argv and argv[0] in ("prefill", "decoder"):
        args = testing_peer.finish_args(testing_peer.parser().parse_args(argv))
        run = testing_peer.run
    else:
        args = _parser().parse_args(argv)
        run = MODES[args.mode]
    testing_peer.guard(args.lifetime)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
