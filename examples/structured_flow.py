"""Push a KV cache layer by layer under structured concurrency: anyio, on asyncio or trio.

One process holds a decoder and a prompt instance (two hosts in real use;
one here so it runs anywhere). The prompt "computes" each layer and pushes
it in a task group while it computes the next one, every push under
``anyio.fail_after``. Then three things a serving engine does on a bad day:

* a push cut off by a cancel scope (a request aborted mid-transfer): when
  the scope ends, nothing is in flight any more and the destination stays
  untouched from then on;
* a push bounded by ``fail_after`` that cannot make it: ``TimeoutError``,
  with the same guarantee;
* a pull of the decoder's cache back, checked byte for byte;

and both instances finalize. The same code runs on asyncio and on trio:

run it:
    python examples/structured_flow.py                  # anyio on asyncio
    python examples/structured_flow.py --backend trio   # anyio on trio
    python examples/structured_flow.py --transport tcp
"""

from __future__ import annotations

import argparse
import sys

import anyio
import anyio.lowlevel
import numpy as np

import aiokvcache as kv
from aiokvcache.options import TRANSPORTS

LAYERS = 16
DESC = kv.CacheDesc(2 * LAYERS, [1, 512, 8, 64], kv.DataType.DT_FLOAT16, kv.Placement.HOST)
BIG = kv.CacheDesc(2, [1, 32 << 20], kv.DataType.DT_UINT8, kv.Placement.HOST)


def config(transport: str, listen: bool, **extra: int | bool) -> dict[str, str]:
    cfg = kv.LLMConfig()
    cfg.transport = transport
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    for name, value in extra.items():
        setattr(cfg, name, value)
    return cfg.generate_options()


def at(listening: kv.LLMDataDist) -> kv.LLMClusterInfo:
    assert listening.listen_address is not None
    host, port = listening.listen_address.rsplit(":", 1)
    info = kv.LLMClusterInfo()
    info.remote_cluster_id = listening.cluster_id
    info.append_remote_ip_info(host, int(port))
    return info


def compute(layer: int, cache: kv.Cache) -> None:
    """The model: writes layer ``layer``'s K and V."""
    cache.tensors[2 * layer][...] = layer
    cache.tensors[2 * layer + 1][...] = -layer


async def still(cache: kv.Cache, seconds: float = 0.3) -> bool:
    """Nothing writes into ``cache`` for ``seconds``."""
    before = [t.copy() for t in cache.tensors]
    await anyio.sleep(seconds)
    return all(np.array_equal(a, b) for a, b in zip(before, cache.tensors, strict=True))


async def main(transport: str) -> None:
    # A small in-flight window makes the big pushes below long enough to cut.
    slow = {"max_inflight_bytes": 64 * 1024, "direct_copy": False}
    async with (
        kv.LLMDataDist(kv.LLMRole.DECODER, cluster_id=2) as decoder,
        kv.LLMDataDist(kv.LLMRole.PROMPT, cluster_id=1) as prompt,
    ):
        await decoder.init(config(transport, True, **slow))
        await prompt.init(config(transport, False, **slow))
        rc, per = await prompt.link_clusters([at(decoder)], timeout=5000)
        if rc != kv.LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"error: link failed: {[s.name for s in per]}")
        cm = prompt.cache_manager
        dst = decoder.cache_manager.allocate_cache(DESC)
        src = cm.allocate_cache(DESC)
        key = kv.CacheKeyByIdAndIndex(2, dst.cache_id)

        async def push(layer: int) -> None:
            with anyio.fail_after(10):
                await cm.push_cache(key, src, src_layer_range=range(layer, layer + 1), tag="r1")

        async with anyio.create_task_group() as tg:
            for layer in range(LAYERS):
                compute(layer, src)  # the next layer computes while this one moves
                tg.start_soon(push, layer)
                await anyio.lowlevel.checkpoint()
        await decoder.cache_manager.wait_for_layers("r1", range(LAYERS), timeout=10)
        assert all(np.array_equal(a, b) for a, b in zip(src.tensors, dst.tensors, strict=True))
        print(f"{LAYERS} layers pushed layer by layer")

        big_src, big_dst = cm.allocate_cache(BIG), decoder.cache_manager.allocate_cache(BIG)
        big_src.tensors[1][...] = 7
        big_key = kv.CacheKeyByIdAndIndex(2, big_dst.cache_id)
        await cm.push_cache(big_key, big_src, src_layer_range=range(1), tensor_num_per_layer=1)
        with anyio.move_on_after(0.005) as scope:  # the request was aborted
            await cm.push_cache(big_key, big_src, tensor_num_per_layer=1)
        in_flight = cm.stats()["live_jobs"]
        print(
            f"aborted push: cut off {scope.cancelled_caught}, in flight after it {in_flight}, "
            f"destination still afterwards {await still(big_dst)}"
        )
        try:
            with anyio.fail_after(0.005):
                await cm.push_cache(big_key, big_src, tensor_num_per_layer=1)
            print("bounded push: landed in time")
        except TimeoutError:
            print(
                f"bounded push: TimeoutError, in flight after it {cm.stats()['live_jobs']}, "
                f"destination still afterwards {await still(big_dst)}"
            )

        back = cm.allocate_cache(DESC)
        with anyio.fail_after(10):
            await cm.pull_cache(key, back)
        same = all(np.array_equal(a, b) for a, b in zip(src.tensors, back.tensors, strict=True))
        print(f"pulled back: {'identical' if same else 'DIFFERENT'}")
        if not same or in_flight:
            raise SystemExit(1)
    print("finalized")


def build_parser() -> argparse.ArgumentParser:
    description, sep, epilog = str(__doc__).partition("run it:\n")
    ap = argparse.ArgumentParser(
        prog="structured_flow.py",
        description=description.strip(),
        epilog=sep + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--backend",
        choices=["asyncio", "trio"],
        default="asyncio",
        help="the async library anyio runs on (default: %(default)s)",
    )
    ap.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="the data plane (default: %(default)s: UCX picks)",
    )
    return ap


if __name__ == "__main__":
    args = build_parser().parse_args()
    try:
        anyio.run(main, args.transport, backend=args.backend)
    except kv.LLMException as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
