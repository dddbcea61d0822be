"""The peer program of :mod:`aiokvcache.testing`: ``python -m aiokvcache.testing.peer``.

Usage: ``python -m aiokvcache.testing.peer ROLE TRANSPORT [options]``.

An :class:`~aiokvcache.LLMDataDist` in its own process, driven op by op
(:class:`aiokvcache.testing.PeerProcess` starts it and speaks to it). ROLE is
``decoder`` (cluster 2, listening on 127.0.0.1:0 by default) or ``prefill``
(cluster 1, a client unless ``--listen``). It prints its hello,
``{"address", "pid", "cluster_id", "rss_kb"}``, then answers one JSON line per
request (``{"error": ...}`` when one failed) until ``{"op": "exit"}`` or end of
input:

* caches, named by the caller: ``alloc`` (``name``, ``tensors``, ``bytes``,
  ``blocks``: a blocks cache of ``[blocks, bytes // blocks]`` bound to
  ``BlocksCacheKey(cluster_id)``, else ``[batch, bytes]`` (``batch`` 1 by
  default); ``seed``: random bytes;
  answers ``cache_id``, ``addrs``, ``sha``), ``fill`` (``seed``), ``hash``
  (``blocks``: only those), ``free``;
* links: ``link`` / ``unlink`` (``address``, ``cluster_id``, ``timeout_ms``,
  ``force``; answer ``status``, ``per``, ``seconds``, ``cpu_s``: this
  process's CPU over the call);
* transfers, whose failure is an answer: ``push`` / ``pull`` (``cluster_id``,
  ``cache_id``, ``index``, ``src`` / ``dst``, ``call_timeout`` seconds) and
  ``wait`` (``tag``, ``layers``, ``wait_timeout``: its ``wait_for_layers``)
  answer ``status`` (an ``LLMStatusCode`` name), ``start``, ``end`` (its
  ``time.monotonic()``), ``seconds``, ``message``; ``loop`` (``loop``,
  ``count``, ``seconds``, ``srcs``, ``stop_on_error``) pushes back to back in
  the background, ``loop_status`` / ``loop_join`` (``wait`` seconds) report;
  ``rounds`` (``src``, ``seconds``, ``start_at``; ``cluster_id`` with
  ``src_blocks`` / ``dst_blocks`` / ``model_id`` for push_blocks to a
  BlocksCacheKey, or ``cache_id`` / ``slot`` for push_cache) pushes every
  layer of ``src`` at once, round after round, and answers ``rounds``,
  ``pushes``, ``failed``, ``bytes``, ``seconds``, ``p50`` / ``p99`` (s);
* ``reinit`` (a fresh LLMDataDist), ``rss``, ``stats``, ``health`` (its
  ``live_jobs`` and the errors that reached its peer-service loop).

It ignores SIGINT (its parent decides when it ends) and exits after
``--lifetime`` seconds whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiokvcache import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
)
from aiokvcache.options import KEY_LISTEN_IP_INFO, TRANSPORTS

from .._child import say, serve, unknown
from . import cluster_info, options

__all__ = [
    "finish_args",
    "guard",
    "main",
    "parser",
    "run",
    "service_errors",
    "watch_service_errors",
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    given = json.loads(args.options)
    if not isinstance(given, dict):
        raise SystemExit("--options must be a JSON object")
    extra.update(given)
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
    """What a push loop did so far (a layer loop: each layer's status too)."""
    failed = [r for r in done if r["status"] != "LLM_SUCCESS"]
    by_layer = {str(r["layer"]): r["status"] for r in done if "layer" in r}
    froze = [r["froze_mid_layer"] for r in done if "froze_mid_layer" in r]
    return {
        **({"layers": by_layer} if by_layer else {}),
        **({"froze_mid_layer": froze[0]} if froze else {}),
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
        self.thaws = 0  # SIGCONTs received (push_layers: a thaw cancels a freeze to come)

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = _NODE_OPS.get(req["op"])
        if op is None:
            return unknown(req)
        return await op(self, req)

    def count_thaw(self) -> None:
        self.thaws += 1

    def stop_loops(self) -> None:
        for task in self.loops.values():
            task.cancel()

    # ------------------------------------------------------------ caches

    async def alloc(self, req: dict[str, Any]) -> dict[str, Any]:
        tensors, nbytes, blocks = int(req["tensors"]), int(req["bytes"]), req.get("blocks")
        cm = self.dd.cache_manager
        if blocks is None:
            batch = int(req.get("batch", 1))
            desc = CacheDesc(tensors, [batch, nbytes], DataType.DT_UINT8, Placement.HOST)
            cache = cm.allocate_cache(desc)
        else:
            shape = [int(blocks), nbytes // int(blocks)]
            desc = CacheDesc(tensors, shape, DataType.DT_UINT8, Placement.HOST)
            cache = cm.allocate_blocks_cache(desc, BlocksCacheKey(self.args.cluster_id))
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
        cache = self.caches[str(req["name"])]
        if req.get("blocks") is None:
            return {"sha": _cache_sha(cache)}
        ids = [int(b) for b in req["blocks"]]
        return {"sha": _sha(b"".join(t[ids].tobytes() for t in cache.tensors))}

    async def wait(self, req: dict[str, Any]) -> dict[str, Any]:
        layers = [int(x) for x in req["layers"]]
        tmo = float(req.get("wait_timeout", 30))
        return await _timed_status(
            self.dd.cache_manager.wait_for_layers(str(req["tag"]), layers, timeout=tmo)
        )

    async def free(self, req: dict[str, Any]) -> dict[str, Any]:
        self.dd.cache_manager.deallocate_cache(self.caches.pop(str(req["name"])))
        return {"freed": True}

    # ------------------------------------------------------------ links

    async def link(self, req: dict[str, Any]) -> dict[str, Any]:
        info = cluster_info(str(req["address"]), int(req["cluster_id"]))
        start, cpu = time.monotonic(), time.process_time()
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
            "cpu_s": time.process_time() - cpu,  # this process's, every thread
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

    async def rounds(self, req: dict[str, Any]) -> dict[str, Any]:
        # Every layer of cache "src" in flight at once, round after round, for
        # "seconds" (from "start_at", this host's time.monotonic(), if given):
        # push_blocks of "src_blocks" to "dst_blocks" of BlocksCacheKey
        # ("cluster_id", "model_id"), or with "slot" push_cache to batch "slot"
        # of cache "cache_id". Answers what moved and the layer latencies.
        cm = self.dd.cache_manager
        src = self.caches[str(req["src"])]
        layers = src.cache_desc.num_tensors // 2
        tmo = float(req.get("call_timeout", 10))
        push = _round_pusher(cm, src, req, tmo)
        start_at = float(req.get("start_at", 0))
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        start = time.monotonic()
        end = start + float(req["seconds"])
        lat: list[float] = []
        errors: list[str] = []

        async def one(layer: int) -> None:
            t0 = time.perf_counter()
            try:
                await push(layer)
            except LLMException as exc:
                errors.append(f"{exc.status_code.name}: {exc.message}"[:300])
                return
            lat.append(time.perf_counter() - t0)

        n = 0
        while time.monotonic() < end:
            await asyncio.gather(*(one(layer) for layer in range(layers)))
            n += 1
        elapsed = time.monotonic() - start
        lat.sort()
        return {
            "rounds": n,
            "pushes": len(lat),
            "failed": len(errors),
            "first_error": errors[0] if errors else None,
            "bytes": len(lat) * 2 * _round_bytes(src, req),
            "seconds": elapsed,
            "p50": _quantile(lat, 0.5),
            "p99": _quantile(lat, 0.99),
        }

    async def loop(self, req: dict[str, Any]) -> dict[str, Any]:
        name = str(req["loop"])
        self.progress[name] = []
        self.loops[name] = asyncio.create_task(self._push_loop(req, self.progress[name]))
        return {"started": name}

    async def push_layers(self, req: dict[str, Any]) -> dict[str, Any]:
        # Cache "src" into batch "index" of cache "cache_id" of cluster
        # "cluster_id" layer by layer, each push tagged "tag" (what the decode
        # side's wait_for_layers / notifications() see): "layers" (default
        # every layer) in order, "every_ms" apart, the first "stop_after" only
        # if given; with "freeze_at" k, once layer k's jobs are submitted this
        # whole process stops (SIGSTOP) while its bytes move, and goes on with
        # the next layers when thawed. In the background: the answer comes at
        # once, loop_join("layers:" + tag) gives each layer's status.
        name = "layers:" + str(req["tag"])
        self.progress[name] = []
        req = {**req, "thaws": self.thaws}  # counted from here, not from the loop's start
        self.loops[name] = asyncio.create_task(self._layer_loop(req, self.progress[name]))
        return {"started": name}

    async def _layer_loop(
        self, req: dict[str, Any], done: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        src = self.caches[str(req["src"])]
        layers = [int(x) for x in req.get("layers") or range(src.cache_desc.num_tensors // 2)]
        if req.get("stop_after") is not None:
            layers = layers[: int(req["stop_after"])]
        every = float(req.get("every_ms", 0)) / 1000
        freeze_at = req.get("freeze_at")
        thaws = int(req["thaws"])  # a thaw() after the request cancels the freeze
        cm = self.dd.cache_manager
        for n, layer in enumerate(layers):
            if n and every:
                await asyncio.sleep(every)
            one = range(layer, layer + 1)
            push = cm.push_cache(
                _key_of(req), src, src_layer_range=one, dst_layer_range=one,
                tag=str(req["tag"]), timeout=float(req.get("call_timeout", 10)),
            )  # fmt: skip
            task = asyncio.ensure_future(_timed_status(push))
            entry: dict[str, Any] = {"layer": layer, "src": str(req["src"])}
            if freeze_at is not None and layer == int(freeze_at):
                thawed = self.thaws > thaws
                entry["froze_mid_layer"] = await _freeze_once_submitted(cm, task, thawed)
            done.append({**entry, **await task})
        return done

    async def settle(self, req: dict[str, Any]) -> dict[str, Any]:
        # Let the layer loops (push_layers) end, within "wait" seconds: a
        # peer thawed at teardown goes on with the layers after its freeze.
        tasks = [t for name, t in self.loops.items() if name.startswith("layers:")]
        running = [t for t in tasks if not t.done()]
        if running:
            await asyncio.wait(running, timeout=float(req.get("wait", 30)))
        return {"unsettled": sum(not t.done() for t in running)}

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

    async def health(self, req: dict[str, Any]) -> dict[str, Any]:
        # What the pytest plugin holds a peer to at teardown.
        return {
            "live_jobs": int(self.dd.cache_manager.stats()["live_jobs"]),
            "service_errors": service_errors(),
        }


class _LoggedFailures(logging.Handler):
    """What reached this process's peer-service loop (logged at ERROR), and
    any exception the library caught and logged with its traceback (a
    completion handler, a connection's reader, a request's handler: input
    that raised what it should have refused)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("aiokvcache.service") or record.exc_info:
            self.messages.append(f"{record.name}: {record.getMessage()}"[:300])


_SERVICE_ERRORS = _LoggedFailures()


def watch_service_errors() -> None:
    """Record what reaches this process's peer-service loops and the
    library's logged tracebacks (see :func:`service_errors`); warnings still
    go to stderr, as they would with no handler at all."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(message)s")
    logging.getLogger("aiokvcache").addHandler(_SERVICE_ERRORS)


def service_errors() -> list[str]:
    """What reached this process's peer-service loops, and the exceptions the
    library logged with a traceback, once watched."""
    return list(_SERVICE_ERRORS.messages)


def _round_pusher(
    cm: Any, src: Cache, req: dict[str, Any], tmo: float
) -> Callable[[int], Awaitable[None]]:
    """One layer's push of a ``rounds`` request."""
    if req.get("slot") is not None:
        key = CacheKeyByIdAndIndex(int(req["cluster_id"]), int(req["cache_id"]), int(req["slot"]))

        async def slot(layer: int) -> None:
            await cm.push_cache(key, src, src_layer_range=range(layer, layer + 1), timeout=tmo)

        return slot
    bkey = BlocksCacheKey(int(req["cluster_id"]), int(req.get("model_id", 0)))
    src_blocks = np.asarray(req["src_blocks"], dtype=np.int64)
    dst_blocks = np.asarray(req["dst_blocks"], dtype=np.int64)

    async def blocks(layer: int) -> None:
        await cm.push_blocks(
            bkey, src, src_blocks, dst_blocks, src_layer_range=range(layer, layer + 1), timeout=tmo
        )

    return blocks


async def _freeze_once_submitted(cm: Any, task: asyncio.Future[Any], thawed: bool) -> bool | None:
    """Stop this process (``SIGSTOP``) once ``task``'s push has native jobs
    live (or it ended, or 5 s passed); whether it was still moving then.
    None, and no stop, when a thaw (``SIGCONT``) came first: the test let it
    go on before it got here."""
    if thawed:
        return None
    end = time.monotonic() + 5
    while not task.done() and not cm.stats()["live_jobs"] and time.monotonic() < end:  # noqa: ASYNC110
        await asyncio.sleep(0.0002)  # native state: no event to wait on
    moving = not task.done()
    os.kill(os.getpid(), signal.SIGSTOP)  # the test thaws it (PeerProcess.thaw)
    return moving


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _round_bytes(src: Cache, req: dict[str, Any]) -> int:
    """Bytes of one tensor one ``rounds`` push moves."""
    desc = src.cache_desc
    if req.get("slot") is not None:
        return int(desc.size // desc.batch_size)
    return int(desc.size // desc.shape[0]) * len(req["src_blocks"])


#: The requests a prefill / decoder node answers, by op.
_NODE_OPS: dict[str, Callable[[_Node, dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    "alloc": _Node.alloc,
    "fill": _Node.fill,
    "hash": _Node.hash,
    "wait": _Node.wait,
    "free": _Node.free,
    "link": _Node.link,
    "unlink": _Node.link,
    "push": _Node.push,
    "pull": _Node.pull,
    "rounds": _Node.rounds,
    "loop": _Node.loop,
    "loop_status": _Node.loop_status,
    "loop_join": _Node.loop_join,
    "push_layers": _Node.push_layers,
    "settle": _Node.settle,
    "reinit": _Node.reinit,
    "rss": _Node.rss,
    "stats": _Node.stats,
    "health": _Node.health,
}


async def run(args: argparse.Namespace) -> None:
    """An LLMDataDist driven op by op until ``exit`` or end of input."""
    watch_service_errors()
    node = _Node(args)
    asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, node.count_thaw)
    await node.dd.init(node.cfg)
    say(
        {
            "address": node.dd.listen_address,
            "pid": os.getpid(),
            "cluster_id": args.cluster_id,
            "rss_kb": _rss_kb(),
        }
    )
    try:
        await serve(node.handle)
    finally:
        node.stop_loops()
        await node.dd.finalize()


def parser(prog: str = "python -m aiokvcache.testing.peer") -> argparse.ArgumentParser:
    """The command line: ROLE TRANSPORT and the instance's options."""
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("mode", choices=["decoder", "prefill"], metavar="ROLE", help="decoder, prefill")
    p.add_argument("transport", choices=TRANSPORTS)
    p.add_argument("--cluster-id", type=int, default=None, help="default 2 (decoder), 1 (prefill)")
    p.add_argument("--listen", default=None, help="control-plane listen address ip:port")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--net-devices", default=None, help="the data plane's interfaces")
    p.add_argument("--sync-kv-timeout", type=int, default=60_000, help="ms per layer")
    p.add_argument("--options", default="{}", help="more LLMConfig attributes, a JSON object")
    p.add_argument("--lifetime", type=float, default=None, help="exit after this many seconds")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the role's defaults (cluster id, the decoder's listen address)."""
    if args.cluster_id is None:
        args.cluster_id = 2 if args.mode == "decoder" else 1
    if args.listen is None and args.mode == "decoder":
        args.listen = "127.0.0.1:0"
    return args


def guard(lifetime: float | None) -> None:
    """End this process when the process that started it dies, and after
    ``lifetime`` seconds (if given) whatever it is doing, frozen
    (``SIGSTOP``) included.

    Both are kept by a forked watchdog process, which a ``SIGSTOP`` of this
    one does not stop: it ``SIGKILL``s this process when the parent process
    is gone or the time is up (a stopped process dies of it too), and leaves
    when this one is gone. It watches the parent *process*: Linux's
    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked us exits, and
    trio starts subprocesses from worker threads that exit after 10 s idle.
    Call it first, before any thread starts.
    """
    parent = os.getppid()
    watched = _watch(parent)
    if os.getppid() != parent or parent == 1:
        os._exit(1)  # the parent died before we could watch it
    peer = os.getpid()
    pid = os.fork()
    if pid == 0:  # the watchdog
        try:
            # Not holding the peer's pipes: its parent sees them close when it dies.
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            end = None if lifetime is None else time.monotonic() + lifetime
            _watchdog(peer, parent, watched, end)
        finally:
            os._exit(0)
    if watched is not None:
        os.close(watched)
    # Reaped when it ends, so it leaves no zombie behind.
    threading.Thread(target=os.waitpid, args=(pid, 0), name="watchdog", daemon=True).start()


def _watch(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where the
    kernel has none (then the watchdog polls ``kill(pid, 0)``)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _watchdog(peer: int, parent: int, parent_fd: int | None, end: float | None) -> None:
    """Kill ``peer`` once ``parent`` (its parent process, ``parent_fd`` its
    pidfd) exited or ``end`` passed; return when ``peer`` itself is gone
    (we were reparented)."""
    while os.getppid() == peer:
        if end is not None and time.monotonic() >= end:
            break
        if parent_fd is not None:
            if select.select([parent_fd], [], [], 0.2)[0]:
                break  # the parent process exited
            continue
        time.sleep(0.2)
        if not _alive(parent):
            break
    else:
        return  # the peer ended
    with contextlib.suppress(ProcessLookupError):
        os.kill(peer, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the peer until told to exit."""
    args = finish_args(parser().parse_args(argv))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    guard(args.lifetime)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
