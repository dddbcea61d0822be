"""``python -m aiokvcache bench``: push a KV cache layer by layer to a decode process.

A decode process (the ``decode`` mode of the peer program, see
:mod:`aiokvcache.testing`) owns the destination cache; this process, the
prefill side, pushes a model-shaped KV cache to it layer by layer while
simulating per-layer compute. Each round runs two passes, in alternating
order and measured the same way (every layer pushed with a tag, the pass
ending when all pushes returned, then the decode side confirms each layer):
*transfer alone* (no compute) and *pipelined* (compute per layer, each
layer's push started as soon as its compute ends). The first round is
reported apart (cold: page faults, first metadata look-ups); the others
give a median and a range.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    CacheManager,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    __version__,
    metrics,
)
from ._child import JsonPeer
from .errors import make_error
from .options import DEFAULT_MAX_INFLIGHT_BYTES, TRANSPORTS, LLMConfig

#: The prefill (this process) and decode (its child) cluster ids.
PROMPT_ID, DECODER_ID = 1, 2


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
    cfg = LLMConfig()
    cfg.transport = transport
    cfg.sync_kv_timeout = 60_000
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    if max_inflight:
        cfg.max_inflight_bytes = max_inflight
    return cfg.generate_options()


def _decoder_at(address: str) -> LLMClusterInfo:
    host, port = address.rsplit(":", 1)
    info = LLMClusterInfo()
    info.remote_cluster_id = DECODER_ID
    info.append_remote_ip_info(host, int(port))
    return info


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
    g = p.add_argument_group("the KV cache moved")
    g.add_argument("--layers", type=int, default=32, help="model layers (K and V each)")
    g.add_argument("--batch", type=int, default=1, help="batch slots")
    g.add_argument("--tokens", type=int, default=4096, help="tokens per batch slot")
    g.add_argument("--heads", type=int, default=8, help="KV heads")
    g.add_argument("--head-dim", type=int, default=128, help="elements per head")
    g.add_argument("--dtype", default="float16", help="numpy dtype name, or bfloat16")
    g.add_argument(
        "--blocks",
        type=int,
        default=0,
        metavar="TOKENS",
        help="paged mode: blocks of TOKENS tokens, pushed with push_blocks to scattered "
        "destination blocks (0: one contiguous cache, push_cache)",
    )
    e = p.add_argument_group("the engine")
    e.add_argument(
        "--transport",
        default=LLMConfig().transport,
        choices=TRANSPORTS,
        help="UCX transports: auto (UCX chooses), shm, tcp, rdma (needs verbs)",
    )
    e.add_argument(
        "--max-inflight",
        type=int,
        default=0,
        metavar="BYTES",
        help="the engine's in-flight window (0: the library's default, "
        f"{DEFAULT_MAX_INFLIGHT_BYTES >> 20} MiB)",
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

DESCRIPTION = """\
Start a decode process on this machine, then push a model-shaped KV cache to
it layer by layer while this process simulates each layer's compute, and
print how long the transfer takes alone, how long the pipelined pass takes
with compute, and how much of the transfer the compute hid."""

EPILOG = """\
Each round runs a "transfer alone" pass and a "pipelined" pass, in
alternating order and measured the same way. The first round is reported
apart as "cold"; the table gives the median and range of the others.
overlap = (compute spent + transfer alone - pipelined wall) / the smaller of
compute spent and transfer alone: 100 % when the pipelined pass takes only
as long as the longer of the two, 0 % when it takes their sum.

examples:
  python -m aiokvcache bench                       shared memory or whatever UCX picks
  python -m aiokvcache bench --transport tcp --iterations 9
  python -m aiokvcache bench --blocks 16           paged cache, scattered blocks
  python -m aiokvcache bench --json > run.json     every sample, for scripts
  python -m aiokvcache bench --plot timeline.png   one pass as a picture (needs matplotlib)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    add_shape_arguments(p)
    r = p.add_argument_group("the run")
    r.add_argument(
        "--compute-ms", type=float, default=2.0, metavar="MS", help="simulated compute per layer"
    )
    r.add_argument(
        "--compute",
        default="sleep",
        choices=["sleep", "busy"],
        help="sleep: accelerator-style, the CPU is free meanwhile; busy: NumPy work "
        "holding this process's CPU",
    )
    r.add_argument(
        "--iterations",
        type=int,
        default=5,
        metavar="N",
        help="measured rounds, after one cold round",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    o.add_argument(
        "--metrics",
        action="store_true",
        help="record every push (aiokvcache.metrics) and print where its time went: "
        "submitted, posted, done, seen (p50/p99 per phase)",
    )
    o.add_argument(
        "--metrics-out",
        metavar="FILE",
        help="with --metrics: write a Prometheus scrape of the run (text format) to FILE "
        "(needs prometheus_client: pip install 'aiokvcache[metrics]')",
    )
    o.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw one pipelined pass: compute spans, each layer's push from submit to "
        "landing, and when the decode side was notified (needs matplotlib: "
        "pip install 'aiokvcache[plot]')",
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    for name in ("layers", "batch", "tokens", "heads", "head_dim", "iterations"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.blocks < 0 or (args.blocks and args.tokens % args.blocks):
        return "--blocks must be 0 or divide --tokens"
    if args.compute_ms < 0:
        return "--compute-ms must be >= 0"
    if args.max_inflight < 0:
        return "--max-inflight must be >= 0"
    try:
        DataType.from_numpy(args.dtype)
    except (TypeError, ValueError) as exc:
        return f"--dtype: {exc}"
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'aiokvcache[plot]'"
    if args.metrics_out:
        if not args.metrics:
            return "--metrics-out needs --metrics"
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            return "--metrics-out needs prometheus_client: pip install 'aiokvcache[metrics]'"
    return None


def main(args: argparse.Namespace) -> int:
    """Run the bench (options checked); 0 when the decode side's bytes verified."""
    return asyncio.run(_bench(args))


# ------------------------------------------------------------- one pass


@dataclass
class PassResult:
    """One pass over every layer (times in seconds, on the monotonic clock)."""

    kind: str  # "alone" | "pipelined"
    start: float
    wall: float  # first compute (or push) to the last push returned
    tail: float  # last compute done to the last push returned
    compute: float  # compute time actually spent (sleeps overshoot)
    compute_spans: list[tuple[float, float]]
    push_spans: list[tuple[float, float]]  # per layer: submitted, returned (landed)
    arrivals: dict[int, float]  # per layer: the decode side's notification

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "wall_s": self.wall,
            "tail_s": self.tail,
            "compute_s": self.compute,
            "push_latency_s": [b - a for a, b in self.push_spans],
        }


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
    kind: str,
    push_layer: Callable[[int, str], Awaitable[None]],
    shape: Shape,
    compute_ms: float,
    mode: str,
    tag: str,
    on_layer: Callable[[], None],
) -> PassResult:
    scratch = np.random.default_rng(0).standard_normal((64, 64))
    loop = asyncio.get_running_loop()
    spans: list[tuple[float, float]] = []
    pushes: list[tuple[float, float]] = [(0.0, 0.0)] * shape.layers

    async def push(layer: int) -> None:
        t0 = loop.time()
        await push_layer(layer, tag)
        pushes[layer] = (t0, loop.time())
        on_layer()

    tasks = []
    start = loop.time()
    for layer in range(shape.layers):
        c0 = loop.time()
        work = _compute(compute_ms, mode, scratch)
        if work is not None:
            await work
        if compute_ms > 0:
            spans.append((c0, loop.time()))
        tasks.append(asyncio.create_task(push(layer)))
        await asyncio.sleep(0)  # let the push submit before the next layer's compute
    compute_done = loop.time()
    await asyncio.gather(*tasks)
    end = loop.time()
    return PassResult(
        kind,
        start,
        end - start,
        end - compute_done,
        sum(b - a for a, b in spans),
        spans,
        pushes,
        {},
    )


# ------------------------------------------------------------- summary


def _stats(values: list[float]) -> tuple[float, float, float]:
    return float(np.median(values)), min(values), max(values)


def summarize(rounds: list[list[PassResult]], total: int) -> dict[str, Any]:
    """Medians and ranges over the measured rounds (``rounds[0]`` is cold)."""
    measured = [p for r in rounds[1:] for p in r]
    alone = [p.wall for p in measured if p.kind == "alone"]
    piped = [p for p in measured if p.kind == "pipelined"]
    walls = [p.wall for p in piped]
    compute = [p.compute for p in piped]
    tails = [p.tail for p in piped]
    lat = [b - a for p in piped for a, b in p.push_spans]
    t, c, w = float(np.median(alone)), float(np.median(compute)), float(np.median(walls))
    # Hidden share of the smaller of the two: 100 % when the wall is the
    # larger one alone, 0 % when it is their sum. Undefined without compute.
    smaller = min(t, c)
    overlap = None if smaller <= 0 else max(0.0, min(1.0, (t + c - w) / smaller))
    return {
        "bytes_per_pass": total,
        "transfer_alone_s": _stats(alone),
        "pipelined_wall_s": _stats(walls),
        "compute_s": _stats(compute),
        "no_overlap_s": t + c,
        "tail_after_compute_s": _stats(tails),
        "push_latency_p50_s": float(np.percentile(lat, 50)),
        "push_latency_p99_s": float(np.percentile(lat, 99)),
        "overlap": overlap,
        "cold": {p.kind: p.wall for p in rounds[0]},
    }


def _table(summary: dict[str, Any], verified: bool) -> str:
    total = summary["bytes_per_pass"]
    cold = summary["cold"]

    def ms(v: float) -> str:
        return f"{v * 1000:.1f}"

    def gbs(v: float) -> str:
        return f"{total / v / 1e9:.2f}"

    t, w = summary["transfer_alone_s"], summary["pipelined_wall_s"]
    c, tail = summary["compute_s"], summary["tail_after_compute_s"]
    rows: list[tuple[str, str, str, str, str]] = [
        ("transfer alone, ms", ms(t[0]), ms(t[1]), ms(t[2]), ms(cold["alone"])),
        ("transfer alone, GB/s", gbs(t[0]), gbs(t[2]), gbs(t[1]), gbs(cold["alone"])),
        ("pipelined wall, ms", ms(w[0]), ms(w[1]), ms(w[2]), ms(cold["pipelined"])),
        ("pipelined, GB/s", gbs(w[0]), gbs(w[2]), gbs(w[1]), gbs(cold["pipelined"])),
        ("compute spent, ms", ms(c[0]), ms(c[1]), ms(c[2]), ""),
        ("compute + transfer, ms", ms(summary["no_overlap_s"]), "", "", ""),
        ("tail after compute, ms", ms(tail[0]), ms(tail[1]), ms(tail[2]), ""),
        ("push latency p50, ms", f"{summary['push_latency_p50_s'] * 1000:.2f}", "", "", ""),
        ("push latency p99, ms", f"{summary['push_latency_p99_s'] * 1000:.2f}", "", "", ""),
    ]
    ov = summary["overlap"]
    hidden = "n/a (no compute)" if ov is None else f"{ov * 100:.0f} %"
    rows.append(("overlap (transfer hidden)", hidden, "", "", ""))
    rows.append(("decode side bytes verified", "yes" if verified else "NO", "", "", ""))
    head = ("", "median", "min", "max", "cold")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    lines = []
    for r in [head, *rows]:
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, 5)]
        lines.append("  " + "  ".join(cells).rstrip())
    alloc = summary.get("allocate_s")
    if alloc:
        lines.append(
            f"\n  allocate_cache took {ms(alloc['prompt'])} ms here and {ms(alloc['decode'])} ms "
            "on the decode side:\n  their pages are faulted in then, and the decode's cache is "
            "mapped here once the link is up,\n  not in the cold round (aiokvcache.prefault)"
        )
    return "\n".join(lines)


def plot(path: str, p: PassResult, title: str) -> None:
    """A timeline of one pipelined pass, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = p.start
    layers = len(p.push_spans)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.22 * layers + 1.5)))
    for i, (a, b) in enumerate(p.compute_spans):
        ax.barh(i, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.8, color="#bbbbbb",
                label="compute" if i == 0 else None)  # fmt: skip
    for i, (a, b) in enumerate(p.push_spans):
        ax.barh(i, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.4, color="#1f77b4",
                label="push: submitted to landed" if i == 0 else None)  # fmt: skip
    if p.arrivals:
        xs = [(t - t0) * 1e3 for t in p.arrivals.values()]
        ax.scatter(xs, list(p.arrivals), marker="|", s=80, color="#d62728", zorder=3,
                   label="decode side notified")  # fmt: skip
    ax.set_xlabel("ms since the pass started")
    ax.set_ylabel("layer")
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------- the run


class _Progress:
    """A progress bar on stderr while passes run, when it is a terminal and
    rich is installed (``pip install "aiokvcache[progress]"``)."""

    def __init__(self, total: int) -> None:
        self._bar: Any = None
        self._task: Any = None
        if sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            except ImportError:
                return

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._bar.add_task("layers pushed", total=total)
            self._bar.start()

    def layer(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def conditions(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    """What the run measured, for the header and the JSON."""
    return {
        "version": __version__,
        "transport": args.transport,
        "layers": shape.layers,
        "tensor_shape": list(shape.desc.shape),
        "dtype": shape.dtype,
        "paged_block_tokens": shape.block_tokens,
        "bytes_per_layer": shape.layer_bytes,
        "bytes_per_pass": shape.layer_bytes * shape.layers,
        "compute_ms_per_layer": args.compute_ms,
        "compute_mode": args.compute,
        "rounds": args.iterations,
        "cores": os.cpu_count(),
    }


def header(cond: dict[str, Any]) -> str:
    """Two lines: the run's conditions."""
    paged = (
        f", paged ({cond['paged_block_tokens']}-token blocks, scattered)"
        if cond["paged_block_tokens"]
        else ""
    )
    return (
        f"aiokvcache {cond['version']} bench: transport {cond['transport']}, "
        f"{cond['layers']} layers x (K,V) {cond['tensor_shape']} {cond['dtype']}{paged} = "
        f"{cond['bytes_per_layer'] / 2**20:.1f} MiB/layer, "
        f"{cond['bytes_per_pass'] / 2**20:.0f} MiB/pass\n"
        f"compute {cond['compute_ms_per_layer']:g} ms/layer ({cond['compute_mode']}); "
        f"{cond['rounds']} rounds after 1 cold; {cond['cores']} cores; each round: one "
        f"transfer-alone and one pipelined pass, alternating, measured alike"
    )


PushLayer = Callable[[int, str], Awaitable[None]]


def _source_cache(cm: CacheManager, shape: Shape) -> tuple[Cache, float]:
    """The cache pushed from, filled with seeded random bytes, and the
    seconds its allocation took."""
    began = time.monotonic()
    if shape.block_tokens:
        src = cm.allocate_blocks_cache(shape.desc)
    else:
        src = cm.allocate_cache(shape.desc)
    allocated = time.monotonic() - began
    rng = np.random.default_rng(42)
    for t in src.tensors:
        t.view(np.uint8)[...] = rng.integers(0, 256, t.nbytes, dtype=np.uint8).reshape(
            t.view(np.uint8).shape
        )
    return src, allocated


def _layer_pusher(cm: CacheManager, shape: Shape, src: Cache, peer: JsonPeer) -> PushLayer:
    """Push one layer of ``src`` into the decode process's cache, under a tag."""
    if shape.block_tokens:
        bkey = BlocksCacheKey(DECODER_ID)
        src_blocks = np.arange(shape.num_blocks)
        dst_blocks = block_order(shape)

        async def push_blocks(layer: int, tag: str) -> None:
            await cm.push_blocks(
                bkey, src, src_blocks, dst_blocks, range(layer, layer + 1), tag=tag
            )

        return push_blocks
    key = CacheKeyByIdAndIndex(DECODER_ID, int(peer.hello["cache_id"]), 0)

    async def push_slot(layer: int, tag: str) -> None:
        await cm.push_cache(key, src, src_layer_range=range(layer, layer + 1), tag=tag)

    return push_slot


async def _rounds(
    args: argparse.Namespace, shape: Shape, peer: JsonPeer, push_layer: PushLayer
) -> list[list[PassResult]]:
    """One cold round, then ``args.iterations``: each a transfer-alone and a
    pipelined pass, in alternating order."""
    n_rounds = args.iterations + 1
    progress = _Progress(2 * n_rounds * shape.layers)
    rounds: list[list[PassResult]] = []
    try:
        for r in range(n_rounds):
            order = ("alone", "pipelined") if r % 2 == 0 else ("pipelined", "alone")
            passes = []
            for kind in order:
                label = "cold round" if r == 0 else f"round {r}/{args.iterations}"
                progress.describe(f"{label}: {kind}")
                tag = f"r{r}-{kind}"
                c_ms = args.compute_ms if kind == "pipelined" else 0.0
                p = await _push_pass(
                    kind, push_layer, shape, c_ms, args.compute, tag, progress.layer
                )
                reply = await asyncio.to_thread(peer.call, "wait", tag=tag)
                p.arrivals = {int(k): float(v) for k, v in reply["arrivals"].items()}
                passes.append(p)
            rounds.append(passes)
    finally:
        progress.close()
    return rounds


def _report(
    args: argparse.Namespace,
    cond: dict[str, Any],
    rounds: list[list[PassResult]],
    total: int,
    verified: bool,
    phases: dict[str, Any] | None = None,
    allocate_s: dict[str, float] | None = None,
) -> None:
    """The summary (a table or JSON), the plot asked for, and with --metrics
    the phase table. ``allocate_s``: how long each side's allocate_cache took."""
    summary = summarize(rounds, total)
    if allocate_s is not None:
        summary["allocate_s"] = allocate_s
    if args.plot:
        piped = [p for r in rounds[1:] for p in r if p.kind == "pipelined"]
        median = sorted(piped, key=lambda p: p.wall)[len(piped) // 2]
        plot(args.plot, median, header(cond))
    if args.json:
        print(
            json.dumps(
                {
                    "conditions": cond,
                    "summary": summary,
                    "verified": verified,
                    "rounds": [[p.to_json() for p in r] for r in rounds],
                    **({"metrics": phases} if phases is not None else {}),
                },
                indent=2,
            )
        )
    else:
        print()
        print(_table(summary, verified))
        if args.plot:
            print(f"\n  timeline of the median pipelined pass: {args.plot}")
        if phases is not None:
            print()
            print(_phase_text(phases))
            if args.metrics_out:
                print(f"\n  Prometheus scrape of the run: {args.metrics_out}")


async def _bench(args: argparse.Namespace) -> int:
    shape = shape_of(args)
    cond = conditions(args, shape)
    if not args.json:
        print(header(cond), flush=True)
    records: list[metrics.TransferRecord] = []
    registry = _metrics_on(args, records)
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        # This side first: a transport that cannot start fails here, with
        # its status, before any decode process exists.
        await dd.init(engine_options(args.transport, False, args.max_inflight))
        argv = [sys.executable, "-m", "aiokvcache._benchpeer", *shape_argv(args)]
        with JsonPeer(argv, label="bench decode side", startup_timeout=120) as peer:
            _, per = await dd.link_clusters([_decoder_at(peer.address)], timeout=10_000)
            if per[0] != LLMStatusCode.LLM_SUCCESS:
                raise make_error(per[0], f"cannot link to the decode process at {peer.address}")
            cm = dd.cache_manager
            src, allocated = _source_cache(cm, shape)
            allocate_s = {"prompt": allocated, "decode": float(peer.hello["alloc_s"])}
            rounds = await _rounds(args, shape, peer, _layer_pusher(cm, shape, src, peer))
            mine = digest(src, slice(None) if shape.block_tokens else 0)
            verified = (await asyncio.to_thread(peer.call, "digest"))["sha"] == mine
    phases = _metrics_off(args, records, registry)
    _report(args, cond, rounds, shape.layer_bytes * shape.layers, verified, phases, allocate_s)
    return 0 if verified else 1


# ------------------------------------------------------------- --metrics


def _metrics_on(args: argparse.Namespace, records: list[metrics.TransferRecord]) -> Any:
    """With --metrics: every call recorded into ``records`` (and, with
    --metrics-out, into a registry of its own: the scrape written at the end)."""
    if not args.metrics:
        return None
    registry = None
    if args.metrics_out:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
    metrics.enable(registry, prometheus=registry is not None, tracing=False)
    metrics.add_sink(records.append)
    return registry


def _metrics_off(
    args: argparse.Namespace, records: list[metrics.TransferRecord], registry: Any
) -> dict[str, Any] | None:
    """With --metrics: recording stopped, the scrape written; the phase table."""
    if not args.metrics:
        return None
    metrics.remove_sink(records.append)
    metrics.disable()
    if registry is not None:
        from prometheus_client import generate_latest

        Path(args.metrics_out).write_bytes(generate_latest(registry))
    return phase_table(records)


def phase_table(records: list[metrics.TransferRecord]) -> dict[str, Any]:
    """Per op: calls, failures, bytes, and p50/p99 µs of the call and each phase."""
    out: dict[str, Any] = {}
    for op in sorted({r.op for r in records}):
        recs = [r for r in records if r.op == op]
        ok = [r for r in recs if r.status == "ok"]
        row: dict[str, Any] = {
            "calls": len(recs),
            "failed": len(recs) - len(ok),
            "bytes": sum(r.nbytes for r in ok),
            "segments_per_call": round(sum(r.segments for r in ok) / max(1, len(ok)), 1),
        }
        spans = {"call": [r.seconds for r in ok]}
        for name in metrics.PHASES:
            spans[name] = [r.phases()[name] for r in ok if name in r.phases()]
        for name, values in spans.items():
            values.sort()
            row[name] = {
                "n": len(values),
                "p50_us": round(_pick(values, 0.5) * 1e6, 1),
                "p99_us": round(_pick(values, 0.99) * 1e6, 1),
            }
        out[op] = row
    return out


def _pick(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _phase_text(table: dict[str, Any]) -> str:
    lines = [
        "  where a push's time went (aiokvcache.metrics; µs, p50 / p99 over the run's calls)",
        "    submitted: checked, planned, handed to the engine · posted: the progress thread "
        "posted its last operation",
        "    done: its bytes landed at the peer (flushed) · seen: the loop read the completion",
        "",
        f"  {'op':<22}{'calls':>7}{'call':>18}" + "".join(f"{name:>18}" for name in metrics.PHASES),
    ]
    for op, row in table.items():
        cells = [
            f"{row[k]['p50_us']:.0f} / {row[k]['p99_us']:.0f}" for k in ("call", *metrics.PHASES)
        ]
        lines.append(f"  {op:<22}{row['calls']:>7}" + "".join(f"{c:>18}" for c in cells))
        if row["failed"]:
            lines.append(f"  {'':<22}{row['failed']:>7} failed")
    return "\n".join(lines)
