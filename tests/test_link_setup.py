"""What a link's set-up does, after cutting its cost: the handshake carries a
probe slot (the first probe asks nothing), the two probes run at once, a
probe's jobs are waited for on the engine's release signal, and a key that
cannot map is unpacked without reading /proc/self/maps (one that maps is
still checked, and maps once). A peer's bad probe slot or probe answer fails
that probe or that link only, and a peer cannot hold many put-probe waits on
one link. The code's docstrings say what the handshake and the probes do.

None of these asserts a duration: each checks the mechanism (what was asked,
what woke whom, what still fails as it should).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache._core.peers import probe
from aiokvcache._core.peers.servicethread import ReleaseWatch
from aiokvcache._core.wire import control, handshake
from aiokvcache._core.wire import messages as wire
from aiokvcache._core.wire.peerstatus import PeerRefusal
from aiokvcache._loader import native
from aiokvcache.testing import cluster_info, make_pair, options
from support.instances import instance, link_of, runtime
from support.native_pair import QuietHandler, slow_pair


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


# ------------------------------------------------------- the release signal


@pytest.fixture
def slow_put() -> Iterator[tuple[Any, Any]]:
    """A put of 64 MiB through a 64 KiB window (hundreds of round trips)."""
    with slow_pair() as pair:
        yield pair.a, pair.put


def test_release_signal_is_written_once_armed(slow_put: tuple[Any, Any]) -> None:
    engine, put = slow_put
    fd = engine.release_fd
    assert fd >= 0 and not _readable(fd, 0)
    # Not armed: a release writes nothing.
    job = put()
    assert engine.wait_released([job], 60)
    assert not _readable(fd, 0.05)
    # Armed: the next release writes it (once), then it is disarmed again.
    job = put()
    engine.arm_release_signal()
    assert engine.wait_released([job], 60)
    assert _readable(fd, 5)
    assert int.from_bytes(os.read(fd, 8), "little") == 1
    job = put()
    assert engine.wait_released([job], 60)
    assert not _readable(fd, 0.05)


def test_release_signal_is_written_and_closed_at_close() -> None:
    engine = native.Engine("tcp")
    watcher = os.dup(engine.release_fd)
    try:
        engine.close()
        # Close ends every wait: a watcher that armed nothing still wakes, on
        # its own dup; the engine's descriptor is gone with close (not with
        # the object, which may live on until a garbage collection).
        assert _readable(watcher, 5)
        assert engine.release_fd == -1
    finally:
        os.close(watcher)


async def test_release_watch_wakes_on_release_not_on_a_poll(
    slow_put: tuple[Any, Any],
) -> None:
    engine, put = slow_put
    watch = ReleaseWatch(engine)
    # No backstop within the test's bound: only the signal can wake it.
    watch.backstop_first_s = watch.backstop_max_s = 120.0
    checks = 0

    def done() -> bool:
        nonlocal checks
        checks += 1
        return bool(engine.wait_released([job], 0.0))

    job = put()
    try:
        assert await asyncio.wait_for(watch.until(done, 600), 60)
    finally:
        watch.close()
    assert checks <= 2  # before the wait, and once woken (no poll in between)
    # After close it still answers, by polling.
    job = put()
    assert await watch.until(done, 60)


async def test_release_watch_times_out_and_serves_many_waiters(
    slow_put: tuple[Any, Any],
) -> None:
    engine, put = slow_put
    watch = ReleaseWatch(engine)
    try:
        jobs = [put(), put()]
        assert await watch.until(lambda: False, 0.01) is False
        results = await asyncio.gather(
            *(watch.until(lambda j=j: bool(engine.wait_released([j], 0.0)), 60) for j in jobs)
        )
        assert results == [True, True]
    finally:
        watch.close()


# ------------------------------------------- the probe slot in the handshake


@pytest.fixture
def asks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The requests our probes send, by kind (probe.py's ask)."""
    seen: list[str] = []
    real = probe.ask

    async def counting(conn: Any, request: Any, timeout: Any) -> Any:
        seen.append(type(request).__name__)
        return await real(conn, request, timeout)

    monkeypatch.setattr(probe, "ask", counting)
    return seen


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("token", [None, b"s3cret"])
async def test_a_link_asks_no_probe_info_and_puts_once_a_side(
    asks: list[str], jobs: list[str], transport: str, token: bytes | None
) -> None:
    extra = {} if token is None else {"auth_token": token}
    pair = await make_pair(transport, **extra)
    try:
        # Both probes (ours and the peer's probe_back) took the slot the other
        # side's handshake gave, and moved their bytes: one put each (put probes).
        assert "ProbeInfo" not in asks
        assert jobs == ["put", "put"]
        for dd in pair.instances:
            link = next(iter(runtime(dd).state.links.values()))
            # The acceptor's is up once the initiator's link_up arrived.
            for _ in range(5000):
                if link.up:
                    break
                await asyncio.sleep(0.001)
            assert link.up and link.ctl_rkey is not None
            assert link.conn.peer_probe is None  # taken by the first probe
    finally:
        await pair.close()


async def test_a_peer_without_a_handshake_slot_is_asked(asks: list[str]) -> None:
    """An older peer (or one that gives no slot) is asked with probe_info, as before."""
    async with instance("tcp", 2) as decoder, instance("tcp", 1, listen=False) as prompt:
        st = runtime(decoder).state
        st.local = dataclasses.replace(st.local, probe=None)
        runtime(decoder).service.linker._server.set_local(st.local)
        rc, per = await prompt.link_clusters([cluster_info(decoder)], timeout=5000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        assert asks.count("ProbeInfo") == 1  # the prompt's probe asked the decoder


@pytest.mark.parametrize(
    "bad",
    [
        {"addr": 0, "len": 1, "rkey": b"x"},
        {"addr": (1 << 64) - 1, "len": 64, "base": 1, "span": 1 << 29, "rkey": b""},
        {"nested": {"too": ["deep"]}},
    ],
)
async def test_a_bad_handshake_slot_fails_that_probe_only(bad: dict[str, Any]) -> None:
    """A handshaken peer whose AUTH carries a bad probe slot: the victim's
    probe_back fails with a clear reason, the victim lives and links others."""
    async with instance("tcp", 2) as victim, instance("tcp", 1, listen=False) as good:
        host, port = str(victim.listen_address).rsplit(":", 1)
        other = native.Engine("tcp")
        try:
            me = handshake.LocalInfo(
                7, int(kv.LLMRole.PROMPT), other.worker_address, probe=lambda: dict(bad)
            )
            conn = await control.connect(host, int(port), me, QuietHandler(), 5.0)
            answer = await wire.ask(conn, wire.ProbeBack(2.0), timeout=5.0)
            assert "no probe buffer from the peer" in answer.problem
            await conn.close("done")
        finally:
            other.close()
        rc, per = await good.link_clusters([cluster_info(victim)], timeout=5000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per


async def test_a_probe_slot_that_is_not_a_dict_fails_only_the_probe() -> None:
    """A bad handshake slot fails that probe, not the handshake: one that was
    not a dict at all (``None``) failed the handshake."""
    victim = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    try:
        await victim.init(options("tcp", listen=True))
        host, port = str(victim.listen_address).rsplit(":", 1)
        other = native.Engine("tcp")
        try:
            me = handshake.LocalInfo(
                7,
                int(kv.LLMRole.PROMPT),
                other.worker_address,
                probe=lambda: None,  # type: ignore[arg-type,return-value]
            )
            conn = await control.connect(host, int(port), me, QuietHandler(), 5.0)
            try:
                answer = await wire.ask(conn, wire.ProbeBack(2.0), timeout=5.0)
                assert "no probe buffer from the peer" in answer.problem
            finally:
                await conn.close("done")
        finally:
            other.close()
    finally:
        await victim.finalize()


# ------------------------------------------------------------- put probes


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The probe jobs run (put / get), in either instance of this process."""
    seen: list[str] = []
    real = probe.Prober._probe_job

    async def counting(self: Any, link: Any, what: str, *args: Any) -> str:
        seen.append(what)
        return await real(self, link, what, *args)

    monkeypatch.setattr(probe.Prober, "_probe_job", counting)
    return seen


async def _link(prompt: kv.LLMDataDist, decoder: kv.LLMDataDist, ms: int = 5000) -> Any:
    return await prompt.link_clusters([cluster_info(decoder)], timeout=ms)


async def test_an_acceptor_that_offers_no_put_probe_gets_read_back_probes(
    jobs: list[str],
) -> None:
    """An older acceptor (its handshake's slot does not say put_probe)."""
    async with instance("tcp", 2) as decoder, instance("tcp", 1, listen=False) as prompt:
        rt = runtime(decoder)
        st = rt.state
        old_slot = rt.service.prober.probe_info
        st.local = dataclasses.replace(st.local, probe=lambda: old_slot().encode())
        rt.service.linker._server.set_local(st.local)
        rc, per = await _link(prompt, decoder)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        assert sorted(jobs) == ["get", "get", "put", "put"]


async def test_an_initiator_that_asks_a_read_back_probe_gets_one(
    jobs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older initiator (it does not know put_probe): probe_back without a nonce."""
    from aiokvcache._core.peers import linker

    monkeypatch.setattr(linker, "offers_put_probe", lambda slot: False)
    async with kv.testing.pair("tcp") as pr:
        assert sorted(jobs) == ["get", "get", "put", "put"]
        assert all(runtime(dd).state.links for dd in pr.instances)


async def test_an_initiators_put_that_never_landed_fails_the_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The initiator says nothing of its put but the nonce: the acceptor
    looks for it in its own memory, does not find it, and says so."""
    async with instance("tcp", 2) as decoder, instance("tcp", 1, listen=False) as prompt:
        prober = runtime(prompt).service.prober
        real = prober.half

        async def no_put(link: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            return ("", 0) if nonce else await real(link, timeout, nonce)

        prober.half = no_put
        rc, per = await _link(prompt, decoder, 1500)
        assert per == [kv.LLMStatusCode.LLM_LINK_FAILED], per
        assert "on cluster 2's side: the initiator's put to it: the nonce put never arrived" in (
            caplog.text
        )
        assert not runtime(decoder).state.links or not any(
            link.up for link in runtime(decoder).state.links.values()
        )
        prober.half = real
        rc, per = await _link(prompt, decoder)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per


async def test_an_acceptors_put_that_never_landed_fails_the_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The acceptor answers with a nonce it never put: the initiator looks
    for it in its own memory, does not find it, and fails the link."""
    async with instance("tcp", 2) as decoder, instance("tcp", 1, listen=False) as prompt:
        prober = runtime(decoder).service.prober

        async def no_put(link: Any, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
            given, link.conn.peer_probe = link.conn.peer_probe, None
            return "", int(given["addr"])  # the slot it would have put into

        prober.half = no_put
        _, per = await _link(prompt, decoder, 1500)
        assert per == [kv.LLMStatusCode.LLM_LINK_FAILED], per
        assert "from cluster 2 to us does not work: the nonce put never arrived" in caplog.text
        assert not runtime(prompt).state.links


@pytest.mark.parametrize(
    ("body", "answer"),
    [
        ({"nonce": b"n" * 16, "slot": 8}, "no probe slot here"),
        ({"nonce": bytes(16), "slot": None}, "PARAM_INVALID"),
        ({"nonce": b"short", "slot": 0}, "PARAM_INVALID"),
        ({"nonce": b"n" * 16}, "PARAM_INVALID"),
    ],
)
async def test_a_bad_put_probe_request_fails_that_probe_only(
    body: dict[str, Any], answer: str
) -> None:
    """A handshaken peer's probe_back naming a slot that is none of the
    victim's, or a malformed nonce: a clear answer, the victim lives and
    links others."""
    async with instance("tcp", 2) as victim, instance("tcp", 1, listen=False) as good:
        host, port = str(victim.listen_address).rsplit(":", 1)
        other = native.Engine("tcp")
        try:
            me = handshake.LocalInfo(7, int(kv.LLMRole.PROMPT), other.worker_address)
            conn = await control.connect(host, int(port), me, QuietHandler(), 5.0)
            try:
                reply = await conn.request("probe_back", {"timeout": 1.0, **body}, timeout=5.0)
                got = str(reply.get("problem"))
            except PeerRefusal as refusal:  # its status, as the victim named it
                got = str(refusal)
            assert answer in got, got
            await conn.close("done")
        finally:
            other.close()
        rc, per = await good.link_clusters([cluster_info(victim)], timeout=5000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per


def test_a_probe_nonce_is_never_all_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([bytes(16), bytes(16), b"\x01" * 16])
    monkeypatch.setattr(probe.secrets, "token_bytes", lambda n: next(draws))
    assert probe.new_nonce() == b"\x01" * 16


def test_the_mac_binds_the_probe_slot() -> None:
    """A slot swapped in flight fails the sender's proof (with a token)."""
    ident = {"worker_address": b"w", "host_id": b"", "note_key": b"k" * 16}
    a = handshake.compute_mac(b"t", b"l", b"1", b"2", b"ids", {**ident, "probe": {"addr": 1}})
    b = handshake.compute_mac(b"t", b"l", b"1", b"2", b"ids", {**ident, "probe": {"addr": 2}})
    c = handshake.compute_mac(b"t", b"l", b"1", b"2", b"ids", ident)
    assert len({a, b, c}) == 3


async def test_a_malformed_probe_result_fails_that_link_only() -> None:
    """A linked acceptor answers the put probe with a nonce that is not 16
    bytes: the decode error is no LLMException, and link_clusters raised it
    instead of answering LINK_FAILED for that cluster."""
    two = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    one = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    try:
        await two.init(options("tcp", listen=True))
        await one.init(options("tcp"))
        handler = runtime(two).service.handler

        async def bad_answer(link: Any, timeout: float, nonce: bytes, slot: int) -> Any:
            return wire.ProbeResult("", b"short", slot)

        handler._probe_back = bad_answer
        got: list[Any]
        try:
            _, got = await one.link_clusters([cluster_info(two)], timeout=3000)
        except Exception as exc:  # a decode error that escapes
            got = [f"raised {type(exc).__name__}: {exc}"]
        assert got == [kv.LLMStatusCode.LLM_LINK_FAILED], got
    finally:
        await one.finalize()
        await two.finalize()


async def test_a_peer_cannot_hold_many_put_probe_waits_on_one_link() -> None:
    """Each put-probe probe_back makes the victim poll its own memory for up
    to 30 s: a linked peer that never puts held hundreds of such polls on the
    victim's service loop at once, renewable at will. One link needs one."""
    victim = kv.LLMDataDist(kv.LLMRole.DECODER, 2)
    peer = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    try:
        await victim.init(options("tcp", listen=True))
        await peer.init(options("tcp"))
        rc, per = await peer.link_clusters([cluster_info(victim)], timeout=5000)
        assert rc == kv.LLMStatusCode.LLM_SUCCESS, per
        prober = runtime(victim).service.prober
        real = prober.nonce_arrived
        waiting, most = 0, 0

        async def counted(*args: Any) -> Any:
            nonlocal waiting, most
            waiting += 1
            most = max(most, waiting)
            try:
                return await real(*args)
            finally:
                waiting -= 1

        prober.nonce_arrived = counted
        slot = int(runtime(victim).state.ctl.base)  # a probe slot of the victim's
        conn = link_of(peer, 2).conn

        async def flood() -> list[Any]:
            return await asyncio.gather(
                *(
                    conn.request(
                        "probe_back",
                        {"timeout": 1.0, "nonce": os.urandom(16), "slot": slot},
                        timeout=10.0,
                    )
                    for _ in range(200)
                ),
                return_exceptions=True,
            )

        await asyncio.wrap_future(runtime(peer).service.thread.call(flood()))
        assert most <= 8, f"{most} put-probe waits of one peer ran at once on the victim"
    finally:
        await peer.finalize()
        await victim.finalize()


# ------------------------------------------------- keys that cannot map

_UNPACK = """
import os, sys
from aiokvcache._loader import native
a, b = native.Engine(sys.argv[1]), native.Engine(sys.argv[1])
region, addr = b.mem_alloc(4096)
ep = a.connect(b.worker_address, False)
packed = b.rkey_pack(region)
os.close(os.open("/MARK-BEFORE", os.O_RDONLY | os.O_CREAT, 0o600))
a.rkey_unpack(ep, packed, addr, 4096)
os.close(os.open("/MARK-AFTER", os.O_RDONLY | os.O_CREAT, 0o600))
a.close(); b.close()
"""


@pytest.mark.parametrize(("transport", "reads"), [("tcp", False), ("shm", True)])
def test_only_a_key_that_maps_reads_the_maps(
    tmp_path: Any, transport: str, reads: bool
) -> None:
    """Over tcp no key maps: rkey_unpack leaves /proc/self/maps alone (reading
    it cost about 1 ms a key); over shm the mapping check still reads it."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    script = tmp_path / "unpack.py"
    script.write_text(_UNPACK.replace("/MARK-", str(tmp_path / "mark-")))
    log = tmp_path / "trace.log"
    run = subprocess.run(
        [strace, "-f", "-qq", "-e", "trace=openat", "-o", str(log), sys.executable, str(script),
         transport],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = log.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "mark-BEFORE" in line)
    end = next(i for i, line in enumerate(lines) if "mark-AFTER" in line)
    maps = [line for line in lines[start:end] if "/proc/self/maps" in line]
    assert bool(maps) is reads, lines[start:end]


def test_a_shm_key_is_checked_and_maps_once() -> None:
    """A key that maps is unpacked twice (the second time to check its
    mapping): a claim outside the peer's segment must still be refused, and
    the first unpack's mapping dropped, not kept beside the second's."""
    a, b = native.Engine("shm"), native.Engine("shm")
    try:
        size = 1 << 20
        region, addr = b.mem_alloc(size)
        ep = a.connect(b.worker_address, False)
        packed = b.rkey_pack(region)
        # The endpoint's own segments come while its wire-up runs (on the
        # progress thread): one put that ended first, so that the only
        # mapping that can appear below is the key's.
        warm = a.rkey_unpack(ep, packed, addr, size)
        _, src_addr = a.mem_alloc(4096)
        rows = np.array([[src_addr, addr, 8, warm]], np.uint64)
        assert a.wait_released([a.submit(native.OP_PUT, ep, rows)], 60)
        a.drain()
        a.rkey_release(warm)
        # The maps are the whole process's: an engine of an earlier test that
        # is still being torn down may map or unmap meanwhile. A key that maps
        # twice does so on every try; such noise does not come every time.
        for _ in range(3):
            gc.collect()
            with open("/proc/self/maps") as f:
                before = set(f.read().splitlines())
            key = a.rkey_unpack(ep, packed, addr, size)
            with open("/proc/self/maps") as f:
                new = [line for line in set(f.read().splitlines()) - before if " rw-s " in line]
            a.rkey_release(key)
            if len(new) == 1:
                break
        assert len(new) == 1, new
        for claim in ((addr, 2 * size), (addr + size, 4096), (addr - 4096, 8192)):
            with pytest.raises(native.InvalidArgumentError):
                a.rkey_unpack(ep, packed, *claim)
    finally:
        a.close()
        b.close()


# ----------------------------------------------- descriptors past 1023


def test_a_child_is_read_in_a_process_with_many_descriptors() -> None:
    """aiokvcache._child (the testing peer's pipe) waits with poll, not
    select: select() refuses a descriptor past 1023, which a serving process
    (or a long test run: each finalized engine keeps its completion eventfd
    until it is collected) reaches."""
    import resource

    from aiokvcache._child import Child

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: cannot open 1100 descriptors")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with Child([sys.executable, "-c", "print('hello', flush=True)"]) as child:
            assert child.proc.stdout is not None and child.proc.stdout.fileno() > 1023
            assert child.read_line("hello", timeout=60) == "hello"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ----------------------------------------------------- the code's own account


def test_the_docstrings_say_what_the_handshake_and_the_probe_do() -> None:
    """docs/design.md says it; the code's docstrings must not say otherwise:
    without a token AUTH goes with HELLO, and a put probe only puts (no read-back)."""
    from aiokvcache._core.peers import linker

    def flat(text: str | None) -> str:
        return " ".join((text or "").split())

    stale = []
    if "and sends nothing but HELLO to an acceptor that claims another id" in flat(control.__doc__):
        stale.append("control: 'sends nothing but HELLO' (true with a token only)")
    if "into the peer's memory and read it back over our endpoint" in flat(
        linker.Linker._try_link.__doc__
    ):
        stale.append("Linker._try_link: 'read it back' (a put probe only puts)")
    assert not stale, stale
