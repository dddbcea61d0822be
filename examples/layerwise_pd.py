"""Layer-wise prefill → decode with paged (blocks) KV caches, two processes.

The prefill process runs a small fake model (NumPy matmuls per layer) and
hands each layer's K/V blocks to transfer_cache_async as soon as that layer
is computed, while it goes on computing the next layer. The decode process
learns of each layer the moment it lands (a receiver notification carrying
the destination block ids) and consumes it at once: it checks the bytes
against its own run of the model and computes one decode-step attention
over that layer's K/V. Both sides build the same model from one seed, so the
decode side knows what must arrive.

run it:
  one machine (the decode side runs in a child process):
    python examples/layerwise_pd.py
  two hosts (start the decode side first: it prints the prefill's command line):
    decode$  python examples/layerwise_pd.py --role decode --listen 0.0.0.0:26002
    prefill$ python examples/layerwise_pd.py --role prefill --peer DECODE_IP:26002
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
from _cli import Failed, add_transport, base_parser, peer_argument, run_role

import aiokvcache as kv
from aiokvcache.testing import Child, PeerExited

PREFILL, DECODE = 1, 2
LAYERS, TOKENS, HEADS, HEAD_DIM = 8, 256, 4, 64
HIDDEN = HEADS * HEAD_DIM
BLOCK_TOKENS = 16  # tokens per KV block
SEQ_BLOCKS = TOKENS // BLOCK_TOKENS
DECODE_BLOCKS = 64  # the decode side's block pool
TAG = "request-7"
LINGER_S = 1.0  # see decode()


def blocks_desc(num_blocks: int) -> kv.CacheDesc:
    """K and V per layer; a block holds BLOCK_TOKENS tokens of every head."""
    return kv.CacheDesc(
        2 * LAYERS,
        [num_blocks, BLOCK_TOKENS, HEADS, HEAD_DIM],
        kv.DataType.DT_FLOAT16,
        kv.Placement.HOST,
    )


class FakeModel:
    """Deterministic per-layer weights: both processes build the same model."""

    def __init__(self, seed: int = 1234) -> None:
        rng = np.random.default_rng(seed)
        scale = 1 / np.sqrt(HIDDEN)
        self.x0 = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
        self.w = [
            (rng.standard_normal((3, HIDDEN, HIDDEN)) * scale).astype(np.float32)
            for _ in range(LAYERS)
        ]

    def layer(self, i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One layer: (next hidden state, K, V), K/V as (tokens, heads, head_dim) fp16."""
        w_h, w_k, w_v = self.w[i]
        k = (x @ w_k).astype(np.float16).reshape(TOKENS, HEADS, HEAD_DIM)
        v = (x @ w_v).astype(np.float16).reshape(TOKENS, HEADS, HEAD_DIM)
        return np.tanh(x @ w_h), k, v

    def all_kv(self) -> list[tuple[np.ndarray, np.ndarray]]:
        x, out = self.x0, []
        for i in range(LAYERS):
            x, k, v = self.layer(i, x)
            out.append((k, v))
        return out


def as_blocks(t: np.ndarray) -> np.ndarray:
    return t.reshape(SEQ_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM)


# ------------------------------------------------------------------ decode


async def decode(args: argparse.Namespace) -> None:
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = args.listen
    cfg.transport = args.transport
    expected = FakeModel().all_kv()
    query = np.random.default_rng(7).standard_normal((HEADS, HEAD_DIM)).astype(np.float32)
    async with kv.LLMDataDist(kv.LLMRole.DECODER, DECODE) as dd:
        await dd.init(cfg.generate_options())
        cm = dd.cache_manager
        pool = cm.allocate_blocks_cache(blocks_desc(DECODE_BLOCKS), kv.BlocksCacheKey(DECODE, 0))
        tensors = pool.tensors
        verified: list[int] = []

        async def consume() -> None:
            # One notification per landed layer; its bytes are in memory now.
            async for note in cm.notifications():
                if note.tag != TAG:
                    continue
                layer, block_ids = note.layer, list(note.blocks or ())
                k = tensors[2 * layer][block_ids].reshape(TOKENS, HEADS, HEAD_DIM)
                v = tensors[2 * layer + 1][block_ids].reshape(TOKENS, HEADS, HEAD_DIM)
                if not (
                    np.array_equal(k, expected[layer][0]) and np.array_equal(v, expected[layer][1])
                ):
                    raise Failed(f"decode: layer {layer}'s bytes differ from the model's")
                # The decode step's attention for this layer, over the prompt's K/V.
                kf, vf = k.astype(np.float32), v.astype(np.float32)
                scores = np.einsum("hd,thd->ht", query, kf) / np.sqrt(HEAD_DIM)
                probs = np.exp(scores - scores.max(axis=1, keepdims=True))
                probs /= probs.sum(axis=1, keepdims=True)
                out = np.einsum("ht,thd->hd", probs, vf)
                verified.append(layer)
                print(
                    f"decode: layer {layer} landed in blocks {block_ids[:4]}..., verified, "
                    f"attention |out|={np.linalg.norm(out):.3f}",
                    flush=True,
                )
                if len(verified) == LAYERS:
                    return

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0)  # subscribed before anyone can push
        address = dd.listen_address
        if args.protocol:
            print(f"READY {address}", flush=True)
        else:
            peer = peer_argument(address, "DECODE_IP")
            again = f"python {sys.argv[0]} --role prefill --peer {peer}"
            if args.transport != "auto":
                again += f" --transport {args.transport}"
            print(
                f"decode listening on {address} — start the prefill with: {again}",
                flush=True,
            )
        try:
            await asyncio.wait_for(consumer, args.timeout)
        except TimeoutError:
            raise Failed(
                f"decode: {len(verified)} of {LAYERS} layers landed in {args.timeout:g} s"
            ) from None
        print(f"decode: all {LAYERS} layers verified (in order {verified})", flush=True)
        if args.protocol:
            await asyncio.to_thread(sys.stdin.readline)  # linked until the parent says done
        else:
            # The prefill's last transfers return a moment after their layers
            # land here; leaving at once would break its link under them.
            await asyncio.sleep(LINGER_S)


# ----------------------------------------------------------------- prefill


class LayerReady(kv.LayerSynchronizer):
    """Layer *i* is ready when the compute loop has written its K/V."""

    def __init__(self) -> None:
        self.events = [asyncio.Event() for _ in range(LAYERS)]

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await self.events[layer_index].wait()
        return True


async def prefill(peer: str, transport: str) -> None:
    cfg = kv.LLMConfig()
    cfg.transport = transport
    model = FakeModel()
    async with kv.LLMDataDist(kv.LLMRole.PROMPT, PREFILL) as dd:
        await dd.init(cfg.generate_options())
        host, port = peer.rsplit(":", 1)
        info = kv.LLMClusterInfo()
        info.remote_cluster_id = DECODE
        info.append_remote_ip_info(host, int(port))
        rc, rcs = await dd.link_clusters([info], timeout=10_000)
        if rc != kv.LLMStatusCode.LLM_SUCCESS:
            raise kv.LLMException(
                f"could not link to the decode side at {peer} (is it running? it prints "
                "its address)",
                rcs[0],
            )
        print(f"prefill: linked to cluster {DECODE} at {peer}", flush=True)
        cm = dd.cache_manager
        cache = cm.allocate_blocks_cache(blocks_desc(SEQ_BLOCKS))
        tensors = cache.tensors
        # The decode side's scheduler gave this request these blocks of its pool.
        dst_blocks = [
            int(b) for b in np.random.default_rng(3).permutation(DECODE_BLOCKS)[:SEQ_BLOCKS]
        ]
        ready = LayerReady()
        task = await cm.transfer_cache_async(
            cache,
            ready,
            [kv.TransferWithCacheKeyConfig(kv.BlocksCacheKey(DECODE, 0), tag=TAG)],
            src_block_indices=list(range(SEQ_BLOCKS)),
            dst_block_indices=dst_blocks,
        )
        start = time.perf_counter()
        x = model.x0
        for i in range(LAYERS):
            x, k, v = model.layer(i, x)
            tensors[2 * i][...] = as_blocks(k)
            tensors[2 * i + 1][...] = as_blocks(v)
            ready.events[i].set()
            # Let the transfer task submit layer i; it moves while we compute i + 1.
            await asyncio.sleep(0)
        computed = time.perf_counter() - start
        await task
        total = time.perf_counter() - start
        print(
            f"prefill: all {LAYERS} layers sent: compute {computed * 1e3:.1f} ms, "
            f"compute + transfer {total * 1e3:.1f} ms",
            flush=True,
        )


# -------------------------------------------------------------------- main


def both(args: argparse.Namespace) -> None:
    """The decode side in a child process (killed if anything fails), the prefill here."""
    argv = [sys.executable, __file__, "--role", "decode", "--protocol"]
    argv += ["--transport", args.transport, "--timeout", str(args.timeout)]
    with Child(argv) as dec:
        try:
            address = dec.read_line("READY ", timeout=args.timeout).split()[1]
            print(f"decode listening on {address} (child process {dec.pid})", flush=True)
            asyncio.run(prefill(address, args.transport))
            print(dec.communicate("done", timeout=60), end="")
        except PeerExited:
            raise Failed(f"the decode process failed (exit status {dec.wait(10)})") from None
    if dec.returncode:
        raise Failed(f"the decode process exited with status {dec.returncode}")
    print(f"layerwise: {LAYERS} layers sent as they were computed, all verified by the decode side")


def build_parser() -> argparse.ArgumentParser:
    ap = base_parser("layerwise_pd.py", __doc__, "decode", "prefill", "the decode side")
    add_transport(ap)
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="decode: how long to wait for the prefill's layers (default: %(default)s)",
    )
    ap.add_argument(
        "--protocol",
        action="store_true",
        help="decode: print the line 'READY ADDRESS' for a parent process instead of the "
        "prefill's command line, and stay linked until a line on stdin (the one-machine "
        "mode runs its child so)",
    )
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if args.timeout <= 0:
        ap.error(f"--timeout must be > 0, got {args.timeout}")
    return run_role(
        ap,
        args,
        ("decode", lambda: decode(args)),
        ("prefill", lambda: prefill(args.peer, args.transport)),
        lambda: both(args),
    )


if __name__ == "__main__":
    sys.exit(main())
