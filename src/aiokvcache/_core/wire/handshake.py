"""The control plane's handshake (protocol 3) and the session it opens.

::

    initiator -> HELLO        {version, cluster_id, role, nonce, auth, [expect], [eager]}
    acceptor  -> HELLO_REPLY  {same fields, mac}
    initiator -> AUTH         {mac, worker_address, host_id, note_key, [probe]}
    acceptor  -> AUTH_OK      {mac, worker_address, host_id, note_key, [probe]}
                              (or ERROR_RESPONSE {status, message})

With a token, each side's identity travels only once the other side has
proven the token, and is bound into the sender's mac; both sides then derive
one AES-256-GCM key per direction (:func:`session_seals`) that seals AUTH,
AUTH_OK and every later frame.

Without a token there is nothing to prove, and the handshake takes one round
trip: the initiator marks its HELLO ``eager`` and sends AUTH in the same write
(AUTH carries nothing that depends on HELLO_REPLY then), and an acceptor that
knows ``eager`` reads AUTH before it answers, and sends HELLO_REPLY and
AUTH_OK in one write (a refusal, after HELLO_REPLY). An acceptor that does
not know it answers HELLO first and finds AUTH already waiting: the frames
and their checks are the same. ``expect`` names the cluster the initiator
means to reach: an acceptor of another id refuses the HELLO before it reads
or admits anything (an older acceptor ignores it, and the initiator refuses
its HELLO_REPLY as before).

See :mod:`aiokvcache._core.wire.control` and docs/design.md, "Handshake (protocol 3)".
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.errors import LLMException, LLMStatusCode
from .codec import ProtocolError, encode
from .frames import (
    PROTOCOL_VERSION,
    Kind,
    Seal,
    field,
    link_failed,
    pack_frame,
    read_frame,
    send_now,
)
from .peerstatus import PeerRefusal, handshake_refusal

__all__ = [
    "MAX_WORKER_ADDRESS",
    "NONCE_LEN",
    "NOTE_KEY_LEN",
    "AcceptorHandshake",
    "InitiatorHandshake",
    "LocalInfo",
    "compute_mac",
    "hello_payload",
    "identity_payload",
    "session_seals",
    "transcript",
    "validate_local",
]

NOTE_KEY_LEN = 16
"""Bytes of the key each side gives the other for its notifications."""

NONCE_LEN = 32
"""Bytes of each side's HELLO nonce."""

#: Longest UCX worker address a peer may announce (real ones are a few hundred bytes).
MAX_WORKER_ADDRESS = 1 << 16


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
    #: A probe slot of ours and the key to our control region, for the
    #: peer's first data-path probe (see ``identity_payload``): called once
    #: per handshake, after the peer proved the token. None: the peer asks
    #: for one with a probe_info request.
    probe: Callable[[], dict[str, Any]] | None = None


def _int64_ok(value: object) -> bool:
    # Whatever the codec carries as an int; bool would arrive as a flag.
    return (
        isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 64)
    )


def validate_local(local: LocalInfo) -> None:
    """Raise ``LLMException(LLM_PARAM_INVALID)`` if ``local`` cannot be announced."""
    if not _int64_ok(local.cluster_id):
        raise LLMException("cluster_id must be a 64-bit int", LLMStatusCode.LLM_PARAM_INVALID)
    if not _int64_ok(local.role):
        raise LLMException("role must be a 64-bit int", LLMStatusCode.LLM_PARAM_INVALID)
    if not isinstance(local.worker_address, (bytes, bytearray)):
        raise LLMException("worker_address must be bytes", LLMStatusCode.LLM_PARAM_INVALID)
    if local.auth_token is not None and not isinstance(local.auth_token, (bytes, bytearray)):
        raise LLMException("auth_token must be bytes or None", LLMStatusCode.LLM_PARAM_INVALID)


# --------------------------------------------------------------------------
# Messages and proofs


def hello_payload(local: LocalInfo, nonce: bytes) -> dict[str, Any]:
    """HELLO (and, with a mac added, HELLO_REPLY)."""
    # Nothing here lets the peer reach our memory: it has proven nothing yet.
    return {
        "version": PROTOCOL_VERSION,
        "cluster_id": local.cluster_id,
        "role": local.role,
        "nonce": nonce,
        "auth": local.auth_token is not None,
    }


def _check_hello(kind: Kind, payload: dict[str, Any]) -> dict[str, Any]:
    field(payload, "version", int, kind)
    if not 0 <= field(payload, "cluster_id", int, kind) < 1 << 64:
        # A cluster id is unsigned: it becomes the link's peer id natively.
        raise ProtocolError(f"{kind.name}: cluster_id out of range")
    field(payload, "role", int, kind)
    field(payload, "auth", bool, kind)
    if len(field(payload, "nonce", bytes, kind)) != NONCE_LEN:
        raise ProtocolError(f"{kind.name}: nonce must be {NONCE_LEN} bytes")
    return payload


def identity_payload(local: LocalInfo, note_key: bytes) -> dict[str, Any]:
    """What a proven peer may learn: how to reach our transfer engine, the
    key its notifications to us must carry (one per connection) and, when
    ``local.probe`` gives one, a probe slot of ours with the key to our
    control region (what a probe_info request answers: carried here, the
    peer's first probe waits for no round trip)."""
    payload: dict[str, Any] = {
        "worker_address": bytes(local.worker_address),
        "host_id": bytes(local.host_id),
        "note_key": note_key,
    }
    if local.probe is not None:
        payload["probe"] = local.probe()
    return payload


def _check_identity(kind: Kind, payload: dict[str, Any]) -> dict[str, Any]:
    address = field(payload, "worker_address", bytes, kind)
    if not 0 < len(address) <= MAX_WORKER_ADDRESS:
        raise ProtocolError(f"{kind.name}: worker_address of {len(address)} bytes")
    if len(field(payload, "host_id", bytes, kind)) > 256:
        raise ProtocolError(f"{kind.name}: host_id too long")
    if len(field(payload, "note_key", bytes, kind)) != NOTE_KEY_LEN:
        raise ProtocolError(f"{kind.name}: note_key must be {NOTE_KEY_LEN} bytes")
    identity: dict[str, Any] = {
        "worker_address": address,
        "host_id": payload["host_id"],
        "note_key": payload["note_key"],
    }
    if "probe" in payload:
        # Checked where it is used (as a probe_info answer is): a bad one
        # fails that probe, not the handshake. None: the peer is asked.
        identity["probe"] = payload["probe"]
    return identity


def transcript(client: dict[str, Any], server: dict[str, Any]) -> bytes:
    """Both HELLOs' identities, bound into every mac and the session secret."""
    # Both identities bound into the mac, so neither can be swapped in flight.
    fields = ("version", "cluster_id", "role", "auth")
    return encode([[client[f] for f in fields], [server[f] for f in fields]])


def compute_mac(
    token: bytes | None,
    label: bytes,
    first: bytes,
    second: bytes,
    ids: bytes,
    identity: dict[str, Any] | None = None,
) -> bytes:
    """HMAC-SHA256 proof of the token over both nonces, the transcript and an
    identity; empty without a token."""
    if token is None:
        return b""
    if identity is None:
        extra = b""
    else:
        proven = [identity["worker_address"], identity["host_id"], identity["note_key"]]
        if "probe" in identity:
            proven.append(identity["probe"])
        extra = encode(proven)
    return hmac.new(bytes(token), label + first + second + ids + extra, hashlib.sha256).digest()


def session_seals(
    token: bytes | None, client_nonce: bytes, server_nonce: bytes, ids: bytes
) -> tuple[Seal, Seal] | tuple[None, None]:
    """(client -> server, server -> client) seals of a session, or Nones without a token."""
    if token is None:
        return None, None
    secret = hmac.new(
        bytes(token), b"aiokvcache-session" + client_nonce + server_nonce + ids, hashlib.sha256
    ).digest()
    c2s = hmac.new(secret, b"client->server", hashlib.sha256).digest()
    s2c = hmac.new(secret, b"server->client", hashlib.sha256).digest()
    return Seal(c2s), Seal(s2c)


def _auth_mismatch(local_auth: bool, peer_auth: bool) -> str:
    if local_auth and not peer_auth:
        return "authentication failed: peer has no auth token but one is required"
    if peer_auth and not local_auth:
        return "authentication failed: peer requires an auth token but none is configured"
    return ""


# --------------------------------------------------------------------------
# The two sides


class InitiatorHandshake:
    """The side that dialled: sends HELLO, checks HELLO_REPLY, sends AUTH, checks AUTH_OK.

    Errors: ``LLMException`` (``LLM_LINK_FAILED``) for a refusal or a failed
    check (a refusal is a :class:`.peerstatus.LinkRefused`: the acceptor's
    status is only a hint, see :mod:`.peerstatus`), :class:`ProtocolError`
    for malformed messages, and whatever the socket raises. ``tx`` / ``rx`` are the
    session's seals once it exists (None before, and always without a token).
    """

    def __init__(self, local: LocalInfo, expected_cluster_id: int | None) -> None:
        self.local = local
        self.expected_cluster_id = expected_cluster_id
        self.note_key = secrets.token_bytes(NOTE_KEY_LEN)
        self.tx: Seal | None = None  # client -> server, once the nonces are known
        self.rx: Seal | None = None

    async def run(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, Any]:
        """Run the handshake on a fresh socket; returns the acceptor's HELLO_REPLY
        with its proven identity."""
        token = self.local.auth_token
        nonce = secrets.token_bytes(NONCE_LEN)
        hello = hello_payload(self.local, nonce)
        if self.expected_cluster_id is not None:
            # An acceptor that knows the field refuses a dial meant for
            # another cluster before it admits anything of ours.
            hello["expect"] = self.expected_cluster_id
        if token is None:
            # Nothing to prove either way (any acceptor may claim any id),
            # so AUTH goes with HELLO: one round trip instead of two.
            hello["eager"] = True
            mine = identity_payload(self.local, self.note_key)
            writer.write(
                pack_frame(Kind.HELLO, 0, hello) + pack_frame(Kind.AUTH, 0, {"mac": b"", **mine})
            )
            await writer.drain()
        else:
            await send_now(writer, Kind.HELLO, 0, hello)
        kind, _, reply = await read_frame(reader)
        ids = self._check_reply(kind, reply, hello)
        self.tx, self.rx = session_seals(token, nonce, reply["nonce"], ids)
        if token is not None:
            # The acceptor proved the token: it may learn our identity now.
            mine = identity_payload(self.local, self.note_key)
            client_mac = compute_mac(token, b"aiokvcache-c", reply["nonce"], nonce, ids, mine)
            await send_now(writer, Kind.AUTH, 0, {"mac": client_mac, **mine}, self.tx)
        kind, _, ok = await read_frame(reader, self.rx)
        if kind is Kind.ERROR_RESPONSE:
            # After HELLO_REPLY passed its checks (sealed, with a token): the
            # peer's status is a hint for the linker, not our verdict.
            raise handshake_refusal(PeerRefusal.from_payload(ok), checked=True)
        if kind is not Kind.AUTH_OK:
            raise ProtocolError(f"expected AUTH_OK, got {kind.name}")
        peer_identity = _check_identity(kind, ok)
        expected = compute_mac(token, b"aiokvcache-a", nonce, reply["nonce"], ids, peer_identity)
        if not hmac.compare_digest(field(ok, "mac", bytes, kind), expected):
            raise link_failed("authentication failed: bad server identity proof")
        return {**reply, **peer_identity}

    def _check_reply(self, kind: Kind, reply: dict[str, Any], hello: dict[str, Any]) -> bytes:
        """Check HELLO_REPLY (its proof included); returns the transcript."""
        if kind is Kind.ERROR_RESPONSE:
            # In HELLO_REPLY's place: the peer proved nothing, not even its id.
            raise handshake_refusal(PeerRefusal.from_payload(reply), checked=False)
        if kind is not Kind.HELLO_REPLY:
            raise ProtocolError(f"expected HELLO_REPLY, got {kind.name}")
        _check_hello(kind, reply)
        server_mac = field(reply, "mac", bytes, kind)
        if reply["version"] != PROTOCOL_VERSION:
            raise link_failed(f"peer speaks protocol version {reply['version']}")
        expected_id = self.expected_cluster_id
        if expected_id is not None and reply["cluster_id"] != expected_id:
            raise link_failed(f"it is cluster {reply['cluster_id']}, not cluster {expected_id}")
        mismatch = _auth_mismatch(self.local.auth_token is not None, reply["auth"])
        if mismatch:
            raise link_failed(mismatch)
        if reply["nonce"] == hello["nonce"]:
            raise link_failed("authentication failed: peer reflected our nonce")
        ids = transcript(hello, reply)
        expected = compute_mac(
            self.local.auth_token, b"aiokvcache-s", hello["nonce"], reply["nonce"], ids
        )
        if not hmac.compare_digest(server_mac, expected):
            raise link_failed("authentication failed: bad server proof (auth token differs)")
        return ids


class AcceptorHandshake:
    """The side that accepted: checks HELLO, sends HELLO_REPLY, checks AUTH, and
    once the connection is admitted answers AUTH_OK (:meth:`auth_ok`).

    Errors as for :class:`InitiatorHandshake`; an ``LLMException`` is a
    refusal to send back (sealed with ``tx`` once the session exists).
    ``hello_seen`` turns True once a well-formed HELLO arrived.
    """

    def __init__(self, local: LocalInfo) -> None:
        self.local = local
        self.note_key = secrets.token_bytes(NOTE_KEY_LEN)
        self.hello_seen = False
        self.tx: Seal | None = None  # server -> client, once the nonces are known
        self.rx: Seal | None = None
        # What AUTH_OK's mac covers: (client nonce, server nonce, transcript).
        self._proof: tuple[bytes, bytes, bytes] = (b"", b"", b"")
        # An eager initiator's HELLO_REPLY, held back to go out with AUTH_OK.
        self._reply = b""

    async def run(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, Any]:
        """Run the handshake up to AUTH; returns the initiator's HELLO with its
        proven identity."""
        token = self.local.auth_token
        hello = await self._read_hello(reader)
        nonce = secrets.token_bytes(NONCE_LEN)
        reply = hello_payload(self.local, nonce)
        ids = transcript(hello, reply)
        reply["mac"] = compute_mac(token, b"aiokvcache-s", hello["nonce"], nonce, ids)
        if hello.get("eager") is True and token is None:
            # Its AUTH is on the way: both answers go out in one write
            # (auth_ok); a refusal goes out after HELLO_REPLY (held_reply).
            self._reply = pack_frame(Kind.HELLO_REPLY, 0, reply)
        else:
            await send_now(writer, Kind.HELLO_REPLY, 0, reply)
        self.rx, self.tx = session_seals(token, hello["nonce"], nonce, ids)
        kind, _, auth = await read_frame(reader, self.rx)
        if kind is Kind.BYE:
            why = auth.get("reason")
            raise link_failed(f"peer gave up: {why}" if isinstance(why, str) else "peer gave up")
        if kind is not Kind.AUTH:
            raise ProtocolError(f"expected AUTH, got {kind.name}")
        mac = field(auth, "mac", bytes, kind)
        peer_identity = _check_identity(kind, auth)
        expected = compute_mac(token, b"aiokvcache-c", nonce, hello["nonce"], ids, peer_identity)
        if not hmac.compare_digest(mac, expected):
            raise link_failed("authentication failed: bad client proof (auth token differs)")
        self._proof = (hello["nonce"], nonce, ids)
        return {**hello, **peer_identity}

    async def _read_hello(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        kind, _, hello = await read_frame(reader)
        if kind is not Kind.HELLO:
            raise ProtocolError(f"expected HELLO, got {kind.name}")
        _check_hello(kind, hello)
        self.hello_seen = True
        if hello["version"] != PROTOCOL_VERSION:
            raise link_failed(f"unsupported protocol version {hello['version']}")
        if hello["cluster_id"] == self.local.cluster_id:
            raise link_failed("the peer claims our own cluster id")
        expect = hello.get("expect")
        if expect is not None:
            if not _int64_ok(expect):
                raise ProtocolError("HELLO: field 'expect' not an int")
            if expect != self.local.cluster_id:
                # Refused before the eager AUTH is read: nothing of a dial
                # meant for another cluster is admitted here.
                raise link_failed(f"it is cluster {self.local.cluster_id}, not cluster {expect}")
        mismatch = _auth_mismatch(self.local.auth_token is not None, hello["auth"])
        if mismatch:
            raise link_failed(mismatch)
        return hello

    def held_reply(self) -> bytes:
        """The HELLO_REPLY held back for an eager initiator, if not sent yet
        (once): a refusal goes out after it, so that the initiator checks
        our id and proof before it reads why."""
        reply, self._reply = self._reply, b""
        return reply

    def auth_ok(self) -> bytes:
        """The AUTH_OK frame (after the HELLO_REPLY held back for an eager
        initiator), ready for the socket. Our identity goes out only here:
        the initiator has proven the token."""
        client_nonce, server_nonce, ids = self._proof
        mine = identity_payload(self.local, self.note_key)
        mac = compute_mac(
            self.local.auth_token, b"aiokvcache-a", client_nonce, server_nonce, ids, mine
        )
        return self.held_reply() + pack_frame(Kind.AUTH_OK, 0, {"mac": mac, **mine}, self.tx)
