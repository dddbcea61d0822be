"""``python -m aiokvcache bench``: push a KV cache layer by layer to a decode process.

A decode process (the ``decode`` mode of the peer program, see
:mod:`aiokvcache.testing`) owns the destination cache; this process, the
prefill side, pushes a model-shaped KV cache to it layer by layer while
simulating per-layer compute, and prints bandwidth, per-layer latency and
how much of the transfer was hidden behind compute.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMRole,
    Placement,
    __version__,
)
from .testing import DECODER_ID, PROMPT_ID, Peer, cluster_info, options

TRANSPORTS = ("auto", "shm", "tcp", "rdma")


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


# ------------------------------------------------------- shared with the peer


def engine_options(transport: str, listen: bool, max_inflight: int | None) -> dict[str, str]:
    """Both sides' init options: a 60 s layer deadline (a loaded 2-core host is slow)."""
    extra: dict[str, Any] = {"sync_kv_timeout": 60_000}
    if max_inflight:
        extra["max_inflight_bytes"] = max_inflight
    return options(transport, listen, **extra)


def digest(cache: Cache, index: Any) -> str:
    """Hash of every tensor's batch slot (an int) or blocks (an index array), in order."""
    h = hashlib.sha256()
    for t in cache.tensors:
        h.update(t[index].tobytes())
    return h.hexdigest()


def block_order(shape: Shape) -> np.ndarray:
    """Where the decode side puts each of the prefill side's blocks: scattered,
    as a paged allocator would, but the same in both processes."""
    return np.random.default_rng(1234).permutation(shape.num_blocks)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The cache shape and engine options, for the bench and its decode peer."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", help="numpy dtype name, or bfloat16")
    p.add_argument("--transport", default="auto", choices=TRANSPORTS)
    p.add_argument("--max-inflight", type=int, default=0, help="engine window in bytes")
    p.add_argument(
        "--blocks",
        type=int,
        default=0,
        metavar="TOKENS",
        help="paged mode: blocks of TOKENS tokens, pushed with push_blocks to scattered "
        "destination blocks (0 = one contiguous cache, push_cache)",
    )


def shape_of(args: argparse.Namespace) -> Shape:
    """The :class:`Shape` that :func:`add_shape_arguments`' options describe."""
    return Shape(
        args.layers, args.batch, args.tokens, args.heads, args.head_dim, args.dtype, args.blocks
    )


def shape_argv(args: argparse.Namespace) -> list[str]:
    """:func:`add_shape_arguments`' options back as a command line (for the peer)."""
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


# ------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    add_shape_arguments(p)
    p.add_argument("--compute-ms", type=float, default=2.0, help="simulated compute per layer")
    p.add_argument(
        "--compute",
        default="sleep",
        choices=["sleep", "busy"],
        help="sleep: accelerator-style (CPU free); busy: numpy work holding the CPU",
    )
    p.add_argument("--iterations", type=int, default=5)


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    for name in ("layers", "batch", "tokens", "heads", "head_dim", "iterations"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.blocks < 0 or (args.blocks and args.tokens % args.blocks):
        return "--blocks must be 0 or divide --tokens"
    return None


def main(args: argparse.Namespace) -> int:
    """Run the bench (options checked); 0 when the decode side's bytes verified."""
    return asyncio.run(_bench(args))


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


async def _bench(args: argparse.Namespace) -> int:
    shape = shape_of(args)
    total = shape.layer_bytes * shape.layers
    print(
        f"aiokvcache {__version__} bench: {shape.layers} layers x (K,V) "
        f"{list(shape.desc.shape)} {shape.dtype}"
        f"{' (paged blocks, scattered destination)' if shape.block_tokens else ''} = "
        f"{shape.layer_bytes / 2**20:.1f} MiB/layer, {total / 2**20:.0f} MiB per pass; "
        f"transport={args.transport}, compute={args.compute_ms} ms/layer ({args.compute}), "
        f"{args.iterations} iterations"
    )
    with Peer("decode", *shape_argv(args), startup_timeout=120) as peer:
        async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
            await dd.init(engine_options(args.transport, False, args.max_inflight))
            _, per = await dd.link_clusters(
                [cluster_info(peer.address, DECODER_ID)], timeout=10_000
            )
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
                bkey = BlocksCacheKey(DECODER_ID)
                src_blocks = np.arange(shape.num_blocks)
                dst_blocks = block_order(shape)

                async def push_layer(layer: int, tag: str) -> None:
                    await cm.push_blocks(
                        bkey, src, src_blocks, dst_blocks, range(layer, layer + 1), tag=tag
                    )

            else:
                key = CacheKeyByIdAndIndex(DECODER_ID, int(peer.hello["cache_id"]), 0)

                async def push_layer(layer: int, tag: str) -> None:
                    await cm.push_cache(key, src, src_layer_range=range(layer, layer + 1), tag=tag)

            # Warm-up (metadata lookup, endpoint wire-up), then the serial
            # baseline: every layer back to back, no compute.
            await asyncio.gather(*(push_layer(i, "warmup") for i in range(shape.layers)))
            serial = []
            for i in range(max(1, args.iterations // 2)):
                wall, _, _ = await _push_pass(push_layer, shape, 0, "sleep", f"serial-{i}", None)
                peer.call("wait", tag=f"serial-{i}")
                serial.append(wall)
            t_serial = min(serial)
            progress = _Progress(shape.layers * args.iterations, sys.stderr.isatty())
            walls, tails, lat = [], [], []
            for i in range(args.iterations):
                wall, tail, lats = await _push_pass(
                    push_layer, shape, args.compute_ms, args.compute, f"iter-{i}", progress
                )
                peer.call("wait", tag=f"iter-{i}")
                walls.append(wall)
                tails.append(tail)
                lat += lats
                if not progress.enabled:
                    print(
                        f"  iteration {i + 1}/{args.iterations}: {wall * 1000:.1f} ms", flush=True
                    )
            progress.close()
            mine = digest(src, slice(None) if shape.block_tokens else 0)
            verified = peer.call("digest")["sha"] == mine
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
