"""``python -m aiokvcache info`` and ``demo``: what is here, and a two-instance round trip."""

from __future__ import annotations

import platform
import sys

import numpy as np

from . import (
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    __version__,
)
from .options import TRANSPORTS

PROMPT_ID, DECODER_ID = 1, 2


def info() -> int:
    """Print versions and the transports UCX offers here."""
    from . import _ucxlog
    from ._loader import native

    print(f"aiokvcache {__version__}")
    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"numpy      {np.__version__}")
    print(f"UCX        {native.ucx_version()}")
    for transport in TRANSPORTS:
        try:
            eng = native.Engine(transport)
        except Exception as exc:
            _ucxlog.drain()  # UCX's own words: logged, shown with --debug
            print(f"transport {transport:<5} unavailable: {str(exc).splitlines()[0]}")
            continue
        try:
            text = eng.info()
        finally:
            eng.close()
            _ucxlog.drain()
        tls = sorted(
            {line.rsplit("--", 1)[-1].strip() for line in text.splitlines() if "resource" in line}
        )
        print(f"transport {transport:<5} {', '.join(tls)}")
    return 0


def _options(listen: bool) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.transport = "auto"
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    cfg.sync_kv_timeout = 60_000  # a 2-core machine under load can be slow
    return cfg.generate_options()


async def demo() -> int:
    """Push and pull a tiny cache between two instances in this process."""
    shape = CacheDesc(4, [1, 8], DataType.DT_FLOAT16, Placement.HOST)
    async with (
        LLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder,
        LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt,
    ):
        await decoder.init(_options(listen=True))
        await prompt.init(_options(listen=False))
        host, port = str(decoder.listen_address).rsplit(":", 1)
        info = LLMClusterInfo()
        info.remote_cluster_id = DECODER_ID
        info.append_remote_ip_info(host, int(port))
        print("link:", (await prompt.link_clusters([info]))[0].name)
        dst = decoder.cache_manager.allocate_cache(shape)
        src = prompt.cache_manager.allocate_cache(shape, [CacheKey(PROMPT_ID, req_id=7)])
        for i, t in enumerate(src.tensors):
            t[...] = i + 1
        await prompt.cache_manager.push_cache(CacheKeyByIdAndIndex(DECODER_ID, dst.cache_id), src)
        print("pushed; decoder sees:", [float(t[0, 0]) for t in dst.tensors])
        for t in dst.tensors:
            t[...] = 0
        await decoder.cache_manager.pull_cache(CacheKey(PROMPT_ID, req_id=7), dst)
        print("pulled by CacheKey; decoder sees:", [float(t[0, 0]) for t in dst.tensors])
    return 0
