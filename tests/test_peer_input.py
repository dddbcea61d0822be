"""What a peer sends us is data: it can make a call fail, never succeed falsely
or crash the process.

The instance under attack runs in a child process (the public peer program,
:mod:`aiokvcache.testing.peer`), so that a crash is its exit status; the
attacker runs here, speaking protocol 3 with the library's own codec (a fake
listener) or as a real instance whose answers are tampered with.

* A status in a peer's error frame is never our verdict: before the peer has
  proven anything it is a link failure; after, it maps through the statuses a
  peer may report for that request, and anything else is ``LLM_FAILED``.
* A packed remote key from a peer is walked with bounds before UCX reads it
  (cache metadata, the handshake's probe slot, a probe_info answer).
* A peer's answer is checked whole before any of it is installed (a
  ``cache_by_addr`` answer with one bad entry installs none).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import aiokvcache as kv
from aiokvcache._core.memory.ctlregion import PROBE_BYTES
from aiokvcache._core.model.errors import LLMException
from aiokvcache._core.wire import frames, handshake
from aiokvcache._core.wire import messages as wire
from aiokvcache._core.wire.peerstatus import PeerRefusal
from aiokvcache.testing import PeerProcess
from support.instances import instance, runtime

S = kv.LLMStatusCode
TOKEN = "peer-input-token"
U8_4K = kv.CacheDesc(2, [1, 4096], kv.DataType.DT_UINT8, kv.Placement.HOST)


# ----------------------------------------------------------- a fake listener


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]


@contextlib.asynccontextmanager
async def fake_listener(script: Script) -> AsyncIterator[str]:
    """A TCP listener on loopback that runs ``script`` on every connection;
    yields its ``ip:port``."""
    conns: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
            await script(reader, writer)
            await writer.drain()
            await reader.read()  # until the initiator hangs up

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        host, port = server.sockets[0].getsockname()[:2]
        yield f"{host}:{port}"
    finally:
        for w in conns:
            w.transport.abort()
        server.close()
        await server.wait_closed()


def refusal(status: int, message: str = "no") -> dict[str, Any]:
    return {"status": status, "message": message}


async def read_hello(reader: asyncio.StreamReader) -> dict[str, Any]:
    kind, _, hello = await frames.read_frame(reader)
    assert kind is frames.Kind.HELLO
    return hello


def local_info(cluster_id: int, token: str | None) -> handshake.LocalInfo:
    return handshake.LocalInfo(
        cluster_id=cluster_id,
        role=int(kv.LLMRole.DECODER),
        worker_address=b"\x00" * 8,
        auth_token=None if token is None else token.encode(),
    )


# Statuses a lying acceptor puts in its refusal: success, one that made the
# initiator retry to its deadline, one that passed through as if it were ours.
LIES = [S.LLM_SUCCESS, S.LLM_ALREADY_LINK, S.LLM_PARAM_INVALID]


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
@pytest.mark.parametrize("lie", LIES, ids=lambda s: s.name)
async def test_a_refusal_in_place_of_hello_reply_is_a_link_failure(
    transport: str, lie: S, token: str | None
) -> None:
    """An acceptor that answers HELLO with an error frame has proven nothing
    (not the token, not its cluster id): whatever status it names, the link
    fails at once (LINK_FAILED, no retry until the deadline) and none exists."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_hello(reader)
        writer.write(frames.pack_frame(frames.Kind.ERROR_RESPONSE, 0, refusal(lie)))

    opts = {} if token is None else {"auth_token": token}
    async with (
        fake_listener(script) as address,
        PeerProcess("prefill", transport, options=opts) as victim,
    ):
        got = await victim.link(address, 2, timeout_ms=4000)
        assert got["per"] == ["LLM_LINK_FAILED"], got
        assert got["seconds"] < 3.0, f"retried a peer's {lie.name} to the deadline: {got}"
        # No link: a transfer to cluster 2 is refused as unlinked.
        await victim.alloc("src", 2, 4096)
        push = await victim.call("push", cluster_id=2, cache_id=1, index=0, src="src")
        assert push["status"] == "LLM_NOT_YET_LINK", push
        assert victim.returncode is None


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
@pytest.mark.parametrize("lie", LIES, ids=lambda s: s.name)
async def test_a_refusal_in_place_of_auth_ok_is_a_link_failure(
    transport: str, lie: S, token: str | None
) -> None:
    """An acceptor that passed HELLO_REPLY's checks (its id, and with a token
    its proof) and then refuses names a status that is data: the link fails
    (LINK_FAILED) and none exists; with a token the refusal is sealed, so it
    is the token holder's own word, and it still is not our verdict."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        acceptor = handshake.AcceptorHandshake(local_info(2, token))
        await acceptor.run(reader, writer)
        body = frames.frame_body(frames.Kind.ERROR_RESPONSE, 0, refusal(lie))
        writer.write(acceptor.held_reply() + frames.to_wire(body, acceptor.tx))

    opts = {} if token is None else {"auth_token": token}
    async with (
        fake_listener(script) as address,
        PeerProcess("prefill", transport, options=opts) as victim,
    ):
        got = await victim.link(address, 2, timeout_ms=2000)
        assert got["per"] == ["LLM_LINK_FAILED"], got
        await victim.alloc("src", 2, 4096)
        push = await victim.call("push", cluster_id=2, cache_id=1, index=0, src="src")
        assert push["status"] == "LLM_NOT_YET_LINK", push
        assert victim.returncode is None


# --------------------------------------------------- the one place that decides


@pytest.mark.parametrize(
    ("status", "ours"),
    [
        (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_KV_CACHE_NOT_EXIST),
        (S.LLM_FEATURE_NOT_ENABLED, S.LLM_FEATURE_NOT_ENABLED),
        (S.LLM_LINK_BUSY, S.LLM_LINK_BUSY),
        (S.LLM_ENGINE_FINALIZED, S.LLM_LINK_FAILED),
        (S.LLM_NOT_YET_LINK, S.LLM_LINK_FAILED),
        (S.LLM_SUCCESS, S.LLM_FAILED),
        (S.LLM_TIMEOUT, S.LLM_FAILED),
        (S.LLM_PARAM_INVALID, S.LLM_FAILED),
        (S.LLM_ALREADY_LINK, S.LLM_FAILED),
        (12345, S.LLM_FAILED),
        (-(2**63), S.LLM_FAILED),
    ],
)
def test_a_lookups_refusal_maps_through_its_table(status: int, ours: S) -> None:
    """What a lookup's refusal becomes: its table's status, else LLM_FAILED
    naming the peer's; never a TimeoutError or a success."""
    got = PeerRefusal(status, "text").verdict(wire.CacheById.peer_statuses, "cluster 2")
    assert got.status_code == ours and not isinstance(got, TimeoutError)
    if ours == S.LLM_FAILED:
        assert str(status) in got.message or S(status).name in got.message


def test_requests_that_are_not_lookups_pass_no_lookup_status() -> None:
    for request in (wire.ProbeInfo, wire.ProbeBack, wire.Invalidate, wire.Unlink):
        got = PeerRefusal(S.LLM_KV_CACHE_NOT_EXIST, "x").verdict(request.peer_statuses, "c")
        assert got.status_code == S.LLM_FAILED


# ------------------------------------------------------- a lying linked peer


def lookups_raise(dd: kv.LLMDataDist, status: int, message: str) -> None:
    """Make ``dd`` answer every metadata lookup with an error frame of ``status``."""
    handler = runtime(dd).service.handler

    def serve(link: Any, request: Any) -> dict[str, Any]:
        raise LLMException(message, status)

    handler._serve_lookup = serve


# Statuses a linked peer may not hand us as the verdict of a lookup.
LOOKUP_LIES = [S.LLM_SUCCESS, S.LLM_ALREADY_LINK, S.LLM_PARAM_INVALID, S.LLM_TIMEOUT]


@pytest.mark.parametrize("lie", LOOKUP_LIES, ids=lambda s: s.name)
async def test_a_lookup_refused_with_a_status_a_peer_may_not_give_is_llm_failed(
    transport: str, lie: S
) -> None:
    """A linked peer answering a metadata lookup with a status outside what a
    lookup may report: the push and the pull fail with LLM_FAILED, the
    peer's status named in the message, never LLMException[LLM_SUCCESS]."""
    async with instance(transport, 2) as liar, PeerProcess("prefill", transport) as victim:
        assert (await victim.link(str(liar.listen_address), 2))["status"] == "LLM_SUCCESS"
        lookups_raise(liar, lie, "as you wish")
        await victim.alloc("buf", 2, 4096, seed=3)
        for op, extra in (("push", {"src": "buf"}), ("pull", {"dst": "buf"})):
            got = await victim.call(op, cluster_id=2, cache_id=7, index=0, **extra)
            assert got["status"] == "LLM_FAILED", (op, got)
            assert lie.name in got["message"] or str(int(lie)) in got["message"], got


async def test_a_lookup_refused_as_not_existing_keeps_its_status(transport: str) -> None:
    """What a lookup may report (the cache does not exist) reaches the caller as is."""
    async with instance(transport, 2) as peer, PeerProcess("prefill", transport) as victim:
        assert (await victim.link(str(peer.listen_address), 2))["status"] == "LLM_SUCCESS"
        await victim.alloc("buf", 2, 4096, seed=3)
        got = await victim.call("push", cluster_id=2, cache_id=12345, index=0, src="buf")
        assert got["status"] == "LLM_KV_CACHE_NOT_EXIST", got


def test_a_cache_by_addr_answer_with_a_bad_entry_installs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Installed entry by entry, the entries before a bad one stayed: the
    whole answer is checked first, and the error names it."""
    from aiokvcache._core.peers import lookups as lookups_mod

    installed: list[dict[str, Any]] = []
    monkeypatch.setattr(
        lookups_mod, "install_remote", lambda st, link, meta: installed.append(meta)
    )

    class Conn:
        async def request(self, op: str, body: dict[str, Any], timeout: Any = None) -> Any:
            assert op == "cache_by_addr"
            return {"caches": [{"cache_id": 1}, 5]}

    link = SimpleNamespace(ctl_rkey=1, cluster_id=7, conn=Conn())
    lk = lookups_mod.Lookups(SimpleNamespace(), SimpleNamespace(), SimpleNamespace())
    with pytest.raises(LLMException) as info:
        asyncio.run(lk.remotes_by_addr(link, [4096]))  # type: ignore[arg-type]
    assert info.value.status_code == S.LLM_FAILED
    assert "cluster 7 sent a bad cache_by_addr answer" in info.value.message
    assert installed == []


# ------------------------------------------------------------- remote keys


def serve_tampered(dd: kv.LLMDataDist, tamper: Callable[[dict[str, Any]], None]) -> None:
    """Make ``dd`` answer every metadata lookup with its real answer, tampered."""
    handler = runtime(dd).service.handler
    real = type(handler)._serve_lookup.__get__(handler)

    def serve(link: Any, request: Any) -> dict[str, Any]:
        body: dict[str, Any] = real(link, request)
        tamper(body)
        return body

    handler._serve_lookup = serve


def rkey_of(meta: dict[str, Any]) -> bytes:
    return bytes(meta["regions"][0]["rkey"])


def with_rkey(make: Callable[[bytes], bytes]) -> Callable[[dict[str, Any]], None]:
    def tamper(meta: dict[str, Any]) -> None:
        for region in meta["regions"]:
            region["rkey"] = make(bytes(region["rkey"]))

    return tamper


def set_mem_type(packed: bytes, value: int) -> bytes:
    return packed[:8] + bytes([value]) + packed[9:]


RKEYS: list[tuple[str, Callable[[bytes], bytes]]] = [
    ("one-byte", lambda k: b"\x01"),
    ("md-map-only", lambda k: k[:8]),
    ("mem-type-7f", lambda k: set_mem_type(k, 0x7F)),
    ("truncated", lambda k: k[: len(k) // 2]),
    ("all-md-bits", lambda k: struct.pack("<Q", 2**64 - 1) + k[8:]),
    ("trailing-bytes", lambda k: k + b"\x00" * 7),
    ("no-last-byte", lambda k: k[:-1]),
]


@pytest.mark.parametrize("name,make", RKEYS, ids=[n for n, _ in RKEYS])
async def test_a_malformed_remote_key_in_cache_metadata_fails_the_call(
    transport: str, name: str, make: Callable[[bytes], bytes]
) -> None:
    """A linked peer's cache metadata with a malformed packed key: the push
    fails with LLM_FAILED, the process lives, and the link still carries a
    push with honest metadata."""
    async with instance(transport, 2) as liar, PeerProcess("prefill", transport) as victim:
        assert (await victim.link(str(liar.listen_address), 2))["status"] == "LLM_SUCCESS"
        cm = liar.cache_manager
        dst = cm.allocate_cache(U8_4K)
        serve_tampered(liar, with_rkey(make))
        await victim.alloc("src", 2, 4096, seed=5)
        got = await victim.call("push", cluster_id=2, cache_id=dst.cache_id, index=0, src="src")
        assert got["status"] == "LLM_FAILED", got
        assert victim.returncode is None
        # Honest again: a fresh cache (the bad answer installed nothing).
        runtime(liar).service.handler.__dict__.pop("_serve_lookup")
        good = cm.allocate_cache(U8_4K)
        got = await victim.call("push", cluster_id=2, cache_id=good.cache_id, index=0, src="src")
        assert got["status"] == "LLM_SUCCESS", got["message"]
        health = await victim.health()
        assert health["live_jobs"] == 0 and not health["service_errors"], health


@pytest.mark.parametrize("name,make", RKEYS[:4], ids=[n for n, _ in RKEYS[:4]])
async def test_a_malformed_remote_key_in_a_probe_slot_fails_the_link(
    transport: str, name: str, make: Callable[[bytes], bytes]
) -> None:
    """The key to a peer's control region travels in its handshake's probe
    slot and in probe_info answers: a malformed one fails that link's set-up
    (LINK_FAILED), the process lives, and an honest peer links after."""
    async with instance(transport, 2) as liar, PeerProcess("prefill", transport) as victim:
        prober = runtime(liar).service.prober
        real = type(prober).probe_info.__get__(prober)

        def tampered() -> wire.ProbeSlot:
            slot = real()
            return dataclasses.replace(slot, rkey=make(slot.rkey))

        prober.probe_info = tampered  # the handshake's slot and probe_info answers
        got = await victim.link(str(liar.listen_address), 2, timeout_ms=3000)
        assert got["per"] == ["LLM_LINK_FAILED"], got
        assert victim.returncode is None
        del prober.probe_info
        got = await victim.link(str(liar.listen_address), 2, timeout_ms=5000)
        assert got["per"] == ["LLM_SUCCESS"], got


# ----------------------------------------- notifications and the data-path check


async def _send_notifications(sender: kv.LLMDataDist, cid: int, payloads: list[bytes]) -> None:
    """Post ``payloads`` as notifications on ``sender``'s link to ``cid`` (no bytes moved)."""
    import numpy as np

    from aiokvcache._bridge import OP_PUT
    from aiokvcache._core.transfer.runner import run_jobs

    rt = runtime(sender)
    ep = rt.state.links[cid].ep
    rows = np.zeros((0, 4), np.uint64)
    await run_jobs(rt.bridge, [(OP_PUT, ep, rows, p, 5000) for p in payloads], timeout=5)


@contextlib.contextmanager
def put_probe_acceptor() -> Iterator[handshake.LocalInfo]:
    """What an acceptor with a real engine says of itself (cluster 2): its
    worker address and a probe slot in its memory, for put probes."""
    from aiokvcache._loader import native

    engine = native.Engine("tcp")
    try:
        region, base = engine.mem_alloc(1 << 16)
        rkey = engine.rkey_pack(region)
        slot = {"addr": base, "len": PROBE_BYTES, "base": base, "span": 1 << 16, "rkey": rkey}
        yield dataclasses.replace(
            local_info(2, None),
            worker_address=engine.worker_address,
            probe=lambda: {**slot, "put_probe": True},
        )
    finally:
        engine.close()


@pytest.mark.parametrize("field", ["i", "b", "l"])
async def test_a_notification_with_an_infinite_number_is_dropped_as_malformed(
    transport: str, field: str
) -> None:
    """A linked peer's notification whose cache id, batch index or layer is
    ``inf`` (the codec carries floats) is malformed: counted in
    ``bad_notifications`` and dropped with a warning, like one with ``nan``,
    never an exception in the victim's completion handler."""
    import tempfile

    from aiokvcache._core.wire.codec import encode
    from aiokvcache.testing import cluster_info

    note: dict[str, Any] = {"t": "tag", "i": 3, "b": 0, "l": 1}
    note[field] = float("inf")
    nan = dict(note, **{field: float("nan")})
    with tempfile.TemporaryFile("w+") as err:
        async with (
            PeerProcess("decoder", transport, stderr=err) as victim,
            instance(transport, 1, listen=False) as sender,
        ):
            rc, per = await sender.link_clusters([cluster_info(victim.address, 2)], 10_000)
            assert rc == S.LLM_SUCCESS, per
            await _send_notifications(sender, 2, [encode(nan), encode(note)])
            for _ in range(200):
                stats = await victim.call("stats")
                if stats["notifications_received"] >= 2:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # the loop dispatches what arrived
            stats = await victim.call("stats")
            assert victim.returncode is None
        err.seek(0)
        log = err.read()
    assert "completion handler failed" not in log, log[-2000:]
    assert stats["bad_notifications"] == 2, stats


async def test_a_silent_probe_back_cannot_hold_link_clusters_past_its_timeout() -> None:
    """An acceptor that completes the handshake (a real engine's worker address
    and a probe slot our put lands in) and then never answers probe_back:
    link_clusters fails within its timeout (plus scheduling slack), as
    docs/api.md promises ("all within ``timeout``")."""
    with put_probe_acceptor() as local:
        asked: list[str] = []

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            acceptor = handshake.AcceptorHandshake(local)
            await acceptor.run(reader, writer)
            writer.write(acceptor.auth_ok())
            while True:  # read what it asks, answer nothing
                kind, _, body = await frames.read_frame(reader, acceptor.rx)
                if kind is frames.Kind.REQUEST:
                    asked.append(str(body.get("op")))

        async with fake_listener(script) as address, PeerProcess("prefill", "tcp") as victim:
            for timeout_ms in (300, 1500):
                got = await victim.link(address, 2, timeout_ms=timeout_ms)
                assert got["per"] != ["LLM_SUCCESS"], got
                assert "probe_back" in asked, asked  # it got as far as the data-path check
                slack = 0.4
                assert got["seconds"] < timeout_ms / 1000 + slack, (timeout_ms, got)


def _link_clusters_statuses_documented() -> dict[str, str]:
    """docs/api.md's table of what link_clusters returns: status -> when."""
    from pathlib import Path

    api = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    section = api.split("### `await link_clusters(")[1].split("### `await unlink_clusters(")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`LLM_"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_the_docs_do_not_say_link_clusters_returns_a_peers_refusal_status() -> None:
    """A peer's refusal in the handshake is LINK_FAILED (its status only a
    hint: test_a_refusal_in_place_of_auth_ok_is_a_link_failure, and an
    ALREADY_LINK the peer keeps saying ends as LINK_FAILED at the deadline):
    docs/api.md's link_clusters table and docs/troubleshooting.md say so."""
    from pathlib import Path

    rows = _link_clusters_statuses_documented()
    stale = {
        status: when
        for status, when in rows.items()
        if status != "LLM_LINK_FAILED" and ("peer refuse" in when or "peer is finalizing" in when)
    }
    assert not stale, stale
    text = (Path(__file__).parents[1] / "docs" / "troubleshooting.md").read_text()
    section = " ".join(text.split("### LLM_ALREADY_LINK")[1].split("###")[0].split())
    assert "(the peer refuses) on the peer's side" not in section, section


@pytest.mark.parametrize(
    ("lie", "ours"),
    [(S.LLM_LINK_BUSY, S.LLM_LINK_BUSY), (S.LLM_SUCCESS, S.LLM_FAILED)],
    ids=["LINK_BUSY", "SUCCESS"],
)
async def test_every_status_a_refused_probe_back_gives_link_clusters_is_documented(
    lie: S, ours: S
) -> None:
    """An acceptor that completes the handshake and refuses the data-path
    check's probe_back: the refusal maps through COMMON (LINK_BUSY passed on,
    anything else LLM_FAILED), and that is link_clusters' status for the
    cluster, which docs/api.md's table lists."""
    with put_probe_acceptor() as local:

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            acceptor = handshake.AcceptorHandshake(local)
            await acceptor.run(reader, writer)
            writer.write(acceptor.auth_ok())
            while True:
                kind, rid, body = await frames.read_frame(reader, acceptor.rx)
                if kind is frames.Kind.REQUEST and body.get("op") == "probe_back":
                    answer = frames.frame_body(frames.Kind.ERROR_RESPONSE, rid, refusal(lie))
                    writer.write(frames.to_wire(answer, acceptor.tx))

        async with fake_listener(script) as address, PeerProcess("prefill", "tcp") as victim:
            got = await victim.link(address, 2, timeout_ms=3000)
            assert got["per"] == [ours.name], got
    assert ours.name in _link_clusters_statuses_documented(), _link_clusters_statuses_documented()


@pytest.mark.parametrize("name,make", RKEYS[:4], ids=[n for n, _ in RKEYS[:4]])
async def test_a_malformed_remote_key_in_a_probe_info_answer_fails_the_link(
    name: str, make: Callable[[bytes], bytes]
) -> None:
    """An acceptor whose AUTH_OK carries no probe slot (an older peer) is
    asked for one with probe_info; a malformed key in the answer fails the
    link (LINK_FAILED) and the process lives."""
    from aiokvcache._loader import native

    engine = native.Engine("tcp")
    try:
        region, base = engine.mem_alloc(1 << 16)
        slot = wire.ProbeSlot(base, PROBE_BYTES, base, 1 << 16, make(engine.rkey_pack(region)))
        local = dataclasses.replace(local_info(2, None), worker_address=engine.worker_address)
        asked: list[str] = []

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            acceptor = handshake.AcceptorHandshake(local)
            await acceptor.run(reader, writer)
            writer.write(acceptor.auth_ok())
            while True:
                kind, rid, body = await frames.read_frame(reader, acceptor.rx)
                if kind is frames.Kind.REQUEST:
                    asked.append(str(body.get("op")))
                    if body.get("op") == "probe_info":
                        answer = {"body": slot.encode()}
                        out = frames.frame_body(frames.Kind.RESPONSE, rid, answer)
                        writer.write(frames.to_wire(out, acceptor.tx))

        async with fake_listener(script) as address, PeerProcess("prefill", "tcp") as victim:
            got = await victim.link(address, 2, timeout_ms=3000)
            assert got["per"] == ["LLM_LINK_FAILED"], got
            assert "probe_info" in asked, asked
            assert victim.returncode is None
            assert not (await victim.health())["service_errors"]
    finally:
        engine.close()


_LINK_TWO_ADDRESSES = """
import asyncio, json, sys, time
import aiokvcache as kv
from aiokvcache import testing

async def main():
    dd = kv.LLMDataDist(kv.LLMRole.PROMPT, 1)
    await dd.init(testing.options("tcp"))
    info = kv.LLMClusterInfo()
    info.remote_cluster_id = 2
    for address in sys.argv[1:]:
        host, port = address.rsplit(":", 1)
        info.append_remote_ip_info(host, int(port))
    start = time.monotonic()
    _, per = await dd.link_clusters([info], timeout=2000)
    print(json.dumps({"per": [s.name for s in per], "seconds": time.monotonic() - start}))
    await dd.finalize()

asyncio.run(main())
"""


async def test_an_already_link_liar_at_one_address_does_not_starve_the_others() -> None:
    """A cluster given with two addresses: at the first, an acceptor (no
    token: it need only echo the cluster id we expect) that refuses every
    handshake with ALREADY_LINK; at the second, the real instance. docs/api.md:
    "Every remote_ip_info address is tried in turn, each with a fair share of
    the time left": the liar's ALREADY_LINK is asked again only within its
    address's share, and the real instance links well within the call."""
    import json
    import sys

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        acceptor = handshake.AcceptorHandshake(local_info(2, None))
        await acceptor.run(reader, writer)
        body = frames.frame_body(frames.Kind.ERROR_RESPONSE, 0, refusal(S.LLM_ALREADY_LINK))
        writer.write(acceptor.held_reply() + frames.to_wire(body, acceptor.tx))

    async with fake_listener(script) as liar, PeerProcess("decoder", "tcp") as honest:
        # The linking side is the victim: a child process of its own.
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _LINK_TWO_ADDRESSES,
            liar,
            honest.address,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(child.communicate(), 60)
        assert child.returncode == 0, out
        got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["per"] == ["LLM_SUCCESS"], got
    # The liar's fair share is half of the 2 s; the real instance links in
    # tens of ms.
    assert got["seconds"] < 1.5, got


# ------------------------------------------------------------ worker addresses

_SHORTENED_ADDRESSES = """
import sys
from aiokvcache._loader import native

peer, me = native.Engine("tcp"), native.Engine("tcp")
good = peer.worker_address
tried = refused = 0
for i in range(len(good)):
    for k in range(1, (good[i] & 0x1F) + 1):
        # A length byte made k smaller, and k of the bytes it counts gone:
        # every walk of the layout still ends at the last byte.
        bad = good[:i] + bytes([good[i] - k]) + good[i + 1 + k :]
        tried += 1
        try:
            ep = me.connect(bad, False)
        except native.NativeError:
            refused += 1
            continue
        me.disconnect(ep)
print(tried, refused, flush=True)
"""


async def test_a_worker_address_with_a_shortened_part_is_refused_or_harmless() -> None:
    """A peer's worker address whose device or interface address was made
    shorter together with its length byte walks to its last byte as UCX packs
    it, yet UCT reads such a part by its own structure: a TCP device address
    of length 0 was a null pointer (SIGSEGV in uct_tcp_iface_is_reachable_v2).
    Every such shortening of a real address is refused or harmless; the
    process that tries them all lives."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SHORTENED_ADDRESSES, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0, (child.returncode, out)
    tried, refused = (int(x) for x in out.split())
    assert tried > 100 and refused > 0, (tried, refused)


async def test_a_data_path_answer_naming_our_own_nonce_is_a_link_failure() -> None:
    """The peer's half of a put probe is its word that it put a nonce into our
    probe slot, which we then look for. An acceptor that names *our* nonce and
    the slot our own probe wrote it into (its source, which the handshake's
    probe slot and the round-robin make easy to guess) would be found there
    without moving a byte: it is refused as such, never a link."""
    import tempfile

    with put_probe_acceptor() as local:
        attempt = 0

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal attempt
            acceptor = handshake.AcceptorHandshake(local)
            theirs = await acceptor.run(reader, writer)
            writer.write(acceptor.auth_ok())
            ctl = theirs["probe"]["base"]
            guess = ctl + (2 * attempt + 1) * PROBE_BYTES  # its put probe's source slot
            attempt += 1
            while True:
                kind, rid, body = await frames.read_frame(reader, acceptor.rx)
                if kind is frames.Kind.REQUEST and body.get("op") == "probe_back":
                    nonce = body["body"]["nonce"]
                    answer = {"body": {"problem": "", "nonce": nonce, "slot": guess}}
                    out = frames.frame_body(frames.Kind.RESPONSE, rid, answer)
                    writer.write(frames.to_wire(out, acceptor.tx))

        with tempfile.TemporaryFile("w+") as err:
            async with (
                fake_listener(script) as address,
                PeerProcess("prefill", "tcp", stderr=err) as victim,
            ):
                for _ in range(4):
                    got = await victim.link(address, 2, timeout_ms=2000)
                    assert got["per"] == ["LLM_LINK_FAILED"], got
            err.seek(0)
            assert "with our own nonce" in err.read()


@pytest.mark.parametrize("cid", [-1, -(2**63)])
async def test_a_hello_naming_a_cluster_id_no_cluster_can_have_is_refused(cid: int) -> None:
    """Cluster ids are unsigned 64-bit: a HELLO (eager, with a real engine's
    AUTH) claiming a negative one is a protocol error, refused before it
    reaches anything of ours (it reached the engine's endpoint call as the
    link's peer id and raised TypeError, logged as a traceback)."""
    from aiokvcache._loader import native

    engine = native.Engine("tcp")
    try:
        async with PeerProcess("decoder", "tcp") as victim:
            host, port = victim.address.rsplit(":", 1)
            local = dataclasses.replace(local_info(cid, None), worker_address=engine.worker_address)
            reader, writer = await asyncio.open_connection(host, int(port))
            nonce = bytes(range(handshake.NONCE_LEN))
            hello = {**handshake.hello_payload(local, nonce), "eager": True, "expect": 2}
            ident = handshake.identity_payload(local, bytes(handshake.NOTE_KEY_LEN))
            writer.write(
                frames.pack_frame(frames.Kind.HELLO, 0, hello)
                + frames.pack_frame(frames.Kind.AUTH, 0, {"mac": b"", **ident})
            )
            await writer.drain()
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await asyncio.wait_for(reader.read(), 5)
            writer.transport.abort()
            health = await victim.health()
            assert not health["service_errors"], health
            assert victim.returncode is None
    finally:
        engine.close()
