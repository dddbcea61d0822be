"""Peer trust: what a linked, relaying or flooding peer cannot do to us, as
adversarial tests, each failing on a library without the guard it holds.

Peers are child processes (the peer program, an LLMDataDist driven by JSON
lines, with the ops of ``tests/support/peer_ops_trust.py``); every test runs
over shm and tcp unless marked otherwise. Reaching inside the library:
``_runtime`` below (our own instance's worker address and table of cache
records), ``aiokvcache._core.wire.control`` (a hostile control-plane peer)
and, in those ops, the *internal* ones (forge a notification, serve
crafted metadata, flood probe_back).

How each test fails without its guard:

* ``test_a_relay_learns_no_worker_address_and_no_cache_metadata[shm,tcp]``
    AssertionError: the relay (no token) read: A's UCX worker address, B's UCX worker
    address, 4-5 of B's cache addresses; link LLM_SUCCESS (everything after the handshake
    is plaintext; nothing binds the transcript to a session).
* ``test_initiator_sends_no_auth_to_the_wrong_cluster[shm,tcp]``
    AssertionError: A sent its UCX worker address (AUTH) to cluster 3 before checking the
    cluster id (the link fails only afterwards: LLM_LINK_FAILED, "it is cluster 3").
* ``test_acceptor_refuses_a_hello_claiming_its_own_cluster_id``
    ``[shm,tcp x token,no-token]``:
    AssertionError: cluster 2 accepted a peer claiming to be cluster 2: link LLM_SUCCESS,
    its links {'2': False}, endpoints 1.
* ``test_notification_source_is_the_link_it_came_on[shm,tcp]``
    AssertionError: C's notification reads as sent by [1] (C is 3, A is 1).
* ``test_wait_for_layers_from_a_cluster_ignores_forgeries[shm,tcp]``
    TypeError: CacheManager.wait_for_layers() got an unexpected keyword argument
    'src_cluster_id' (the keyword is new; the test above shows the misattribution).
* ``test_a_peer_that_never_reads_cannot_grow_the_victims_queue[shm,tcp]``
    AssertionError: the victim grew by 129 MiB queueing answers for a peer that does not
    read (bound 128 MiB; 1500 cache_by_id requests, ~290 KB answers each; the connection
    stays up).
* ``test_cache_by_addr_lookup_does_not_scan_every_cache[shm,tcp]``
    AssertionError: looking up 4096 addresses among 20000 caches read cache records more
    than 524288 times (the lookup is stopped there and answers LLM_FAILED).
* ``test_a_notification_flood_into_a_blocked_loop_is_capped[shm,tcp]``
    AssertionError: 400000 notifications of 468 bytes into a blocked loop: the victim grew
    by 207 MiB; drop counters {'dropped_notifications': 0}.
* ``test_a_frozen_prober_stalls_neither_retirement_nor_new_links (tcp only)``
    AssertionError: a new peer could not link (LLM_TIMEOUT) while a frozen peer holds 40
    probe_back requests. With that check left out: a retired cache's memory was not
    released in 30 s (regions 6 -> 6). The same test with the attacker merely SIGSTOPped
    (no probe_back flood) passes without the guard.
* ``test_a_tagged_push_to_a_frozen_receiver_ends_at_its_deadline (shm only)``
    AssertionError: 146-147 of 400 tagged pushes (timeout=2.0s) to a frozen receiver
    still running after 30 s (the same 147 after 60 s).
* ``test_transfer_from_another_loop_is_refused_before_submitting``
    ``[shm,tcp x push_cache,pull_cache,notify]``:
    AssertionError: 2 jobs (notify: 1) submitted before the refusal; the refusal is
    RuntimeError "Task ... got Future ... attached to a different loop", which names
    neither init() nor the right loop.
* ``test_simultaneous_links_from_both_sides_leave_a_working_link[shm,tcp]``
    AssertionError: round N (seen N = 0..26 of 60; one run of 20 rounds in 12 missed):
    links LLM_ALREADY_LINK / LLM_ALREADY_LINK, then pushes a->b and b->a LLM_LINK_FAILED
    ("peer closed: cluster 2 is already linked").
* ``test_infinite_timeout_means_no_limit[shm,tcp]``
    AssertionError: timeout=inf failed: push_cache, pull_cache, push_blocks, pull_blocks,
    notify: OverflowError: cannot convert float infinity to integer (wait_for_layers works
    already).
* ``test_malformed_peer_metadata_raises_llm_errors_only[shm,tcp]``
    AssertionError: 9 non-LLM errors escaped: TypeError (rkey not bytes) and KeyError
    ('rkey' missing) for every lookup, OverflowError (cache_by_key batch_index -1);
    accepted: cache_id "7", tensor_region ["0", "0"], shape [1, 0] (cache_by_key).
* ``test_endpoint_records_of_broken_links_are_erased``
    ``[shm,tcp x force_unlink,finalize,kill]``:
    AssertionError: 4 endpoint records for one live link after 3 links broken by their
    peers; baseline 0.
* ``test_ucx_fatal_lines_reach_stderr_at_once[exit,drain]``
    AttributeError in the child: module 'aiokvcache._native' has no attribute
    'ucx_log_emit' (assert 'EMITTED' in its stdout).
* ``test_init_warns_once_when_listening_beyond_loopback_without_token``
    AssertionError: no warning for 0.0.0.0 without a token (assert 0 == 1).

Endpoints of broken links: a break from the peer side re-linked under the *same* cluster id
does not fail without the guard: the re-link drops the broken link and its endpoint
goes. What does fail is the record of a broken link that is not re-linked:
peers that come and go under new cluster ids leave one endpoint each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache.testing import cluster_info, fill
from support.harness import TRUST, AsyncPeer, rss_kb

S = kv.LLMStatusCode
TOKEN = "tr-shared-token"


def u8_desc(tensors: int, nbytes: int) -> kv.CacheDesc:
    return kv.CacheDesc(tensors, [1, nbytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


def blocks_u8(tensors: int, blocks: int, block_bytes: int) -> kv.CacheDesc:
    return kv.CacheDesc(tensors, [blocks, block_bytes], kv.DataType.DT_UINT8, kv.Placement.HOST)


class TrPeer(AsyncPeer):
    """The peer program with the trust ops (tests/support/peer_ops_trust.py)."""

    def __init__(self, role: str, *args: str, **kw: Any) -> None:
        super().__init__(role, *args, ops=TRUST, lifetime=300, **kw)

    @property
    def cluster_id(self) -> int:
        return int(self.hello["cluster_id"])

    @property
    def worker(self) -> bytes:
        return bytes.fromhex(self.hello["worker"])


def _runtime(dd: kv.LLMDataDist) -> Any:
    """The private runtime of an in-process LLMDataDist: the one reach inside
    the library this file makes on its own instances, to read its UCX worker
    address (the relay test) and to find its table of cache records (the
    cache_by_addr test)."""
    return dd._rt


def engine_of(dd: kv.LLMDataDist) -> Any:
    return _runtime(dd).engine


def record_table(dd: kv.LLMDataDist) -> dict[int, Any]:
    """Our cache records by id (their type is what the cache_by_addr test counts reads of)."""
    return _runtime(dd).state.cache_table.caches  # type: ignore[no-any-return]


async def started(
    transport: str,
    cluster_id: int,
    *,
    listen: str | None = "127.0.0.1:0",
    auth_token: str | None = None,
    peer_timeout: int | None = None,
    **extra: Any,
) -> kv.LLMDataDist:
    """An initialized in-process LLMDataDist."""
    cfg = kv.LLMConfig()
    cfg.transport = transport
    if listen is not None:
        cfg.listen_ip_info = listen
    if auth_token is not None:
        cfg.auth_token = auth_token
    if peer_timeout is not None:
        cfg.peer_timeout = peer_timeout
    for k, v in extra.items():
        setattr(cfg, k, v)
    role = kv.LLMRole.DECODER if listen is not None else kv.LLMRole.PROMPT
    dd = kv.LLMDataDist(role, cluster_id)
    await dd.init(cfg.generate_options())
    return dd


@contextlib.asynccontextmanager
async def instance(transport: str, cluster_id: int, **kw: Any) -> AsyncIterator[kv.LLMDataDist]:
    dd = await started(transport, cluster_id, **kw)
    try:
        yield dd
    finally:
        await dd.finalize()


def peer_args(
    transport: str,
    cluster_id: int,
    *,
    listen: str = "127.0.0.1:0",
    auth_token: str | None = None,
    peer_timeout: int | None = None,
    prefault: bool = True,
) -> list[str]:
    """A :class:`TrPeer`'s role and options: a decoder listening on
    ``listen``, or with ``listen="none"`` a prefill that does not listen."""
    role = "prefill" if listen == "none" else "decoder"
    args = [role, transport, f"--cluster-id={cluster_id}"]
    if listen != "none":
        args.append(f"--listen={listen}")
    if auth_token is not None:
        args.append(f"--auth-token={auth_token}")
    extra: dict[str, Any] = {}
    if peer_timeout is not None:
        extra["peer_timeout"] = peer_timeout
    if not prefault:
        extra["prefault"] = False  # nor does it install a same-host peer's caches at link time
    if extra:
        args.append(f"--options={json.dumps(extra)}")
    return args


async def link(dd: kv.LLMDataDist, address: str, cluster_id: int, timeout_ms: int = 5000) -> S:
    rc, _ = await dd.link_clusters([cluster_info(address, cluster_id)], timeout=timeout_ms)
    return rc


# =============================================== infinite timeouts
# timeout=float("inf") passes check_timeout, then the job path computes
# math.ceil(inf * 1000): OverflowError. inf must mean "no limit".


async def test_infinite_timeout_means_no_limit(transport: str) -> None:
    inf = float("inf")
    async with TrPeer(*peer_args(transport, 2)) as peer, instance(transport, 1) as dd:
        cm = dd.cache_manager
        assert await link(dd, peer.address, 2) == S.LLM_SUCCESS
        nbytes = 256 << 10  # over the inline-copy size: the job path
        slot = await peer.call("alloc", name="slot", tensors=4, bytes=nbytes, seed=5)
        await peer.call("alloc", name="blk", tensors=4, bytes=4096, blocks=8, blocks_key=[2, 0])
        mine = cm.allocate_cache(u8_desc(4, nbytes))
        fill(mine, 9)
        mine_blocks = cm.allocate_blocks_cache(blocks_u8(4, 8, 4096))
        fill(mine_blocks, 10)
        key = kv.CacheKeyByIdAndIndex(2, slot["cache_id"], 0)
        bkey = kv.BlocksCacheKey(2, 0)
        calls: dict[str, Any] = {
            "push_cache": lambda: cm.push_cache(key, mine, timeout=inf),
            "pull_cache": lambda: cm.pull_cache(key, mine, timeout=inf),
            "push_blocks": lambda: cm.push_blocks(bkey, mine_blocks, [0, 1], [2, 3], timeout=inf),
            "pull_blocks": lambda: cm.pull_blocks(bkey, mine_blocks, [2, 3], [4, 5], timeout=inf),
            "notify": lambda: cm.notify(2, "inf-note", timeout=inf),
        }
        failures: dict[str, str] = {}
        for name, call in calls.items():
            try:
                await call()
            except Exception as exc:
                failures[name] = f"{type(exc).__name__}: {exc}"
        # wait_for_layers: the peer pushes a tagged layer into our cache.
        waiter = asyncio.ensure_future(cm.wait_for_layers("inf-tag", [0, 1], timeout=inf))
        got = await peer.call(
            "push", cluster_id=1, cache_id=mine.cache_id, src="slot", tag="inf-tag", timeout=10
        )
        assert got["status"] == "LLM_SUCCESS", got
        try:
            async with asyncio.timeout(30):
                await waiter
        except Exception as exc:
            failures["wait_for_layers"] = f"{type(exc).__name__}: {exc}"
        assert not failures, f"timeout=inf failed: {failures}"
        assert cm.stats()["live_jobs"] == 0


# ======================================= listening without a token
# init() on a non-loopback listen address without an auth token says nothing.


async def test_init_warns_once_when_listening_beyond_loopback_without_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def warnings_of(records: list[logging.LogRecord]) -> list[str]:
        return [
            r.getMessage()
            for r in records
            if r.name == "aiokvcache" and r.levelno == logging.WARNING
        ]

    seen: dict[str, list[str]] = {}
    for label, listen, token in (
        ("0.0.0.0 without token", "0.0.0.0:0", None),
        ("0.0.0.0 with token", "0.0.0.0:0", TOKEN),
        ("127.0.0.1 without token", "127.0.0.1:0", None),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aiokvcache"):
            async with instance("tcp", 1, listen=listen, auth_token=token):
                pass
        seen[label] = warnings_of(caplog.records)
    assert len(seen["0.0.0.0 without token"]) == 1, seen
    assert seen["0.0.0.0 with token"] == [], seen
    assert seen["127.0.0.1 without token"] == [], seen


# =========================================== UCX's fatal log lines
# The UCX log handler queues FATAL / ERROR lines like warnings: a process UCX
# aborts dies without printing why.

_UCXLOG_CHILD = textwrap.dedent(
    """
    import logging, os, sys
    from aiokvcache._loader import native
    fmt = "LOGGED %(name)s %(message)s"
    logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format=fmt)
    native.ucx_log_emit(2, "tr-warn-marker")
    if sys.argv[1] == "drain":
        from aiokvcache import _ucxlog
        _ucxlog.drain()
    print("EMITTED", flush=True)
    sys.stderr.flush()
    # A FATAL line: UCX's own handler prints it, then UCX aborts as it does
    # on a fatal error; no Python drain ever runs.
    native.ucx_log_emit(0, "tr-fatal-marker")
    os._exit(7)
    """
)


@pytest.mark.parametrize("then", ["exit", "drain"])
def test_ucx_fatal_lines_reach_stderr_at_once(then: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UCXLOG_CHILD, then],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out, err = proc.stdout, proc.stderr
    assert "EMITTED" in out, f"rc {proc.returncode}; stderr: {err[-2000:]}"
    # UCX ends the process on a fatal line (abort), or it exits by itself.
    assert proc.returncode in (7, -signal.SIGABRT), (proc.returncode, err[-2000:])
    # FATAL: printed by UCX's own handler, before any Python drain.
    assert "tr-fatal-marker" in err, f"the FATAL line never reached stderr: {err[-2000:]!r}"
    # Warnings: still captured, not printed; the aiokvcache.ucx logger gets them.
    assert "tr-warn-marker" not in err, err[-2000:]
    if then == "drain":
        assert any(
            line.startswith("LOGGED aiokvcache.ucx") and "tr-warn-marker" in line
            for line in out.splitlines()
        ), out


# ======================================= endpoints of broken links
# A link broken from the peer's side keeps its endpoint record for as long as
# the (broken) link record stays: with peers that come and go (new cluster
# ids), every cycle adds one.

CYCLES = 3


async def endpoints_reach(cm: kv.CacheManager, want: int, seconds: float) -> int:
    """``cm.stats()["endpoints"]`` once it is ``want``, or at the end of ``seconds``."""
    end = time.monotonic() + seconds
    while True:
        got = int(cm.stats()["endpoints"])
        if got == want or time.monotonic() > end:
            return got
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", ["force_unlink", "finalize", "kill"])
async def test_endpoint_records_of_broken_links_are_erased(transport: str, how: str) -> None:
    async with instance(transport, 1, listen=None) as dd:
        cm = dd.cache_manager
        base = cm.stats()["endpoints"]
        for cycle in range(CYCLES):
            cid = 10 + cycle
            async with TrPeer(*peer_args(transport, cid)) as peer:
                assert await link(dd, peer.address, cid) == S.LLM_SUCCESS, f"cycle {cycle}"
                if how == "force_unlink":
                    got = await peer.call("unlink", address="127.0.0.1:1", cluster_id=1, force=True)
                    assert got["status"] == "LLM_SUCCESS", got
                elif how == "kill":
                    await peer.kill()
            # The peer is gone (finalized at the end of the block, or killed)
            # or force-unlinked us: our side sees the link broken.
            for _ in range(1000):
                if all(lk.broken for lk in dd._links.values()):
                    break
                await asyncio.sleep(0.01)
            assert all(lk.broken for lk in dd._links.values()), dd._links
        async with TrPeer(*peer_args(transport, 99)) as peer:
            assert await link(dd, peer.address, 99) == S.LLM_SUCCESS
            eps = await endpoints_reach(cm, base + 1, 10)
            assert eps == base + 1, (
                f"{eps} endpoint records for one live link after {CYCLES} links broken by "
                f"their peers ({how}); baseline {base}"
            )


# ====================================== a transfer on another loop
# A transfer awaited on a loop other than the one that ran init(): the bridge
# submits first, then its futures (the owner loop's) are awaited from the
# wrong loop. It must be refused, clearly, before anything is submitted.


def _on_other_loop(coro_fn: Any) -> BaseException | None:
    """Run ``coro_fn()`` on a fresh event loop in this (worker) thread."""

    async def run() -> None:
        await coro_fn()

    try:
        asyncio.run(run())
    except BaseException as exc:
        return exc
    return None


@pytest.mark.parametrize("what", ["push_cache", "pull_cache", "notify"])
async def test_transfer_from_another_loop_is_refused_before_submitting(
    transport: str, what: str
) -> None:
    async with TrPeer(*peer_args(transport, 2)) as peer, instance(transport, 1, listen=None) as dd:
        cm = dd.cache_manager
        assert await link(dd, peer.address, 2) == S.LLM_SUCCESS
        nbytes = 1 << 20  # the job path, not an inline copy
        remote = await peer.call("alloc", name="r", tensors=4, bytes=nbytes, seed=1)
        mine = cm.allocate_cache(u8_desc(4, nbytes))
        fill(mine, 2)
        key = kv.CacheKeyByIdAndIndex(2, remote["cache_id"], 0)
        await cm.push_cache(key, mine, timeout=10)  # the owner loop learns the cache
        calls = {
            "push_cache": lambda: cm.push_cache(key, mine, timeout=10),
            "pull_cache": lambda: cm.pull_cache(key, mine, timeout=10),
            "notify": lambda: cm.notify(2, "other-loop", timeout=10),
        }
        before = cm.stats()["jobs_submitted"]
        exc = await asyncio.to_thread(_on_other_loop, calls[what])
        assert exc is not None, f"{what} on another loop was not refused"
        submitted = cm.stats()["jobs_submitted"] - before
        assert submitted == 0, f"{submitted} jobs submitted before the refusal ({exc!r})"
        if isinstance(exc, kv.LLMException):
            assert exc.status_code == S.LLM_PARAM_INVALID, exc
        else:
            assert isinstance(exc, RuntimeError), repr(exc)
        text = str(exc)
        assert "init()" in text and "loop" in text, f"unclear refusal: {exc!r}"
        assert cm.stats()["live_jobs"] == 0
        # The instance still works on its own loop.
        await cm.push_cache(key, mine, timeout=10)


# ============================================== simultaneous links
# A links B while B links A: each side may refuse the other's connection as
# ALREADY_LINK while the one it kept is being refused by the other side.

SIMULTANEOUS_ROUNDS = 60


async def test_simultaneous_links_from_both_sides_leave_a_working_link(
    transport: str, tmp_path: Path
) -> None:
    async with (
        TrPeer(*peer_args(transport, 1)) as a,
        TrPeer(*peer_args(transport, 2)) as b,
    ):
        ca = await a.call("alloc", name="c", tensors=2, bytes=1 << 16, seed=1)
        cb = await b.call("alloc", name="c", tensors=2, bytes=1 << 16, seed=2)
        bad: list[str] = []
        for rnd in range(SIMULTANEOUS_ROUNDS):
            fifos = [tmp_path / f"go-{rnd}-a", tmp_path / f"go-{rnd}-b"]
            for f in fifos:
                os.mkfifo(f)
            await a.send(
                {"op": "link_go", "address": b.address, "cluster_id": 2, "fifo": str(fifos[0])}
            )
            await b.send(
                {"op": "link_go", "address": a.address, "cluster_id": 1, "fifo": str(fifos[1])}
            )
            assert (await a.read_json(30)).get("ready"), "a not ready"
            assert (await b.read_json(30)).get("ready"), "b not ready"
            # The barrier: one byte to each, back to back.
            fds = [os.open(f, os.O_WRONLY | os.O_NONBLOCK) for f in fifos]
            for fd in fds:
                os.write(fd, b"!")
            for fd in fds:
                os.close(fd)
            ra, rb = await a.read_json(60), await b.read_json(60)
            ok = ("LLM_SUCCESS", "LLM_ALREADY_LINK")
            if ra.get("status") not in ok or rb.get("status") not in ok:
                bad.append(f"round {rnd}: link statuses {ra} / {rb}")
                break
            pa = await a.call("push", cluster_id=2, cache_id=cb["cache_id"], src="c", timeout=5)
            pb = await b.call("push", cluster_id=1, cache_id=ca["cache_id"], src="c", timeout=5)
            if pa["status"] != "LLM_SUCCESS" or pb["status"] != "LLM_SUCCESS":
                bad.append(
                    f"round {rnd}: links {ra['status']} / {rb['status']}, then pushes "
                    f"a->b {pa['status']} ({pa['message'][:120]}), "
                    f"b->a {pb['status']} ({pb['message'][:120]})"
                )
                break
            await a.call("unlink", address=b.address, cluster_id=2)
            await b.call("unlink", address=a.address, cluster_id=1)
            for peer in (a, b):
                for _ in range(500):
                    if not (await peer.call("links"))["links"]:
                        break
                    await asyncio.sleep(0.01)
        assert not bad, bad


# ========================================= a notification's source
# The receiver takes a notification's source from its payload ("c"): a
# linked peer C can make D believe cluster A sent it.

A_ID, D_ID, C_ID = 1, 2, 3


@contextlib.asynccontextmanager
async def three(transport: str) -> AsyncIterator[tuple[kv.LLMDataDist, TrPeer, TrPeer, int]]:
    """D (this process, cluster 2, listening) linked to A (1) and C (3), each a
    child process with a cache "src"; yields (D, A, C, id of D's cache)."""
    async with (
        instance(transport, D_ID) as d,
        TrPeer(*peer_args(transport, A_ID, listen="none")) as a,
        TrPeer(*peer_args(transport, C_ID, listen="none")) as c,
    ):
        dst = d.cache_manager.allocate_cache(u8_desc(2, 4096))
        for peer, cid in ((a, A_ID), (c, C_ID)):
            got = await peer.call("link", address=d.listen_address, cluster_id=D_ID)
            assert got["status"] == "LLM_SUCCESS", got
            await peer.call("alloc", name="src", tensors=2, bytes=4096, seed=cid)
        yield d, a, c, dst.cache_id


async def test_notification_source_is_the_link_it_came_on(transport: str) -> None:
    async with three(transport) as (d, _a, c, dst):
        notes: list[Any] = []

        async def collect() -> None:
            async for note in d.cache_manager.notifications():
                notes.append(note)
                if note.tag == "c-sentinel":
                    return

        collector = asyncio.ensure_future(collect())
        for _ in range(3):
            await asyncio.sleep(0)  # the collector has subscribed
        got = await c.call(
            "forge", cluster_id=D_ID, claim=A_ID, tag="forged", cache_id=dst, layer=0
        )
        assert got.get("sent") == 1, got
        # A genuine note from C after it, on the same path: the forged one is in by then.
        got = await c.call("notify", cluster_id=D_ID, tag="c-sentinel")
        assert got["status"] == "LLM_SUCCESS", got
        async with asyncio.timeout(30):
            await collector
        forged = [n for n in notes if n.tag == "forged"]
        assert forged, f"the notification C sent never surfaced: {notes}"
        assert all(n.src_cluster_id == C_ID for n in forged), (
            f"C's notification reads as sent by {[n.src_cluster_id for n in forged]} "
            f"(C is {C_ID}, A is {A_ID})"
        )


async def test_wait_for_layers_from_a_cluster_ignores_forgeries(transport: str) -> None:
    async with three(transport) as (d, a, c, dst):
        cm = d.cache_manager
        tag = "req-7"
        got = await c.call(
            "forge", cluster_id=D_ID, claim=A_ID, tag=tag, cache_id=dst, layer=0, count=1
        )
        assert got.get("sent") == 1, got
        # C's genuine tagged push too: from C, so it does not count either.
        got = await c.call("push", cluster_id=D_ID, cache_id=dst, src="src", tag=tag)
        assert got["status"] == "LLM_SUCCESS", got
        with pytest.raises(kv.LLMTimeoutError):
            await cm.wait_for_layers(tag, [0], timeout=1.0, src_cluster_id=A_ID)
        waiter = asyncio.ensure_future(
            cm.wait_for_layers(tag, [0], timeout=30, src_cluster_id=A_ID)
        )
        got = await a.call("push", cluster_id=D_ID, cache_id=dst, src="src", tag=tag)
        assert got["status"] == "LLM_SUCCESS", got
        await waiter


# ============================================= a relayed handshake
# The handshake can be relayed: a plain TCP proxy between A and B, holding
# nothing, sees both UCX worker addresses and every cache's metadata in
# clear; A sends its AUTH before it checks the cluster id that answered; an
# acceptor takes a HELLO that claims its own cluster id.


class Relay:
    """A plain TCP proxy: every byte from a client goes to ``target`` and
    back, and is recorded (``seen``: both directions, all connections)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.up = bytearray()  # client -> target
        self.down = bytearray()  # target -> client
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def seen(self) -> bytes:
        return bytes(self.up) + bytes(self.down)

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> Relay:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.transport.abort()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, log: bytearray) -> None:
            try:
                while data := await r.read(1 << 16):
                    log += data
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.transport.abort()

        both = [
            asyncio.ensure_future(pipe(cr, tw, self.up)),
            asyncio.ensure_future(pipe(tr, cw, self.down)),
        ]
        self.tasks.update(both)
        await asyncio.gather(*both, return_exceptions=True)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def as_ints(values: list[int]) -> list[bytes]:
    """Each value as 8 bytes, both byte orders."""
    return [v.to_bytes(8, order) for v in values for order in ("big", "little")]


async def test_a_relay_learns_no_worker_address_and_no_cache_metadata(transport: str) -> None:
    async with (
        TrPeer(*peer_args(transport, 2, auth_token=TOKEN)) as b,
        instance(transport, 1, listen=None, auth_token=TOKEN) as a,
    ):
        relay = await Relay(b.address).start()
        try:
            cm = a.cache_manager
            remote = await b.call("alloc", name="c", tensors=4, bytes=1 << 16, seed=3)
            rc = await link(a, relay.address, 2)
            if rc == S.LLM_SUCCESS:
                # The link works: the data plane goes straight to B.
                mine = cm.allocate_cache(u8_desc(4, 1 << 16))
                fill(mine, 4)
                key = kv.CacheKeyByIdAndIndex(2, remote["cache_id"], 0)
                await cm.push_cache(key, mine, timeout=10)
                assert (await b.call("hash", name="c"))["sha"] != remote["sha"]
                await cm.pull_cache(key, mine, timeout=10)
            seen = relay.seen
            assert seen, "nothing went through the relay"
            leaks = []
            if bytes(engine_of(a).worker_address) in seen:
                leaks.append("A's UCX worker address")
            if b.worker in seen:
                leaks.append("B's UCX worker address")
            found = [v for v in as_ints(remote["addrs"]) if v in seen]
            if found:
                leaks.append(f"{len(found)} of B's cache addresses")
            assert not leaks, f"the relay (no token) read: {', '.join(leaks)}; link {rc.name}"
        finally:
            await relay.close()


async def test_initiator_sends_no_auth_to_the_wrong_cluster(transport: str) -> None:
    # Cluster 3 holds the token and answers A's HELLO; A expects cluster 2.
    async with (
        TrPeer(*peer_args(transport, 3, auth_token=TOKEN)) as wrong,
        instance(transport, 1, listen=None, auth_token=TOKEN) as a,
    ):
        relay = await Relay(wrong.address).start()
        try:
            rc = await link(a, relay.address, 2)
            assert rc != S.LLM_SUCCESS, "linked cluster 3 as cluster 2"
            sent = bytes(relay.up)
            assert sent, "A sent nothing"
            leaked = bytes(engine_of(a).worker_address) in sent
            assert not leaked, (
                "A sent its UCX worker address (AUTH) to cluster 3 before checking the "
                f"cluster id (link status {rc.name})"
            )
        finally:
            await relay.close()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
async def test_acceptor_refuses_a_hello_claiming_its_own_cluster_id(
    transport: str, token: str | None
) -> None:
    async with (
        TrPeer(*peer_args(transport, 2, auth_token=token)) as b,
        instance(transport, 2, listen=None, auth_token=token) as impostor,
    ):
        rc = await link(impostor, b.address, 2)
        stats = await b.call("stats")
        links = (await b.call("links"))["links"]
        assert rc != S.LLM_SUCCESS and not links and stats["endpoints"] == 0, (
            f"cluster 2 accepted a peer claiming to be cluster 2: link {rc.name}, "
            f"its links {links}, endpoints {stats['endpoints']}"
        )


# ======================================== malformed cache metadata
# Malformed cache metadata from a linked peer escapes as TypeError,
# ZeroDivisionError, ... instead of an LLMException.


def _mut(path: tuple[Any, ...], value: Any) -> Any:
    """A mutation setting ``meta[path...] = value`` (``DELETE`` removes it)."""

    def apply(meta: dict[str, Any]) -> None:
        obj: Any = meta
        for k in path[:-1]:
            obj = obj[k]
        if value is DELETE:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value

    return apply


DELETE = object()
BIG = 2**63 - 1
UBIG = 2**64 - 1

# (name, mutation) applied to a valid metadata of the peer's real cache (two
# uint8 tensors of [1, 4096] in one region for a slot cache; [8, 512] for a
# blocks cache).
META_CASES: list[tuple[str, Any]] = [
    ("desc-not-dict", _mut(("desc",), "x")),
    ("desc-empty", _mut(("desc",), {})),
    ("shape-zero-dim", _mut(("desc", "shape", 0), 0)),
    ("shape-zero-last", _mut(("desc", "shape", 1), 0)),
    ("shape-negative", _mut(("desc", "shape", 0), -1)),
    ("shape-huge", _mut(("desc", "shape"), [BIG, BIG])),
    ("shape-not-list", _mut(("desc", "shape"), 5)),
    ("shape-none", _mut(("desc", "shape"), None)),
    ("shape-strings", _mut(("desc", "shape"), ["1", "4096"])),
    ("num-tensors-str", _mut(("desc", "num_tensors"), "2")),
    ("num-tensors-zero", _mut(("desc", "num_tensors"), 0)),
    ("num-tensors-bool", _mut(("desc", "num_tensors"), True)),
    ("num-tensors-huge", _mut(("desc", "num_tensors"), UBIG)),
    ("dtype-unknown", _mut(("desc", "dtype"), 999)),
    ("dtype-str", _mut(("desc", "dtype"), "uint8")),
    ("batch-dim-out", _mut(("desc", "batch_dim_index"), 7)),
    ("batch-dim-str", _mut(("desc", "batch_dim_index"), "0")),
    ("seq-dim-out", _mut(("desc", "seq_len_dim_index"), 9)),
    ("cache-id-str", _mut(("cache_id",), "7")),
    ("cache-id-missing", _mut(("cache_id",), DELETE)),
    ("cache-id-none", _mut(("cache_id",), None)),
    ("addrs-not-list", _mut(("addrs",), 5)),
    ("addrs-str", _mut(("addrs",), ["a", "b"])),
    ("addrs-float", _mut(("addrs",), [1.5, 2.5])),
    ("addrs-negative", _mut(("addrs",), [-1, -4097])),
    ("addrs-huge", _mut(("addrs",), [UBIG, UBIG])),
    ("addrs-short", lambda m: m["addrs"].pop()),
    ("addrs-long", lambda m: m["addrs"].append(m["addrs"][-1])),
    ("tensor-region-out", _mut(("tensor_region",), [5, 5])),
    ("tensor-region-str", _mut(("tensor_region",), ["0", "0"])),
    ("tensor-region-short", lambda m: m["tensor_region"].pop()),
    ("regions-not-list", _mut(("regions",), {"a": 1})),
    ("regions-empty", _mut(("regions",), [])),
    ("region-not-dict", _mut(("regions", 0), 1)),
    ("region-base-str", _mut(("regions", 0, "base"), "0")),
    ("region-len-negative", _mut(("regions", 0, "len"), -1)),
    ("region-len-huge", _mut(("regions", 0, "len"), UBIG)),
    ("region-rkey-int", _mut(("regions", 0, "rkey"), 5)),
    ("region-rkey-missing", _mut(("regions", 0, "rkey"), DELETE)),
    ("is-blocks-str", _mut(("is_blocks",), "yes")),
    ("meta-empty", lambda m: m.clear()),
]

KEY_CASES: list[tuple[str, Any]] = [
    ("batch-index-str", _mut(("batch_index",), "0")),
    ("batch-index-negative", _mut(("batch_index",), -1)),
    ("batch-index-huge", _mut(("batch_index",), BIG)),
    ("batch-index-missing", _mut(("batch_index",), DELETE)),
    ("batch-index-float", _mut(("batch_index",), 0.5)),
    ("batch-index-bool", _mut(("batch_index",), True)),
]

BLOCKS_CASES: list[tuple[str, Any]] = [
    ("zero-blocks", _mut(("desc", "shape", 0), 0)),
    ("zero-block-bytes", _mut(("desc", "shape", 1), 0)),
    ("not-blocks", _mut(("is_blocks",), False)),
    ("blocks-huge", _mut(("desc", "shape"), [BIG, 1])),
]

ADDR_RESPONSES: list[tuple[str, Any]] = [
    ("caches-not-list", {"caches": "x"}),
    ("caches-none", {"caches": None}),
    ("caches-missing", {}),
    ("cache-not-dict", {"caches": [1]}),
    ("cache-empty", {"caches": [{}]}),
]


class _Ready(kv.LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def test_malformed_peer_metadata_raises_llm_errors_only(transport: str) -> None:
    import copy

    async with (
        TrPeer(*peer_args(transport, 2)) as evil,
        instance(transport, 1, listen=None) as dd,
    ):
        cm = dd.cache_manager
        assert await link(dd, evil.address, 2) == S.LLM_SUCCESS
        await evil.call("alloc", name="c", tensors=2, bytes=4096, seed=1, keys=[[2, 77]])
        await evil.call("alloc", name="b", tensors=2, bytes=512, blocks=8, blocks_key=[2, 0])
        real = (await evil.call("meta", name="c"))["meta"]
        real_blocks = (await evil.call("meta", name="b"))["meta"]
        src = cm.allocate_cache(u8_desc(2, 4096))
        fill(src, 2)
        src_blocks = cm.allocate_blocks_cache(blocks_u8(2, 8, 512))
        escaped: list[str] = []
        succeeded: list[str] = []
        fresh = iter(range(1000, 100000))

        async def case(label: str, op: str, meta: Any, call: Any) -> None:
            got = await evil.call("evil", op_name=op, meta=meta)
            assert got.get("armed") == op, got
            try:
                await call()
            except kv.LLMException:
                return
            except Exception as exc:
                escaped.append(f"{label}: {type(exc).__name__}: {exc}"[:200])
                return
            succeeded.append(label)

        for name, mutate in META_CASES:
            cid = next(fresh)
            meta = copy.deepcopy(real)
            meta["cache_id"] = cid
            mutate(meta)
            key = kv.CacheKeyByIdAndIndex(2, cid, 0)
            await case(
                f"cache_by_id/{name}", "cache_by_id", meta,
                lambda key=key: cm.push_cache(key, src, timeout=5),
            )  # fmt: skip
        for name, mutate in META_CASES + KEY_CASES:
            meta = copy.deepcopy(real)
            meta["cache_id"] = next(fresh)
            meta["batch_index"] = 0
            mutate(meta)
            ck = kv.CacheKey(2, req_id=77)
            await case(
                f"cache_by_key/{name}", "cache_by_key", meta,
                lambda ck=ck: cm.pull_cache(ck, src, timeout=5),
            )  # fmt: skip
        for name, mutate in META_CASES + BLOCKS_CASES:
            meta = copy.deepcopy(real_blocks)
            meta["cache_id"] = next(fresh)
            mutate(meta)
            bk = kv.BlocksCacheKey(2, 0)
            await case(
                f"blocks_by_key/{name}", "blocks_by_key", meta,
                lambda bk=bk: cm.push_blocks(bk, src_blocks, [0, 1], [2, 3], timeout=5),
            )  # fmt: skip

        async def layerwise(addrs: list[int]) -> None:
            cfg = kv.TransferConfig(2, addrs)
            task = await cm.transfer_cache_async(src, _Ready(), [cfg], timeout=5)
            await task

        base_addr = 0x7F00_0000_0000
        cases = [(f"response-{n}", r) for n, r in ADDR_RESPONSES]
        for name, mutate in META_CASES:
            meta = copy.deepcopy(real)
            meta["cache_id"] = next(fresh)
            mutate(meta)
            cases.append((f"cache-{name}", {"caches": [meta]}))
        for i, (name, response) in enumerate(cases):
            addrs = [base_addr + i * 0x100000, base_addr + i * 0x100000 + 8192]
            await case(
                f"cache_by_addr/{name}", "cache_by_addr", response,
                lambda addrs=addrs: layerwise(addrs),
            )  # fmt: skip

        # Still usable: the peer answers honestly again.
        await evil.call("evil", op_name="cache_by_id", meta=None)
        good = await evil.call("alloc", name="g", tensors=2, bytes=4096, seed=5)
        await cm.push_cache(kv.CacheKeyByIdAndIndex(2, good["cache_id"], 0), src, timeout=10)
        assert (await evil.call("hash", name="g"))["sha"] != good["sha"]
        assert not escaped and not succeeded, (
            f"{len(escaped)} non-LLM errors escaped: {escaped}; "
            f"malformed metadata accepted: {succeeded}"
        )
        assert cm.stats()["live_jobs"] == 0


# ==================================== cache_by_addr without a scan
# A peer's cache_by_addr request scans every cache of ours for every address,
# under the state lock: O(addresses x caches) per request.

N_CACHES = 20_000
N_ADDRS = 4096  # MAX_ADDRS_PER_REQUEST
# O(addresses x log N) with a generous constant: 4096 x 128 attribute reads of
# cache records; a scan reads about 3 per cache per address (245 million).
TOUCH_BUDGET = N_ADDRS * 128


class _TooManyTouches(Exception):
    pass


async def test_cache_by_addr_lookup_does_not_scan_every_cache(transport: str) -> None:
    async with (
        instance(transport, 2) as dd,
        # It installs no caches ahead at link time: what it learns is this lookup's.
        TrPeer(*peer_args(transport, 1, listen="none", prefault=False)) as asker,
    ):
        cm = dd.cache_manager
        stride, size = 128, 64  # tensors of 64 bytes with 64-byte gaps between them
        buf = np.zeros(N_CACHES * stride, np.uint8)
        base = int(buf.ctypes.data)
        desc = u8_desc(1, size)
        caches = [cm.register_cache(desc, [base + i * stride]) for i in range(N_CACHES)]
        got = await asker.call("link", address=dd.listen_address, cluster_id=2)
        assert got["status"] == "LLM_SUCCESS", got
        inside = list(range(0, N_CACHES, N_CACHES // 16))[:16]
        addrs = [base + i * stride + 10 for i in inside]
        gaps = [i for i in range(N_CACHES) if i not in set(inside)][: N_ADDRS - len(addrs)]
        addrs += [base + i * stride + size + 10 for i in gaps]  # in no cache
        assert len(addrs) == N_ADDRS
        # Count attribute reads of our cache records while the lookup runs; stop
        # the lookup (it fails) once it is past the O(A log N) budget.
        rec_type: Any = type(next(iter(record_table(dd).values())))
        touches = [0]
        active = [True]
        orig = rec_type.__getattribute__

        def counting(self: Any, name: str) -> Any:
            if active[0] and not name.startswith("__"):
                touches[0] += 1
                if touches[0] > TOUCH_BUDGET:
                    active[0] = False
                    raise _TooManyTouches(name)
            return orig(self, name)

        rec_type.__getattribute__ = counting
        try:
            got = await asker.call("by_addr", cluster_id=2, addrs=addrs, timeout=300)
        finally:
            rec_type.__getattribute__ = orig
        assert touches[0] <= TOUCH_BUDGET, (
            f"looking up {N_ADDRS} addresses among {N_CACHES} caches read cache records more "
            f"than {TOUCH_BUDGET} times (stopped there; the lookup answered {got['status']})"
        )
        assert got["status"] == "LLM_SUCCESS", got
        assert got["cache_ids"] == sorted(caches[i].cache_id for i in inside), got
        del caches, buf


# ========================================= a peer that never reads
# A handshaken peer that sends requests and never reads: the victim queues
# every response (ControlConnection._outq has no bound).

BIG_META_TENSORS = 16_000  # cache_by_id of this cache answers about 290 KB
FLOOD_REQUESTS = 1500  # about 430 MB of answers
RSS_BOUND_KB = 128 << 10  # the victim may grow this much while it is flooded


class _Quiet:
    """A control.Handler that serves nothing."""

    def on_connected(self, conn: Any) -> None:
        pass

    async def handle_request(self, conn: Any, op: str, body: dict[str, Any]) -> dict[str, Any]:
        from aiokvcache._core.model.errors import LLMStatusCode, make_error

        raise make_error(LLMStatusCode.LLM_FAILED, "nothing here")

    def on_event(self, conn: Any, op: str, body: dict[str, Any]) -> None:
        pass

    def on_closed(self, conn: Any, reason: str) -> None:
        pass


async def test_a_peer_that_never_reads_cannot_grow_the_victims_queue(transport: str) -> None:
    from aiokvcache._core.wire import control
    from aiokvcache._loader import native

    async with TrPeer(*peer_args(transport, 2, auth_token=TOKEN)) as victim:
        big = await victim.call("alloc", name="big", tensors=BIG_META_TENSORS, bytes=64)
        target = await victim.call("alloc", name="t", tensors=2, bytes=4096, seed=1)
        host, port = victim.address.rsplit(":", 1)
        eng = native.Engine(transport)  # a real worker address for the victim to reach
        conn = None
        flood: list[asyncio.Task[Any]] = []
        try:
            local = control.LocalInfo(66, 0, bytes(eng.worker_address), auth_token=TOKEN.encode())
            conn = await control.connect(host, int(port), local, _Quiet(), 10)
            sock: Any = conn._writer.transport
            sock.pause_reading()  # never read again
            rss0 = (await victim.call("rss"))["rss_kb"]
            flood = [
                asyncio.ensure_future(
                    conn.request("cache_by_id", {"cache_id": big["cache_id"]}, timeout=600)
                )
                for _ in range(FLOOD_REQUESTS)
            ]
            # Until the victim gives up on us, or has taken on more than the bound.
            grew = 0
            for _ in range(600):
                await asyncio.sleep(0.1)
                grew = (await victim.call("rss"))["rss_kb"] - rss0
                links = (await victim.call("links"))["links"]
                if grew > RSS_BOUND_KB or links.get("66") in (None, True):
                    break
            assert grew <= RSS_BOUND_KB, (
                f"the victim grew by {grew >> 10} MiB queueing answers for a peer that does "
                f"not read ({FLOOD_REQUESTS} requests of about 290 KB answers)"
            )
            assert links.get("66") in (None, True), f"the victim kept the connection: {links}"
        finally:
            for t in flood:
                t.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            if conn is not None:
                conn._writer.transport.abort()
                await conn.close("done")
            eng.close()
        # A legitimate peer still links and pushes.
        async with instance(transport, 1, listen=None, auth_token=TOKEN) as legit:
            assert await link(legit, victim.address, 2) == S.LLM_SUCCESS
            src = legit.cache_manager.allocate_cache(u8_desc(2, 4096))
            fill(src, 8)
            key = kv.CacheKeyByIdAndIndex(2, target["cache_id"], 0)
            await legit.cache_manager.push_cache(key, src, timeout=10)
            assert (await victim.call("hash", name="t"))["sha"] != target["sha"]


# ============================================ a notification flood
# While the victim's event loop is blocked, the native completion queue takes
# every notification a linked peer sends: it has no bound.

NOTE_FLOOD = 400_000
NOTE_PAD = 400  # bytes of tag: about 470 bytes per notification, 190 MB in all


async def test_a_notification_flood_into_a_blocked_loop_is_capped(
    transport: str, tmp_path: Path
) -> None:
    async with (
        TrPeer(*peer_args(transport, 2)) as victim,
        TrPeer(*peer_args(transport, 3, listen="none")) as flooder,
    ):
        got = await flooder.call("link", address=victim.address, cluster_id=2)
        assert got["status"] == "LLM_SUCCESS", got
        until = tmp_path / "unblock"
        rss0 = (await victim.call("rss"))["rss_kb"]
        await victim.send({"op": "block", "until": str(until)})
        assert (await victim.read_json(30)).get("blocking")
        try:
            got = await flooder.call(
                "forge", cluster_id=2, claim=3, tag="flood", count=NOTE_FLOOD, pad=NOTE_PAD,
                timeout=300,
            )  # fmt: skip
            assert got.get("sent") == NOTE_FLOOD, got
            grew = rss_kb(victim.pid) - rss0  # its loop is still blocked
        finally:
            until.touch()
        assert (await victim.read_json(120)).get("unblocked")
        stats = await victim.call("stats", timeout=120)
        dropped = {k: v for k, v in stats.items() if "drop" in k and "notif" in k}
        assert grew <= RSS_BOUND_KB and any(v > 0 for v in dropped.values()), (
            f"{NOTE_FLOOD} notifications of {got['payload_bytes']} bytes into a blocked loop: "
            f"the victim grew by {grew >> 10} MiB; drop counters {dropped}"
        )


# ==================================== notifications of landed puts
# A tagged put whose bytes landed (direct copies into a frozen receiver's
# mapped memory) but whose notification cannot leave (the frozen receiver's
# active-message channel is full) ignores its deadline: cancel_job returns
# early in the notify phase. Shared memory only: over TCP the put itself
# waits for the frozen peer and its deadline applies.

TAGGED_PUSHES = 400
PUSH_TIMEOUT_S = 2.0


async def test_a_tagged_push_to_a_frozen_receiver_ends_at_its_deadline() -> None:
    async with (
        TrPeer(*peer_args("shm", 2, peer_timeout=0)) as receiver,
        instance("shm", 1, listen=None, peer_timeout=0) as dd,
    ):
        cm = dd.cache_manager
        assert await link(dd, receiver.address, 2) == S.LLM_SUCCESS
        dst = await receiver.call("alloc", name="d", tensors=2, bytes=4096)
        src = cm.allocate_cache(u8_desc(2, 4096))
        fill(src, 1)
        key = kv.CacheKeyByIdAndIndex(2, dst["cache_id"], 0)
        await cm.push_cache(key, src, timeout=10, tag="warm")  # metadata known, path warm
        receiver.signal(signal.SIGSTOP)
        pushes = [
            asyncio.ensure_future(cm.push_cache(key, src, timeout=PUSH_TIMEOUT_S, tag=f"t{i}"))
            for i in range(TAGGED_PUSHES)
        ]
        try:
            # Deadline + graces, many times over; a push that is still running
            # by then ignores its deadline.
            done, pending = await asyncio.wait(pushes, timeout=30)
            assert not pending, (
                f"{len(pending)} of {TAGGED_PUSHES} tagged pushes (timeout={PUSH_TIMEOUT_S}s) to "
                "a frozen receiver still running after 30 s"
            )
            for t in done:
                exc = t.exception()
                if exc is not None:
                    assert isinstance(exc, kv.LLMException), repr(exc)
                    assert exc.status_code in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED), exc
        finally:
            receiver.signal(signal.SIGCONT)
            await asyncio.gather(*pushes, return_exceptions=True)


# ================================================= a frozen prober
# probe_back takes a timeout of up to 600 s from the peer and waits for the
# probe's jobs in the service loop's default executor: a peer that answers
# our probe_info and then freezes ties every executor thread up for minutes
# (with the heartbeat off, peer_timeout=0: nothing breaks the link). What
# else waits in that executor stalls: a retirement's release wait, a new
# link's own probe. TCP only: over shared memory the probe's put and get are
# direct copies into the frozen peer's mapped memory and end at once.

PROBE_FLOOD = 40  # more than any default executor's threads (at most 32)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


async def regions_drop_below(peer: TrPeer, limit: int, seconds: float) -> int:
    end = time.monotonic() + seconds
    while True:
        got = int((await peer.call("stats"))["regions"])
        if got < limit or time.monotonic() > end:
            return got
        await asyncio.sleep(0.05)


async def test_a_frozen_prober_stalls_neither_retirement_nor_new_links() -> None:
    transport = "tcp"
    mib = 1 << 20
    async with (
        TrPeer(*peer_args(transport, 2, peer_timeout=0)) as victim,
        instance(transport, 1, peer_timeout=0) as legit,
    ):
        target = await victim.call("alloc", name="t", tensors=2, bytes=4096, seed=1)
        await victim.call("register_private", name="dst", tensors=4, bytes=4 * mib)
        assert await link(legit, victim.address, 2) == S.LLM_SUCCESS
        src = legit.cache_manager.allocate_cache(u8_desc(4, 4 * mib))
        fill(src, 3)
        got = await victim.call("pull", cluster_id=1, cache_id=src.cache_id, dst="dst")
        assert got["status"] == "LLM_SUCCESS", got  # the victim knows the cache now
        attacker = await TrPeer(*peer_args(transport, 3, listen="none")).start()
        try:
            got = await attacker.call("link", address=victim.address, cluster_id=2)
            assert got["status"] == "LLM_SUCCESS", got
            await attacker.call("probe_flood", cluster_id=2, count=PROBE_FLOOD)
            for _ in range(1000):
                if stopped(attacker.pid):
                    break
                await asyncio.sleep(0.01)
            if not stopped(attacker.pid):
                # The victim did not ask all those probe_infos (it bounds
                # probe_back): freeze the attacker with what it holds.
                attacker.signal(signal.SIGSTOP)
            # A second, legitimate peer links and pushes.
            async with instance(transport, 4, listen=None, peer_timeout=0) as second:
                rc = await link(second, victim.address, 2, timeout_ms=5000)
                assert rc == S.LLM_SUCCESS, (
                    f"a new peer could not link ({rc.name}) while a frozen peer holds "
                    f"{PROBE_FLOOD} probe_back requests"
                )
                s2 = second.cache_manager.allocate_cache(u8_desc(2, 4096))
                fill(s2, 4)
                await second.cache_manager.push_cache(
                    kv.CacheKeyByIdAndIndex(2, target["cache_id"], 0), s2, timeout=10
                )
            # A cache retired while our own pull on it runs is released.
            got = await victim.call("pull_free", cluster_id=1, cache_id=src.cache_id, dst="dst")
            left = await regions_drop_below(victim, got["regions"], 30)
            assert left < got["regions"], (
                "a retired cache's memory was not released in 30 s while a frozen peer "
                "holds probe_back requests"
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                attacker.signal(signal.SIGCONT)
            await attacker.close()
