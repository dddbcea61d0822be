"""Pull flow, two processes: the prompt allocates its KV cache with one
CacheKey per batch slot and serves it; the decoder links to it and pulls
each request by its CacheKey into a cache of its own.

The prompt (cluster 1) holds four requests, 1001 to 1004, in the four batch
slots of one bf16 cache, slot i bound to CacheKey(cluster_id=1,
req_id=1001 + i), and listens. The decoder (cluster 2), whose cache has room
for one request, pulls them one after the other with pull_cache and checks
every byte against the prompt's data. As in LLM-DataDist, the keys are all
the decoder needs to know.

run it:
  one machine (the prompt runs in a child process):
    python examples/pull_flow.py
  two hosts (start the prompt first: it prints the decoder's command line and
  serves until Ctrl-C):
    prompt$  python examples/pull_flow.py --role prompt --listen 0.0.0.0:26001
    decoder$ python examples/pull_flow.py --role decoder --peer PROMPT_IP:26001
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import numpy as np
from _cli import Failed, add_transport, base_parser, digest, peer_argument, run_role

import aiokvcache as kv
from aiokvcache.testing import Child, PeerExited

PROMPT, DECODER = 1, 2
LAYERS, BATCH, TOKENS, HEADS, DIM = 8, 4, 256, 4, 64
DESC = kv.CacheDesc(2 * LAYERS, [BATCH, TOKENS, HEADS, DIM], kv.DataType.DT_BF16, kv.Placement.HOST)
REQUESTS = [1001, 1002, 1003, 1004]  # one request per batch slot


def request_key(req_id: int) -> kv.CacheKey:
    """The key of a request: the prompt's cluster id (it holds the cache) and the request."""
    return kv.CacheKey(cluster_id=PROMPT, req_id=req_id)


def show(key: kv.CacheKey) -> str:
    return f"CacheKey(cluster_id={key.cluster_id}, req_id={key.req_id})"


def prompt_data(req_id: int) -> list[np.ndarray]:
    """The prompt's K/V for a request, one array per tensor (both sides can build it).
    NumPy has no bf16: the cache's arrays hold its bit patterns as uint16."""
    rng = np.random.default_rng(req_id)
    shape = (TOKENS, HEADS, DIM)
    return [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(DESC.num_tensors)]


async def prompt(args: argparse.Namespace) -> None:
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = args.listen
    cfg.transport = args.transport
    async with kv.LLMDataDist(kv.LLMRole.PROMPT, PROMPT) as dd:
        await dd.init(cfg.generate_options())
        # Key i binds batch slot i.
        cache = dd.cache_manager.allocate_cache(DESC, [request_key(r) for r in REQUESTS])
        for i, r in enumerate(REQUESTS):
            for t, data in zip(cache.tensors, prompt_data(r), strict=True):
                t[i] = data
        address = dd.listen_address
        if args.protocol:
            digests = " ".join(digest([t[i] for t in cache.tensors]) for i in range(BATCH))
            print(f"READY {address} {digests}", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # serve until the parent says done
            return
        peer = peer_argument(address, "PROMPT_IP")
        again = f"python {sys.argv[0]} --role decoder --peer {peer}"
        if args.transport != "auto":
            again += f" --transport {args.transport}"
        first, last = (show(request_key(r)) for r in (REQUESTS[0], REQUESTS[-1]))
        print(f"prompt: batch slots 0-{BATCH - 1} hold the requests bound to {first} ... {last}")
        print(
            f"prompt listening on {address} — start the decoder with: {again}",
            flush=True,
        )
        # Pulls are one-sided: this side sees none of them, so it serves until stopped.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print("prompt: serving until Ctrl-C", flush=True)
        await stop.wait()
        print("prompt: stopped", flush=True)


async def decoder(peer: str, transport: str) -> list[str]:
    """Link to the prompt at ``peer`` and pull every request; returns their sha256s."""
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
            raise kv.LLMException(
                f"could not link to the prompt at {peer} (is it running? it prints its address)",
                rets[0],
            )
        print(f"decoder: linked to cluster {PROMPT} at {peer}", flush=True)
        cm = dd.cache_manager
        # The decoder's own cache has room for one request at a time.
        mine = cm.allocate_cache(
            kv.CacheDesc(
                2 * LAYERS, [1, TOKENS, HEADS, DIM], kv.DataType.DT_BF16, kv.Placement.HOST
            )
        )
        out = []
        for r in REQUESTS:
            key = request_key(r)
            await cm.pull_cache(key, mine, batch_index=0)
            got = digest([t[0] for t in mine.tensors])
            if got != digest(prompt_data(r)):
                raise Failed(f"decoder: request {r}'s bytes differ from the prompt's")
            print(f"decoder: pulled {show(key)}, sha256 {got[:16]}… matches", flush=True)
            out.append(got)
        return out


def both(args: argparse.Namespace) -> None:
    """The prompt in a child process (killed if anything fails), the decoder here."""
    argv = [sys.executable, __file__, "--role", "prompt", "--protocol"]
    argv += ["--transport", args.transport]
    with Child(argv) as child:
        try:
            _, address, *expected = child.read_line("READY ").split()
            print(f"prompt listening on {address} (child process {child.pid})", flush=True)
            got = asyncio.run(decoder(address, args.transport))
            child.communicate("done", timeout=30)
        except PeerExited:
            raise Failed(f"the prompt process failed (exit status {child.wait(10)})") from None
    if child.returncode:
        raise Failed(f"the prompt process exited with status {child.returncode}")
    if got != expected:
        raise Failed("the pulled bytes differ from what the prompt process holds")
    print(f"pull flow: {len(REQUESTS)} requests pulled by CacheKey, sha256 of each matches")


def build_parser() -> argparse.ArgumentParser:
    ap = base_parser("pull_flow.py", __doc__, "prompt", "decoder", "the prompt")
    add_transport(ap)
    ap.add_argument(
        "--protocol",
        action="store_true",
        help="prompt: print the line 'READY ADDRESS SHA256...' (one per slot) for a parent "
        "process instead of messages, and serve until a line on stdin (the one-machine "
        "mode runs its child so)",
    )
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    return run_role(
        ap,
        args,
        ("prompt", lambda: prompt(args)),
        ("decoder", lambda: decoder(args.peer, args.transport)),
        lambda: both(args),
    )


if __name__ == "__main__":
    sys.exit(main())
