"""Push flow, two processes: the decoder binds a slot of its KV cache to a
request's CacheKey and listens; the prompt links to it and pushes its KV
cache into that slot by the same key, one push_cache per layer, all in flight
at once.

The decoder (cluster 2) registers NumPy arrays as a cache of two batch slots
and binds slot 1 to CacheKey(cluster_id=2, req_id=42). The prompt (cluster 1)
fills slot 0 of its own cache and pushes it to that key with the tag
"request-42", so the decoder learns of each layer as it lands
(wait_for_layers) and then checks every byte. No cache id travels between
the two: the key is all the prompt needs (an aiokvcache extension; by id and
index, CacheKeyByIdAndIndex, works too).

run it:
  one machine (the decoder runs in a child process):
    python examples/push_flow.py
  two hosts (start the decoder first: it prints the prompt's command line):
    decoder$ python examples/push_flow.py --role decoder --listen 0.0.0.0:26000
    prompt$  python examples/push_flow.py --role prompt --peer DECODER_IP:26000
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np
from _cli import Failed, add_transport, base_parser, digest, peer_argument, run_role

import aiokvcache as kv
from aiokvcache.testing import Child, PeerExited

PROMPT, DECODER = 1, 2
LAYERS, BATCH, TOKENS, HEADS, DIM = 8, 2, 256, 4, 64
DESC = kv.CacheDesc(
    2 * LAYERS, [BATCH, TOKENS, HEADS, DIM], kv.DataType.DT_FLOAT16, kv.Placement.HOST
)
SLOT = 1  # the decoder's batch slot for the request (slot 0 belongs to another one)
LINGER_S = 1.0  # see decoder()


def request_key(req_id: int) -> kv.CacheKey:
    """The key the decoder binds and the prompt pushes to: the decoder's
    cluster id (the cluster holding the cache, as for pull_cache) and the request."""
    return kv.CacheKey(cluster_id=DECODER, req_id=req_id)


def show(key: kv.CacheKey) -> str:
    return f"CacheKey(cluster_id={key.cluster_id}, req_id={key.req_id})"


def prompt_data(req_id: int) -> list[np.ndarray]:
    """The prompt's K/V for the request, one array per tensor (both sides can build it)."""
    rng = np.random.default_rng(req_id)
    shape = (TOKENS, HEADS, DIM)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(DESC.num_tensors)]


async def decoder(args: argparse.Namespace) -> None:
    cfg = kv.LLMConfig()
    cfg.listen_ip_info = args.listen
    cfg.transport = args.transport
    key = request_key(args.req_id)
    async with kv.LLMDataDist(kv.LLMRole.DECODER, DECODER) as dd:
        await dd.init(cfg.generate_options())
        # The decoder owns the memory: plain NumPy arrays, registered. Key i
        # binds batch slot i: slot 0 to another request, slot SLOT to ours.
        buffers = [np.zeros(DESC.shape, np.float16) for _ in range(DESC.num_tensors)]
        dd.cache_manager.register_cache(DESC, buffers, [request_key(args.req_id + 1), key])
        address = dd.listen_address
        if args.protocol:
            print(f"READY {address}", flush=True)
        else:
            peer = peer_argument(address, "DECODER_IP")
            again = f"python {sys.argv[0]} --role prompt --peer {peer}"
            if args.req_id != 42:
                again += f" --req-id {args.req_id}"
            if args.transport != "auto":
                again += f" --transport {args.transport}"
            print(f"decoder: {show(key)} bound to batch slot {SLOT}")
            print(
                f"decoder listening on {address} — start the prompt with: {again}",
                flush=True,
            )
        # Each layer announces itself as it lands (the prompt pushes with a tag).
        await dd.cache_manager.wait_for_layers(
            f"request-{args.req_id}", range(LAYERS), timeout=args.timeout
        )
        got = digest([b[SLOT] for b in buffers])
        if args.protocol:
            print(f"DIGEST {got}", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # linked until the parent says done
            return
        if got != digest(prompt_data(args.req_id)):
            raise Failed(f"decoder: the bytes in slot {SLOT} differ from the prompt's")
        if any(b[1 - SLOT].any() for b in buffers):
            raise Failed(f"decoder: slot {1 - SLOT} was written")
        print(f"decoder: {LAYERS} layers landed in batch slot {SLOT}, sha256 {got[:16]}… matches")
        # The prompt's last pushes return a moment after their layers land
        # here; leaving at once would break its link under them.
        await asyncio.sleep(LINGER_S)


async def prompt(peer: str, req_id: int, transport: str) -> str:
    """Link to the decoder at ``peer`` and push the request; returns its sha256."""
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
            raise kv.LLMException(
                f"could not link to the decoder at {peer} (is it running? it prints its address)",
                rets[0],
            )
        print(f"prompt: linked to cluster {DECODER} at {peer}", flush=True)
        cm = dd.cache_manager
        src = cm.allocate_cache(DESC)
        for t, data in zip(src.tensors, prompt_data(req_id), strict=True):
            t[0] = data  # the request is in our batch slot 0
        key = request_key(req_id)
        # One push per layer, as a model would after computing each layer.
        await asyncio.gather(
            *(
                cm.push_cache(
                    key,
                    src,
                    src_batch_index=0,
                    src_layer_range=range(i, i + 1),
                    tag=f"request-{req_id}",
                )
                for i in range(LAYERS)
            )
        )
        sent = digest([t[0] for t in src.tensors])
        print(f"prompt: pushed {LAYERS} layers to {show(key)}, sha256 {sent[:16]}…", flush=True)
        return sent


def both(args: argparse.Namespace) -> None:
    """The decoder in a child process (killed if anything fails), the prompt here."""
    argv = [sys.executable, __file__, "--role", "decoder", "--protocol"]
    argv += ["--transport", args.transport, "--req-id", str(args.req_id)]
    argv += ["--timeout", str(args.timeout)]
    with Child(argv) as child:
        try:
            address = child.read_line("READY ", timeout=args.timeout).split()[1]
            print(f"decoder listening on {address} (child process {child.pid})", flush=True)
            sent = asyncio.run(prompt(address, args.req_id, args.transport))
            got = child.read_line("DIGEST ", timeout=args.timeout).split()[1]
            child.communicate("done", timeout=30)
        except PeerExited:
            raise Failed(f"the decoder process failed (exit status {child.wait(10)})") from None
    if child.returncode:
        raise Failed(f"the decoder process exited with status {child.returncode}")
    if got != sent:
        raise Failed(f"decoder slot {SLOT} holds sha256 {got[:16]}…, the prompt sent {sent[:16]}…")
    print(f"push flow: {LAYERS} layers landed in the decoder's slot {SLOT}, sha256 matches")


def build_parser() -> argparse.ArgumentParser:
    ap = base_parser("push_flow.py", __doc__, "decoder", "prompt", "the decoder")
    ap.add_argument(
        "--req-id",
        type=int,
        default=42,
        metavar="N",
        help="the request id in the CacheKey both sides use; give both the same "
        "(default: %(default)s)",
    )
    add_transport(ap)
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="decoder: how long to wait for the prompt's layers (default: %(default)s)",
    )
    ap.add_argument(
        "--protocol",
        action="store_true",
        help="decoder: print the lines 'READY ADDRESS' and 'DIGEST SHA256' for a parent "
        "process instead of messages, and stay linked until a line on stdin (the "
        "one-machine mode runs its child so)",
    )
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if not 0 <= args.req_id < 2**64 - 2:
        ap.error(f"--req-id must be in [0, 2**64 - 2), got {args.req_id}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be > 0, got {args.timeout}")
    return run_role(
        ap,
        args,
        ("decoder", lambda: decoder(args)),
        ("prompt", lambda: prompt(args.peer, args.req_id, args.transport)),
        lambda: both(args),
    )


if __name__ == "__main__":
    sys.exit(main())
