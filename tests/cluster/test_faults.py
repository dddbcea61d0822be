"""The promises hold under faults, across hosts (network namespaces, TCP).

Every side is the harness peer program (``prefill`` / ``decoder`` modes) in
a host of its own, driven over its JSON stdin/stdout; faults are a cable
cut (:meth:`NetCluster.cut`) and signals to a host's process. Each test
prints what it measured (``MEASURED ...`` lines; ``pytest -s`` shows them):
the time from the fault to the error the library reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from aiokvcache.options import DEFAULT_MAX_UNCONFIRMED_BYTES
from support.harness import AsyncPeer, NetCluster, NetHost, read_memory

PORT = 26000
TENSORS = 8
TENSOR_BYTES = 4 << 20  # 32 MiB a push: tens of ms over a veth
PUSH_TIMEOUT = 3.0  # seconds, the push's timeout=
# After timeout=, a cancel waits for what is in flight; a frozen peer's
# endpoint is force-closed 2 s later and its jobs released 1 s after that
# (docs/design.md): 3 s, plus slack for a loaded machine.
GRACE = 4.0
DEAD_PEER_BOUND = 2.0  # a killed process's sockets close at once
CYCLES_BUDGET_S = 45.0  # the 100 cycles take ~4 s; give up (and fail) past this
RELINK_BOUND = 10.0  # after a cable is back, a link + push works within this

MakeCluster = Callable[..., NetCluster]


def measured(what: str, **values: Any) -> None:
    text = " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
    print(f"MEASURED {what}: {text}")


@contextlib.asynccontextmanager
async def started(peer: AsyncPeer) -> AsyncIterator[AsyncPeer]:
    async with peer:
        yield peer


def decoder(cluster: NetCluster, host: NetHost, cluster_id: int, **kw: Any) -> AsyncPeer:
    return cluster.peer(
        host,
        "decoder",
        "tcp",
        f"--cluster-id={cluster_id}",
        f"--listen={host.address(PORT)}",
        lifetime=110,
        **kw,
    )


def prefill(
    cluster: NetCluster, host: NetHost, cluster_id: int = 1, *, net_devices: str | None = None
) -> AsyncPeer:
    extra = [f"--net-devices={net_devices}"] if net_devices else []
    return cluster.peer(host, "prefill", "tcp", f"--cluster-id={cluster_id}", *extra, lifetime=110)


async def alloc(peer: AsyncPeer, name: str, seed: int | None = None) -> dict[str, Any]:
    return await peer.call("alloc", name=name, tensors=TENSORS, bytes=TENSOR_BYTES, seed=seed)


async def link(p: AsyncPeer, d: AsyncPeer, timeout_ms: int = 3000) -> dict[str, Any]:
    return await p.call(
        "link", address=d.address, cluster_id=d.hello["cluster_id"], timeout_ms=timeout_ms
    )


async def push(p: AsyncPeer, d: AsyncPeer, cache_id: int, src: str = "src") -> dict[str, Any]:
    return await p.call(
        "push",
        cluster_id=d.hello["cluster_id"],
        cache_id=cache_id,
        src=src,
        call_timeout=PUSH_TIMEOUT,
    )


async def start_loop(p: AsyncPeer, name: str, d: AsyncPeer, cache_id: int, **kw: Any) -> None:
    kw.setdefault("src", "src")
    await p.call(
        "loop",
        loop=name,
        cluster_id=d.hello["cluster_id"],
        cache_id=cache_id,
        call_timeout=PUSH_TIMEOUT,
        **kw,
    )


async def until_pushing(p: AsyncPeer, name: str, pushes: int = 2) -> None:
    """Wait until the loop finished ``pushes`` pushes, all good."""
    deadline = time.monotonic() + 20
    while True:
        st = await p.call("loop_status", loop=name)
        assert not st["failed"], f"loop {name} failed before the fault: {st['failed']}"
        if st["done"] >= pushes:
            return
        assert time.monotonic() < deadline, f"loop {name} is not pushing: {st}"
        await asyncio.sleep(0.02)


def first_error(summary: dict[str, Any]) -> dict[str, Any]:
    assert summary["failed"], f"no push failed: {summary}"
    return dict(summary["failed"][0])


# ------------------------------------------------------------- a. fresh links


@pytest.mark.parametrize(
    ("uplink", "nic"),
    [(False, None), (True, "eth0"), (True, None)],
    ids=["one-nic", "default-route-elsewhere", "default-route-elsewhere-defaults"],
)
async def test_fresh_link_and_push_cycles(
    make_cluster: MakeCluster, uplink: bool, nic: str | None
) -> None:
    """100 x (fresh LLMDataDist, link, push, bytes checked) between two hosts;
    also with the hosts' default route on another interface (multi-homed).

    Multi-homed, the decoder needs no setting: it listens on its cluster
    address, so its data plane uses that interface. The prefill listens
    nowhere: naming its data NIC (``net_devices``) or not, every fresh
    wire-up works (with defaults it advertises every interface, and the
    decoder's UCX keeps only the addresses its kernel routes to).
    """
    cycles = 100
    cluster = make_cluster(2, uplink=uplink)
    h1, h2 = cluster.hosts
    async with (
        started(decoder(cluster, h2, 2)) as d,
        started(prefill(cluster, h1, net_devices=nic)) as p,
    ):
        dst = await d.call("alloc", name="dst", tensors=4, bytes=64 << 10)
        t0 = time.monotonic()
        failures: list[str] = []
        worst_link = worst_push = 0.0
        done = 0
        for i in range(cycles):
            if time.monotonic() > t0 + CYCLES_BUDGET_S or len(failures) >= 5:
                failures.append(f"stopped after {done} good cycles of {i}")
                break
            await p.call("reinit")  # a fresh LLMDataDist: new engine, no links
            src = await p.call("alloc", name="src", tensors=4, bytes=64 << 10, seed=i)
            ln = await link(p, d)
            if ln["per"] != ["LLM_SUCCESS"]:
                failures.append(f"cycle {i}: link {ln['per']}")
                continue
            worst_link = max(worst_link, ln["seconds"])
            res = await push(p, d, dst["cache_id"])
            if res["status"] != "LLM_SUCCESS":
                failures.append(f"cycle {i}: push {res['status']}: {res.get('message')}")
                continue
            worst_push = max(worst_push, res["seconds"])
            if (await d.call("hash", name="dst"))["sha"] != src["sha"]:
                failures.append(f"cycle {i}: wrong bytes")
                continue
            done += 1
        took = time.monotonic() - t0
    measured(
        f"fresh cycles uplink={uplink} nic={nic}",
        cycles=cycles,
        good=done,
        failures=len(failures),
        total_s=took,
        worst_link_s=worst_link,
        worst_push_s=worst_push,
    )
    assert not failures, failures[:10]


# ------------------------------------------------------------- b. cable cut


def _squeeze(steps: list[str]) -> list[str]:
    """Runs of the same step as one "step xN"."""
    out: list[tuple[str, int]] = []
    for step in steps:
        if out and out[-1][0] == step:
            out[-1] = (step, out[-1][1] + 1)
        else:
            out.append((step, 1))
    return [s if n == 1 else f"{s} x{n}" for s, n in out]


@pytest.mark.parametrize("down_s", [0.0, 15.0], ids=["restore-at-once", "restore-after-15s"])
async def test_link_cut_mid_push(make_cluster: MakeCluster, down_s: float) -> None:
    """Cable cut mid-push: the push raises within timeout + grace, the engine
    keeps serving a healthy host, and after the cable is back a link + push works."""
    cluster = make_cluster(3)
    hp, ha, hb = cluster.hosts
    async with (
        started(decoder(cluster, ha, 2)) as a,
        started(decoder(cluster, hb, 3)) as b,
        started(prefill(cluster, hp)) as p,
    ):
        dst_a, dst_b = await alloc(a, "dst"), await alloc(b, "dst")
        src = await alloc(p, "src", seed=1)
        assert (await link(p, a))["per"] == ["LLM_SUCCESS"]
        assert (await link(p, b))["per"] == ["LLM_SUCCESS"]
        await start_loop(p, "a", a, dst_a["cache_id"])
        await until_pushing(p, "a")
        t_cut = cluster.cut(ha)
        err = first_error(await p.call("loop_join", loop="a", wait=30, timeout=40))
        to_error = err["end"] - t_cut
        measured(
            "cable cut",
            status=err["status"],
            fault_to_error_s=to_error,
            push_timeout_s=PUSH_TIMEOUT,
            push_started_before_cut=err["start"] < t_cut,
        )
        assert err["status"] in ("LLM_TIMEOUT", "LLM_LINK_FAILED"), err
        assert to_error <= PUSH_TIMEOUT + GRACE, err

        # The engine still serves the healthy host, bytes right.
        ok = await push(p, b, dst_b["cache_id"])
        assert ok["status"] == "LLM_SUCCESS", ok
        assert (await b.call("hash", name="dst"))["sha"] == src["sha"]

        # Cable back (at once, or after the prefill's side of the dead
        # link has long been closed): what does it take to push to A again?
        await asyncio.sleep(max(0.0, t_cut + down_s - time.monotonic()))
        t_up = cluster.restore(ha)
        steps: list[str] = []
        again = await push(p, a, dst_a["cache_id"])
        steps.append(f"push: {again['status']}")
        while again["status"] != "LLM_SUCCESS" and time.monotonic() < t_up + RELINK_BOUND:
            ln = await link(p, a)
            steps.append(f"link: {ln['per'][0]}")
            if ln["per"] != ["LLM_SUCCESS"]:
                if ln["per"] == ["LLM_ALREADY_LINK"]:
                    un = await p.call("unlink", address=a.address, cluster_id=2, force=True)
                    steps.append(f"unlink: {un['per'][0]}")
                await asyncio.sleep(0.25)
                continue
            again = await push(p, a, dst_a["cache_id"])
            steps.append(f"push: {again['status']}")
        measured(
            "cable restored",
            down_s=t_up - t_cut,
            relink_s=time.monotonic() - t_up,
            steps=" / ".join(_squeeze(steps)),
        )
        assert again["status"] == "LLM_SUCCESS", steps
        assert (await a.call("hash", name="dst"))["sha"] == src["sha"]


# ------------------------------------------------------------- c. SIGKILL


async def test_decoder_killed_mid_push(make_cluster: MakeCluster) -> None:
    """A decode process SIGKILLed mid-push: LINK_FAILED at once; engine usable."""
    cluster = make_cluster(3)
    hp, ha, hb = cluster.hosts
    async with (
        started(decoder(cluster, ha, 2)) as a,
        started(decoder(cluster, hb, 3)) as b,
        started(prefill(cluster, hp)) as p,
    ):
        dst_a, dst_b = await alloc(a, "dst"), await alloc(b, "dst")
        src = await alloc(p, "src", seed=1)
        assert (await link(p, a))["per"] == ["LLM_SUCCESS"]
        assert (await link(p, b))["per"] == ["LLM_SUCCESS"]
        await start_loop(p, "a", a, dst_a["cache_id"])
        await until_pushing(p, "a")
        t_kill = a.signal(signal.SIGKILL)
        err = first_error(await p.call("loop_join", loop="a", wait=30, timeout=40))
        to_error = err["end"] - t_kill
        measured(
            "SIGKILL",
            status=err["status"],
            fault_to_error_s=to_error,
            push_started_before_kill=err["start"] < t_kill,
        )
        assert err["status"] == "LLM_LINK_FAILED", err
        assert to_error <= DEAD_PEER_BOUND, err
        ok = await push(p, b, dst_b["cache_id"])
        assert ok["status"] == "LLM_SUCCESS", ok
        assert (await b.call("hash", name="dst"))["sha"] == src["sha"]
        # Pushing to the dead host fails cleanly, and quickly.
        dead = await push(p, a, dst_a["cache_id"])
        assert dead["status"] in ("LLM_LINK_FAILED", "LLM_NOT_YET_LINK"), dead
        assert dead["seconds"] < DEAD_PEER_BOUND, dead


# ------------------------------------------------------------- d. SIGSTOP


def _tcp_queues(cluster: NetCluster, host: NetHost) -> tuple[int, int]:
    """Bytes queued in ``host``'s TCP sockets: (receive queues, send queues)."""
    out = cluster.run(host, "ss", "-tnH").stdout
    recv = send = 0
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 3 and cols[1].isdigit() and cols[2].isdigit():
            recv, send = recv + int(cols[1]), send + int(cols[2])
    return recv, send


def _cache_bytes(pid: int, info: dict[str, Any]) -> np.ndarray:
    n = int(info["tensor_bytes"])
    return np.frombuffer(
        b"".join(read_memory(pid, int(a), n) for a in info["addrs"]), dtype=np.uint8
    )


async def test_decoder_stopped_mid_push(make_cluster: MakeCluster) -> None:
    """A decode process SIGSTOPped mid-push: the push raises within timeout +
    grace, and after SIGCONT at most one confirmation window of it lands.

    Over TCP the decoder's own kernel holds what it received and its UCX
    applies that when it thaws; nothing on our side can take it back. The
    engine keeps at most ``max_unconfirmed_bytes`` per link posted and not
    confirmed by the peer (a flush it answered), which bounds those bytes,
    and the source reads behind them (docs/design.md, "Late writes").
    """
    cluster = make_cluster(2)
    hp, ha = cluster.hosts
    window = max(DEFAULT_MAX_UNCONFIRMED_BYTES, 1 << 20)  # at least one chunk
    async with started(decoder(cluster, ha, 2)) as a, started(prefill(cluster, hp)) as p:
        dst = await alloc(a, "dst")
        srcs = [await alloc(p, "s0", seed=1), await alloc(p, "s1", seed=2)]
        assert (await link(p, a))["per"] == ["LLM_SUCCESS"]
        # Alternate sources: every push rewrites every byte of dst.
        await start_loop(p, "a", a, dst["cache_id"], srcs=["s0", "s1"])
        await until_pushing(p, "a", 3)
        t_stop = a.signal(signal.SIGSTOP)
        try:
            err = first_error(await p.call("loop_join", loop="a", wait=30, timeout=40))
            # Still stopped: what the destination holds when the call raised,
            # and what waits in the kernel's TCP queues on either side.
            at_raise = _cache_bytes(a.pid, dst)
            a_recv_q, _ = _tcp_queues(cluster, ha)
            _, p_send_q = _tcp_queues(cluster, hp)
            # New content in both sources: a source read after the raise
            # would carry it into dst.
            for i in range(len(srcs)):
                await p.call("fill", name=f"s{i}", seed=90 + i)
            fresh = [_cache_bytes(p.pid, s) for s in srcs]
        finally:
            t_cont = a.signal(signal.SIGCONT)
        to_error = err["end"] - t_stop
        await asyncio.sleep(1.0)
        h1 = (await a.call("hash", name="dst"))["sha"]
        await asyncio.sleep(1.0)
        h2 = (await a.call("hash", name="dst"))["sha"]
        after = _cache_bytes(a.pid, dst)
        moved = at_raise != after
        changed = int(np.count_nonzero(moved))
        # Bytes that changed to the sources' new content (1 in 256 of the
        # others match it by chance).
        read_late = max(int(np.count_nonzero(moved & (after == f))) for f in fresh)
        measured(
            "SIGSTOP",
            status=err["status"],
            fault_to_error_s=to_error,
            push_timeout_s=PUSH_TIMEOUT,
            stopped_for_s=t_cont - t_stop,
            bytes_changed_after_raise=changed,
            source_bytes_read_after_raise_upper=read_late,
            window_bytes=window,
            decoder_tcp_recv_queue_at_raise=a_recv_q,
            prefill_tcp_send_queue_at_raise=p_send_q,
            stable_after_cont=h1 == h2,
            push_bytes=TENSORS * TENSOR_BYTES,
        )
        assert err["status"] in ("LLM_TIMEOUT", "LLM_LINK_FAILED"), err
        assert to_error <= PUSH_TIMEOUT + GRACE, err
        assert h1 == h2, "the destination still changed 1 s after SIGCONT"
        assert changed <= window, f"{changed} bytes landed after the push raised (> {window})"
        assert read_late <= window, f"{read_late} bytes of new source content landed"


# ------------------------------------------------------------- e. restart


async def test_decoder_restarted_same_address(make_cluster: MakeCluster) -> None:
    """The decoder restarts on the same address with new caches: the old key
    fails cleanly without writing into the new process; a new lookup works."""
    cluster = make_cluster(2)
    hp, ha = cluster.hosts
    async with started(prefill(cluster, hp)) as p:
        src = await alloc(p, "src", seed=1)
        async with started(decoder(cluster, ha, 2)) as old:
            for name in ("c1", "c2"):
                await alloc(old, name)
            old_dst = await alloc(old, "dst")  # cache id 3 there
            assert (await link(p, old))["per"] == ["LLM_SUCCESS"]
            assert (await push(p, old, old_dst["cache_id"]))["status"] == "LLM_SUCCESS"
            t_kill = old.signal(signal.SIGKILL)
            await old.kill()
        async with started(decoder(cluster, ha, 2)) as new:
            t_up = time.monotonic()
            canary = await alloc(new, "canary", seed=7)  # cache id 1
            new_dst = await alloc(new, "dst")  # cache id 2
            assert old_dst["cache_id"] not in (canary["cache_id"], new_dst["cache_id"])
            stale = await push(p, new, old_dst["cache_id"])
            steps = [f"old key before re-link: {stale['status']}"]
            assert stale["status"] in ("LLM_LINK_FAILED", "LLM_NOT_YET_LINK"), stale
            ln = await link(p, new)
            steps.append(f"link: {ln['per'][0]}")
            assert ln["per"] == ["LLM_SUCCESS"], steps
            stale = await push(p, new, old_dst["cache_id"])
            steps.append(f"old key after re-link: {stale['status']}")
            assert stale["status"] in ("LLM_KV_CACHE_NOT_EXIST", "LLM_LINK_FAILED"), stale
            assert (await new.call("hash", name="canary"))["sha"] == canary["sha"]
            assert (await new.call("hash", name="dst"))["sha"] == new_dst["sha"]
            fresh = await push(p, new, new_dst["cache_id"])
            steps.append(f"new key: {fresh['status']}")
            assert fresh["status"] == "LLM_SUCCESS", fresh
            assert (await new.call("hash", name="dst"))["sha"] == src["sha"]
            assert (await new.call("hash", name="canary"))["sha"] == canary["sha"]
            measured("restart", restart_s=t_up - t_kill, steps=" / ".join(steps))


# ------------------------------------------------------------- f. 2 x 2


async def test_two_by_two_one_decoder_killed(make_cluster: MakeCluster) -> None:
    """2 prefill x 2 decode hosts push concurrently; one decoder is killed: the
    other pairs' pushes all succeed, with the right bytes."""
    cluster = make_cluster(4)
    hp1, hp2, hd1, hd2 = cluster.hosts
    async with (
        started(decoder(cluster, hd1, 3)) as d1,
        started(decoder(cluster, hd2, 4)) as d2,
        started(prefill(cluster, hp1, 1)) as p1,
        started(prefill(cluster, hp2, 2)) as p2,
    ):
        ps, ds = {"p1": p1, "p2": p2}, {"d1": d1, "d2": d2}
        dst: dict[tuple[str, str], dict[str, Any]] = {}
        src: dict[str, dict[str, Any]] = {}
        for pn, p in ps.items():
            src[pn] = await alloc(p, "src", seed=int(pn[1]))
            for dn, d in ds.items():
                dst[pn, dn] = await alloc(d, pn)
                assert (await link(p, d))["per"] == ["LLM_SUCCESS"]
        for (pn, dn), info in dst.items():
            await start_loop(
                ps[pn], dn, ds[dn], info["cache_id"], seconds=6.0, stop_on_error=dn == "d2"
            )
        for pn, dn in dst:
            await until_pushing(ps[pn], dn)
        t_kill = d2.signal(signal.SIGKILL)
        results = {
            (pn, dn): await ps[pn].call("loop_join", loop=dn, wait=40, timeout=50) for pn, dn in dst
        }
        for pn in ps:
            victim = first_error(results[pn, "d2"])
            measured(
                f"2x2 {pn}->d2 killed",
                status=victim["status"],
                fault_to_error_s=victim["end"] - t_kill,
            )
            assert victim["status"] == "LLM_LINK_FAILED", victim
            assert victim["end"] - t_kill <= DEAD_PEER_BOUND, victim
            healthy = results[pn, "d1"]
            measured(
                f"2x2 {pn}->d1 healthy",
                pushes=healthy["done"],
                failed=len(healthy["failed"]),
                worst_push_s=healthy["max_seconds"],
            )
            assert not healthy["failed"], healthy["failed"]
            assert healthy["last"]["end"] > t_kill, "the healthy loop ended before the kill"
            assert (await d1.call("hash", name=pn))["sha"] == src[pn]["sha"]
