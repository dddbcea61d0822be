"""A decode process whose event loop is blocked still serves its peers.

LLM-DataDist serves peers from native threads and its samples rely on it:
the decoder sits in a blocking barrier while the prompt side links and
pushes. Here the decode process blocks its loop (``time.sleep``, then a
pure-Python busy loop) while this process links, pushes, pulls, and the
decoder deallocates a cache from another thread: every call must complete
while the decoder is still blocked (the block lasts far longer than any of
them may take), with the bytes right.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import aiokvcache as kv

PEER = Path(__file__).with_name("_blocked_peer.py")
BLOCK_S = 8.0
# Each call must finish long before the block ends: a call that needed the
# decoder's loop would take the whole block.
CALL_BOUND_S = BLOCK_S / 2
SHAPE = [1, 64, 8, 64]
TENSORS = 8


class Peer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.seen: list[str] = []

    async def expect(self, prefix: str, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), timeout)).decode()
            if not line:
                raise AssertionError(f"peer exited before {prefix!r}; saw {self.seen}")
            line = line.strip()
            self.seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    def still_blocked(self) -> bool:
        return "UNBLOCKED" not in self.seen


async def timed(coro: object, what: str) -> object:
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await coro  # type: ignore[misc]
    took = loop.time() - start
    assert took < CALL_BOUND_S, f"{what} took {took:.2f}s: it waited for the blocked loop"
    return result


@pytest.mark.parametrize("mode", ["sleep", "busy"])
async def test_blocked_decoder_is_served(transport: str, mode: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PEER),
        transport,
        mode,
        str(BLOCK_S),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    peer = Peer(proc)
    cfg = kv.LLMConfig()
    cfg.transport = transport
    prompt = kv.LLMDataDist(kv.LLMRole.PROMPT, cluster_id=1)
    try:
        info = json.loads(await peer.expect("READY "))
        await peer.expect("BLOCKING")
        await prompt.init(cfg.generate_options())
        cm = prompt.cache_manager
        host, port = info["address"].rsplit(":", 1)
        cluster = kv.LLMClusterInfo()
        cluster.remote_cluster_id = 2
        cluster.append_remote_ip_info(host, int(port))
        ret, _ = await timed(prompt.link_clusters([cluster], timeout=3000), "link_clusters")
        assert ret == kv.LLMStatusCode.LLM_SUCCESS

        desc = kv.CacheDesc(TENSORS, SHAPE, kv.DataType.DT_FLOAT16, kv.Placement.HOST)
        src = cm.allocate_cache(desc)
        rng = np.random.default_rng(3)
        for t in src.tensors:
            t.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
        key = kv.CacheKeyByIdAndIndex(2, info["push"], 0)
        await timed(cm.push_cache(key, src, timeout=3), "push_cache")
        gone = kv.CacheKeyByIdAndIndex(2, info["gone"], 0)
        await timed(cm.push_cache(gone, src, timeout=3), "push_cache to the doomed cache")

        back = cm.allocate_cache(desc)
        await timed(cm.pull_cache(kv.CacheKey(2, req_id=7), back, timeout=3), "pull_cache")
        for i, t in enumerate(back.tensors):
            want = np.arange(t.nbytes, dtype=np.uint64).astype(np.uint8) ^ i
            assert np.array_equal(t.view(np.uint8).reshape(-1), want)

        # The decoder deallocates from another thread: it asks us to
        # invalidate, we acknowledge, its memory goes, all while blocked.
        peer.send("dealloc")
        await timed(peer.expect("RELEASED"), "deallocation with invalidation")
        with pytest.raises(kv.LLMException) as ei:
            await timed(cm.push_cache(gone, src, timeout=3), "push_cache to the freed cache")
        assert ei.value.status_code == kv.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert peer.still_blocked(), f"the calls outlived the block: {peer.seen}"

        await peer.expect("UNBLOCKED")
        digest = await peer.expect("DIGEST ")
        assert digest == hashlib.sha256(b"".join(t.tobytes() for t in src.tensors)).hexdigest()
        peer.send("exit")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await prompt.finalize()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
