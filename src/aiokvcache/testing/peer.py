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

It ignores SIGINT (its parent decides when it ends), ends when its parent
process does, and exits after ``--lifetime`` seconds whatever happens.

ROLE ``none`` starts no LLMDataDist and answers none of these: its ops
modules give it all it does (a bare native engine, a transfer agent).

Ops modules add ops: ``--ops MODULE`` (repeatable) names a module, or the
path of a ``.py`` file, loaded once, in order, before the peer starts. One
defines any of:

* ``add_arguments(parser)``: options of its own (read back from ``node.args``);
* ``register(ops, node)``: adds entries to ``ops``, the op table (op name ->
  ``async def handler(req) -> answer``), or replaces one (the entry it
  replaces is its to call); ``node`` is the :class:`PeerNode` they act on
  (its LLMDataDist, ``node.dd``, is initialized by the time one runs);
* ``start(node)``: an async context manager entered once the LLMDataDist is
  initialized and before the hello (to make what the peer owns from the
  start, put fields into its hello, ``node.hello``, and add the ops that act
  on it), and left when the peer ends, in reverse order, before the
  LLMDataDist is finalized.

:func:`aiokvcache.testing.peer_argv` writes its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
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

from .._child import Handler, say, serve, unknown
from . import cluster_info, fill, options
from ._guard import guard
from ._procfs import rss_kb

__all__ = [
    "Handler",
    "PeerNode",
    "cache_sha",
    "finish_args",
    "guard",
    "key_of",
    "load_ops",
    "main",
    "parser",
    "run",
    "service_errors",
    "timed_status",
    "watch_service_errors",
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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


async def timed_status(aw: Awaitable[Any]) -> dict[str, Any]:
    """Run ``aw``: ``status`` (an ``LLMStatusCode`` name, ``EXCEPTION`` for
    another error), ``start``, ``end`` (``time.monotonic()``), ``seconds``
    and, when it failed, ``message``."""
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


def key_of(req: dict[str, Any]) -> CacheKeyByIdAndIndex:
    """The request's ``cluster_id``, ``cache_id`` and ``index`` (0 by default)."""
    return CacheKeyByIdAndIndex(
        int(req["cluster_id"]), int(req["cache_id"]), int(req.get("index", 0))
    )


def cache_sha(cache: Cache) -> str:
    """sha256 of every tensor's bytes, in order."""
    return _sha(b"".join(t.tobytes() for t in cache.tensors))


class PeerNode:
    """The peer: an LLMDataDist driven op by op (none for ROLE ``none``), the
    caches (:attr:`caches`, by the caller's names) and push loops it owns,
    its op table :attr:`ops` (op name -> handler: its own methods, then what
    ops modules add) and :attr:`hello`, the fields they add to its hello."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.role = LLMRole.PROMPT if args.mode == "prefill" else LLMRole.DECODER
        self.has_instance = args.mode != "none"
        self.cfg = _node_options(args) if self.has_instance else {}
        self._dd = LLMDataDist(self.role, args.cluster_id) if self.has_instance else None
        self.caches: dict[str, Cache] = {}
        self.loops: dict[str, asyncio.Task[list[dict[str, Any]]]] = {}
        self.progress: dict[str, list[dict[str, Any]]] = {}
        self.thaws = 0  # SIGCONTs received (push_layers: a thaw cancels a freeze to come)
        self.hello: dict[str, Any] = {}
        self.ops: dict[str, Handler] = self._builtin_ops() if self.has_instance else {}

    @property
    def dd(self) -> LLMDataDist:
        """Its LLMDataDist (``RuntimeError`` for ROLE ``none``)."""
        if self._dd is None:
            raise RuntimeError("ROLE none: this peer has no LLMDataDist")
        return self._dd

    def _builtin_ops(self) -> dict[str, Handler]:
        """The requests a prefill / decoder node answers, by op."""
        return {
            "alloc": self.alloc,
            "fill": self.fill,
            "hash": self.hash,
            "wait": self.wait,
            "free": self.free,
            "link": self.link,
            "unlink": self.link,
            "push": self.push,
            "pull": self.pull,
            "rounds": self.rounds,
            "loop": self.loop,
            "loop_status": self.loop_status,
            "loop_join": self.loop_join,
            "push_layers": self.push_layers,
            "settle": self.settle,
            "reinit": self.reinit,
            "rss": self.rss,
            "stats": self.stats,
            "health": self.health,
        }

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = self.ops.get(req["op"])
        if op is None:
            return unknown(req)
        return await op(req)

    def base_hello(self) -> dict[str, Any]:
        """What every hello says: ``address`` (with an LLMDataDist), ``pid``,
        ``cluster_id``, ``rss_kb``."""
        address = {"address": self.dd.listen_address} if self.has_instance else {}
        return {
            **address,
            "pid": os.getpid(),
            "cluster_id": self.args.cluster_id,
            "rss_kb": rss_kb(os.getpid()),
        }

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
            fill(cache, int(req["seed"]))
        self.caches[str(req["name"])] = cache
        return {
            "cache_id": cache.cache_id,
            "addrs": cache.tensor_addrs,
            "tensor_bytes": int(req["bytes"]),
            "sha": cache_sha(cache),
        }

    async def fill(self, req: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(req["name"])]
        fill(cache, int(req["seed"]))
        return {"sha": cache_sha(cache)}

    async def hash(self, req: dict[str, Any]) -> dict[str, Any]:
        cache = self.caches[str(req["name"])]
        if req.get("blocks") is None:
            return {"sha": cache_sha(cache)}
        ids = [int(b) for b in req["blocks"]]
        return {"sha": _sha(b"".join(t[ids].tobytes() for t in cache.tensors))}

    async def wait(self, req: dict[str, Any]) -> dict[str, Any]:
        layers = [int(x) for x in req["layers"]]
        tmo = float(req.get("wait_timeout", 30))
        return await timed_status(
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
            key_of(req),
            self.caches[src or str(req["src"])],
            timeout=float(req.get("call_timeout", 5)),
        )

    async def push(self, req: dict[str, Any]) -> dict[str, Any]:
        return await timed_status(self._push_of(req))

    async def pull(self, req: dict[str, Any]) -> dict[str, Any]:
        dst = self.caches[str(req["dst"])]
        timeout = float(req.get("call_timeout", 5))
        return await timed_status(
            self.dd.cache_manager.pull_cache(key_of(req), dst, timeout=timeout)
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
            res = await timed_status(self._push_of(req, src))
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
                key_of(req), src, src_layer_range=one, dst_layer_range=one,
                tag=str(req["tag"]), timeout=float(req.get("call_timeout", 10)),
            )  # fmt: skip
            task = asyncio.ensure_future(timed_status(push))
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
        self._dd = LLMDataDist(self.role, self.args.cluster_id)
        await self.dd.init(self.cfg)
        return {"seconds": time.monotonic() - start, "address": self.dd.listen_address}

    async def rss(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"rss_kb": rss_kb(os.getpid())}

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


async def run(args: argparse.Namespace) -> None:
    """The peer until ``exit`` or end of input: its LLMDataDist and its ops
    modules' start-up (``args.ops``), its hello, then an answer a request."""
    watch_service_errors()
    modules = _modules(args.ops)
    node = PeerNode(args)
    for module in modules:
        if hasattr(module, "register"):
            module.register(node.ops, node)
    asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, node.count_thaw)
    async with contextlib.AsyncExitStack() as stack:
        if node.has_instance:
            await node.dd.init(node.cfg)
            stack.push_async_callback(lambda: node.dd.finalize())  # the one reinit made too
        for module in modules:
            if hasattr(module, "start"):
                await stack.enter_async_context(module.start(node))
        stack.callback(node.stop_loops)
        say({**node.base_hello(), **node.hello})
        await serve(node.handle)


_HOOKS = ("add_arguments", "register", "start")
_loaded: dict[str, ModuleType] = {}


def load_ops(spec: str) -> ModuleType:
    """The ops module ``spec`` names (see the module's docs), loaded once: a
    ``.py`` file's path (a module named after the file), else a module name."""
    if spec in _loaded:
        return _loaded[spec]
    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).resolve()
        found = importlib.util.spec_from_file_location(path.stem, path)
        if found is None or found.loader is None or not path.is_file():
            raise SystemExit(f"--ops {spec}: no such Python file")
        if path.stem in sys.modules:
            raise SystemExit(f"--ops {spec}: a module named {path.stem!r} is loaded already")
        module = importlib.util.module_from_spec(found)
        sys.modules[path.stem] = module
        found.loader.exec_module(module)
    else:
        module = importlib.import_module(spec)
    if not any(hasattr(module, hook) for hook in _HOOKS):
        raise SystemExit(f"--ops {spec}: defines none of {', '.join(_HOOKS)}")
    _loaded[spec] = module
    return module


def _modules(specs: Sequence[str]) -> list[ModuleType]:
    """The ops modules ``specs`` name, each once, in the order first named."""
    return list(dict.fromkeys(load_ops(spec) for spec in specs))


def parser(
    prog: str = "python -m aiokvcache.testing.peer", modules: Sequence[ModuleType] = ()
) -> argparse.ArgumentParser:
    """The command line: ROLE TRANSPORT, the instance's options and those of
    the ops ``modules`` (:func:`load_ops`)."""
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "mode",
        choices=["decoder", "prefill", "none"],
        metavar="ROLE",
        help="decoder, prefill, or none (no LLMDataDist: its ops modules' ops only)",
    )
    p.add_argument("transport", choices=TRANSPORTS)
    p.add_argument("--cluster-id", type=int, default=None, help="default 2 (decoder), 1 (prefill)")
    p.add_argument("--listen", default=None, help="control-plane listen address ip:port")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--net-devices", default=None, help="the data plane's interfaces")
    p.add_argument("--sync-kv-timeout", type=int, default=60_000, help="ms per layer")
    p.add_argument("--options", default="{}", help="more LLMConfig attributes, a JSON object")
    p.add_argument("--lifetime", type=float, default=None, help="exit after this many seconds")
    p.add_argument(
        "--ops",
        action="append",
        default=[],
        metavar="MODULE",
        help="an ops module to load (a module name or a .py file); repeatable",
    )
    for module in modules:
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the role's defaults (cluster id, the decoder's listen address)."""
    if args.cluster_id is None:
        args.cluster_id = 2 if args.mode == "decoder" else 1
    if args.listen is None and args.mode == "decoder":
        args.listen = "127.0.0.1:0"
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the peer until told to exit."""
    # What must hold before anything else runs (an ops module's import
    # included): the watchdog and the lifetime, and SIGINT left to the parent.
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--ops", action="append", default=[])
    first.add_argument("--lifetime", type=float, default=None)
    early = first.parse_known_args(argv)[0]  # the rest is parsed with the modules' options
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    guard(early.lifetime)
    args = finish_args(parser(modules=_modules(early.ops)).parse_args(argv))
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    # Run as the package's module, not as a second copy named __main__: an
    # ops module that imports aiokvcache.testing.peer (service_errors(), its
    # PeerNode) must see the state this run keeps.
    from aiokvcache.testing import peer as _this

    sys.exit(_this.main())
