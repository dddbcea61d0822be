"""Frames of the control plane on an asyncio stream.

A frame is a 4-byte big-endian length followed by a body of at most
:data:`MAX_FRAME` bytes: protocol version (1 byte), message kind (1 byte),
request id (4 bytes, big-endian) and a payload encoded by
:func:`~aiokvcache._core.wire.codec.encode`. Within a session (see
:mod:`aiokvcache._core.wire.handshake`) every body travels sealed by a
:class:`Seal`, one per direction.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..model.errors import LLMException, LLMStatusCode
from .codec import ProtocolError, decode, encode

__all__ = [
    "MAX_FRAME",
    "MAX_MESSAGE",
    "PROTOCOL_VERSION",
    "Kind",
    "Seal",
    "error_payload",
    "field",
    "fmt_address",
    "frame_body",
    "link_failed",
    "pack_frame",
    "peer_address",
    "read_frame",
    "send_now",
    "to_wire",
]

PROTOCOL_VERSION: int = 3
"""Version byte carried by every frame and by HELLO / HELLO_REPLY."""

MAX_FRAME: int = 1 << 20
"""Largest frame body (bytes); a larger announced length closes the connection."""

MAX_MESSAGE = 4096
"""Error / bye text sent to a peer is cut to this many characters."""

_TAG_LEN = 16  # AES-GCM's tag on a sealed frame
_HEADER = struct.Struct(">BBI")
_LEN = struct.Struct(">I")


class Kind(enum.IntEnum):
    """A frame's message kind (its second byte)."""

    HELLO = 1
    HELLO_REPLY = 2
    AUTH = 3
    AUTH_OK = 4
    REQUEST = 5
    RESPONSE = 6
    ERROR_RESPONSE = 7
    EVENT = 8
    BYE = 9


_KINDS = frozenset(int(k) for k in Kind)


class Seal:
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


def frame_body(kind: Kind, rid: int, payload: dict[str, Any]) -> bytes:
    """A frame's body (header and payload), not yet sealed nor length-prefixed."""
    body = _HEADER.pack(PROTOCOL_VERSION, kind, rid) + encode(payload)
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds MAX_FRAME ({MAX_FRAME})")
    return body


def to_wire(body: bytes, seal: Seal | None) -> bytes:
    """The bytes that carry ``body``: sealed when there is a session, length first."""
    data = body if seal is None else seal.seal(body)
    return _LEN.pack(len(data)) + data


def pack_frame(kind: Kind, rid: int, payload: dict[str, Any], seal: Seal | None = None) -> bytes:
    return to_wire(frame_body(kind, rid, payload), seal)


async def read_frame(
    reader: asyncio.StreamReader, opener: Seal | None = None
) -> tuple[Kind, int, dict[str, Any]]:
    """Read one frame: (kind, request id, payload); ProtocolError if it is malformed."""
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
        raise ProtocolError(f"{Kind(kind).name} payload is not a dict")
    return Kind(kind), rid, payload


async def send_now(
    writer: asyncio.StreamWriter,
    kind: Kind,
    rid: int,
    payload: dict[str, Any],
    seal: Seal | None = None,
) -> None:
    """Write one frame and drain (the handshake's messages, before any write loop runs)."""
    writer.write(pack_frame(kind, rid, payload, seal))
    await writer.drain()


def field(payload: dict[str, Any], key: str, typ: type, kind: Kind) -> Any:
    """``payload[key]``, which must be a ``typ``; ProtocolError if it is not."""
    value = payload.get(key)
    # bool is an int subclass; a flag is never a valid integer field here.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ProtocolError(f"{kind.name}: field {key!r} missing or not {typ.__name__}")
    return value


def error_payload(exc: LLMException) -> dict[str, Any]:
    """The payload of an ERROR_RESPONSE that carries ``exc``."""
    return {"status": int(exc.status_code), "message": exc.message[:MAX_MESSAGE]}


def link_failed(message: str) -> LLMException:
    return LLMException(message, LLMStatusCode.LLM_LINK_FAILED)


def peer_address(writer: asyncio.StreamWriter) -> tuple[str, int]:
    """The remote (host, port) of a socket; ("?", 0) when it is unknown."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return (str(peer[0]), int(peer[1]))
    return ("?", 0)


def fmt_address(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"
