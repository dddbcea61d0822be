"""Layer-wise prefill → decode with paged (blocks) KV caches, two processes.

The prefill process runs a small fake model (NumPy matmuls per layer) and
hands each layer's K/V blocks to ``transfer_cache_async`` as soon as that
layer is computed, while it goes on computing the next layer. The decode
process learns of each layer the moment it lands (a receiver notification
carrying the destination block ids) and consumes it at once: it checks the
bytes against its own run of the model and computes one decode-step
attention over that layer's K/V.

Run both roles on this machine:   python examples/layerwise_pd.py
Or on two hosts:
    python examples/layerwise_pd.py --role decode --listen 0.0.0.0:26001
    python examples/layerwise_pd.py --role prefill --peer HOST:26001
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import numpy as np

import aiokvcache as kv
from aiokvcache.testing import Child

PREFILL, DECODE = 1, 2
LAYERS, TOKENS, HEADS, HEAD_DIM = 8, 256, 4, 64
HIDDEN = HEADS * HEAD_DIM
BLOCK_TOKENS = 16  # tokens per KV block
SEQ_BLOCKS = TOKENS // BLOCK_TOKENS
DECODE_BLOCKS = 64  # the decode side's block pool
TAG = "request-7"


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


async def decode(listen: str, transport: str) -> None:
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = listen
    cfg.transport = transport
    expected = FakeModel().all_kv()
    query = np.random.default_rng(7).standard_normal((HEADS, HEAD_DIM)).astype(np.float32)
    async with kv.LLMDataDist(kv.LLMRole.DECODER, DECODE) as dd:
        await dd.init(cfg.generate_options())
        cm = dd.cache_manager
        pool = cm.allocate_blocks_cache(blocks_desc(DECODE_BLOCKS), kv.BlocksCacheKey(DECODE, 0))
        tensors = pool.tensors
        done = asyncio.Event()
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
                    raise SystemExit(f"decode: layer {layer} bytes differ")
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
                    done.set()
                    return

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0)  # subscribed before anyone can push
        print(f"READY {dd.listen_address}", flush=True)
        await asyncio.wait_for(done.wait(), 60)
        await consumer
        print(f"decode: all {LAYERS} layers verified (in order {verified})", flush=True)
        # Stay linked until the prefill side says it is finished.
        await asyncio.to_thread(sys.stdin.readline)


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
        rc, _ = await dd.link_clusters([info], timeout=10_000)
        if rc != kv.LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"prefill: link failed: {rc.name}")
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


def both(transport: str) -> None:
    """Start the decode process, then the prefill process, on this machine."""
    # The decode process is killed if anything fails.
    with Child([sys.executable, __file__, "--role", "decode", "--transport", transport]) as dec:
        address = dec.read_line("READY ").split()[1]
        pre = subprocess.run(
            [
                sys.executable,
                __file__,
                "--role",
                "prefill",
                "--peer",
                address,
                "--transport",
                transport,
            ],
            timeout=120,
        )
        print(dec.communicate("done", timeout=60), end="")
    if pre.returncode or dec.returncode:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["decode", "prefill"])
    ap.add_argument("--listen", default="127.0.0.1:0", help="decode: control address")
    ap.add_argument("--peer", help="prefill: the decode side's ip:port")
    ap.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "rdma"])
    args = ap.parse_args()
    if args.role == "decode":
        asyncio.run(decode(args.listen, args.transport))
    elif args.role == "prefill":
        if not args.peer:
            ap.error("--peer is required with --role prefill")
        asyncio.run(prefill(args.peer, args.transport))
    else:
        both(args.transport)


if __name__ == "__main__":
    main()
