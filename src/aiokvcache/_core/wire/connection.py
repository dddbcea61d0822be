"""An established control connection: requests, responses, events and BYE.

After the handshake the connection is symmetric: either end sends REQUESTs
(answered by RESPONSE or ERROR_RESPONSE with the same request id) and
EVENTs, and either end says BYE before closing. Anything malformed,
unexpected or oversized closes that one connection with a warning on the
``aiokvcache.control`` logger; it never escapes into the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from typing import Any, Protocol

from ..model.errors import LLMException, LLMStatusCode, LLMTimeoutError
from .codec import ProtocolError
from .frames import (
    MAX_MESSAGE,
    Kind,
    Seal,
    error_payload,
    field,
    fmt_address,
    frame_body,
    link_failed,
    peer_address,
    read_frame,
    to_wire,
)
from .peerstatus import PeerRefusal

__all__ = [
    "CLOSE_TIMEOUT",
    "MAX_BACKLOG",
    "MAX_INFLIGHT_REQUESTS",
    "CloseReason",
    "Closed",
    "ControlConnection",
    "Handler",
    "abort",
    "close_writer",
]

_log = logging.getLogger("aiokvcache.control")

CLOSE_TIMEOUT = 1.0
"""Seconds close() waits for queued frames / socket shutdown before aborting."""

MAX_INFLIGHT_REQUESTS = 1024
"""Incoming requests served at once per connection; more get LLM_LINK_BUSY."""

MAX_BACKLOG = 32 << 20
"""Bytes of frames queued for one connection's socket at most. A peer that
stops reading while it keeps asking (or while we keep pinging it) would
otherwise grow our memory without bound: past this the connection closes."""


class CloseReason(enum.Enum):
    """What closed a control connection. The value is how the reason's text
    begins (for ``LOCAL`` the text is the detail alone)."""

    #: This side closed it: :meth:`ControlConnection.close`, a server closing.
    LOCAL = "closed locally"
    #: The peer said BYE; the detail is the reason it gave, if any.
    PEER_CLOSED = "peer closed"
    #: The peer left more than ``MAX_BACKLOG`` bytes of our frames unread.
    PEER_NOT_READING = "the peer does not read its connection"
    #: The peer's socket reached EOF without a BYE.
    EOF = "connection lost (EOF)"
    #: Reading the socket failed; the detail is the error.
    CONNECTION_LOST = "connection lost"
    #: Writing the socket failed; the detail is the error.
    WRITE_FAILED = "write failed"
    #: The peer broke the protocol; the detail says how.
    PROTOCOL_ERROR = "protocol error"
    #: A bug of ours in the reader; the detail is the error.
    INTERNAL_ERROR = "internal error"


class Closed(str):
    """Why a control connection closed: a :class:`CloseReason` and its detail.

    It is a ``str`` holding the reason's text (what logs, errors and the BYE
    to the peer read), so a handler may print it as it is; decisions should
    look at ``kind`` and ``detail`` instead of parsing the text.
    """

    kind: CloseReason
    detail: str | None

    def __new__(cls, kind: CloseReason, detail: str | None = None) -> Closed:
        if kind is CloseReason.LOCAL:
            text = detail or ""
        elif detail is None:
            text = kind.value
        else:
            text = f"{kind.value}: {detail}"
        self = super().__new__(cls, text)
        self.kind = kind
        self.detail = detail
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Closed, (self.kind, self.detail))

    def __repr__(self) -> str:
        return f"Closed({self.kind.name}, {self.detail!r})"


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

    def on_closed(self, conn: ControlConnection, reason: Closed) -> None:
        """Called exactly once for every connection reported by on_connected."""


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
    #: The probe slot the peer gave in its handshake (a probe_info answer's
    #: body, unchecked), until its first probe takes it; None: ask for one.
    peer_probe: Any
    #: The peer's handshake carried a probe slot: it runs its half of a new
    #: link's data path beside ours and says link_up once both worked (a
    #: peer without one asks for our half only after its own worked).
    peer_confirms_up: bool

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
        peer_probe: Any = None,
        peer_confirms_up: bool = False,
        tx: Seal | None = None,
        rx: Seal | None = None,
    ) -> None:
        self.peer_cluster_id = peer_cluster_id
        self.peer_host_id = peer_host_id
        self.peer_role = peer_role
        self.peer_worker_address = peer_worker_address
        self.local_note_key = local_note_key
        self.peer_note_key = peer_note_key
        self.peer_probe = peer_probe
        self.peer_confirms_up = peer_confirms_up
        self.peer_address = peer_address(writer)
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
    def from_handshake(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        peer: dict[str, Any],
        *,
        initiator: bool,
        local_note_key: bytes,
        tx: Seal | None,
        rx: Seal | None,
    ) -> ControlConnection:
        """A connection, not yet started, to the peer a handshake checked: ``peer`` is
        its HELLO (or HELLO_REPLY) with its proven identity."""
        return cls(
            reader,
            writer,
            handler,
            initiator=initiator,
            peer_cluster_id=peer["cluster_id"],
            peer_role=peer["role"],
            peer_worker_address=peer["worker_address"],
            peer_host_id=peer["host_id"],
            local_note_key=local_note_key,
            peer_note_key=peer["note_key"],
            peer_probe=peer.get("probe"),
            peer_confirms_up="probe" in peer,
            tx=tx,
            rx=rx,
        )

    def __repr__(self) -> str:
        side = "initiator" if self.initiator else "acceptor"
        state = "closed" if self._closing else "open"
        return (
            f"<ControlConnection {side} peer={fmt_address(self.peer_address)} "
            f"cluster={self.peer_cluster_id} {state}>"
        )

    @property
    def closed(self) -> bool:
        """True once close has begun (locally or because the peer went away)."""
        return self._closing

    @property
    def fully_closed(self) -> bool:
        """True once the connection is fully closed (on_closed, if owed, has run)."""
        return self._closed_event.is_set()

    def add_done_callback(self, callback: Callable[[ControlConnection], None]) -> None:
        """Call ``callback(self)`` once the connection is fully closed."""
        self._done_callbacks.append(callback)

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
        ``timeout`` seconds, :class:`.peerstatus.PeerRefusal` when the peer
        answered with an error (its status is data: ``wire.ask`` decides what
        it means), or ``LLMException(LLM_PARAM_INVALID)`` if ``op`` / ``body``
        cannot be encoded.  Cancellation or timeout leaves the connection usable.
        """
        if self._closing:
            raise LLMException(
                f"control connection to {fmt_address(self.peer_address)} is closed",
                LLMStatusCode.LLM_LINK_FAILED,
            )
        rid = self._alloc_id()
        frame = self._pack_user(Kind.REQUEST, rid, op, body)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._enqueue(frame)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise LLMTimeoutError(
                f"request {op!r} to {fmt_address(self.peer_address)} timed out after {timeout}s"
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
        self._enqueue(self._pack_user(Kind.EVENT, 0, op, body))

    def _enqueue(self, body: bytes) -> None:
        """Queue a frame body for the write loop; past MAX_BACKLOG, close."""
        if self._closing:
            return
        if self._backlog + len(body) > MAX_BACKLOG:
            _log.warning(
                "closing control connection to %s: it does not read what we send (%d bytes queued)",
                fmt_address(self.peer_address),
                self._backlog,
            )
            self._begin_close(Closed(CloseReason.PEER_NOT_READING), send_bye=False)
            return
        self._backlog += len(body)
        self._outq.put_nowait(body)

    def _pack_user(self, kind: Kind, rid: int, op: str, body: dict[str, Any]) -> bytes:
        if not isinstance(op, str) or not isinstance(body, dict):
            raise LLMException("op must be str and body a dict", LLMStatusCode.LLM_PARAM_INVALID)
        try:
            return frame_body(kind, rid, {"op": op, "body": body})
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

    def start(self) -> None:
        """Start reading and writing: the handshake is done and on_connected
        accepted the connection, so from here on_closed is owed."""
        self._reported = True
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())
        self._writer_task = asyncio.get_running_loop().create_task(self._write_loop())

    def abandon(self, reason: str) -> None:
        """Give up a connection that on_connected refused, before :meth:`start`.

        Nothing runs and on_closed is not owed, but requests queued by
        on_connected must not wait forever: they fail with ``reason``.
        """
        self._closing = True
        self._fail_pending(f"link to {fmt_address(self.peer_address)} refused: {reason}")
        self._closed_event.set()

    def _fail_pending(self, message: str) -> None:
        """Fail every request still waiting for its response (LLM_LINK_FAILED)."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(link_failed(message))
        self._pending.clear()

    async def close(self, reason: str = "closed") -> None:
        """Say BYE (best effort), close the socket and fail pending requests.

        Idempotent; returns once on_closed has run.  Never hangs on a peer
        that stopped reading (queued frames get ``CLOSE_TIMEOUT`` seconds).
        """
        self._begin_close(Closed(CloseReason.LOCAL, reason), send_bye=True)
        if self._close_task is not None:
            await asyncio.shield(self._close_task)
        else:
            await self._closed_event.wait()

    async def wait_closed(self) -> None:
        """Wait until the connection is fully closed (on_closed has run)."""
        await self._closed_event.wait()

    def close_soon(self, reason: str) -> None:
        """Begin :meth:`close` without waiting for it."""
        self._begin_close(Closed(CloseReason.LOCAL, reason), send_bye=True)

    def _begin_close(self, reason: Closed, *, send_bye: bool) -> None:
        if self._close_task is not None or self._closed_event.is_set():
            return
        self._closing = True
        self._close_task = asyncio.get_running_loop().create_task(
            self._finish_close(reason, send_bye)
        )

    async def _finish_close(self, reason: Closed, send_bye: bool) -> None:
        try:
            peer = fmt_address(self.peer_address)
            self._fail_pending(f"control connection to {peer} closed: {reason}")
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
                            frame_body(Kind.BYE, 0, {"reason": str(reason)[:MAX_MESSAGE]})
                        )
                self._outq.put_nowait(None)
                done, _ = await asyncio.wait({self._writer_task}, timeout=CLOSE_TIMEOUT)
                if not done:
                    self._writer_task.cancel()
                tasks.append(self._writer_task)
            await close_writer(self._writer)
            await asyncio.gather(*tasks, return_exceptions=True)
        except Exception:
            _log.exception(
                "error while closing control connection to %s", fmt_address(self.peer_address)
            )
        finally:
            try:
                if self._reported:
                    self._reported = False
                    self._handler.on_closed(self, reason)
            except Exception:
                _log.exception("on_closed handler failed for %s", fmt_address(self.peer_address))
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
                self._writer.write(to_wire(body, self._tx))
                # Coalesce whatever is queued already into one drain.
                while not self._outq.empty():
                    more = self._outq.get_nowait()
                    if more is None:
                        await self._writer.drain()
                        return
                    self._backlog -= len(more)
                    self._writer.write(to_wire(more, self._tx))
                await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._begin_close(Closed(CloseReason.WRITE_FAILED, repr(e)), send_bye=False)

    async def _read_loop(self) -> None:
        peer = fmt_address(self.peer_address)
        send_bye = True
        try:
            while True:
                kind, rid, payload = await read_frame(self._reader, self._rx)
                if kind is Kind.REQUEST:
                    self._dispatch(rid, payload)
                elif kind is Kind.RESPONSE:
                    body = field(payload, "body", dict, kind)
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(body)
                elif kind is Kind.ERROR_RESPONSE:
                    exc = PeerRefusal.from_payload(payload)  # data: see .peerstatus
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                elif kind is Kind.EVENT:
                    op = field(payload, "op", str, kind)
                    body = field(payload, "body", dict, kind)
                    try:
                        self._handler.on_event(self, op, body)
                    except Exception:
                        _log.exception("on_event handler failed for %r from %s", op, peer)
                elif kind is Kind.BYE:
                    why = payload.get("reason")
                    reason = Closed(CloseReason.PEER_CLOSED, why if isinstance(why, str) else None)
                    send_bye = False
                    break
                else:
                    raise ProtocolError(f"unexpected {kind.name} after handshake")
        except asyncio.IncompleteReadError:
            reason, send_bye = Closed(CloseReason.EOF), False
        except ProtocolError as e:
            _log.warning("closing control connection with %s: %s", peer, e)
            reason = Closed(CloseReason.PROTOCOL_ERROR, str(e))
        except (ConnectionError, OSError) as e:
            reason, send_bye = Closed(CloseReason.CONNECTION_LOST, repr(e)), False
        except Exception as e:  # a bug of ours; keep it to this connection
            _log.exception("control connection reader for %s failed", peer)
            reason = Closed(CloseReason.INTERNAL_ERROR, repr(e))
        self._begin_close(reason, send_bye=send_bye)

    def _dispatch(self, rid: int, payload: dict[str, Any]) -> None:
        op = field(payload, "op", str, Kind.REQUEST)
        body = field(payload, "body", dict, Kind.REQUEST)
        if rid in self._serving:
            raise ProtocolError(f"request id {rid} reused while outstanding")
        if len(self._serving) >= MAX_INFLIGHT_REQUESTS:
            busy = LLMException("too many outstanding requests", LLMStatusCode.LLM_LINK_BUSY)
            self._enqueue(frame_body(Kind.ERROR_RESPONSE, rid, error_payload(busy)))
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
                frame = frame_body(Kind.RESPONSE, rid, {"body": result})
            except LLMException as e:
                frame = frame_body(Kind.ERROR_RESPONSE, rid, error_payload(e))
            except Exception as e:
                _log.exception(
                    "handler for request %r from %s failed", op, fmt_address(self.peer_address)
                )
                failed = LLMException(f"{type(e).__name__}: {e}", LLMStatusCode.LLM_FAILED)
                frame = frame_body(Kind.ERROR_RESPONSE, rid, error_payload(failed))
            self._enqueue(frame)
        except asyncio.CancelledError:
            pass  # the connection is closing; nobody is left to answer
        except Exception:  # cannot happen: error frames always encode
            _log.exception(
                "answering request %r from %s failed", op, fmt_address(self.peer_address)
            )
        finally:
            self._serving.discard(rid)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a socket, waiting at most ``CLOSE_TIMEOUT`` before aborting it; never raises."""
    writer.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
    except Exception:
        pass  # the socket is gone either way; close must not fail


def abort(writer: asyncio.StreamWriter) -> None:
    """Drop a socket at once, unsent bytes and all."""
    writer.transport.abort()
