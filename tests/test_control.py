"""Tests for the control plane: codec, framing, handshake, requests, hostile peers."""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import math
import pickle
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aiokvcache._core.wire import connection, control
from aiokvcache._core.wire.control import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    Closed,
    CloseReason,
    ControlConnection,
    ControlServer,
    LocalInfo,
    ProtocolError,
    connect,
    decode,
    encode,
)
from aiokvcache._core.wire.peerstatus import LinkRefused, PeerRefusal
from aiokvcache.errors import LLMException, LLMStatusCode, LLMTimeoutError

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

HOST = "127.0.0.1"
LOGGER = "aiokvcache.control"

# Function-scoped fixtures (the loop guard) are fine here: every example
# leaves nothing behind, which the guard checks once at the end.
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
FUZZ_NET = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------
# helpers


@pytest_asyncio.fixture(autouse=True)
async def loop_guard() -> AsyncIterator[None]:
    """Fail a test that reached the loop's exception handler or leaked tasks."""
    loop = asyncio.get_running_loop()
    contexts: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: contexts.append(ctx))
    try:
        yield
        await asyncio.sleep(0.02)  # let transports finish closing
        gc.collect()
        await asyncio.sleep(0)
        me = asyncio.current_task()
        leftover = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        assert not leftover, f"tasks left running: {leftover}"
        assert not contexts, f"loop exception handler called: {contexts}"
    finally:
        loop.set_exception_handler(old)


class Recorder:
    """A Handler that records everything and serves a few test ops."""

    def __init__(self, name: str = "", refuse: LLMException | None = None) -> None:
        self.name = name
        self.refuse = refuse
        self.connected: list[ControlConnection] = []
        self.closed: list[tuple[ControlConnection, str]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.release = asyncio.Event()
        self.ops: dict[str, Callable[[ControlConnection, dict[str, Any]], Awaitable[Any]]] = {}

    def on_connected(self, conn: ControlConnection) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.connected.append(conn)

    async def handle_request(
        self, conn: ControlConnection, op: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        if op == "echo":
            return {"echo": body, "from": self.name}
        if op == "sleep":
            await asyncio.sleep(body.get("s", 0))
            return {"slept": body.get("s", 0), "i": body.get("i")}
        if op == "block":
            await self.release.wait()
            return {}
        if op == "fail":
            raise LLMException(body["message"], body["status"])
        if op == "crash":
            raise ValueError("boom")
        if op == "not_a_dict":
            return [1, 2]  # type: ignore[return-value]
        if op in self.ops:
            result: dict[str, Any] = await self.ops[op](conn, body)
            return result
        raise LLMException(f"unknown op {op}", LLMStatusCode.LLM_PARAM_INVALID)

    def on_event(self, conn: ControlConnection, op: str, body: dict[str, Any]) -> None:
        self.events.append((op, body))

    def on_closed(self, conn: ControlConnection, reason: str) -> None:
        self.closed.append((conn, reason))


async def eventually(pred: Callable[[], bool], within: float = 5.0) -> None:
    # Polling is the point: the predicates read plain lists the handlers fill.
    async with asyncio.timeout(within):
        while not pred():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def local(cluster_id: int, token: bytes | None = None, role: int = 0) -> LocalInfo:
    return LocalInfo(cluster_id, role, f"ucx-worker-{cluster_id}".encode(), token)


class Net:
    """Servers and client connections made by a test, all closed at teardown."""

    def __init__(self) -> None:
        self.servers: list[ControlServer] = []
        self.conns: list[ControlConnection] = []

    async def server(
        self, handler: Recorder | None = None, token: bytes | None = None, cluster_id: int = 1
    ) -> tuple[ControlServer, Recorder]:
        h = handler if handler is not None else Recorder("server")
        srv = ControlServer(local(cluster_id, token), h)
        await srv.start(HOST, 0)
        self.servers.append(srv)
        return srv, h

    async def connect(
        self,
        srv: ControlServer,
        handler: Recorder | None = None,
        token: bytes | None = None,
        cluster_id: int = 2,
        link_timeout: float = 5.0,
    ) -> tuple[ControlConnection, Recorder]:
        h = handler if handler is not None else Recorder("client")
        conn = await connect(*srv.address, local(cluster_id, token, role=1), h, link_timeout)
        self.conns.append(conn)
        return conn, h

    async def aclose(self) -> None:
        for conn in self.conns:
            await conn.close()
        for srv in self.servers:
            await srv.close()


@pytest_asyncio.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        await n.aclose()


def frame(kind: int, payload: bytes, rid: int = 0, version: int = PROTOCOL_VERSION) -> bytes:
    body = struct.pack(">BBI", version, kind, rid) + payload
    return struct.pack(">I", len(body)) + body


async def raw_exchange(addr: tuple[str, int], data: bytes, *, eof: bool = True) -> bytes:
    """Send raw bytes; return what comes back until the server closes."""
    reader, writer = await asyncio.open_connection(*addr)
    got = b""
    try:
        try:
            writer.write(data)
            await writer.drain()
            if eof:
                writer.write_eof()
        except (ConnectionError, OSError):
            pass  # the server may hang up before we finish writing
        async with asyncio.timeout(5):
            try:
                got = await reader.read()
            except (ConnectionError, OSError):
                pass
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
    return got


def control_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING
    ]


async def assert_serves(srv: ControlServer) -> None:
    """A fresh, proper client still gets served."""
    conn = await connect(*srv.address, local(99), Recorder("fresh"), 5.0)
    try:
        assert await conn.request("echo", {"ok": True}, timeout=5) == {
            "echo": {"ok": True},
            "from": "server",
        }
    finally:
        await conn.close()


# --------------------------------------------------------------------------
# codec

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(), inner, max_size=6),
    max_leaves=40,
)


def depth(obj: object) -> int:
    if isinstance(obj, list):
        return 1 + max((depth(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((depth(x) for x in obj.values()), default=0)
    return 0


def assert_same(a: object, b: object) -> None:
    """Equal, with exact types (bool is not int, bytes is not str, -0.0 keeps its sign)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, float):
        assert isinstance(b, float)
        if math.isnan(a):
            assert math.isnan(b)
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


@FUZZ
@given(values)
async def test_codec_round_trip(value: object) -> None:
    assume(depth(value) <= control.MAX_DEPTH)
    assert_same(decode(encode(value)), value)


@FUZZ
@given(st.binary(max_size=512))
async def test_decode_random_bytes_only_raises_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@FUZZ
@given(values, st.data())
async def test_decode_mutated_encodings_only_raises_protocol_error(
    value: object, data: st.DataObject
) -> None:
    assume(depth(value) <= control.MAX_DEPTH)
    raw = bytearray(encode(value))
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, len(raw)))
        if action == "flip" and pos < len(raw):
            raw[pos] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[pos:]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decode(bytes(raw))
    except ProtocolError:
        pass


async def test_codec_exact_types_and_edges() -> None:
    for value in [True, False, 0, 1, -1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, 0.0, -0.0]:
        assert_same(decode(encode(value)), value)
    assert math.isnan(decode(encode(float("nan"))))  # type: ignore[arg-type]
    assert decode(encode((1, (2, b"x")))) == [1, [2, b"x"]]
    assert decode(encode(bytearray(b"ab"))) == b"ab"
    assert_same(decode(encode({"": {"ü": ["", b""]}})), {"": {"ü": ["", b""]}})


async def test_encode_rejects_what_it_cannot_carry() -> None:
    with pytest.raises(TypeError):
        encode({1: "int key"})
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(TypeError):
        encode({1, 2})
    with pytest.raises(ValueError):
        encode(2**64)
    with pytest.raises(ValueError):
        encode(-(2**63) - 1)
    nested: object = None
    for _ in range(control.MAX_DEPTH):
        nested = [nested]
    assert decode(encode(nested)) == nested  # exactly MAX_DEPTH is fine
    with pytest.raises(ValueError):
        encode([nested])
    with pytest.raises(ValueError):
        encode([None] * control.MAX_ITEMS)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "truncated"),
        (b"\x03\x00", "truncated"),
        (b"\x00\x00", "trailing"),
        (b"\x63", "unknown tag"),
        (b"\x04" + struct.pack(">Q", 5), "non-canonical"),
        (b"\x06\x00\x00\x00\x02\xff\xfe", "utf-8"),
        (b"\x06\xff\xff\xff\xff", "truncated"),
        (b"\x08\xff\xff\xff\xff", "count"),
        (b"\x09\xff\xff\xff\xff" + b"\x00" * 8, "count"),
        (
            b"\x09\x00\x00\x00\x02" + (b"\x00\x00\x00\x01k\x00") * 2,
            "duplicate",
        ),
        (b"\x09\x00\x00\x00\x01\x00\x00\x00\x02\xc3\x28\x00", "utf-8"),
        (b"\x08\x00\x00\x00\x01" * (control.MAX_DEPTH + 1) + b"\x00", "nesting"),
        (
            b"\x08" + struct.pack(">I", control.MAX_ITEMS) + b"\x00" * control.MAX_ITEMS,
            "values",
        ),
    ],
    ids=[
        "empty",
        "short-int",
        "trailing",
        "tag",
        "uint",
        "str-utf8",
        "str-len",
        "list-count",
        "dict-count",
        "dup-key",
        "key-utf8",
        "depth",
        "items",
    ],
)
async def test_decode_rejects_hostile_input(data: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode(data)


# --------------------------------------------------------------------------
# handshake


@pytest.mark.parametrize("token", [None, b"s3cret"])
async def test_handshake_and_peer_info(net: Net, token: bytes | None) -> None:
    srv, sh = await net.server(token=token, cluster_id=2**64 - 1)
    conn, ch = await net.connect(srv, token=token, cluster_id=7)
    assert conn.initiator and not conn.closed
    assert conn.peer_cluster_id == 2**64 - 1
    assert conn.peer_role == 0
    assert conn.peer_worker_address == f"ucx-worker-{2**64 - 1}".encode()
    assert conn.peer_address == srv.address
    assert ch.connected == [conn]
    await eventually(lambda: len(sh.connected) == 1)
    sconn = sh.connected[0]
    assert not sconn.initiator
    assert (sconn.peer_cluster_id, sconn.peer_role) == (7, 1)
    assert sconn.peer_worker_address == b"ucx-worker-7"
    assert sconn.peer_address[0] == HOST
    assert srv.connections == frozenset({sconn})
    assert await conn.request("echo", {"a": 1}) == {"echo": {"a": 1}, "from": "server"}


@pytest.mark.parametrize(
    ("client_token", "server_token"),
    [(b"tok", None), (None, b"tok"), (b"tok-a", b"tok-b")],
)
async def test_token_mismatch_fails_both_sides(
    net: Net,
    caplog: pytest.LogCaptureFixture,
    client_token: bytes | None,
    server_token: bytes | None,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv, sh = await net.server(token=server_token)
    ch = Recorder("client")
    with pytest.raises(LLMException) as info:
        await net.connect(srv, ch, token=client_token)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert "authentication failed" in str(info.value)
    await eventually(lambda: any("authentication failed" in m for m in control_warnings(caplog)))
    assert ch.connected == [] and ch.closed == []
    assert sh.connected == [] and sh.closed == []
    assert srv.connections == frozenset()
    # The right token still works afterwards.
    conn, _ = await net.connect(srv, token=server_token)
    assert await conn.request("echo", {}) == {"echo": {}, "from": "server"}


async def test_acceptor_refusal_is_link_failed_with_its_status_as_a_hint(net: Net) -> None:
    """The acceptor's status is data: the refusal is LINK_FAILED, the status it
    named (after its HELLO_REPLY checked out) a hint for the linker."""
    refusal = LLMException("cluster 2 already linked", LLMStatusCode.LLM_ALREADY_LINK)
    srv, sh = await net.server(Recorder("server", refuse=refusal))
    ch = Recorder("client")
    with pytest.raises(LinkRefused) as info:
        await net.connect(srv, ch)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert info.value.peer_status == LLMStatusCode.LLM_ALREADY_LINK
    assert "already linked" in str(info.value)
    assert ch.connected == [] and ch.closed == []
    assert sh.closed == []


async def test_initiator_refusal(net: Net) -> None:
    srv, sh = await net.server()
    refusal = LLMException("no thanks", LLMStatusCode.LLM_ALREADY_LINK)
    with pytest.raises(LLMException) as info:
        await net.connect(srv, Recorder("client", refuse=refusal))
    assert info.value is refusal
    # The acceptor had reported the link, so it reports its end once.
    await eventually(lambda: len(sh.closed) == 1)
    assert sh.closed[0][0] is sh.connected[0]
    assert "no thanks" in sh.closed[0][1]
    await asyncio.sleep(0.05)
    assert len(sh.closed) == 1


async def test_requests_queued_by_on_connected_are_sent_after_handshake(net: Net) -> None:
    replies: list[asyncio.Task[dict[str, Any]]] = []

    class Eager(Recorder):
        def on_connected(self, conn: ControlConnection) -> None:
            super().on_connected(conn)
            conn.send_event("hi", {"from": self.name})
            replies.append(asyncio.ensure_future(conn.request("echo", {"early": 1})))

    srv, sh = await net.server(Eager("server"))
    _, ch = await net.connect(srv, Eager("client"))
    results = await asyncio.gather(*replies)
    assert {r["from"] for r in results} == {"client", "server"}
    await eventually(lambda: ch.events == [("hi", {"from": "server"})])
    await eventually(lambda: sh.events == [("hi", {"from": "client"})])


async def test_connect_to_closed_port_fails_fast() -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(LLMException) as info:
        await connect(HOST, port, local(2), Recorder(), 5.0)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert time.monotonic() - start < 2.0


async def test_connect_to_silent_server_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # say nothing; wait for the client to give up
        except (ConnectionError, OSError):
            pass
        writer.close()

    server = await asyncio.start_server(silent, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(LLMTimeoutError) as info:
            await connect(HOST, port, local(2), Recorder(), 0.3)
        elapsed = time.monotonic() - start
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert isinstance(info.value, TimeoutError)
        assert 0.25 < elapsed < 1.5
    finally:
        server.close()
        await server.wait_closed()


async def test_acceptor_handshake_timeout(
    net: Net, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT", 0.2)
    srv, _ = await net.server()
    start = time.monotonic()
    assert await raw_exchange(srv.address, b"", eof=False) == b""
    assert time.monotonic() - start < 2.0
    assert any("handshake timed out" in m and HOST in m for m in control_warnings(caplog))
    await assert_serves(srv)


async def test_invalid_local_info() -> None:
    with pytest.raises(LLMException) as info:
        await connect(HOST, 1, LocalInfo(2**64, 0, b""), Recorder(), 1.0)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        ControlServer(LocalInfo(1, 0, "not bytes"), Recorder())  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# requests and events


async def test_symmetric_requests_and_events(net: Net) -> None:
    srv, sh = await net.server()
    conn, ch = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    sconn = sh.connected[0]
    assert await conn.request("echo", {"x": [1, b"2"]}) == {
        "echo": {"x": [1, b"2"]},
        "from": "server",
    }
    assert await sconn.request("echo", {"y": None}) == {"echo": {"y": None}, "from": "client"}
    conn.send_event("invalidate", {"cache_id": 3})
    sconn.send_event("invalidate", {"cache_id": 4})
    await eventually(lambda: sh.events == [("invalidate", {"cache_id": 3})])
    await eventually(lambda: ch.events == [("invalidate", {"cache_id": 4})])


async def test_hundred_concurrent_requests_each_way(net: Net) -> None:
    srv, sh = await net.server()
    conn, _ = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    sconn = sh.connected[0]
    rng = random.Random(1)

    async def one(c: ControlConnection, i: int) -> None:
        reply = await c.request("sleep", {"s": rng.random() / 50, "i": i}, timeout=10)
        assert reply["i"] == i

    await asyncio.gather(*(one(c, i) for i in range(100) for c in (conn, sconn)))
    assert conn._pending == {} and sconn._pending == {}


async def test_error_responses_carry_the_peers_status_as_data(
    net: Net, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer's error answer reaches the asker as a PeerRefusal (its status
    and text, unread): what it means is wire.ask's call, never the frame's."""
    srv, _ = await net.server()
    conn, _ = await net.connect(srv)
    with pytest.raises(PeerRefusal) as refused:
        await conn.request(
            "fail", {"message": "no cache 7", "status": int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)}
        )
    assert refused.value.status == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert refused.value.message == "no cache 7"
    # Not a TimeoutError of ours, whatever status it names.
    with pytest.raises(PeerRefusal, match="layer 3 late") as refused:
        await conn.request(
            "fail", {"message": "layer 3 late", "status": int(LLMStatusCode.LLM_TIMEOUT)}
        )
    assert not isinstance(refused.value, TimeoutError)
    # (The server's LLMException made its unknown number LLM_FAILED.)
    with pytest.raises(PeerRefusal) as refused:
        await conn.request("fail", {"message": "odd", "status": 12345})
    assert refused.value.status == LLMStatusCode.LLM_FAILED
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        with pytest.raises(PeerRefusal) as refused:
            await conn.request("crash", {})
    assert refused.value.status == LLMStatusCode.LLM_FAILED
    assert "boom" in refused.value.message
    assert any(r.exc_info for r in caplog.records if r.name == LOGGER)
    with pytest.raises(PeerRefusal) as refused:
        await conn.request("not_a_dict", {})
    assert refused.value.status == LLMStatusCode.LLM_FAILED
    # The connection is fine after all of that.
    assert (await conn.request("echo", {}))["from"] == "server"


async def test_unencodable_request_is_param_invalid(net: Net) -> None:
    srv, _ = await net.server()
    conn, _ = await net.connect(srv)
    bodies: list[dict[str, Any]] = [
        {"x": object()},
        {"big": b"\0" * (MAX_FRAME + 1)},
        {"n": 2**64},
    ]
    for body in bodies:
        with pytest.raises(LLMException) as info:
            await conn.request("echo", body)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        conn.send_event("e", {"x": object()})
    assert conn._pending == {}
    assert (await conn.request("echo", {}))["from"] == "server"


async def test_request_timeout(net: Net) -> None:
    srv, sh = await net.server()
    conn, _ = await net.connect(srv)
    start = time.monotonic()
    with pytest.raises(LLMTimeoutError) as info:
        await conn.request("block", {}, timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert conn._pending == {}
    # A late answer to the timed-out request is dropped quietly.
    sh.release.set()
    assert (await conn.request("echo", {}, timeout=5))["from"] == "server"


async def test_request_cancelled_leaves_no_pending_entry(net: Net) -> None:
    srv, sh = await net.server()
    conn, _ = await net.connect(srv)
    task = asyncio.ensure_future(conn.request("block", {}))
    await eventually(lambda: len(conn._pending) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert conn._pending == {}
    # Cancellation storm: many in flight, cancelled at random points.
    rng = random.Random(2)
    tasks = [asyncio.ensure_future(conn.request("sleep", {"s": 0.01})) for _ in range(200)]
    for _ in range(5):
        await asyncio.sleep(rng.random() / 100)
        for t in rng.sample(tasks, 40):
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert conn._pending == {}
    sh.release.set()
    assert (await conn.request("echo", {}))["from"] == "server"


async def test_too_many_inflight_requests_get_link_busy(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUESTS", 2)
    srv, sh = await net.server()
    conn, _ = await net.connect(srv)
    blocked = [asyncio.ensure_future(conn.request("block", {})) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(PeerRefusal) as refused:
        await conn.request("echo", {})
    assert refused.value.status == LLMStatusCode.LLM_LINK_BUSY
    sh.release.set()
    await asyncio.gather(*blocked)


# --------------------------------------------------------------------------
# closing


async def test_close_reasons_read_as_their_text() -> None:
    cases = [
        (Closed(CloseReason.LOCAL, "bye now"), "bye now"),
        (Closed(CloseReason.PEER_CLOSED, "unlinked"), "peer closed: unlinked"),
        (Closed(CloseReason.PEER_CLOSED), "peer closed"),
        (Closed(CloseReason.PEER_CLOSED, ""), "peer closed: "),
        (Closed(CloseReason.PEER_NOT_READING), "the peer does not read its connection"),
        (Closed(CloseReason.EOF), "connection lost (EOF)"),
        (Closed(CloseReason.CONNECTION_LOST, "OSError()"), "connection lost: OSError()"),
        (Closed(CloseReason.WRITE_FAILED, "OSError()"), "write failed: OSError()"),
        (Closed(CloseReason.PROTOCOL_ERROR, "bad tag"), "protocol error: bad tag"),
        (Closed(CloseReason.INTERNAL_ERROR, "KeyError('x')"), "internal error: KeyError('x')"),
    ]
    for reason, text in cases:
        assert reason == text and str(reason) == text and f"{reason}" == text
        for copied in (copy.copy(reason), pickle.loads(pickle.dumps(reason))):
            assert (copied.kind, copied.detail, copied) == (reason.kind, reason.detail, text)


async def test_on_closed_gets_the_kind_of_close(net: Net) -> None:
    srv, sh = await net.server()
    conn, ch = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    await sh.connected[0].close("unlinked")
    await conn.wait_closed()
    (_, ours), (_, theirs) = sh.closed[0], ch.closed[0]
    assert isinstance(ours, Closed) and isinstance(theirs, Closed)
    assert (ours.kind, ours.detail) == (CloseReason.LOCAL, "unlinked")
    assert (theirs.kind, theirs.detail) == (CloseReason.PEER_CLOSED, "unlinked")


async def test_peer_close_fails_pending_and_reports_once(net: Net) -> None:
    srv, sh = await net.server()
    conn, ch = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    sconn = sh.connected[0]
    pending = asyncio.ensure_future(conn.request("block", {}))
    back = asyncio.ensure_future(sconn.request("block", {}))
    await eventually(lambda: len(conn._pending) == 1 and len(sconn._pending) == 1)
    await sconn.close("bye now")
    assert sconn.closed
    assert sh.closed == [(sconn, "bye now")]
    with pytest.raises(LLMException) as info:
        await back
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    with pytest.raises(LLMException) as info:
        await pending
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    await conn.wait_closed()
    assert conn.closed
    assert len(ch.closed) == 1 and ch.closed[0][0] is conn
    assert "bye now" in ch.closed[0][1]
    # Closed connections: requests fail, events are dropped, close is idempotent.
    with pytest.raises(LLMException) as info:
        await conn.request("echo", {})
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    conn.send_event("ignored", {})
    await conn.close()
    await sconn.close()
    await asyncio.sleep(0.05)
    assert len(ch.closed) == 1 and len(sh.closed) == 1
    assert srv.connections == frozenset()


async def test_handler_may_close_its_own_connection(net: Net) -> None:
    srv, sh = await net.server()

    async def close_me(conn: ControlConnection, body: dict[str, Any]) -> dict[str, Any]:
        await conn.close("handler asked")
        return {}

    sh.ops["close_me"] = close_me
    conn, ch = await net.connect(srv)
    with pytest.raises(LLMException) as info:
        await conn.request("close_me", {})
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    await conn.wait_closed()
    await eventually(lambda: len(sh.closed) == 1)
    assert sh.closed[0][1] == "handler asked"
    assert len(ch.closed) == 1 and "handler asked" in ch.closed[0][1]


async def test_peer_vanishes(net: Net) -> None:
    srv, sh = await net.server()
    conn, ch = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    pending = asyncio.ensure_future(conn.request("block", {}))
    await eventually(lambda: len(conn._pending) == 1)
    sh.connected[0]._writer.transport.abort()  # no BYE: the socket just dies
    with pytest.raises(LLMException) as info:
        await pending
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    await conn.wait_closed()
    assert len(ch.closed) == 1
    await eventually(lambda: len(sh.closed) == 1)


async def test_server_close_closes_every_connection(net: Net) -> None:
    srv, sh = await net.server()
    clients = [await net.connect(srv, cluster_id=10 + i) for i in range(3)]
    await eventually(lambda: len(sh.connected) == 3)
    await srv.close()
    assert len(sh.closed) == 3
    assert {id(c) for c, _ in sh.closed} == {id(c) for c in sh.connected}
    for conn, ch in clients:
        await conn.wait_closed()
        assert len(ch.closed) == 1 and "server closing" in ch.closed[0][1]
    await srv.close()
    assert len(sh.closed) == 3
    with pytest.raises(LLMException):
        await connect(*srv.address, local(5), Recorder(), 1.0)


async def test_close_does_not_hang_on_a_peer_that_stopped_reading(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "CLOSE_TIMEOUT", 0.2)
    srv, sh = await net.server()
    conn, ch = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    sconn = sh.connected[0]
    conn._writer.transport.pause_reading()  # type: ignore[attr-defined]
    chunk = b"\0" * (MAX_FRAME // 2)
    for _ in range(64):  # far more than the socket buffers hold
        sconn.send_event("bulk", {"data": chunk})
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await sconn.close("giving up")
    assert time.monotonic() - start < 2.0
    assert len(sh.closed) == 1
    conn._writer.transport.resume_reading()  # type: ignore[attr-defined]
    await asyncio.wait_for(conn.wait_closed(), 10)
    assert len(ch.closed) == 1


# --------------------------------------------------------------------------
# hostile peers


async def test_oversize_frame_closes_connection(net: Net, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv, sh = await net.server()
    # No EOF: the announced length alone must make the server hang up.
    assert await raw_exchange(srv.address, struct.pack(">I", MAX_FRAME + 1), eof=False) == b""
    assert any("exceeds MAX_FRAME" in m and HOST in m for m in control_warnings(caplog))
    await assert_serves(srv)
    assert len(sh.connected) == 1


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (frame(1, encode({}), version=PROTOCOL_VERSION + 1), "unsupported protocol version"),
        (frame(200, encode({})), "unknown message kind"),
        (frame(5, encode({"op": "echo", "body": {}}), rid=1), "expected HELLO, got REQUEST"),
        (frame(1, b"\xff"), "unknown tag"),
        (frame(1, encode([1])), "not a dict"),
        (frame(1, encode({"version": 1})), "field"),
        (struct.pack(">I", 2) + b"\x01\x01", "shorter than header"),
    ],
    ids=["version", "kind", "request", "payload", "not-dict", "fields", "short"],
)
async def test_bad_frames_before_handshake(
    net: Net, caplog: pytest.LogCaptureFixture, data: bytes, why: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv, sh = await net.server()
    assert await raw_exchange(srv.address, data, eof=False) == b""
    assert any(why in m and HOST in m for m in control_warnings(caplog)), control_warnings(caplog)
    await assert_serves(srv)
    await eventually(lambda: len(sh.closed) == 1)
    assert len(sh.connected) == 1


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (frame(1, encode({})), "unexpected HELLO"),
        (frame(200, encode({})), "unknown message kind"),
        (frame(5, b"\x09\x00\x00\x00\x09"), "count exceeds"),
        (frame(5, encode({"op": 3, "body": {}})), "'op'"),
        (frame(7, encode({"status": "x"})), "'status'"),
        (struct.pack(">I", MAX_FRAME + 1), "exceeds MAX_FRAME"),
    ],
    ids=["hello", "kind", "payload", "op-type", "status-type", "oversize"],
)
async def test_bad_frames_after_handshake(
    net: Net, caplog: pytest.LogCaptureFixture, data: bytes, why: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv, sh = await net.server()
    conn, ch = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    conn._writer.write(data)  # behind the library's back
    await asyncio.wait_for(conn.wait_closed(), 5)
    await eventually(lambda: len(sh.closed) == 1)
    assert why in sh.closed[0][1]
    assert any(why in m and HOST in m for m in control_warnings(caplog))
    assert len(ch.closed) == 1
    await assert_serves(srv)


async def test_duplicate_outstanding_request_id_is_a_violation(net: Net) -> None:
    srv, sh = await net.server()
    conn, _ = await net.connect(srv)
    await eventually(lambda: len(sh.connected) == 1)
    block = encode({"op": "block", "body": {}})
    conn._writer.write(frame(5, block, rid=77) + frame(5, block, rid=77))
    await asyncio.wait_for(conn.wait_closed(), 5)
    await eventually(lambda: len(sh.closed) == 1)
    assert "reused" in sh.closed[0][1]


framed_garbage = st.builds(
    frame,
    st.integers(0, 255),
    st.binary(max_size=200) | values.map(encode),
    st.integers(0, 2**32 - 1),
    st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, 255]),
)


@FUZZ_NET
@given(st.lists(st.binary(min_size=1, max_size=300) | framed_garbage, min_size=1, max_size=3))
async def test_garbage_from_raw_socket_never_hurts_the_server(chunks: list[bytes]) -> None:
    handler = Recorder("server")
    srv = ControlServer(local(1), handler)
    await srv.start(HOST, 0)
    try:
        await raw_exchange(srv.address, b"".join(chunks))
        await assert_serves(srv)
    finally:
        await srv.close()
    assert len(handler.connected) == 1 and len(handler.closed) == 1


# --------------------------------------------------------------------------
# what an unproven peer learns, and what idle sockets cannot block


async def _read_raw_frame(reader: asyncio.StreamReader) -> tuple[int, dict[str, object]]:
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    body = await reader.readexactly(length)
    payload = decode(body[6:])
    assert isinstance(payload, dict)
    return body[1], payload


async def test_no_worker_address_before_the_token_is_proven(net: Net) -> None:
    srv, sh = await net.server(token=b"secret")
    reader, writer = await asyncio.open_connection(*srv.address)
    try:
        hello = {"version": PROTOCOL_VERSION, "cluster_id": 5, "role": 1}
        hello.update(nonce=b"n" * 32, auth=True)
        writer.write(frame(1, encode(hello)))
        kind, reply = await asyncio.wait_for(_read_raw_frame(reader), 5)
        assert kind == 2  # HELLO_REPLY: no identity in it
        assert "worker_address" not in reply and "host_id" not in reply
        # A forged proof with an identity of our own (and, without the token,
        # not sealed with the session key): the connection closes, and
        # nothing of the acceptor's identity came back.
        auth = {"mac": b"x" * 32, "worker_address": b"w", "host_id": b"", "note_key": b"k" * 16}
        writer.write(frame(3, encode(auth)))
        rest = await asyncio.wait_for(reader.read(), 5)
        while chunk := await asyncio.wait_for(reader.read(), 5):
            rest += chunk
        assert b"ucx-worker" not in rest
    finally:
        writer.close()
    assert sh.connected == []
    await net.connect(srv, token=b"secret")  # the real peer still links
    await eventually(lambda: len(sh.connected) == 1)


def _identity(cluster_id: int) -> dict[str, object]:
    address = f"ucx-worker-{cluster_id}".encode()
    return {"worker_address": address, "host_id": b"", "note_key": b"k" * 16}


def _hello(cluster_id: int, **extra: object) -> dict[str, object]:
    hello = {"version": PROTOCOL_VERSION, "cluster_id": cluster_id, "role": 1}
    hello.update(nonce=bytes([cluster_id]) * 32, auth=False, **extra)
    return hello


async def test_without_a_token_the_initiator_sends_auth_with_hello() -> None:
    """An acceptor scripted to read HELLO and AUTH before it answers anything
    (an initiator that waited for HELLO_REPLY would never send AUTH); it then
    answers the old way, HELLO_REPLY and AUTH_OK apart, and the link works."""
    got: list[int] = []

    async def acceptor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(2):
                kind, _ = await asyncio.wait_for(_read_raw_frame(reader), 5)
                got.append(kind)
            writer.write(frame(2, encode(_hello(1) | {"mac": b""})))
            await writer.drain()
            writer.write(frame(4, encode({"mac": b"", **_identity(1)})))
            await reader.read()  # until the initiator closes
        finally:
            writer.close()

    server = await asyncio.start_server(acceptor, HOST, 0)
    try:
        port = server.sockets[0].getsockname()[1]
        conn = await connect(HOST, port, local(2), Recorder("client"), 5.0)
        assert got == [1, 3]  # HELLO, then AUTH, before any answer
        assert conn.peer_worker_address == b"ucx-worker-1"
        await conn.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_an_acceptor_answers_an_eager_hello_once_auth_came(net: Net) -> None:
    srv, sh = await net.server()
    reader, writer = await asyncio.open_connection(*srv.address)
    try:
        writer.write(frame(1, encode(_hello(5, eager=True))))
        # It waits for the AUTH that an eager HELLO announces.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_read_raw_frame(reader), 0.3)
        writer.write(frame(3, encode({"mac": b"", **_identity(5)})))
        kind, reply = await asyncio.wait_for(_read_raw_frame(reader), 5)
        assert kind == 2 and reply["cluster_id"] == 1
        kind, ok = await asyncio.wait_for(_read_raw_frame(reader), 5)
        assert kind == 4 and ok["worker_address"] == b"ucx-worker-1"
        await eventually(lambda: len(sh.connected) == 1)
        assert sh.connected[0].peer_worker_address == b"ucx-worker-5"
    finally:
        writer.close()


async def test_an_acceptor_answers_a_plain_hello_first(net: Net) -> None:
    """An initiator that does not send AUTH with HELLO (no ``eager``) gets
    HELLO_REPLY before it sends AUTH, as before."""
    srv, sh = await net.server()
    reader, writer = await asyncio.open_connection(*srv.address)
    try:
        writer.write(frame(1, encode(_hello(6))))
        kind, reply = await asyncio.wait_for(_read_raw_frame(reader), 5)
        assert kind == 2 and "worker_address" not in reply
        writer.write(frame(3, encode({"mac": b"", **_identity(6)})))
        kind, ok = await asyncio.wait_for(_read_raw_frame(reader), 5)
        assert kind == 4 and ok["worker_address"] == b"ucx-worker-1"
        await eventually(lambda: len(sh.connected) == 1)
    finally:
        writer.close()


async def test_an_eager_hello_with_a_token_on_the_acceptor_is_refused(net: Net) -> None:
    srv, sh = await net.server(token=b"secret")
    with pytest.raises(LLMException, match="one is required") as exc:
        await net.connect(srv)
    assert exc.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert sh.connected == []


async def test_the_identity_is_proven_with_the_token(net: Net) -> None:
    srv, sh = await net.server(token=b"k")
    conn, _ = await net.connect(srv, token=b"k")
    await eventually(lambda: len(sh.connected) == 1)
    assert conn.peer_worker_address == b"ucx-worker-1"
    assert sh.connected[0].peer_worker_address == b"ucx-worker-2"


async def test_idle_sockets_cannot_lock_out_a_peer(
    net: Net, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(control, "MAX_PENDING_HANDSHAKES", 8)
    srv, _ = await net.server()
    idle = [await asyncio.open_connection(*srv.address) for _ in range(3 * 8)]
    try:
        await eventually(lambda: srv.evicted >= 2 * 8)
        for _ in range(3):  # served at once, every time, while they stay open
            await asyncio.wait_for(assert_serves(srv), 5)
    finally:
        for _, w in idle:
            w.close()
    assert any("evicting the oldest pending handshake" in m for m in control_warnings(caplog))


async def test_connection_cap_refuses_more(net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "MAX_CONNECTIONS", 2)
    srv, _ = await net.server()
    await net.connect(srv, cluster_id=11)
    await net.connect(srv, cluster_id=12)
    await eventually(lambda: len(srv.connections) == 2)
    with pytest.raises(LLMException) as ei:
        await net.connect(srv, cluster_id=13, link_timeout=2.0)
    assert ei.value.status_code == LLMStatusCode.LLM_LINK_FAILED
