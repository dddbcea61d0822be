# ruff: noqa: E501  (the child programs are kept whole)
"""Ctrl-C (``KeyboardInterrupt``) under trio, which ignores shielded scopes:
a cancelled push still waits for its jobs' release, finalize still finishes,
and a layer-wise lookup raises a plain KeyboardInterrupt. Each runs as a
child program (tests/support/child_script.py) that raises SIGINT in itself
at the chosen moment."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.child_script import run_child

pytestmark = pytest.mark.anyio

CTRL_C_PUSH = """
import signal, threading
import anyio
from aiokvcache import CacheDesc, CacheKeyByIdAndIndex, DataType, LLMDataDist, LLMRole, Placement
from aiokvcache import testing
from aiokvcache.testing import PeerProcess

N = 32 << 20


async def main():
    async with PeerProcess("decoder", "tcp") as peer:
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(testing.options("tcp", max_inflight_bytes=64 * 1024, direct_copy=False))
        try:
            await dd.link_clusters([testing.cluster_info(peer.address, peer.cluster_id)], timeout=10000)
            dst = await peer.alloc("dst", 2, N)
            desc = CacheDesc(2, [1, N], DataType.DT_UINT8, Placement.HOST)
            src = dd.cache_manager.allocate_cache(desc)
            key = CacheKeyByIdAndIndex(2, dst["cache_id"])
            await dd.cache_manager.push_cache(key, src, src_layer_range=range(1), tensor_num_per_layer=1)
            peer.freeze()
            # Cut at 0.3 s; releasing its jobs takes a few hundred ms more (a
            # frozen TCP peer): Ctrl-C comes in the middle of that wait.
            threading.Timer(0.4, signal.raise_signal, (signal.SIGINT,)).start()
            try:
                with anyio.move_on_after(0.3):
                    await dd.cache_manager.push_cache(key, src, tensor_num_per_layer=1)
                print("returned; live", dd.cache_manager.stats()["live_jobs"], flush=True)
                await anyio.sleep(1)
            except KeyboardInterrupt:
                print("interrupted; live", dd.cache_manager.stats()["live_jobs"], flush=True)
            peer.thaw()
        finally:
            with anyio.CancelScope(shield=True):
                await dd.finalize()


anyio.run(main, backend="trio")
"""

CTRL_C_FINALIZE = """
import signal, threading
import anyio
from aiokvcache import LLMDataDist, LLMRole
from aiokvcache import testing
from aiokvcache.testing import PeerProcess


async def main():
    async with PeerProcess("decoder", "tcp") as peer:
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(testing.options("tcp"))
        await dd.link_clusters([testing.cluster_info(peer.address, peer.cluster_id)], timeout=10000)
        peer.freeze()  # finalize tells the peer it goes: that waits up to 1 s
        threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,)).start()
        try:
            await dd.finalize()
            await anyio.sleep(1)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        await dd.finalize()  # idempotent: must leave it finalized
        print("engine closed:", dd._rt.bridge.closed, flush=True)
        peer.thaw()


anyio.run(main, backend="trio")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["trio"])
def test_ctrl_c_during_a_cancelled_push_release_under_trio(tmp_path: Path) -> None:
    """A Ctrl-C that cut the shielded release wait short made the push raise
    with its jobs still live."""
    done = run_child(CTRL_C_PUSH, tmp_path, 90)
    assert done is not None, "hung"
    lines = [ln for ln in done.stdout.splitlines() if "; live" in ln]
    assert lines, done.stdout[-3000:]
    assert lines[0].endswith("live 0"), f"the push ended with jobs live: {lines[0]!r}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["trio"])
def test_ctrl_c_during_finalize_under_trio(tmp_path: Path) -> None:
    """A Ctrl-C that cut a finalize half way left it marked closed, so a
    second finalize did nothing and the engine was never closed."""
    done = run_child(CTRL_C_FINALIZE, tmp_path, 90)
    assert done is not None, "hung"
    assert "engine closed: True" in done.stdout, done.stdout[-3000:]


CTRL_C_LOOKUP = """
import signal, threading
import anyio
from aiokvcache import CacheDesc, CacheKeyByIdAndIndex, DataType, LLMDataDist, LLMRole, Placement
from aiokvcache import TransferWithCacheKeyConfig, testing
from aiokvcache.testing import PeerProcess


class Sync:
    def synchronize_layer(self, layer, timeout):
        return True


async def main():
    async with PeerProcess("decoder", "tcp") as peer:
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(testing.options("tcp"))
        try:
            await dd.link_clusters([testing.cluster_info(peer.address, peer.cluster_id)], timeout=10000)
            dst = await peer.alloc("dst", 4, 4096)
            src = dd.cache_manager.allocate_cache(CacheDesc(4, [1, 4096], DataType.DT_UINT8, Placement.HOST))
            peer.freeze()  # the destination lookup waits for the peer
            threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,)).start()
            try:
                cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst["cache_id"]))
                await dd.cache_manager.transfer_cache_async(src, Sync(), [cfg], timeout=5)
            except BaseException as exc:
                print("raised", type(exc).__name__, flush=True)
            peer.thaw()
        finally:
            with anyio.CancelScope(shield=True):
                await dd.finalize()


anyio.run(main, backend="trio")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["trio"])
def test_ctrl_c_during_a_layerwise_lookup_is_a_plain_keyboardinterrupt(tmp_path: Path) -> None:
    """The destination lookups run in a nursery: a Ctrl-C there came out as a
    BaseExceptionGroup, which ``except KeyboardInterrupt`` misses."""
    done = run_child(CTRL_C_LOOKUP, tmp_path, 90)
    assert done is not None, "hung"
    assert "raised KeyboardInterrupt" in done.stdout, done.stdout[-3000:]
