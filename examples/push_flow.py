"""LLM-DataDist push flow, two processes: the decoder registers a cache, the
prompt links to it and pushes its KV cache into it by CacheKeyByIdAndIndex,
layer by layer, with a tag so the decoder sees each layer land.

Run both roles on this machine:
    python examples/push_flow.py
Or on two hosts:
    python examples/push_flow.py --role decoder --listen 0.0.0.0:26000
    python examples/push_flow.py --role prompt --peer HOST:26000 --cache-id 1
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys

import numpy as np

import aiokvcache as kv
from aiokvcache.testing import Child

PROMPT, DECODER = 1, 2
LAYERS, BATCH, TOKENS, HEADS, DIM = 8, 2, 256, 4, 64
DESC = kv.CacheDesc(
    2 * LAYERS, [BATCH, TOKENS, HEADS, DIM], kv.DataType.DT_FLOAT16, kv.Placement.HOST
)


def digest(tensors: list[np.ndarray], batch_index: int) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t[batch_index].tobytes())
    return h.hexdigest()


async def decoder(listen: str, transport: str) -> None:
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = listen
    cfg.transport = transport
    async with kv.LLMDataDist(kv.LLMRole.DECODER, DECODER) as dd:
        await dd.init(cfg.generate_options())
        # The decoder owns the memory: plain numpy arrays, registered.
        buffers = [np.zeros(DESC.shape, np.float16) for _ in range(DESC.num_tensors)]
        cache = dd.cache_manager.register_cache(DESC, buffers)
        print(f"READY {dd.listen_address} {cache.cache_id}", flush=True)
        # Each layer announces itself as it lands; wait for all of them.
        await dd.cache_manager.wait_for_layers("request-42", range(LAYERS), timeout=60)
        print(f"DIGEST {digest(buffers, 1)}", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # stay linked until the prompt is done


async def prompt(peer: str, cache_id: int, transport: str) -> str:
    cfg = kv.LLMConfig()
    cfg.transport = transport
    async with kv.LLMDataDist(kv.LLMRole.PROMPT, PROMPT) as dd:
        await dd.init(cfg.generate_options())
        host, port = peer.rsplit(":", 1)
        info = kv.LLMClusterInfo()
        info.remote_cluster_id = DECODER
        info.append_remote_ip_info(host, int(port))
        ret, rets = await dd.link_clusters([info], timeout=5000)
        if ret != kv.LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"link failed: {rets}")
        cm = dd.cache_manager
        src = cm.allocate_cache(DESC)
        rng = np.random.default_rng(0)
        for t in src.tensors:
            t[...] = rng.standard_normal(t.shape).astype(np.float16)
        key = kv.CacheKeyByIdAndIndex(DECODER, cache_id, batch_index=1)
        # One push per layer, as a model would after computing each layer.
        await asyncio.gather(
            *(
                cm.push_cache(
                    key, src, src_batch_index=0, src_layer_range=range(i, i + 1), tag="request-42"
                )
                for i in range(LAYERS)
            )
        )
        return digest(src.tensors, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["both", "decoder", "prompt"], default="both")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--peer")
    ap.add_argument("--cache-id", type=int, default=1)
    ap.add_argument("--transport", default="auto")
    args = ap.parse_args()
    if args.role == "decoder":
        asyncio.run(decoder(args.listen, args.transport))
        return 0
    if args.role == "prompt":
        print(asyncio.run(prompt(args.peer, args.cache_id, args.transport)))
        return 0
    # Both roles here: the decoder in a child process (killed if anything fails).
    argv = [sys.executable, __file__, "--role", "decoder", "--transport", args.transport]
    with Child(argv) as child:
        _, address, cache_id = child.read_line("READY").split()
        sent = asyncio.run(prompt(address, int(cache_id), args.transport))
        got = child.read_line("DIGEST").split()[1]
        child.communicate("done", timeout=30)
    ok = sent == got and child.returncode == 0
    print(f"push flow: {LAYERS} layers pushed, decoder bytes {'match' if ok else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
