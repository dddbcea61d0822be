"""LLM-DataDist pull flow, two processes: the prompt allocates its KV cache
with CacheKeys and listens; the decoder links to it and pulls by CacheKey.

Run both roles on this machine:
    python examples/pull_flow.py
Or on two hosts:
    python examples/pull_flow.py --role prompt --listen 0.0.0.0:26001
    python examples/pull_flow.py --role decoder --peer HOST:26001
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
LAYERS, BATCH, TOKENS, HEADS, DIM = 8, 4, 256, 4, 64
DESC = kv.CacheDesc(2 * LAYERS, [BATCH, TOKENS, HEADS, DIM], kv.DataType.DT_BF16, kv.Placement.HOST)
REQUESTS = [1001, 1002, 1003, 1004]  # one request per batch slot


def digest(tensors: list[np.ndarray], batch_index: int) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t[batch_index].tobytes())
    return h.hexdigest()


async def prompt(listen: str, transport: str) -> None:
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = listen
    cfg.transport = transport
    async with kv.LLMDataDist(kv.LLMRole.PROMPT, PROMPT) as dd:
        await dd.init(cfg.generate_options())
        keys = [kv.CacheKey(prompt_cluster_id=PROMPT, req_id=r) for r in REQUESTS]
        cache = dd.cache_manager.allocate_cache(DESC, keys)
        rng = np.random.default_rng(1)
        for t in cache.tensors:  # bf16 is stored as uint16
            t[...] = rng.integers(0, 2**16, t.shape, dtype=np.uint16)
        digests = " ".join(digest(cache.tensors, i) for i in range(BATCH))
        print(f"READY {dd.listen_address} {digests}", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # serve until the decoder is done


async def decoder(peer: str, transport: str) -> list[str]:
    cfg = kv.LLMConfig()
    cfg.transport = transport
    async with kv.LLMDataDist(kv.LLMRole.DECODER, DECODER) as dd:
        await dd.init(cfg.generate_options())
        host, port = peer.rsplit(":", 1)
        info = kv.LLMClusterInfo()
        info.remote_cluster_id = PROMPT
        info.append_remote_ip_info(host, int(port))
        ret, rets = await dd.link_clusters([info], timeout=5000)
        if ret != kv.LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"link failed: {rets}")
        cm = dd.cache_manager
        # The decoder's own cache has room for one request at a time.
        mine = cm.allocate_cache(
            kv.CacheDesc(
                2 * LAYERS, [1, TOKENS, HEADS, DIM], kv.DataType.DT_BF16, kv.Placement.HOST
            )
        )
        out = []
        for r in REQUESTS:
            await cm.pull_cache(
                kv.CacheKey(prompt_cluster_id=PROMPT, req_id=r), mine, batch_index=0
            )
            out.append(digest(mine.tensors, 0))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["both", "decoder", "prompt"], default="both")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--peer")
    ap.add_argument("--transport", default="auto")
    args = ap.parse_args()
    if args.role == "prompt":
        asyncio.run(prompt(args.listen, args.transport))
        return 0
    if args.role == "decoder":
        print("\n".join(asyncio.run(decoder(args.peer, args.transport))))
        return 0
    # Both roles here: the prompt in a child process (killed if anything fails).
    argv = [sys.executable, __file__, "--role", "prompt", "--transport", args.transport]
    with Child(argv) as child:
        _, address, *expected = child.read_line("READY").split()
        got = asyncio.run(decoder(address, args.transport))
        child.communicate("done", timeout=30)
    ok = got == expected and child.returncode == 0
    print(
        f"pull flow: {len(REQUESTS)} requests pulled by CacheKey, "
        f"bytes {'match' if ok else 'DIFFER'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
