"""Control plane: framed messages over asyncio TCP streams.

A frame is a 4-byte big-endian length followed by a body of at most
:data:`MAX_FRAME` bytes: protocol version (1 byte), message kind (1 byte),
request id (4 bytes, big-endian) and a payload in the small tag-length-value
encoding implemented by :func:`encode` / :func:`decode`.

The side that calls :func:`connect` (the initiator) and the side whose
:class:`ControlServer` accepted the socket (the acceptor) run a handshake::

    initiator -> HELLO        {version, cluster_id, role, nonce, auth}
    acceptor  -> HELLO_REPLY  {same fields, mac}
    initiator -> AUTH         {mac, worker_address, host_id, note_key, [probe]}
    acceptor  -> AUTH_OK      {mac, worker_address, host_id, note_key, [probe]}
                              (or ERROR_RESPONSE {status, message})

(``probe``: a probe slot of the sender's control region and the key to it,
what a probe_info request answers; optional, see handshake.identity_payload.)
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
it. The initiator names the cluster it means to reach (``expected_cluster_id``,
also sent in HELLO as ``expect``: an acceptor of another id refuses at once);
with a token it sends nothing but HELLO to an acceptor that claims another id.
An acceptor refuses a HELLO that claims its own cluster id. Without a token
nothing is sealed, and the handshake takes one round trip: AUTH goes with
HELLO (see :mod:`.handshake`); the control plane then trusts its network (see
docs/design.md, "What a reachable peer can do"). (Protocol version 3.)

After the handshake the connection is symmetric: either end sends REQUESTs (answered by RESPONSE or
ERROR_RESPONSE with the same request id) and EVENTs, and either end says
BYE before closing.

Anything malformed, unexpected or oversized closes that one connection with
a warning on the ``aiokvcache.control`` logger; it never escapes into the
event loop or the process.

This module holds the two ways in, :func:`connect` and :class:`ControlServer`;
the pieces live beside it: the payload codec (``codec``), frames and their
sealing (``frames``), the handshake (``handshake``) and the established
connection (``connection``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..model.errors import LLMException, LLMStatusCode, LLMTimeoutError, make_error
from .codec import MAX_DEPTH, MAX_ITEMS, ProtocolError, decode, encode
from .connection import (
    CLOSE_TIMEOUT,
    Closed,
    CloseReason,
    ControlConnection,
    Handler,
    abort,
    close_writer,
)
from .frames import (
    MAX_FRAME,
    MAX_MESSAGE,
    PROTOCOL_VERSION,
    Kind,
    Seal,
    error_payload,
    fmt_address,
    link_failed,
    pack_frame,
    peer_address,
    send_now,
)
from .handshake import (
    NOTE_KEY_LEN,
    AcceptorHandshake,
    InitiatorHandshake,
    LocalInfo,
    validate_local,
)
from .peerstatus import LinkRefused

__all__ = [
    "MAX_DEPTH",
    "MAX_FRAME",
    "MAX_ITEMS",
    "NOTE_KEY_LEN",
    "PROTOCOL_VERSION",
    "CloseReason",
    "Closed",
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

HANDSHAKE_TIMEOUT = 10.0
"""Seconds an accepted socket may take to finish the handshake."""

MAX_PENDING_HANDSHAKES = 128
"""Accepted sockets still in the handshake per server. When all are taken, a
new socket evicts the oldest pending one that has sent no HELLO yet (else
the oldest): idle sockets — a slowloris, a connect/close storm — cannot lock
out a peer, whose HELLO follows its connect at once."""

MAX_CONNECTIONS = 1024
"""Established connections per server; a handshake beyond that is refused."""


# --------------------------------------------------------------------------
# Initiator


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

    ``expected_cluster_id``: the cluster we mean to reach, named in HELLO
    (``expect``); an acceptor of another id is refused (LLM_LINK_FAILED).
    With a token it gets nothing past HELLO; without one, AUTH went with
    HELLO (see :mod:`.handshake`), unread by an acceptor that knows expect.

    Raises ``LLMException(LLM_LINK_FAILED)`` when the peer refuses the TCP
    connection, is unreachable, breaks the protocol or fails authentication;
    :class:`LLMTimeoutError` (status ``LLM_TIMEOUT``) when the whole attempt
    takes longer than ``timeout`` seconds; :class:`.peerstatus.LinkRefused`
    (``LLM_LINK_FAILED``, the acceptor's status only a hint) when it refuses;
    and whatever the local ``handler.on_connected`` raises.
    """
    validate_local(local)
    handshake = InitiatorHandshake(local, expected_cluster_id)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            reply = await handshake.run(reader, writer)
    except BaseException as e:
        if writer is not None:
            if isinstance(e, LLMException):
                _say_bye_and_close(writer, e.message, handshake.tx)
            else:
                abort(writer)
        failure = _link_error(e, f"{host}:{port}", timeout)
        if failure is None:
            raise
        raise failure from (None if isinstance(e, LLMException) else e)

    conn = ControlConnection.from_handshake(
        reader,
        writer,
        handler,
        reply,
        initiator=True,
        local_note_key=handshake.note_key,
        tx=handshake.tx,
        rx=handshake.rx,
    )
    try:
        handler.on_connected(conn)
    except BaseException as e:
        why = e.message if isinstance(e, LLMException) else "refused"
        conn.abandon(why)
        _say_bye_and_close(writer, why, handshake.tx)
        raise
    conn.start()
    return conn


def _link_error(exc: BaseException, target: str, timeout: float) -> LLMException | None:
    """What connect() raises for a failed handshake; None: re-raise ``exc`` itself."""
    if isinstance(exc, LinkRefused):
        return LinkRefused(f"link to {target} failed: {exc.message}", exc.peer_status)
    if isinstance(exc, LLMException):
        return make_error(exc.status_code, f"link to {target} failed: {exc.message}")
    if isinstance(exc, TimeoutError):
        return LLMTimeoutError(f"link to {target} timed out after {timeout}s")
    if isinstance(exc, ProtocolError):
        return link_failed(f"link to {target} failed: protocol error: {exc}")
    if isinstance(exc, asyncio.IncompleteReadError):
        return link_failed(
            f"link to {target} failed: peer closed the connection during the handshake"
        )
    if isinstance(exc, (ConnectionError, OSError)):
        return link_failed(f"link to {target} failed: {exc}")
    return None


def _say_bye_and_close(writer: asyncio.StreamWriter, reason: str, seal: Seal | None = None) -> None:
    # No await: connect() must not outlive its timeout for a courtesy.  The
    # transport flushes the small BYE, then closes on its own.
    try:
        writer.write(pack_frame(Kind.BYE, 0, {"reason": reason[:MAX_MESSAGE]}, seal))
    except (ConnectionError, OSError, RuntimeError):
        pass
    writer.close()


# --------------------------------------------------------------------------
# Acceptor


async def _accept(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Handler,
    handshake: AcceptorHandshake,
    timeout: float,
) -> ControlConnection | None:
    """Run the acceptor's side; returns the started connection, or None after
    logging why not (the socket is then closed)."""
    peer = fmt_address(peer_address(writer))
    hello = await _accept_handshake(reader, writer, handshake, timeout, peer)
    if hello is None:
        return None
    conn = ControlConnection.from_handshake(
        reader,
        writer,
        handler,
        hello,
        initiator=False,
        local_note_key=handshake.note_key,
        tx=handshake.tx,
        rx=handshake.rx,
    )
    try:
        handler.on_connected(conn)
    except Exception as e:
        if isinstance(e, LLMException):
            refusal = e
            _log.warning("refusing control connection from %s: %s", peer, e)
        else:
            refusal = LLMException(f"{type(e).__name__}: {e}", LLMStatusCode.LLM_FAILED)
            _log.exception("on_connected failed for %s", peer)
        conn.abandon(refusal.message)
        await _refuse(writer, refusal, handshake.tx, handshake.held_reply())
        await close_writer(writer)
        return None
    # Written now, not queued: AUTH_OK must precede anything on_connected
    # queued (and, sealed, take the session's first counter), and the writer
    # task that sends those only starts here. No await between on_connected
    # and start(), so on_closed is never lost.
    writer.write(handshake.auth_ok())
    conn.start()
    return conn


async def _accept_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handshake: AcceptorHandshake,
    timeout: float,
    peer: str,
) -> dict[str, Any] | None:
    """The initiator's proven HELLO, or None after logging why not and closing."""
    try:
        async with asyncio.timeout(timeout):
            return await handshake.run(reader, writer)
    except TimeoutError:
        _log.warning("closing control connection from %s: handshake timed out", peer)
        abort(writer)
    except LLMException as e:
        _log.warning("refusing control connection from %s: %s", peer, e.message)
        await _refuse(writer, e, handshake.tx, handshake.held_reply())
        await close_writer(writer)
    except ProtocolError as e:
        _log.warning("closing control connection from %s: %s", peer, e)
        await close_writer(writer)
    except asyncio.IncompleteReadError:
        _log.warning("closing control connection from %s: peer closed during handshake", peer)
        await close_writer(writer)
    except (ConnectionError, OSError) as e:
        _log.warning("closing control connection from %s: %r during handshake", peer, e)
        abort(writer)
    return None


async def _refuse(
    writer: asyncio.StreamWriter, exc: LLMException, seal: Seal | None = None, before: bytes = b""
) -> None:
    # Best effort: tell the initiator why before closing (sealed once a
    # session exists: the initiator then reads only sealed frames), after
    # ``before`` (a HELLO_REPLY held back for an eager initiator).
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            writer.write(before)
            await send_now(writer, Kind.ERROR_RESPONSE, 0, error_payload(exc), seal)
    except (TimeoutError, ConnectionError, OSError, ValueError):
        pass


def _buffered(reader: asyncio.StreamReader) -> bool:
    """Whether bytes wait in ``reader`` (the peer sent something)."""
    return bool(getattr(reader, "_buffer", b""))


# --------------------------------------------------------------------------
# Server


class ControlServer:
    """Listens for control connections and runs the acceptor handshake."""

    def __init__(self, local: LocalInfo, handler: Handler) -> None:
        validate_local(local)
        self._local = local
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        # Pending handshakes, oldest first: socket, handshake, reader.
        self._handshakes: dict[
            asyncio.Task[Any],
            tuple[asyncio.StreamWriter, AcceptorHandshake, asyncio.StreamReader],
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
        validate_local(local)
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
            lambda w, h, r: not h.hello_seen and not _buffered(r),
            lambda w, h, r: not h.hello_seen,
        ):
            for task, (w, h, r) in items:
                if pick(w, h, r):
                    return task
        return items[0][0]

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = fmt_address(peer_address(writer))
        if self._closing or len(self._conns) >= self.max_connections:
            _log.warning(
                "dropping control connection from %s: %s",
                peer,
                "server closing" if self._closing else "too many connections",
            )
            abort(writer)
            return
        while len(self._handshakes) >= self.max_pending:
            oldest = self._victim()
            sock, _, _ = self._handshakes.pop(oldest)
            self.evicted += 1
            _log.warning(
                "evicting the oldest pending handshake (%s) for %s: %d pending",
                fmt_address(peer_address(sock)),
                peer,
                self.max_pending,
            )
            abort(sock)
            oldest.cancel()
        task = asyncio.current_task()
        assert task is not None
        handshake = AcceptorHandshake(self._local)
        self._handshakes[task] = (writer, handshake, reader)
        try:
            conn = await _accept(reader, writer, self._handler, handshake, self.handshake_timeout)
        except asyncio.CancelledError:
            abort(writer)  # server closing mid-handshake
            return
        except Exception:  # a bug of ours; keep it to this socket
            _log.exception("control handshake with %s failed", fmt_address(peer_address(writer)))
            abort(writer)
            return
        finally:
            self._handshakes.pop(task, None)
        if conn is None or conn.fully_closed:
            return
        self._conns.add(conn)
        conn.add_done_callback(self._conns.discard)
        if self._closing:  # close() gathers self._conns after the handshakes
            conn.close_soon("server closing")

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
