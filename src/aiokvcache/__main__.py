"""Command line: ``python -m aiokvcache bench | info | demo``.

``bench`` is the main job: it starts a decode process, then (in this process,
the prefill side) pushes a model-shaped KV cache to it layer by layer while
simulating per-layer compute, and prints bandwidth, per-layer latency and how
much of the transfer was hidden behind compute.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import __version__
from .datadist import LLMDataDist
from .errors import LLMException
from .options import LLMConfig
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMRole,
    Placement,
)

PROMPT_ID, DECODE_ID = 1, 2


@dataclass(frozen=True)
class Shape:
    """The KV cache the bench moves: K and V per layer, batch first.

    With ``block_tokens`` > 0 the cache is paged: ``batch * tokens /
    block_tokens`` blocks of ``block_tokens`` tokens each.
    """

    layers: int
    batch: int
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    block_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        return self.batch * self.tokens // self.block_tokens if self.block_tokens else 0

    @property
    def desc(self) -> CacheDesc:
        lead = (
            [self.num_blocks, self.block_tokens] if self.block_tokens else [self.batch, self.tokens]
        )
        return CacheDesc(
            2 * self.layers,
            [*lead, self.heads, self.head_dim],
            DataType.from_numpy(self.dtype),
            Placement.HOST,
        )

    @property
    def layer_bytes(self) -> int:
        return 2 * self.desc.size


def _options(transport: str, listen: bool, max_inflight: int | None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.transport = transport
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    if max_inflight:
        cfg.max_inflight_bytes = max_inflight
    cfg.sync_kv_timeout = 60_000  # a 2-core machine under load can be slow
    return cfg.generate_options()


def _digest(cache: Cache, index: Any) -> str:
    """Hash of every tensor's batch slot (an int) or blocks (an index array), in order."""
    h = hashlib.sha256()
    for t in cache.tensors:
        h.update(t[index].tobytes())
    return h.hexdigest()


def _block_order(shape: Shape) -> np.ndarray:
    """Where the decode side puts each of the prefill side's blocks: scattered,
    as a paged allocator would, but the same in both processes."""
    return np.random.default_rng(1234).permutation(shape.num_blocks)


# ------------------------------------------------------------ decode side


async def _decode_main(args: argparse.Namespace) -> None:
    shape = _shape(args)
    async with LLMDataDist(LLMRole.DECODER, DECODE_ID) as dd:
        await dd.init(_options(args.transport, True, args.max_inflight))
        cm = dd.cache_manager
        if shape.block_tokens:
            cache = cm.allocate_blocks_cache(shape.desc, BlocksCacheKey(DECODE_ID))
        else:
            cache = cm.allocate_cache(shape.desc)
        print(json.dumps({"address": dd.listen_address, "cache_id": cache.cache_id}), flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := (await reader.readline()).decode().strip():
            cmd, _, arg = line.partition(" ")
            if cmd == "wait":
                # Every layer of this iteration announced itself: the bytes
                # are in memory now.
                await cm.wait_for_layers(arg, range(shape.layers), timeout=120)
                print(json.dumps({"landed": arg}), flush=True)
            elif cmd == "digest":
                index = _block_order(shape) if shape.block_tokens else 0
                print(json.dumps({"sha": _digest(cache, index)}), flush=True)
            else:
                break


# ----------------------------------------------------------- prefill side


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.label = ""

    def step(self, label: str) -> None:
        self.done += 1
        self.label = label
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(f"\r  [{bar}] {self.done}/{self.total} layers  {label}   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Peer:
    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def read(self, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"decode process exited (code {self.proc.poll()})")
            if line.startswith("{"):
                return dict(json.loads(line))
        raise TimeoutError("decode process did not answer")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _compute(ms: float, mode: str, scratch: np.ndarray) -> Any:
    if ms <= 0:
        return None
    if mode == "sleep":  # accelerator-style compute: the CPU is free meanwhile
        return asyncio.sleep(ms / 1000)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:  # CPU-bound compute holding the loop
        scratch @= scratch.T
        scratch /= np.abs(scratch).max() + 1
    return None


async def _push_pass(
    push_layer: Callable[[int, str], Awaitable[None]],
    shape: Shape,
    compute_ms: float,
    mode: str,
    tag: str,
    progress: _Progress | None,
) -> tuple[float, float, list[float]]:
    """One pass over all layers. Returns (wall, tail after compute, per-layer latencies)."""
    scratch = np.random.default_rng(0).standard_normal((64, 64))
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def push(layer: int) -> None:
        t0 = loop.time()
        await push_layer(layer, tag)
        latencies.append(loop.time() - t0)
        if progress is not None:
            progress.step(tag)

    tasks = []
    for layer in range(shape.layers):
        work = _compute(compute_ms, mode, scratch)
        if work is not None:
            await work
        tasks.append(asyncio.create_task(push(layer)))
        await asyncio.sleep(0)  # let the push submit before the next layer's compute
    compute_done = loop.time()
    await asyncio.gather(*tasks)
    end = loop.time()
    return end - start, end - compute_done, latencies


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


async def _bench_main(args: argparse.Namespace) -> int:
    shape = _shape(args)
    total = shape.layer_bytes * shape.layers
    print(
        f"aiokvcache {__version__} bench: {shape.layers} layers x (K,V) "
        f"{list(shape.desc.shape)} {shape.dtype}"
        f"{' (paged blocks, scattered destination)' if shape.block_tokens else ''} = "
        f"{shape.layer_bytes / 2**20:.1f} MiB/layer, {total / 2**20:.0f} MiB per pass; "
        f"transport={args.transport}, compute={args.compute_ms} ms/layer ({args.compute}), "
        f"{args.iterations} iterations"
    )
    peer = _Peer(
        [sys.executable, "-m", "aiokvcache", "_decode", *_shape_argv(args)],
    )
    try:
        hello = peer.read()
        host, port = str(hello["address"]).rsplit(":", 1)
        async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
            await dd.init(_options(args.transport, False, args.max_inflight))
            info = LLMClusterInfo()
            info.remote_cluster_id = DECODE_ID
            info.append_remote_ip_info(host, int(port))
            _, per = await dd.link_clusters([info], timeout=10_000)
            if per[0] != per[0].LLM_SUCCESS:
                print(f"link failed: {per[0].name}", file=sys.stderr)
                return 1
            cm = dd.cache_manager
            if shape.block_tokens:
                src = cm.allocate_blocks_cache(shape.desc)
            else:
                src = cm.allocate_cache(shape.desc)
            rng = np.random.default_rng(42)
            for t in src.tensors:
                t.view(np.uint8)[...] = rng.integers(0, 256, t.nbytes, dtype=np.uint8).reshape(
                    t.view(np.uint8).shape
                )
            if shape.block_tokens:
                bkey = BlocksCacheKey(DECODE_ID)
                src_blocks = np.arange(shape.num_blocks)
                dst_blocks = _block_order(shape)

                async def push_layer(layer: int, tag: str) -> None:
                    await cm.push_blocks(
                        bkey, src, src_blocks, dst_blocks, range(layer, layer + 1), tag=tag
                    )

            else:
                key = CacheKeyByIdAndIndex(DECODE_ID, int(hello["cache_id"]), 0)

                async def push_layer(layer: int, tag: str) -> None:
                    await cm.push_cache(key, src, src_layer_range=range(layer, layer + 1), tag=tag)

            # Warm-up (metadata lookup, endpoint wire-up), then the serial
            # baseline: every layer back to back, no compute.
            await asyncio.gather(*(push_layer(i, "warmup") for i in range(shape.layers)))
            serial = []
            for i in range(max(1, args.iterations // 2)):
                wall, _, _ = await _push_pass(push_layer, shape, 0, "sleep", f"serial-{i}", None)
                peer.send(f"wait serial-{i}")
                peer.read()
                serial.append(wall)
            t_serial = min(serial)
            progress = _Progress(shape.layers * args.iterations, sys.stderr.isatty())
            walls, tails, lat = [], [], []
            for i in range(args.iterations):
                wall, tail, lats = await _push_pass(
                    push_layer, shape, args.compute_ms, args.compute, f"iter-{i}", progress
                )
                peer.send(f"wait iter-{i}")
                peer.read()
                walls.append(wall)
                tails.append(tail)
                lat += lats
                if not progress.enabled:
                    print(
                        f"  iteration {i + 1}/{args.iterations}: {wall * 1000:.1f} ms", flush=True
                    )
            progress.close()
            peer.send("digest")
            mine = _digest(src, slice(None) if shape.block_tokens else 0)
            verified = peer.read()["sha"] == mine
        compute_total = shape.layers * args.compute_ms / 1000
        wall = float(np.median(walls))
        tail = float(np.median(tails))
        hidden = 1.0 if t_serial <= 0 else max(0.0, min(1.0, (t_serial - tail) / t_serial))
        rows = [
            ("bytes per pass", f"{total / 2**20:.0f} MiB"),
            (
                "transfer alone (no compute)",
                f"{t_serial * 1000:.1f} ms = {total / t_serial / 1e9:.2f} GB/s",
            ),
            ("compute alone (L x C)", f"{compute_total * 1000:.1f} ms"),
            ("pipelined wall (median)", f"{wall * 1000:.1f} ms = {total / wall / 1e9:.2f} GB/s"),
            ("no-overlap wall would be", f"{(compute_total + t_serial) * 1000:.1f} ms"),
            ("per-layer push latency p50", f"{_pct(lat, 50) * 1000:.2f} ms"),
            ("per-layer push latency p99", f"{_pct(lat, 99) * 1000:.2f} ms"),
            ("transfer tail after compute", f"{tail * 1000:.2f} ms"),
            ("overlap (transfer hidden)", f"{hidden * 100:.0f} %"),
            ("decode side bytes verified", "yes" if verified else "NO"),
        ]
        width = max(len(r[0]) for r in rows)
        print()
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")
        return 0 if verified else 1
    finally:
        peer.close()


def _shape_argv(args: argparse.Namespace) -> list[str]:
    out = [
        f"--layers={args.layers}",
        f"--batch={args.batch}",
        f"--tokens={args.tokens}",
        f"--heads={args.heads}",
        f"--head-dim={args.head_dim}",
        f"--dtype={args.dtype}",
        f"--transport={args.transport}",
    ]
    if args.max_inflight:
        out.append(f"--max-inflight={args.max_inflight}")
    if args.blocks:
        out.append(f"--blocks={args.blocks}")
    return out


def _shape(args: argparse.Namespace) -> Shape:
    return Shape(
        args.layers, args.batch, args.tokens, args.heads, args.head_dim, args.dtype, args.blocks
    )


# ------------------------------------------------------------- info, demo


def _info() -> int:
    from ._loader import native

    print(f"aiokvcache {__version__}")
    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"numpy      {np.__version__}")
    print(f"UCX        {native.ucx_version()}")
    for transport in ("auto", "shm", "tcp", "rdma"):
        try:
            eng = native.Engine(transport)
        except Exception as exc:
            print(f"transport {transport:<5} unavailable: {str(exc).splitlines()[0]}")
            continue
        try:
            text = eng.info()
        finally:
            eng.close()
        tls = sorted(
            {line.rsplit("--", 1)[-1].strip() for line in text.splitlines() if "resource" in line}
        )
        print(f"transport {transport:<5} {', '.join(tls)}")
    return 0


async def _demo() -> int:
    shape = CacheDesc(4, [1, 8], DataType.DT_FLOAT16, Placement.HOST)
    async with (
        LLMDataDist(LLMRole.DECODER, DECODE_ID) as decoder,
        LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt,
    ):
        await decoder.init(_options("auto", True, None))
        await prompt.init(_options("auto", False, None))
        host, port = str(decoder.listen_address).rsplit(":", 1)
        info = LLMClusterInfo()
        info.remote_cluster_id = DECODE_ID
        info.append_remote_ip_info(host, int(port))
        print("link:", (await prompt.link_clusters([info]))[0].name)
        dst = decoder.cache_manager.allocate_cache(shape)
        src = prompt.cache_manager.allocate_cache(shape, [CacheKey(PROMPT_ID, req_id=7)])
        for i, t in enumerate(src.tensors):
            t[...] = i + 1
        await prompt.cache_manager.push_cache(CacheKeyByIdAndIndex(DECODE_ID, dst.cache_id), src)
        print("pushed; decoder sees:", [float(t[0, 0]) for t in dst.tensors])
        for t in dst.tensors:
            t[...] = 0
        await decoder.cache_manager.pull_cache(CacheKey(PROMPT_ID, req_id=7), dst)
        print("pulled by CacheKey; decoder sees:", [float(t[0, 0]) for t in dst.tensors])
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aiokvcache", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def shape_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--layers", type=int, default=32)
        sp.add_argument("--batch", type=int, default=1)
        sp.add_argument("--tokens", type=int, default=4096)
        sp.add_argument("--heads", type=int, default=8, help="KV heads")
        sp.add_argument("--head-dim", type=int, default=128)
        sp.add_argument("--dtype", default="float16", help="numpy dtype name, or bfloat16")
        sp.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "rdma"])
        sp.add_argument("--max-inflight", type=int, default=0, help="engine window in bytes")
        sp.add_argument(
            "--blocks",
            type=int,
            default=0,
            metavar="TOKENS",
            help="paged mode: blocks of TOKENS tokens, pushed with push_blocks to scattered "
            "destination blocks (0 = one contiguous cache, push_cache)",
        )

    bench = sub.add_parser("bench", help="push a KV cache layer by layer to a decode process")
    shape_args(bench)
    bench.add_argument("--compute-ms", type=float, default=2.0, help="simulated compute per layer")
    bench.add_argument(
        "--compute",
        default="sleep",
        choices=["sleep", "busy"],
        help="sleep: accelerator-style (CPU free); busy: numpy work holding the CPU",
    )
    bench.add_argument("--iterations", type=int, default=5)
    dec = sub.add_parser("_decode", help=argparse.SUPPRESS)
    shape_args(dec)
    sub.add_parser("info", help="versions and the transports UCX offers here")
    sub.add_parser("demo", help="push and pull a tiny cache between two instances")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m aiokvcache``."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            return _info()
        if args.command == "demo":
            return asyncio.run(_demo())
        if args.command == "_decode":
            asyncio.run(_decode_main(args))
            return 0
        for name in ("layers", "batch", "tokens", "heads", "head_dim", "iterations"):
            if getattr(args, name) < 1:
                print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
                return 2
        if args.blocks < 0 or (args.blocks and args.tokens % args.blocks):
            print("--blocks must be 0 or divide --tokens", file=sys.stderr)
            return 2
        return asyncio.run(_bench_main(args))
    except (LLMException, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
