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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import aiokvcache as kv
from aiokvcache._core import frames, handshake, wire
from aiokvcache._core.errors import LLMException
from aiokvcache._core.peerstatus import PeerRefusal
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
