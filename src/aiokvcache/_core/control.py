"""Control plane: framed messages over asyncio TCP streams.

A frame is a 4-byte big-endian length followed by a body of at most
:data:`MAX_FRAME` bytes: protocol version (1 byte), message kind (1 byte),
request id (4 bytes, big-endian) and a payload in the small tag-length-value
encoding implemented by :func:`encode` / :func:`decode`.

The side that calls :func:`connect` (the initiator) and the side whose
:class:`ControlServer` accepted the socket (the acceptor) run a handshake::

    initiator -> HELLO        {version, cluster_id, role, nonce, auth}
    acceptor  -> HELLO_REPLY  {same fields, mac}
    initiator -> AUTH         {mac, worker_address, host_id}
    acceptor  -> AUTH_OK      {mac, worker_address, host_id}
                              (or ERROR_RESPONSE {status, message})

With a shared ``auth_token`` each side proves it with an HMAC-SHA256 over
both nonces and both sides' identities; without one the macs are empty but
the same four messages flow. What lets a peer touch memory — the UCX worker
address, the host id, the key that attributes notifications to the link —
travels only after the other side has proven the token: the initiator sends
its own in AUTH, once the acceptor's HELLO_REPLY proved it; the acceptor
sends its own in AUTH_OK, once the initiator's AUTH proved it. Each is bound
into the sender's mac, so it cannot be swapped in flight.

**Session.** With a token, both sides derive a session secret from the token,
both nonces and the transcript, and from it one AES-256-GCM key per
direction. AUTH, AUTH_OK and every frame after them are sealed with those keys
(nonce = a per-direction frame counter, so a frame cannot be replayed,
reordered or dropped unnoticed). A party in the middle that relays the bytes
of a handshake between two token holders learns nothing of what follows —
no worker address, no cache metadata, no remote key — and can change none of
it. The initiator names the cluster it means to reach (``expected_cluster_id``)
and sends nothing but HELLO to an acceptor that claims another id; an
acceptor refuses a HELLO that claims its own cluster id. Without a token
nothing is sealed: the control plane then trusts its network (see
docs/design.md, "What a reachable peer can do"). (Protocol version 3.)

After the handshake the connection is symmetric: either end sends REQUESTs (answered by RESPONSE or
ERROR_RESPONSE with the same request id) and EVENTs, and either end says
BYE before closing.

Anything malformed, unexpected or oversized closes that one connection with
a warning on the ``aiokvcache.control`` logger; it never escapes into the
event loop or the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import logging
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import LLMException, LLMStatusCode, LLMTimeoutError, make_error

__all__ = [
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "ControlConnection",
    "ControlServer",
    "Handler",
    "LocalInfo",
    "ProtocolError",
    "connect",
    "decode",
    "encode",
]

_log = logging.getLogger("aiokvcache.control")

PROTOCOL_VERSION: int = 3
"""Version byte carried by every frame and by HELLO / HELLO_REPLY."""

MAX_FRAME: int = 1 << 20
"""Largest frame body (bytes); a larger announced length closes the connection."""

MAX_DEPTH = 16
"""Most containers (lists / dicts) nested inside one another in a payload."""

MAX_ITEMS = 1 << 16
"""Most values (containers, scalars, dict entries) in one payload."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds an accepted socket may take to finish the handshake."""

CLOSE_TIMEOUT = 1.0
"""Seconds close() waits for queued frames / socket shutdown before aborting."""

MAX_INFLIGHT_REQUESTS = 1024
"""Incoming requests served at once per connection; more get LLM_LINK_BUSY."""

MAX_PENDING_HANDSHAKES = 128
"""Accepted sockets still in the handshake per server. When all are taken, a
new socket evicts the oldest pending one that has sent no HELLO yet (else
the oldest): idle sockets — a slowloris, a connect/close storm — cannot lock
out a peer, whose HELLO follows its connect at once."""

MAX_CONNECTIONS = 1024
"""Established connections per server; a handshake beyond that is refused."""

MAX_BACKLOG = 32 << 20
"""Bytes of frames queued for one connection's socket at most. A peer that
stops reading while it keeps asking (or while we keep pinging it) would
otherwise grow our memory without bound: past this the connection closes."""

NOTE_KEY_LEN = 16
"""Bytes of the key each side gives the other for its notifications."""

_NONCE_LEN = 32
_TAG_LEN = 16  # AES-GCM's tag on a sealed frame
_MAX_MESSAGE = 4096  # error / bye text sent to a peer is cut to this
_HEADER = struct.Struct(">BBI")
_LEN = struct.Struct(">I")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")


class ProtocolError(Exception):
    """A peer sent bytes that break the control protocol (or the codec)."""


class _Kind(enum.IntEnum):
    HELLO = 1
    HELLO_REPLY = 2
    AUTH = 3
    AUTH_OK = 4
    REQUEST = 5
    RESPONSE = 6
    ERROR_RESPONSE = 7
    EVENT = 8
    BYE = 9


_KINDS = frozenset(int(k) for k in _Kind)

# --------------------------------------------------------------------------
# Codec: one tag byte, then a fixed-size value or a u32 length / count.

_T_NONE, _T_FALSE, _T_TRUE, _T_INT, _T_UINT = range(5)  # int: i64; uint: only >= 2**63
_T_FLOAT, _T_STR, _T_BYTES, _T_LIST, _T_DICT = range(5, 10)


def encode(obj: object) -> bytes:
    """Encode ``obj`` (dict with str keys, list/tuple, str, bytes, int, bool, None, float).

    Ints must fit in signed or unsigned 64 bits.  Raises ``TypeError`` for an
    unsupported type or a non-str dict key, ``ValueError`` for an int out of
    range, nesting deeper than ``MAX_DEPTH`` or more than ``MAX_ITEMS``
    values.  Tuples come back from :func:`decode` as lists.
    """
    out = bytearray()
    _encode_into(obj, out, 0, [0])
    return bytes(out)


def _encode_into(obj: object, out: bytearray, depth: int, count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_ITEMS:
        raise ValueError(f"more than {MAX_ITEMS} values")
    if obj is None:
        out.append(_T_NONE)
    elif obj is True:
        out.append(_T_TRUE)
    elif obj is False:
        out.append(_T_FALSE)
    elif isinstance(obj, int):
        if -(1 << 63) <= obj < (1 << 63):
            out.append(_T_INT)
            out += _I64.pack(obj)
        elif (1 << 63) <= obj < (1 << 64):
            out.append(_T_UINT)
            out += _U64.pack(obj)
        else:
            raise ValueError(f"int {obj} does not fit in 64 bits")
    elif isinstance(obj, float):
        out.append(_T_FLOAT)
        out += _F64.pack(obj)
    elif isinstance(obj, str):
        out.append(_T_STR)
        _put_bytes(out, obj.encode("utf-8"))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        out.append(_T_BYTES)
        _put_bytes(out, bytes(obj))
    elif isinstance(obj, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH}")
        out.append(_T_LIST)
        out += _U32.pack(len(obj))
        for item in obj:
            _encode_into(item, out, depth + 1, count)
    elif isinstance(obj, dict):
        if depth >= MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH}")
        out.append(_T_DICT)
        out += _U32.pack(len(obj))
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"dict key must be str, not {type(key).__name__}")
            _put_bytes(out, key.encode("utf-8"))
            _encode_into(value, out, depth + 1, count)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__}")


def _put_bytes(out: bytearray, data: bytes) -> None:
    if len(data) > 0xFFFFFFFF:
        raise ValueError("string or bytes longer than 2**32 - 1")
    out += _U32.pack(len(data))
    out += data


class _Decoder:
    __slots__ = ("data", "items", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.items = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolError("truncated payload")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def u32(self) -> int:
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def text(self) -> str:
        raw = self.take(self.u32())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError("invalid utf-8 in string") from e

    def count(self, min_item_size: int) -> int:
        n = self.u32()
        # Every entry takes at least min_item_size bytes, so a count larger
        # than what is left is a lie; refuse it before allocating anything.
        if n * min_item_size > len(self.data) - self.pos:
            raise ProtocolError("container count exceeds payload size")
        if self.items + n > MAX_ITEMS:
            raise ProtocolError(f"more than {MAX_ITEMS} values")
        return n

    def value(self, depth: int) -> object:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise ProtocolError(f"more than {MAX_ITEMS} values")
        tag = self.take(1)[0]
        if tag == _T_NONE:
            return None
        if tag == _T_FALSE:
            return False
        if tag == _T_TRUE:
            return True
        if tag == _T_INT:
            signed: int = _I64.unpack(self.take(8))[0]
            return signed
        if tag == _T_UINT:
            unsigned: int = _U64.unpack(self.take(8))[0]
            if unsigned < (1 << 63):
                raise ProtocolError("non-canonical unsigned int")
            return unsigned
        if tag == _T_FLOAT:
            real: float = _F64.unpack(self.take(8))[0]
            return real
        if tag == _T_STR:
            return self.text()
        if tag == _T_BYTES:
            return self.take(self.u32())
        if tag in (_T_LIST, _T_DICT):
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"nesting deeper than {MAX_DEPTH}")
            if tag == _T_LIST:
                return [self.value(depth + 1) for _ in range(self.count(1))]
            result: dict[str, object] = {}
            for _ in range(self.count(5)):
                key = self.text()
                if key in result:
                    raise ProtocolError(f"duplicate dict key {key!r}")
                result[key] = self.value(depth + 1)
            return result
        raise ProtocolError(f"unknown tag {tag}")


def decode(data: bytes) -> object:
    """Decode one value produced by :func:`encode`.

    Any malformed input (truncated, trailing bytes, unknown tag, bad utf-8,
    duplicate keys, too deep, too many values) raises :class:`ProtocolError`
    and nothing else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() needs bytes, not {type(data).__name__}")
    dec = _Decoder(bytes(data))
    obj = dec.value(0)
    if dec.pos != len(dec.data):
        raise ProtocolError("trailing bytes after payload")
    return obj


# --------------------------------------------------------------------------
# Frames


class _Seal:
    """One direction of a session: AES-256-GCM with a frame counter as nonce."""

    __slots__ = ("_aead", "_count")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._count = 0

    def _nonce(self) -> bytes:
        nonce = self._count.to_bytes(12, "big")
        self._count += 1
        return nonce

    def seal(self, body: bytes) -> bytes:
        return self._aead.encrypt(self._nonce(), body, None)

    def open(self, data: bytes) -> bytes:
        try:
            return self._aead.decrypt(self._nonce(), data, None)
        except InvalidTag:
            raise ProtocolError(
                "authentication failed: a sealed frame did not verify (the auth tokens differ, "
                "or it was altered on the way)"
            ) from None


def _session(
    token: bytes | None, client_nonce: bytes, server_nonce: bytes, ids: bytes
) -> tuple[_Seal, _Seal] | tuple[None, None]:
    """(client -> server, server -> client) seals of a session, or Nones without a token."""
    if token is None:
        return None, None
    secret = hmac.new(
        bytes(token), b"aiokvcache-session" + client_nonce + server_nonce + ids, hashlib.sha256
    ).digest()
    c2s = hmac.new(secret, b"client->server", hashlib.sha256).digest()
    s2c = hmac.new(secret, b"server->client", hashlib.sha256).digest()
    return _Seal(c2s), _Seal(s2c)


def _body(kind: _Kind, rid: int, payload: dict[str, Any]) -> bytes:
    body = _HEADER.pack(PROTOCOL_VERSION, kind, rid) + encode(payload)
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds MAX_FRAME ({MAX_FRAME})")
    return body


def _wire(body: bytes, seal: _Seal | None) -> bytes:
    data = body if seal is None else seal.seal(body)
    return _LEN.pack(len(data)) + data


def _pack_frame(kind: _Kind, rid: int, payload: dict[str, Any], seal: _Seal | None = None) -> bytes:
    return _wire(_body(kind, rid, payload), seal)


async def _read_frame(
    reader: asyncio.StreamReader, opener: _Seal | None = None
) -> tuple[_Kind, int, dict[str, Any]]:
    (length,) = _LEN.unpack(await reader.readexactly(4))
    limit = MAX_FRAME + (0 if opener is None else _TAG_LEN)
    if length > limit:
        raise ProtocolError(f"announced frame length {length} exceeds MAX_FRAME")
    if length < _HEADER.size:
        raise ProtocolError(f"frame length {length} shorter than header")
    body = await reader.readexactly(length)
    if opener is not None:
        body = opener.open(body)
        if len(body) < _HEADER.size:
            raise ProtocolError("sealed frame shorter than header")
    version, kind, rid = _HEADER.unpack_from(body)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    payload = decode(body[_HEADER.size :])
    if not isinstance(payload, dict):
        raise ProtocolError(f"{_Kind(kind).name} payload is not a dict")
    return _Kind(kind), rid, payload


def _get(payload: dict[str, Any], key: str, typ: type, kind: _Kind) -> Any:
    value = payload.get(key)
    # bool is an int subclass; a flag is never a valid integer field here.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ProtocolError(f"{kind.name}: field {key!r} missing or not {typ.__name__}")
    return value


def _error_payload(exc: LLMException) -> dict[str, Any]:
    return {"status": int(exc.status_code), "message": exc.message[:_MAX_MESSAGE]}


def _error_from_payload(payload: dict[str, Any]) -> LLMException:
    status = _get(payload, "status", int, _Kind.ERROR_RESPONSE)
    message = _get(payload, "message", str, _Kind.ERROR_RESPONSE)
    return make_error(status, message)


def _peer_address(writer: asyncio.StreamWriter) -> tuple[str, int]:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return (str(peer[0]), int(peer[1]))
    return ("?", 0)


def _fmt(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


# --------------------------------------------------------------------------
# Public types


@dataclass(frozen=True)
class LocalInfo:
    """What this side announces in the handshake.

    ``auth_token``: shared secret; both sides must hold the same token, or
    both none, for a handshake to succeed.
    """

    cluster_id: int
    role: int
    worker_address: bytes
    auth_token: bytes | None = None
    #: Identifies the machine (boot id): peers on the same host may use
    #: shared memory. Informational; empty when unknown.
    host_id: bytes = b""


class Handler(Protocol):
    """Callbacks of a control connection; all are called on the event loop."""

    def on_connected(self, conn: ControlConnection) -> None:
        """Called after a successful handshake, on both sides.

        Raising :class:`LLMException` refuses the link: the connection is
        closed and the initiator's :func:`connect` raises it (with the same
        status code when the acceptor refuses).
        """

    async def handle_request(
        self, conn: ControlConnection, op: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Serve a peer's request; the returned dict is the response body.

        :class:`LLMException` is sent back as an error with its status; any
        other exception is logged and sent back as ``LLM_FAILED``.
        """
        ...

    def on_event(self, conn: ControlConnection, op: str, body: dict[str, Any]) -> None:
        """A peer's fire-and-forget event; exceptions are logged and ignored."""

    def on_closed(self, conn: ControlConnection, reason: str) -> None:
        """Called exactly once for every connection reported by on_connected."""


def _int64_ok(value: object) -> bool:
    # Whatever the codec carries as an int; bool would arrive as a flag.
    return (
        isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 64)
    )


def _validate_local(local: LocalInfo) -> None:
    if not _int64_ok(local.cluster_id):
        raise LLMException("cluster_id must be a 64-bit int", LLMStatusCode.LLM_PARAM_INVALID)
    if not _int64_ok(local.role):
        raise LLMException("role must be a 64-bit int", LLMStatusCode.LLM_PARAM_INVALID)
    if not isinstance(local.worker_address, (bytes, bytearray)):
        raise LLMException("worker_address must be bytes", LLMStatusCode.LLM_PARAM_INVALID)
    if local.auth_token is not None and not isinstance(local.auth_token, (bytes, bytearray)):
        raise LLMException("auth_token must be bytes or None", LLMStatusCode.LLM_PARAM_INVALID)


class ControlConnection:
    """One established, symmetric control connection.

    Attributes: ``peer_cluster_id``, ``peer_role``, ``peer_worker_address``
    (from the peer's handshake), ``peer_address`` (remote socket address)
    and ``initiator`` (True on the side that called :func:`connect`).
    """

    peer_cluster_id: int
    peer_role: int
    peer_worker_address: bytes
    peer_host_id: bytes
    peer_address: tuple[str, int]
    initiator: bool
    #: The key the peer's notifications to us carry (we gave it to the peer),
    #: and the one ours to the peer must carry (the peer gave it to us).
    local_note_key: bytes
    peer_note_key: bytes

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        *,
        initiator: bool,
        peer_cluster_id: int,
        peer_role: int,
        peer_worker_address: bytes,
        peer_host_id: bytes = b"",
        local_note_key: bytes = b"",
        peer_note_key: bytes = b"",
        tx: _Seal | None = None,
        rx: _Seal | None = None,
    ) -> None:
        self.peer_cluster_id = peer_cluster_id
        self.peer_host_id = peer_host_id
        self.peer_role = peer_role
        self.peer_worker_address = peer_worker_address
        self.local_note_key = local_note_key
        self.peer_note_key = peer_note_key
        self.peer_address = _peer_address(writer)
        self.initiator = initiator
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._tx = tx  # seals what we send (None: no session, plaintext)
        self._rx = rx  # opens what we receive
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._serving: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_id = 1
        # Frame bodies, sealed and framed by the write loop in write order
        # (the session's counter is the order on the wire).
        self._outq: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._backlog = 0  # bytes queued in _outq
        self._reader_task: asyncio.Task[None] | None = None
        self._writer_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._closed_event = asyncio.Event()
        self._closing = False
        self._reported = False  # on_connected succeeded → on_closed owed
        self._done_callbacks: list[Callable[[ControlConnection], None]] = []

    @classmethod
    def _from_hello(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        hello: dict[str, Any],
        *,
        initiator: bool,
        local_note_key: bytes,
        tx: _Seal | None,
        rx: _Seal | None,
    ) -> ControlConnection:
        """A connection to the peer that sent ``hello`` (checked by _check_hello)."""
        return cls(
            reader,
            writer,
            handler,
            initiator=initiator,
            peer_cluster_id=hello["cluster_id"],
            peer_role=hello["role"],
            peer_worker_address=hello["worker_address"],
            peer_host_id=hello["host_id"],
            local_note_key=local_note_key,
            peer_note_key=hello["note_key"],
            tx=tx,
            rx=rx,
        )

    def __repr__(self) -> str:
        side = "initiator" if self.initiator else "acceptor"
        state = "closed" if self._closing else "open"
        return (
            f"<ControlConnection {side} peer={_fmt(self.peer_address)} "
            f"cluster={self.peer_cluster_id} {state}>"
        )

    @property
    def closed(self) -> bool:
        """True once close has begun (locally or because the peer went away)."""
        return self._closing

    # -- sending ----------------------------------------------------------

    # timeout= on every awaitable is the library's API convention.
    async def request(
        self,
        op: str,
        body: dict[str, Any],
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send a request and wait for the peer's response body.

        Raises ``LLMException(LLM_LINK_FAILED)`` if the connection is or
        becomes closed, :class:`LLMTimeoutError` (``LLM_TIMEOUT``) after
        ``timeout`` seconds, the peer handler's error (with its status), or
        ``LLMException(LLM_PARAM_INVALID)`` if ``op`` / ``body`` cannot be
        encoded.  Cancellation or timeout leaves the connection usable.
        """
        if self._closing:
            raise LLMException(
                f"control connection to {_fmt(self.peer_address)} is closed",
                LLMStatusCode.LLM_LINK_FAILED,
            )
        rid = self._alloc_id()
        frame = self._pack_user(_Kind.REQUEST, rid, op, body)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._enqueue(frame)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise  # a TimeoutError from the peer's status, not ours
            raise LLMTimeoutError(
                f"request {op!r} to {_fmt(self.peer_address)} timed out after {timeout}s"
            ) from None
        finally:
            if self._pending.get(rid) is fut:
                del self._pending[rid]
            if fut.done() and not fut.cancelled():
                fut.exception()  # mark retrieved: a failure raced with our cancel

    def send_event(self, op: str, body: dict[str, Any]) -> None:
        """Send a fire-and-forget event; a no-op once the connection is closed.

        Raises ``LLMException(LLM_PARAM_INVALID)`` if it cannot be encoded.
        """
        if self._closing:
            return
        self._enqueue(self._pack_user(_Kind.EVENT, 0, op, body))

    def _enqueue(self, body: bytes) -> None:
        """Queue a frame body for the write loop; past MAX_BACKLOG, close."""
        if self._closing:
            return
        if self._backlog + len(body) > MAX_BACKLOG:
            _log.warning(
                "closing control connection to %s: it does not read what we send (%d bytes queued)",
                _fmt(self.peer_address),
                self._backlog,
            )
            self._begin_close("the peer does not read its connection", send_bye=False)
            return
        self._backlog += len(body)
        self._outq.put_nowait(body)

    def _pack_user(self, kind: _Kind, rid: int, op: str, body: dict[str, Any]) -> bytes:
        if not isinstance(op, str) or not isinstance(body, dict):
            raise LLMException("op must be str and body a dict", LLMStatusCode.LLM_PARAM_INVALID)
        try:
            return _body(kind, rid, {"op": op, "body": body})
        except (TypeError, ValueError) as e:
            raise LLMException(
                f"cannot encode {kind.name.lower()} {op!r}: {e}", LLMStatusCode.LLM_PARAM_INVALID
            ) from e

    def _alloc_id(self) -> int:
        while True:
            rid = self._next_id
            self._next_id = rid + 1 if rid < 0xFFFFFFFF else 1
            if rid not in self._pending:
                return rid

    # -- lifecycle --------------------------------------------------------

    def _start(self) -> None:
        # Handshake done and on_connected accepted: from here on_closed is owed.
        self._reported = True
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())
        self._writer_task = asyncio.get_running_loop().create_task(self._write_loop())

    def _abandon(self, reason: str) -> None:
        # The link was refused before _start: nothing runs, on_closed is not
        # owed, but requests queued by on_connected must not wait forever.
        self._closing = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(
                    _link_failed(f"link to {_fmt(self.peer_address)} refused: {reason}")
                )
        self._pending.clear()
        self._closed_event.set()

    async def close(self, reason: str = "closed") -> None:
        """Say BYE (best effort), close the socket and fail pending requests.

        Idempotent; returns once on_closed has run.  Never hangs on a peer
        that stopped reading (queued frames get ``CLOSE_TIMEOUT`` seconds).
        """
        self._begin_close(reason, send_bye=True)
        if self._close_task is not None:
            await asyncio.shield(self._close_task)
        else:
            await self._closed_event.wait()

    async def wait_closed(self) -> None:
        """Wait until the connection is fully closed (on_closed has run)."""
        await self._closed_event.wait()

    def _begin_close(self, reason: str, *, send_bye: bool) -> None:
        if self._close_task is not None or self._closed_event.is_set():
            return
        self._closing = True
        self._close_task = asyncio.get_running_loop().create_task(
            self._finish_close(reason, send_bye)
        )

    async def _finish_close(self, reason: str, send_bye: bool) -> None:
        try:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(
                        LLMException(
                            f"control connection to {_fmt(self.peer_address)} closed: {reason}",
                            LLMStatusCode.LLM_LINK_FAILED,
                        )
                    )
            self._pending.clear()
            me = asyncio.current_task()
            tasks: list[asyncio.Task[None]] = [t for t in self._tasks if t is not me]
            if self._reader_task is not None and self._reader_task is not me:
                tasks.append(self._reader_task)
            for task in tasks:
                task.cancel()
            if self._writer_task is not None:
                if send_bye:
                    with contextlib.suppress(ValueError):
                        self._outq.put_nowait(
                            _body(_Kind.BYE, 0, {"reason": reason[:_MAX_MESSAGE]})
                        )
                self._outq.put_nowait(None)
                done, _ = await asyncio.wait({self._writer_task}, timeout=CLOSE_TIMEOUT)
                if not done:
                    self._writer_task.cancel()
                tasks.append(self._writer_task)
            await _close_writer(self._writer)
            await asyncio.gather(*tasks, return_exceptions=True)
        except Exception:
            _log.exception("error while closing control connection to %s", _fmt(self.peer_address))
        finally:
            try:
                if self._reported:
                    self._reported = False
                    self._handler.on_closed(self, reason)
            except Exception:
                _log.exception("on_closed handler failed for %s", _fmt(self.peer_address))
            finally:
                self._closed_event.set()
                for callback in self._done_callbacks:
                    callback(self)

    # -- reading / writing tasks ------------------------------------------

    async def _write_loop(self) -> None:
        try:
            while True:
                body = await self._outq.get()
                if body is None:
                    return
                self._backlog -= len(body)
                self._writer.write(_wire(body, self._tx))
                # Coalesce whatever is queued already into one drain.
                while not self._outq.empty():
                    more = self._outq.get_nowait()
                    if more is None:
                        await self._writer.drain()
                        return
                    self._backlog -= len(more)
                    self._writer.write(_wire(more, self._tx))
                await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._begin_close(f"write failed: {e!r}", send_bye=False)

    async def _read_loop(self) -> None:
        peer = _fmt(self.peer_address)
        send_bye = True
        try:
            while True:
                kind, rid, payload = await _read_frame(self._reader, self._rx)
                if kind is _Kind.REQUEST:
                    self._dispatch(rid, payload)
                elif kind is _Kind.RESPONSE:
                    body = _get(payload, "body", dict, kind)
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(body)
                elif kind is _Kind.ERROR_RESPONSE:
                    exc = _error_from_payload(payload)
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                elif kind is _Kind.EVENT:
                    op = _get(payload, "op", str, kind)
                    body = _get(payload, "body", dict, kind)
                    try:
                        self._handler.on_event(self, op, body)
                    except Exception:
                        _log.exception("on_event handler failed for %r from %s", op, peer)
                elif kind is _Kind.BYE:
                    why = payload.get("reason")
                    reason = f"peer closed: {why}" if isinstance(why, str) else "peer closed"
                    send_bye = False
                    break
                else:
                    raise ProtocolError(f"unexpected {kind.name} after handshake")
        except asyncio.IncompleteReadError:
            reason, send_bye = "connection lost (EOF)", False
        except ProtocolError as e:
            _log.warning("closing control connection with %s: %s", peer, e)
            reason = f"protocol error: {e}"
        except (ConnectionError, OSError) as e:
            reason, send_bye = f"connection lost: {e!r}", False
        except Exception as e:  # a bug of ours; keep it to this connection
            _log.exception("control connection reader for %s failed", peer)
            reason = f"internal error: {e!r}"
        self._begin_close(reason, send_bye=send_bye)

    def _dispatch(self, rid: int, payload: dict[str, Any]) -> None:
        op = _get(payload, "op", str, _Kind.REQUEST)
        body = _get(payload, "body", dict, _Kind.REQUEST)
        if rid in self._serving:
            raise ProtocolError(f"request id {rid} reused while outstanding")
        if len(self._serving) >= MAX_INFLIGHT_REQUESTS:
            busy = LLMException("too many outstanding requests", LLMStatusCode.LLM_LINK_BUSY)
            self._enqueue(_body(_Kind.ERROR_RESPONSE, rid, _error_payload(busy)))
            return
        self._serving.add(rid)
        task = asyncio.get_running_loop().create_task(self._serve(rid, op, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, rid: int, op: str, body: dict[str, Any]) -> None:
        try:
            try:
                result = await self._handler.handle_request(self, op, body)
                if not isinstance(result, dict):
                    raise TypeError(f"handle_request returned {type(result).__name__}, not dict")
                frame = _body(_Kind.RESPONSE, rid, {"body": result})
            except LLMException as e:
                frame = _body(_Kind.ERROR_RESPONSE, rid, _error_payload(e))
            except Exception as e:
                _log.exception("handler for request %r from %s failed", op, _fmt(self.peer_address))
                failed = LLMException(f"{type(e).__name__}: {e}", LLMStatusCode.LLM_FAILED)
                frame = _body(_Kind.ERROR_RESPONSE, rid, _error_payload(failed))
            self._enqueue(frame)
        except asyncio.CancelledError:
            pass  # the connection is closing; nobody is left to answer
        except Exception:  # cannot happen: error frames always encode
            _log.exception("answering request %r from %s failed", op, _fmt(self.peer_address))
        finally:
            self._serving.discard(rid)


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
    except Exception:
        pass  # the socket is gone either way; close must not fail


def _buffered(reader: asyncio.StreamReader) -> bool:
    """Whether bytes wait in ``reader`` (the peer sent something)."""
    return bool(getattr(reader, "_buffer", b""))


def _abort(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


# --------------------------------------------------------------------------
# Handshake


def _hello(local: LocalInfo, nonce: bytes) -> dict[str, Any]:
    # Nothing here lets the peer reach our memory: it has proven nothing yet.
    return {
        "version": PROTOCOL_VERSION,
        "cluster_id": local.cluster_id,
        "role": local.role,
        "nonce": nonce,
        "auth": local.auth_token is not None,
    }


def _check_hello(kind: _Kind, payload: dict[str, Any]) -> dict[str, Any]:
    _get(payload, "version", int, kind)
    _get(payload, "cluster_id", int, kind)
    _get(payload, "role", int, kind)
    _get(payload, "auth", bool, kind)
    if len(_get(payload, "nonce", bytes, kind)) != _NONCE_LEN:
        raise ProtocolError(f"{kind.name}: nonce must be {_NONCE_LEN} bytes")
    return payload


#: Longest UCX worker address a peer may announce (real ones are a few hundred bytes).
MAX_WORKER_ADDRESS = 1 << 16


def _identity(local: LocalInfo, note_key: bytes) -> dict[str, Any]:
    """What a proven peer may learn: how to reach our transfer engine, and the
    key its notifications to us must carry (one per connection)."""
    return {
        "worker_address": bytes(local.worker_address),
        "host_id": bytes(local.host_id),
        "note_key": note_key,
    }


def _check_identity(kind: _Kind, payload: dict[str, Any]) -> dict[str, Any]:
    address = _get(payload, "worker_address", bytes, kind)
    if not 0 < len(address) <= MAX_WORKER_ADDRESS:
        raise ProtocolError(f"{kind.name}: worker_address of {len(address)} bytes")
    if len(_get(payload, "host_id", bytes, kind)) > 256:
        raise ProtocolError(f"{kind.name}: host_id too long")
    if len(_get(payload, "note_key", bytes, kind)) != NOTE_KEY_LEN:
        raise ProtocolError(f"{kind.name}: note_key must be {NOTE_KEY_LEN} bytes")
    return {
        "worker_address": address,
        "host_id": payload["host_id"],
        "note_key": payload["note_key"],
    }


def _transcript(client: dict[str, Any], server: dict[str, Any]) -> bytes:
    # Both identities bound into the mac, so neither can be swapped in flight.
    fields = ("version", "cluster_id", "role", "auth")
    return encode([[client[f] for f in fields], [server[f] for f in fields]])


def _mac(
    token: bytes | None,
    label: bytes,
    first: bytes,
    second: bytes,
    ids: bytes,
    identity: dict[str, Any] | None = None,
) -> bytes:
    if token is None:
        return b""
    extra = (
        b""
        if identity is None
        else encode([identity["worker_address"], identity["host_id"], identity["note_key"]])
    )
    return hmac.new(bytes(token), label + first + second + ids + extra, hashlib.sha256).digest()


def _auth_mismatch(local_auth: bool, peer_auth: bool) -> str:
    if local_auth and not peer_auth:
        return "authentication failed: peer has no auth token but one is required"
    if peer_auth and not local_auth:
        return "authentication failed: peer requires an auth token but none is configured"
    return ""


def _link_failed(message: str) -> LLMException:
    return LLMException(message, LLMStatusCode.LLM_LINK_FAILED)


async def _send_now(
    writer: asyncio.StreamWriter,
    kind: _Kind,
    rid: int,
    payload: dict[str, Any],
    seal: _Seal | None = None,
) -> None:
    writer.write(_pack_frame(kind, rid, payload, seal))
    await writer.drain()


async def _refuse(
    writer: asyncio.StreamWriter, exc: LLMException, seal: _Seal | None = None
) -> None:
    # Best effort: tell the initiator why before closing (sealed once a
    # session exists: the initiator then reads only sealed frames).
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await _send_now(writer, _Kind.ERROR_RESPONSE, 0, _error_payload(exc), seal)
    except (TimeoutError, ConnectionError, OSError, ValueError):
        pass


async def _accept_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    local: LocalInfo,
    handler: Handler,
    timeout: float | None = None,
    hello_seen: list[bool] | None = None,
) -> ControlConnection | None:
    """Acceptor side; returns the started connection, or None after logging why not.

    ``hello_seen[0]`` becomes True once a well-formed HELLO arrived.
    """
    peer = _fmt(_peer_address(writer))
    tx: _Seal | None = None  # server -> client, once the nonces are known
    rx: _Seal | None = None
    note_key = secrets.token_bytes(NOTE_KEY_LEN)
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT if timeout is None else timeout):
            kind, _, hello = await _read_frame(reader)
            if kind is not _Kind.HELLO:
                raise ProtocolError(f"expected HELLO, got {kind.name}")
            _check_hello(kind, hello)
            if hello_seen is not None:
                hello_seen[0] = True
            if hello["version"] != PROTOCOL_VERSION:
                raise _link_failed(f"unsupported protocol version {hello['version']}")
            if hello["cluster_id"] == local.cluster_id:
                raise _link_failed("the peer claims our own cluster id")
            mismatch = _auth_mismatch(local.auth_token is not None, hello["auth"])
            if mismatch:
                raise _link_failed(mismatch)
            nonce = secrets.token_bytes(_NONCE_LEN)
            reply = _hello(local, nonce)
            ids = _transcript(hello, reply)
            reply["mac"] = _mac(local.auth_token, b"aiokvcache-s", hello["nonce"], nonce, ids)
            await _send_now(writer, _Kind.HELLO_REPLY, 0, reply)
            rx, tx = _session(local.auth_token, hello["nonce"], nonce, ids)
            kind, _, auth = await _read_frame(reader, rx)
            if kind is _Kind.BYE:
                why = auth.get("reason")
                raise _link_failed(
                    f"peer gave up: {why}" if isinstance(why, str) else "peer gave up"
                )
            if kind is not _Kind.AUTH:
                raise ProtocolError(f"expected AUTH, got {kind.name}")
            mac = _get(auth, "mac", bytes, kind)
            peer_identity = _check_identity(kind, auth)
            expected = _mac(
                local.auth_token, b"aiokvcache-c", nonce, hello["nonce"], ids, peer_identity
            )
            if not hmac.compare_digest(mac, expected):
                raise _link_failed("authentication failed: bad client proof (auth token differs)")
            hello = {**hello, **peer_identity}
    except TimeoutError:
        _log.warning("closing control connection from %s: handshake timed out", peer)
        _abort(writer)
        return None
    except LLMException as e:
        _log.warning("refusing control connection from %s: %s", peer, e.message)
        await _refuse(writer, e, tx)
        await _close_writer(writer)
        return None
    except ProtocolError as e:
        _log.warning("closing control connection from %s: %s", peer, e)
        await _close_writer(writer)
        return None
    except asyncio.IncompleteReadError:
        _log.warning("closing control connection from %s: peer closed during handshake", peer)
        await _close_writer(writer)
        return None
    except (ConnectionError, OSError) as e:
        _log.warning("closing control connection from %s: %r during handshake", peer, e)
        _abort(writer)
        return None

    conn = ControlConnection._from_hello(
        reader, writer, handler, hello, initiator=False, local_note_key=note_key, tx=tx, rx=rx
    )
    try:
        handler.on_connected(conn)
    except Exception as e:
        refusal = (
            e
            if isinstance(e, LLMException)
            else LLMException(f"{type(e).__name__}: {e}", LLMStatusCode.LLM_FAILED)
        )
        if isinstance(e, LLMException):
            _log.warning("refusing control connection from %s: %s", peer, e)
        else:
            _log.exception("on_connected failed for %s", peer)
        conn._abandon(refusal.message)
        await _refuse(writer, refusal, tx)
        await _close_writer(writer)
        return None
    # Written now, not queued: AUTH_OK must precede anything on_connected
    # queued (and, sealed, take the session's first counter), and the writer
    # task that sends those only starts here. No await between on_connected
    # and _start, so on_closed is never lost. Our identity goes out only
    # now: the initiator has proven the token.
    mine = _identity(local, note_key)
    ok = {"mac": _mac(local.auth_token, b"aiokvcache-a", hello["nonce"], nonce, ids, mine), **mine}
    writer.write(_pack_frame(_Kind.AUTH_OK, 0, ok, tx))
    conn._start()
    return conn


async def connect(
    host: str,
    port: int,
    local: LocalInfo,
    handler: Handler,
    timeout: float,
    *,
    expected_cluster_id: int | None = None,
) -> ControlConnection:
    """Open a control connection to ``host:port`` and run the handshake.

    ``expected_cluster_id``: the cluster we mean to reach; an acceptor that
    claims another id gets nothing past HELLO (LLM_LINK_FAILED).

    Raises ``LLMException(LLM_LINK_FAILED)`` when the peer refuses the TCP
    connection, is unreachable, breaks the protocol or fails authentication;
    :class:`LLMTimeoutError` (status ``LLM_TIMEOUT``) when the whole attempt
    takes longer than ``timeout`` seconds; the acceptor's refusal (its status
    code, e.g. ``LLM_ALREADY_LINK``) when its on_connected refuses; and
    whatever the local ``handler.on_connected`` raises.
    """
    _validate_local(local)
    target = f"{host}:{port}"
    writer: asyncio.StreamWriter | None = None
    tx: _Seal | None = None  # client -> server, once the nonces are known
    rx: _Seal | None = None
    note_key = secrets.token_bytes(NOTE_KEY_LEN)
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            nonce = secrets.token_bytes(_NONCE_LEN)
            hello = _hello(local, nonce)
            await _send_now(writer, _Kind.HELLO, 0, hello)
            kind, _, reply = await _read_frame(reader)
            if kind is _Kind.ERROR_RESPONSE:
                raise _error_from_payload(reply)
            if kind is not _Kind.HELLO_REPLY:
                raise ProtocolError(f"expected HELLO_REPLY, got {kind.name}")
            _check_hello(kind, reply)
            server_mac = _get(reply, "mac", bytes, kind)
            if reply["version"] != PROTOCOL_VERSION:
                raise _link_failed(f"peer speaks protocol version {reply['version']}")
            if expected_cluster_id is not None and reply["cluster_id"] != expected_cluster_id:
                raise _link_failed(
                    f"it is cluster {reply['cluster_id']}, not cluster {expected_cluster_id}"
                )
            mismatch = _auth_mismatch(local.auth_token is not None, reply["auth"])
            if mismatch:
                raise _link_failed(mismatch)
            if reply["nonce"] == nonce:
                raise _link_failed("authentication failed: peer reflected our nonce")
            ids = _transcript(hello, reply)
            expected = _mac(local.auth_token, b"aiokvcache-s", nonce, reply["nonce"], ids)
            if not hmac.compare_digest(server_mac, expected):
                raise _link_failed("authentication failed: bad server proof (auth token differs)")
            tx, rx = _session(local.auth_token, nonce, reply["nonce"], ids)
            # The acceptor proved the token: it may learn our identity now.
            mine = _identity(local, note_key)
            client_mac = _mac(local.auth_token, b"aiokvcache-c", reply["nonce"], nonce, ids, mine)
            await _send_now(writer, _Kind.AUTH, 0, {"mac": client_mac, **mine}, tx)
            kind, _, ok = await _read_frame(reader, rx)
            if kind is _Kind.ERROR_RESPONSE:
                raise _error_from_payload(ok)
            if kind is not _Kind.AUTH_OK:
                raise ProtocolError(f"expected AUTH_OK, got {kind.name}")
            peer_identity = _check_identity(kind, ok)
            expected = _mac(
                local.auth_token, b"aiokvcache-a", nonce, reply["nonce"], ids, peer_identity
            )
            if not hmac.compare_digest(_get(ok, "mac", bytes, kind), expected):
                raise _link_failed("authentication failed: bad server identity proof")
            reply = {**reply, **peer_identity}
    except LLMException as e:
        if writer is not None:
            _say_bye_and_close(writer, e.message, tx)
        raise make_error(e.status_code, f"link to {target} failed: {e.message}") from None
    except TimeoutError as e:
        if writer is not None:
            _abort(writer)
        raise LLMTimeoutError(f"link to {target} timed out after {timeout}s") from e
    except ProtocolError as e:
        if writer is not None:
            _abort(writer)
        raise _link_failed(f"link to {target} failed: protocol error: {e}") from e
    except asyncio.IncompleteReadError as e:
        if writer is not None:
            _abort(writer)
        raise _link_failed(
            f"link to {target} failed: peer closed the connection during the handshake"
        ) from e
    except (ConnectionError, OSError) as e:
        if writer is not None:
            _abort(writer)
        raise _link_failed(f"link to {target} failed: {e}") from e
    except BaseException:
        if writer is not None:
            _abort(writer)
        raise

    conn = ControlConnection._from_hello(
        reader, writer, handler, reply, initiator=True, local_note_key=note_key, tx=tx, rx=rx
    )
    try:
        handler.on_connected(conn)
    except BaseException as e:
        why = e.message if isinstance(e, LLMException) else "refused"
        conn._abandon(why)
        _say_bye_and_close(writer, why, tx)
        raise
    conn._start()
    return conn


def _say_bye_and_close(
    writer: asyncio.StreamWriter, reason: str, seal: _Seal | None = None
) -> None:
    # No await: connect() must not outlive its timeout for a courtesy.  The
    # transport flushes the small BYE, then closes on its own.
    try:
        writer.write(_pack_frame(_Kind.BYE, 0, {"reason": reason[:_MAX_MESSAGE]}, seal))
    except (ConnectionError, OSError, RuntimeError):
        pass
    writer.close()


# --------------------------------------------------------------------------
# Server


class ControlServer:
    """Listens for control connections and runs the acceptor handshake."""

    def __init__(self, local: LocalInfo, handler: Handler) -> None:
        _validate_local(local)
        self._local = local
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        # Pending handshakes, oldest first: socket, whether HELLO came, reader.
        self._handshakes: dict[
            asyncio.Task[Any], tuple[asyncio.StreamWriter, list[bool], asyncio.StreamReader]
        ] = {}
        self.handshake_timeout = HANDSHAKE_TIMEOUT
        self.max_pending = MAX_PENDING_HANDSHAKES
        self.max_connections = MAX_CONNECTIONS
        self.evicted = 0  # pending handshakes dropped to make room
        self._conns: set[ControlConnection] = set()
        self._closing = False
        self._closed = asyncio.Event()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Start listening; port 0 picks a free port.  Returns the bound (host, port).

        Raises ``LLMException(LLM_PARAM_INVALID)`` if already started or the
        address cannot be bound.
        """
        if self._server is not None or self._closing:
            raise LLMException("control server already started", LLMStatusCode.LLM_PARAM_INVALID)
        try:
            server = await asyncio.start_server(self._on_client, host, port)
        except OSError as e:
            raise LLMException(
                f"cannot listen on {host}:{port}: {e}", LLMStatusCode.LLM_PARAM_INVALID
            ) from e
        self._server = server
        sockname = server.sockets[0].getsockname()
        self._address = (str(sockname[0]), int(sockname[1]))
        return self._address

    def set_local(self, local: LocalInfo) -> None:
        """Announce ``local`` (e.g. a new role) in later handshakes."""
        _validate_local(local)
        self._local = local

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); ``LLMException(LLM_PARAM_INVALID)`` before start()."""
        if self._address is None:
            raise LLMException("control server not started", LLMStatusCode.LLM_PARAM_INVALID)
        return self._address

    @property
    def connections(self) -> frozenset[ControlConnection]:
        """Accepted connections that are currently open."""
        return frozenset(self._conns)

    def _victim(self) -> asyncio.Task[Any]:
        """The pending handshake to evict: one whose peer already hung up,
        else the oldest that has sent nothing (not even bytes its task has
        not read yet: a peer's HELLO follows its connect at once, and on a
        busy loop it may wait unread), else the oldest with no HELLO, else
        the oldest."""
        items = list(self._handshakes.items())
        for pick in (
            lambda w, h, r: r.at_eof() or w.is_closing(),
            lambda w, h, r: not h[0] and not _buffered(r),
            lambda w, h, r: not h[0],
        ):
            for task, (w, h, r) in items:
                if pick(w, h, r):
                    return task
        return items[0][0]

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _fmt(_peer_address(writer))
        if self._closing or len(self._conns) >= self.max_connections:
            _log.warning(
                "dropping control connection from %s: %s",
                peer,
                "server closing" if self._closing else "too many connections",
            )
            _abort(writer)
            return
        while len(self._handshakes) >= self.max_pending:
            oldest = self._victim()
            sock, _, _ = self._handshakes.pop(oldest)
            self.evicted += 1
            _log.warning(
                "evicting the oldest pending handshake (%s) for %s: %d pending",
                _fmt(_peer_address(sock)),
                peer,
                self.max_pending,
            )
            _abort(sock)
            oldest.cancel()
        task = asyncio.current_task()
        assert task is not None
        hello = [False]
        self._handshakes[task] = (writer, hello, reader)
        try:
            conn = await _accept_handshake(
                reader, writer, self._local, self._handler, self.handshake_timeout, hello
            )
        except asyncio.CancelledError:
            _abort(writer)  # server closing mid-handshake
            return
        except Exception:  # a bug of ours; keep it to this socket
            _log.exception("control handshake with %s failed", _fmt(_peer_address(writer)))
            _abort(writer)
            return
        finally:
            self._handshakes.pop(task, None)
        if conn is None or conn._closed_event.is_set():
            return
        self._conns.add(conn)
        conn._done_callbacks.append(self._conns.discard)
        if self._closing:  # close() gathers self._conns after the handshakes
            conn._begin_close("server closing", send_bye=True)

    async def close(self) -> None:
        """Stop listening and close every accepted connection; idempotent."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            if self._server is not None:
                self._server.close()
            handshakes = list(self._handshakes)
            for task in handshakes:
                task.cancel()
            await asyncio.gather(*handshakes, return_exceptions=True)
            await asyncio.gather(
                *(c.close("server closing") for c in list(self._conns)), return_exceptions=True
            )
            if self._server is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await self._server.wait_closed()
        finally:
            self._closed.set()
