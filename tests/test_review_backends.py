# ruff: noqa: E501  (the defect table and the child programs are kept whole)
"""Review of the LoopSide refactor (asyncio/trio), the testing package and the plugin.

Each test below failed on the code as reviewed (commit 5671034), for the
reason in this table; each defect was then fixed in
its mechanism (see docs/design.md, "The owner loop"), and the tests pin it:

| defect | how the test shows it |
|---|---|
| D1 A trio run that ends while a ``transfer_cache_async`` task has a layer in flight never ends: the run's end cancels the eventfd watcher (a system task) together with the pipeline, whose cancel path then waits, shielded, for a release only the dead watcher could report | ``test_a_run_ending_with_a_layerwise_task_in_flight_ends[trio]``: a child trio program returns from main with layer 0 in flight; it is still running after 20 s (the asyncio case passes: it pins that guarantee there) |
| D2 ``Notifications`` keeps one waiter: a second concurrent ``__anext__`` replaces the first one's, so the first reader is never woken again, not by a notification, not by ``close()``, not by ``finalize()`` (the old async generator refused a concurrent ``anext`` with a RuntimeError) | ``test_two_readers_of_one_notifications_iterator_both_end``: two readers, then ``close()``: one never returns |
| D3 ``JsonChild``/``PeerProcess`` requests carry no id: after a request times out (or its caller is cancelled) its late answer is read as the answer to the next request | ``test_a_timed_out_peer_request_does_not_answer_the_next_one``: ``rss`` gets the frozen ``stats`` answer |
| D4 ``PeerProcess(lifetime=...)`` promises "it exits after that many seconds whatever happens": the watchdog is a thread of the child, so a frozen (``SIGSTOP``) peer whose test process died stays forever | ``test_a_frozen_peer_outlives_its_lifetime_when_the_test_process_dies``: the peer is still there (state T) well after its lifetime |
| D5 Under trio a Ctrl-C (``KeyboardInterrupt``) ignores shielded scopes: it cuts ``TrioSide.settle`` (a cancelled transfer's release wait) and ``TrioSide.shielded`` (finalize) short, so a push raises while its jobs are live, and a finalize stops half way with ``_closed`` already set (a second finalize is a no-op: the engine is never closed). Under asyncio (``asyncio.run`` turns SIGINT into a cancel) both hold | ``test_ctrl_c_during_a_cancelled_push_release_under_trio`` (the push raises with ``live_jobs`` 1); ``test_ctrl_c_during_finalize_under_trio`` (after KI and a second ``finalize()`` the engine is still open) |
| D6 ``link_clusters`` (also ``unlink_clusters``, ``switch_role``, ``copy_cache``/``copy_blocks``/``swap_blocks``) never calls ``Runtime.check_loop``: from a loop the instance does not belong to, the service call is submitted first and only then does ``from_service`` fail, with a foreign message (trio's "must be called from async context") — and the link is made anyway | ``test_link_clusters_from_another_loop_is_refused_before_it_links``: trio-owned instance, ``link_clusters`` from an asyncio loop in a thread (and the reverse): unclear error, cluster 2 linked afterwards |
| D7 Under trio the layer-wise pipeline is spawned with ``spawn_system_task`` and no ``context=``: it runs in a copy of the run's *initial* context, so the caller's ``contextvars`` (request ids, tracing spans, anything the layer synchronizer reads) are gone there; under asyncio ``create_task`` copies the caller's context | ``test_the_layer_synchronizer_sees_the_callers_contextvars``: the synchronizer reads the caller's ContextVar: set on asyncio, the default on trio |
| D8 ``CacheTask.cancel()`` "stops sending": under trio a cancel made before the pipeline's system task first ran is only seen at its first checkpoint, and with a plain (or non-suspending) synchronizer that is after every layer was submitted; under asyncio a task cancelled before it starts never runs | ``test_cancel_right_after_transfer_cache_async_sends_nothing``: ``jobs_submitted`` grows by the number of layers on trio, 0 on asyncio |
| D9 ``TrioSide.gather`` (``transfer_cache_async``'s destination lookups) is a strict nursery: a ``KeyboardInterrupt`` (or any BaseException that is not Cancelled) arriving while it waits comes out as ``BaseExceptionGroup([KeyboardInterrupt])`` — design.md promises "the first error (not an ExceptionGroup)", and ``except KeyboardInterrupt`` misses it | ``test_ctrl_c_during_a_layerwise_lookup_is_a_plain_keyboardinterrupt``: a lookup held by a frozen peer, Ctrl-C: ``BaseExceptionGroup`` |
| D10 ``AsyncioSide.check_can_close`` let ``finalize()`` run on any asyncio loop, but ``Runtime._close`` then resolves the owner loop's futures (``Receiver.close``, ``Bridge.close``'s dispatch) and calls ``remove_reader`` from the finalizing thread: not thread-safe, and the owner loop, if it is alive, is not woken — its awaiting calls hang. Fixed by refusing it while the owner loop runs | ``test_finalize_from_another_asyncio_loop_is_refused_while_the_owner_loop_runs``: the refusal names the loop; the owner's waiter is untouched until the owner's own finalize ends it |

Tests that pass and stay (they pin guarantees the refactor must keep):
``test_a_run_ending_with_a_layerwise_task_in_flight_ends[asyncio]`` (the
asyncio contrast of D1); ``test_a_copy_cut_by_a_cancel_scope_has_finished_when_it_raises``
(local copies in worker threads are quiescent under both libraries' cancel
scopes); ``test_two_trio_runs_in_two_threads_transfer_between_them``.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import trio

from aiokvcache import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMRole,
    Placement,
    TransferWithCacheKeyConfig,
    testing,
)
from aiokvcache.testing import Pair, PeerProcess

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


def _run_child(
    code: str, tmp_path: Path, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """Run ``code`` in a fresh interpreter; None when it is still running after ``timeout``."""
    script = tmp_path / "child.py"
    # Ctrl-C as an interactive run has it, whatever this process inherited:
    # a run started in the background of a non-interactive shell ignores
    # SIGINT, its children inherit that, and Python (so trio) then turns no
    # SIGINT into a KeyboardInterrupt.
    default_sigint = "import signal as _s\n_s.signal(_s.SIGINT, _s.default_int_handler)\n"
    script.write_text(default_sigint + textwrap.dedent(code))
    log = tmp_path / "child.log"
    # Output to a file, not a pipe: a grandchild that inherits it must not
    # keep us waiting for end of file.
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")


# --------------------------------------------------------------------- D1

END_OF_RUN = """
import anyio
from aiokvcache import CacheDesc, CacheKeyByIdAndIndex, DataType, Placement
from aiokvcache import TransferWithCacheKeyConfig
from aiokvcache.testing import make_pair

DESC = CacheDesc(8, [1, 32 << 20], DataType.DT_UINT8, Placement.HOST)


class Sync:
    async def synchronize_layer(self, layer, timeout):
        if layer == 0:
            return True  # layer 0 goes; layer 1 is "being computed" when the run ends
        await anyio.sleep_forever()


async def main():
    pr = await make_pair("{transport}", max_inflight_bytes=64 * 1024, direct_copy=False)
    dst = pr.d.allocate_cache(DESC)
    src = pr.p.allocate_cache(DESC)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    await pr.p.transfer_cache_async(src, Sync(), [cfg])
    await anyio.sleep(0)
    print("main returns", flush=True)
    # No finalize: the run's end cancels what is left (asyncio: its tasks;
    # trio: the instance's system tasks).


anyio.run(main, backend="{backend}")
print("run ended", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_a_run_ending_with_a_layerwise_task_in_flight_ends(
    tmp_path: Path, transport: str, library: str
) -> None:
    # docs/design.md: "the layer-wise pipeline task | ... the run's end cancels it".
    # asyncio passes (the loop still dispatches completions while it cancels
    # its tasks); trio hangs.
    code = END_OF_RUN.format(transport=transport, backend=library)
    done = _run_child(code, tmp_path, 20)
    assert done is not None, "the run never ended (the pipeline waits for a dead watcher)"
    assert "run ended" in done.stdout, done.stdout[-2000:]


# --------------------------------------------------------------------- D2


@pytest.mark.timeout(60)
async def test_two_readers_of_one_notifications_iterator_both_end(kv_pair: Pair) -> None:
    notes = kv_pair.d.notifications()
    ended: list[str] = []

    async def read(name: str) -> None:
        async for _ in notes:
            pass
        ended.append(name)

    with anyio.move_on_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, "a")
            tg.start_soon(read, "b")
            await anyio.sleep(0.1)
            notes.close()  # documented: stops it at once
            await anyio.sleep(0.5)
            # finalize() ends every iterator too: still not the first reader.
            await kv_pair.decoder.finalize()
    assert sorted(ended) == ["a", "b"], f"readers that ended: {ended}"


# --------------------------------------------------------------------- D3


@pytest.mark.timeout(120)
async def test_a_timed_out_peer_request_does_not_answer_the_next_one(
    kv_peer: PeerProcess,
) -> None:
    kv_peer.freeze()
    try:
        with pytest.raises(TimeoutError):
            await kv_peer.call("stats", timeout=0.5)
    finally:
        kv_peer.thaw()
    reply = await kv_peer.call("rss", timeout=30)
    assert "rss_kb" in reply, f"the answer to 'rss' was {sorted(reply)[:6]}..."


# --------------------------------------------------------------------- D4

ORPHAN = """
import anyio, os
from aiokvcache.testing import PeerProcess


async def main():
    peer = PeerProcess("decoder", "shm", lifetime={lifetime})
    await peer.start()
    peer.freeze()
    print(peer.pid, flush=True)
    os._exit(0)  # the test process dies hard (OOM killer, CI timeout, SIGKILL)


anyio.run(main)
"""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_a_frozen_peer_outlives_its_lifetime_when_the_test_process_dies(tmp_path: Path) -> None:
    lifetime = 2.0
    done = _run_child(ORPHAN.format(lifetime=lifetime), tmp_path, 90)
    assert done is not None and done.returncode == 0, done
    pid = int(done.stdout.split()[-1])  # the last line: the peer's pid
    try:
        time.sleep(lifetime + 4)
        state = _state(pid)
        assert state in (None, "Z"), (
            f"peer {pid} is still there (state {state}) {lifetime + 4:.0f} s after it was "
            f"started with lifetime={lifetime}"
        )
    finally:
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------- D5

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
    done = _run_child(CTRL_C_PUSH, tmp_path, 90)
    assert done is not None, "hung"
    lines = [ln for ln in done.stdout.splitlines() if "; live" in ln]
    assert lines, done.stdout[-3000:]
    assert lines[0].endswith("live 0"), f"the push ended with jobs live: {lines[0]!r}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["trio"])
def test_ctrl_c_during_finalize_under_trio(tmp_path: Path) -> None:
    done = _run_child(CTRL_C_FINALIZE, tmp_path, 90)
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
    done = _run_child(CTRL_C_LOOKUP, tmp_path, 90)
    assert done is not None, "hung"
    assert "raised KeyboardInterrupt" in done.stdout, done.stdout[-3000:]


# --------------------------------------------------------------------- D6


def _other_loop(owner: str, fn: Any) -> None:
    """Run ``fn`` (an async function) on the other library, in a thread."""
    thread = threading.Thread(
        target=(lambda: asyncio.run(fn())) if owner == "trio" else (lambda: trio.run(fn))
    )
    thread.start()
    thread.join(30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("owner", ["trio", "asyncio"])
def test_link_clusters_from_another_loop_is_refused_before_it_links(owner: str) -> None:
    seen: list[BaseException] = []
    linked: list[list[int]] = []

    async def main() -> None:
        dec = LLMDataDist(LLMRole.DECODER, 2)
        pro = LLMDataDist(LLMRole.PROMPT, 1)
        await dec.init(testing.options("shm", listen=True))
        await pro.init(testing.options("shm"))
        try:

            async def misuse() -> None:
                try:
                    await pro.link_clusters([testing.cluster_info(dec)], timeout=3000)
                except BaseException as exc:
                    seen.append(exc)

            await anyio.to_thread.run_sync(_other_loop, owner, misuse)
            await anyio.sleep(1)  # whatever the service thread went on doing
            linked.append(sorted(pro._links))
        finally:
            await pro.finalize()
            await dec.finalize()

    # In a thread of its own: the anyio plugin's loop may run in this one.
    runner = threading.Thread(target=anyio.run, args=(main,), kwargs={"backend": owner})
    runner.start()
    runner.join(50)
    assert seen, "link_clusters from another loop raised nothing"
    assert linked == [[]], f"{seen[0]!r}, and linked anyway: {linked}"
    assert isinstance(seen[0], RuntimeError) and "init()" in str(seen[0]), repr(seen[0])


# --------------------------------------------------------------------- D7

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


@pytest.mark.timeout(60)
async def test_the_layer_synchronizer_sees_the_callers_contextvars(kv_pair: Pair) -> None:
    desc = CacheDesc(4, [1, 4096], DataType.DT_UINT8, Placement.HOST)
    dst = kv_pair.d.allocate_cache(desc)
    src = kv_pair.p.allocate_cache(desc)
    seen: list[str] = []

    class Sync:
        async def synchronize_layer(self, layer: int, timeout: int | None) -> bool:
            seen.append(REQUEST_ID.get())
            return True

    token = REQUEST_ID.set("req-42")
    try:
        cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
        with anyio.fail_after(10):
            task = await kv_pair.p.transfer_cache_async(src, Sync(), [cfg])
            await task
    finally:
        REQUEST_ID.reset(token)
    assert seen == ["req-42", "req-42"], seen


# --------------------------------------------------------------------- D8


@pytest.mark.timeout(60)
async def test_cancel_right_after_transfer_cache_async_sends_nothing(kv_pair: Pair) -> None:
    layers = 4
    desc = CacheDesc(2 * layers, [1, 64 << 10], DataType.DT_UINT8, Placement.HOST)
    dst = kv_pair.d.allocate_cache(desc)
    src = kv_pair.p.allocate_cache(desc)
    src.tensors[0][...] = 1

    class Plain:
        def synchronize_layer(self, layer: int, timeout: int | None) -> bool:
            return True

    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, dst.cache_id))
    before = kv_pair.p.stats()["jobs_submitted"]
    task = await kv_pair.p.transfer_cache_async(src, Plain(), [cfg])
    assert task.cancel()  # before anything was sent
    with anyio.fail_after(10):
        try:
            await task
        except BaseException as exc:  # CancelledError (asyncio), LLMException (trio)
            if not isinstance(exc, (Exception, anyio.get_cancelled_exc_class())):
                raise
    sent = kv_pair.p.stats()["jobs_submitted"] - before
    assert sent == 0, f"{sent} layers were submitted after task.cancel()"


# ------------------------------------------------------------ pinned (pass)


@pytest.mark.timeout(60)
async def test_a_copy_cut_by_a_cancel_scope_has_finished_when_it_raises(kv_pair: Pair) -> None:
    desc = CacheDesc(4, [1, 64 << 20], DataType.DT_UINT8, Placement.HOST)
    src = kv_pair.p.allocate_cache(desc)
    dst = kv_pair.p.allocate_cache(desc)
    for t in src.tensors:
        t[...] = 5
    with anyio.CancelScope() as scope:
        scope.cancel()  # cancelled before the copy even starts its thread...
        await kv_pair.p.copy_cache(dst, src)
    assert scope.cancelled_caught
    with anyio.move_on_after(0.002) as scope:  # ...and while it runs
        await kv_pair.p.copy_cache(dst, src)
    assert scope.cancelled_caught
    # Returned: the copy is whole and nothing writes any more.
    assert all(int(t[0, -1]) == 5 and int(t[0, 0]) == 5 for t in dst.tensors)
    await testing.assert_still(dst, 0.1)


TWO_RUNS_DESC = CacheDesc(4, [1, 1 << 20], DataType.DT_UINT8, Placement.HOST)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_two_trio_runs_in_two_threads_transfer_between_them(transport: str) -> None:
    import queue

    where: queue.Queue[tuple[str, int]] = queue.Queue()
    got: dict[str, Any] = {}

    async def decoder() -> None:
        dec = LLMDataDist(LLMRole.DECODER, 2)
        await dec.init(testing.options(transport, listen=True))
        try:
            dst = dec.cache_manager.allocate_cache(TWO_RUNS_DESC)
            assert dec.listen_address is not None
            where.put((dec.listen_address, dst.cache_id))
            with trio.fail_after(30):
                for i in range(10):
                    await dec.cache_manager.wait_for_layers(f"r{i}", [0, 1], timeout=10)
            got["bytes"] = bytes(dst.tensors[3][0, :4])
        finally:
            await dec.finalize()

    async def prompt() -> None:
        address, cache_id = await trio.to_thread.run_sync(where.get, True, 30)
        pro = LLMDataDist(LLMRole.PROMPT, 1)
        await pro.init(testing.options(transport))
        try:
            await pro.link_clusters([testing.cluster_info(address, 2)], timeout=5000)
            src = pro.cache_manager.allocate_cache(TWO_RUNS_DESC)
            src.tensors[3][...] = 7
            for i in range(10):
                with trio.fail_after(10):
                    key = CacheKeyByIdAndIndex(2, cache_id)
                    await pro.cache_manager.push_cache(key, src, tag=f"r{i}")
            got["live"] = pro.cache_manager.stats()["live_jobs"]
            await trio.sleep(0.3)
        finally:
            await pro.finalize()

    runs = [threading.Thread(target=trio.run, args=(fn,)) for fn in (decoder, prompt)]
    for r in runs:
        r.start()
    for r in runs:
        r.join(60)
    assert got == {"bytes": b"\x07" * 4, "live": 0}, got


# --------------------------------------------------------------------- D10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_finalize_from_another_asyncio_loop_is_refused_while_the_owner_loop_runs() -> None:
    """D10, fixed by refusing: resolving the owner loop's waiters from another
    thread is not safe while it runs (and running the close there is cut by
    that loop's own shutdown). The refusal changes nothing; the owner's own
    finalize then ends its waiters."""
    from aiokvcache import LLMException

    ready = threading.Event()
    owner: dict[str, Any] = {}
    refused = threading.Event()
    ended = threading.Event()

    def run_owner() -> None:
        async def main() -> None:
            dd = LLMDataDist(LLMRole.DECODER, 2)
            await dd.init(testing.options("shm"))
            owner["dd"] = dd
            ready.set()

            async def wait() -> None:
                try:
                    await dd.cache_manager.wait_for_layers("never", [0])
                except LLMException as exc:
                    owner["status"] = exc.status_code.name

            waiter = asyncio.ensure_future(wait())
            await asyncio.to_thread(refused.wait, 20)
            assert not waiter.done()  # the refused finalize changed nothing
            await dd.finalize()
            await waiter
            ended.set()

        asyncio.run(main())

    thread = threading.Thread(target=run_owner, daemon=True)
    thread.start()
    assert ready.wait(20)

    async def finalize() -> None:
        try:
            await owner["dd"].finalize()
        except RuntimeError as exc:
            owner["refusal"] = str(exc)
        refused.set()

    other = threading.Thread(target=lambda: asyncio.run(finalize()))
    other.start()
    other.join(20)
    assert ended.wait(20), owner
    thread.join(5)
    assert "the event loop that ran init()" in owner.get("refusal", ""), owner
    assert owner["status"] == "LLM_ENGINE_FINALIZED"
