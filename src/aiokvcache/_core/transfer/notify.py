"""Receiver notifications: what a tagged push tells its destination, per layer.

The sender encodes one small payload per layer (:func:`payload`), which the
engine sends as an eager active message after the layer's bytes landed. The
receiver's :class:`Receiver` lives on the owner's event loop (asyncio or
trio, through its :class:`~aiokvcache._loopside.LoopSide`): the bridge hands
it each payload as the loop drains the completion queue, with the cluster id
of the link it arrived on. That id is the notification's source: the engine
attributes each message by the key in its header, which only that link's
peer was given (ext/engine.hpp ``set_note_keys``); the payload names no
sender, so no peer can speak for another.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..._loader import native
from ..._loopside import LoopSide, Waiter
from ..model.errors import LLMStatusCode, LLMTimeoutError, landed_text, make_error, param_invalid
from ..wire import control
from .planner import runs

__all__ = [
    "MAX_NOTIFY_BLOCKS",
    "MAX_QUEUED_NOTIFICATIONS",
    "MAX_TAG_RECORDS",
    "NO_BLOCKS",
    "Notification",
    "Notifications",
    "Receiver",
    "block_list",
    "decode_block_ids",
    "encode_block_ids",
    "parse_notification",
    "payload",
]

log = logging.getLogger("aiokvcache")

# Receiver state caps (see API.md, "Receiver notifications").
MAX_TAG_RECORDS = 4096
MAX_QUEUED_NOTIFICATIONS = 65536
#: Most block ids a notification carries (sender and receiver both apply it).
MAX_NOTIFY_BLOCKS = 1 << 20


class _NoBlocks:
    """Marks a notification of a contiguous (not blocks) destination."""


NO_BLOCKS = _NoBlocks()


class Notification(NamedTuple):
    """A layer of a tagged push landed in one of our caches.

    ``batch_index`` is the destination batch index for a contiguous cache;
    for a blocks destination it is the tuple of destination block ids — or
    None when that list was too long to travel with the notification (more
    than about 1000 scattered ids; runs of consecutive ids travel as runs, so
    long consecutive lists fit), or when a ``TransferConfig``'s raw address
    does not name a batch slot.
    """

    tag: str | bytes
    src_cluster_id: int
    cache_id: int
    batch_index: int | tuple[int, ...] | None
    layer: int

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """The destination block ids of a blocks push (None otherwise)."""
        return self.batch_index if isinstance(self.batch_index, tuple) else None


def payload(
    tag: str | bytes | None,
    cache_id: int,
    batch_index: int | None,
    layer: int,
    blocks: bytes | _NoBlocks | None = NO_BLOCKS,
) -> bytes:
    """One layer's notification (empty without a tag); ``blocks`` from :func:`block_list`."""
    if tag is None:
        return b""
    d: dict[str, Any] = {"t": tag, "i": cache_id, "b": batch_index, "l": layer}
    if not isinstance(blocks, _NoBlocks):
        d["k"] = blocks
    out = control.encode(d)
    if len(out) > native.MAX_PAYLOAD:
        raise param_invalid(
            f"tag is too long for a notification ({len(out)} > {native.MAX_PAYLOAD} bytes)"
        )
    return out


def block_list(tag: str | bytes | None, ids: npt.NDArray[np.int64]) -> bytes | None:
    """Destination block ids in the compact form that fits next to ``tag``, or None."""
    if tag is None:
        return None
    base = len(payload(tag, 2**63 - 1, None, 2**31 - 1, b""))
    return encode_block_ids(ids, native.MAX_PAYLOAD - base)


_FMT_IDS = 1  # little-endian uint32 ids
_FMT_RUNS = 2  # little-endian uint32 (start, count) pairs


def encode_block_ids(ids: npt.NDArray[np.int64], budget: int) -> bytes | None:
    """The shorter of two compact forms of ``ids``, or None if neither fits ``budget``."""
    if ids.size > MAX_NOTIFY_BLOCKS or (ids.size and int(ids.max()) >= 1 << 32):
        return None
    if ids.size == 0:
        return bytes([_FMT_IDS])
    starts, _, counts = runs(ids, np.arange(ids.size, dtype=np.int64))
    if starts.size * 8 < ids.size * 4:
        pairs = np.empty((starts.size, 2), dtype="<u4")
        pairs[:, 0] = starts
        pairs[:, 1] = counts
        out = bytes([_FMT_RUNS]) + pairs.tobytes()
    else:
        out = bytes([_FMT_IDS]) + ids.astype("<u4").tobytes()
    return out if len(out) <= budget else None


def decode_block_ids(data: bytes) -> tuple[int, ...]:
    """Inverse of :func:`encode_block_ids`; ``ValueError`` on malformed input."""
    if not data:
        raise ValueError("empty block list")
    fmt, body = data[0], data[1:]
    if len(body) % 4:
        raise ValueError("block list is not whole uint32s")
    words = np.frombuffer(body, dtype="<u4").astype(np.int64)
    if fmt == _FMT_IDS:
        if words.size > MAX_NOTIFY_BLOCKS:
            raise ValueError("too many block ids")
        return tuple(words.tolist())
    if fmt != _FMT_RUNS or words.size % 2:
        raise ValueError("unknown block list format")
    starts, counts = words[0::2], words[1::2]
    total = int(counts.sum())
    if total > MAX_NOTIFY_BLOCKS:
        raise ValueError("too many block ids")
    # ids = start of the run + position inside it
    first = np.cumsum(counts) - counts
    ids = np.arange(total, dtype=np.int64) + np.repeat(starts - first, counts)
    return tuple(ids.tolist())


def _int(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if type(value) is not int:  # not a bool, a float (inf, nan) nor a str
        raise control.ProtocolError(f"notification field {key!r} is not an int")
    return value


def parse_notification(src: int, data: bytes) -> Notification:
    """A linked peer's notification payload (what :func:`payload` builds),
    checked field by field: ``ProtocolError`` or ``ValueError`` otherwise."""
    d = control.decode(data)
    if not isinstance(d, dict):
        raise control.ProtocolError("not a dict")
    tag = d.get("t")
    if not isinstance(tag, (str, bytes)):
        raise control.ProtocolError("bad tag")
    where: int | tuple[int, ...] | None
    if "k" in d:
        blocks = d["k"]
        if blocks is not None and not isinstance(blocks, bytes):
            raise control.ProtocolError("a block list must be bytes")
        where = None if blocks is None else decode_block_ids(blocks)
    else:
        where = None if d.get("b") is None else _int(d, "b")
    return Notification(tag, int(src), _int(d, "i"), where, _int(d, "l"))


class _Subscription:
    """One ``notifications()`` iterator's queue: bounded, oldest dropped first.
    Any number of readers may wait on it; each note goes to one of them."""

    __slots__ = ("closed", "items", "side", "waiters")

    def __init__(self, side: LoopSide) -> None:
        self.side = side
        self.items: collections.deque[tuple[Notification, int]] = collections.deque()
        self.waiters: list[Waiter[None]] = []
        self.closed = False

    def _wake(self) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_result(None)

    def put(self, note: Notification, ep: int = 0) -> bool:
        """Queue ``note`` (``ep``: the endpoint it came on); False when the
        oldest had to go to make room."""
        kept = len(self.items) < MAX_QUEUED_NOTIFICATIONS
        if not kept:
            self.items.popleft()
        self.items.append((note, ep))
        if self.waiters:
            self._wake()
        return kept

    def end(self) -> None:
        """No more notifications (finalize, close): every reader ends once drained."""
        self.closed = True
        self._wake()

    async def get(self) -> tuple[Notification, int]:
        while not self.items:
            if self.closed:
                raise StopAsyncIteration
            w = self.side.future()
            self.waiters.append(w)
            try:
                await w
            finally:
                self.waiters.remove(w)
        return self.items.popleft()


class Notifications:
    """What ``CacheManager.notifications()`` returns: an async iterator of every
    :class:`Notification` that arrives from the call on.

    It ends when the instance is finalized. ``async with
    cm.notifications() as notes:`` (or :meth:`aclose`) stops it at once; one
    dropped without that stops when it is garbage collected. It is a plain
    object, not an async generator: dropping it needs no event loop's help.
    """

    __slots__ = ("__weakref__", "_receiver", "_sub")

    def __init__(self, receiver: Receiver, sub: _Subscription) -> None:
        self._receiver: Receiver | None = receiver
        self._sub = sub

    def __aiter__(self) -> Notifications:
        return self

    async def __anext__(self) -> Notification:
        return (await self._sub.get())[0]

    async def next_with_link(self) -> tuple[Notification, int]:
        """The next notification and the id of the endpoint of the link it
        came on (not public: the vLLM connector binds what a peer registers
        to that link, so that a message that waited while the link was made
        anew never counts for the new one). Raises ``StopAsyncIteration`` at
        the end."""
        return await self._sub.get()

    def close(self) -> None:
        """Stop receiving (idempotent)."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.unsubscribe(self._sub)
        self._sub.end()

    async def aclose(self) -> None:
        """:meth:`close`, awaitable (``contextlib.aclosing``)."""
        self.close()

    async def __aenter__(self) -> Notifications:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.unsubscribe(self._sub)


class Receiver:
    """Notifications that arrived, per tag and source, and who waits for them
    (owner loop only)."""

    def __init__(self, side: LoopSide) -> None:
        self._side = side
        # tag -> source cluster id -> layers landed
        self._records: collections.OrderedDict[str | bytes, dict[int, set[int]]] = (
            collections.OrderedDict()
        )
        self._waiters: dict[str | bytes, list[tuple[set[int], int | None, Waiter[None]]]] = {}
        self._subscribers: list[_Subscription] = []
        self._closed = False
        self.dropped_records = 0
        self.dropped_notifications = 0
        self.bad_notifications = 0

    @property
    def records(self) -> int:
        """Tags with a record."""
        return len(self._records)

    def on_notify(self, src: int, data: bytes, ep: int = 0) -> None:
        """The bridge's callback for every notification a linked peer sent:
        ``src`` is the cluster id of the link it arrived on, ``ep`` the id of
        that link's endpoint (see :meth:`Notifications.next_with_link`)."""
        try:
            note = parse_notification(src, data)
        except (control.ProtocolError, ValueError):
            self.bad_notifications += 1
            log.warning("aiokvcache: dropped a malformed notification (%d bytes)", len(data))
            return
        if note.layer >= 0:
            self._record(note)
        for q in self._subscribers:
            if not q.put(note, ep):
                self.dropped_notifications += 1

    @staticmethod
    def _landed(rec: dict[int, set[int]] | None, src: int | None) -> set[int]:
        if not rec:
            return set()
        if src is not None:
            return rec.get(src, set())
        if len(rec) == 1:
            return next(iter(rec.values()))
        return set().union(*rec.values())

    def _record(self, note: Notification) -> None:
        """Count a landed layer for its tag and source; wake who waits for it."""
        rec = self._records.get(note.tag)
        if rec is None:
            rec = {}
            self._records[note.tag] = rec
            while len(self._records) > MAX_TAG_RECORDS:
                # Oldest first, but never what someone waits for (few: skip them).
                victim = next((t for t in self._records if t not in self._waiters), None)
                if victim is None or victim == note.tag:
                    break
                del self._records[victim]
                self.dropped_records += 1
        rec.setdefault(note.src_cluster_id, set()).add(note.layer)
        for want, src, fut in self._waiters.get(note.tag, []):
            if not fut.done() and (src is None or src == note.src_cluster_id):
                if want <= self._landed(rec, src):
                    fut.set_result(None)

    async def wait_for_layers(
        self, tag: str | bytes, want: set[int], timeout: float | None, src: int | None = None
    ) -> None:
        """Return once every layer in ``want`` of ``tag`` has landed (from
        cluster ``src``, or from any linked peer when None); drop the record then."""
        if not want <= self._landed(self._records.get(tag), src):
            fut: Waiter[None] = self._side.future()
            entry = (want, src, fut)
            self._waiters.setdefault(tag, []).append(entry)
            try:
                async with self._side.deadline(timeout):
                    await fut
            except TimeoutError:
                have = frozenset(self._landed(self._records.get(tag), src) & want)
                exc = LLMTimeoutError(
                    f"wait_for_layers({tag!r}) timed out: its timeout={timeout:g} s passed; "
                    f"landed: {landed_text(have)}"
                )
                exc.landed, exc.deadline = have, f"timeout={timeout:g} s"
                raise exc from None
            finally:
                waiters = self._waiters.get(tag, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._waiters.pop(tag, None)
        if tag not in self._waiters:
            self._records.pop(tag, None)

    def discard(self, tag: str | bytes) -> None:
        """Drop what is recorded for ``tag``."""
        self._records.pop(tag, None)

    def subscribe(self) -> Notifications:
        """Every notification that arrives from now on."""
        q = _Subscription(self._side)
        if self._closed:
            q.end()
        else:
            self._subscribers.append(q)
        return Notifications(self, q)

    def unsubscribe(self, q: _Subscription) -> None:
        """Stop queueing notifications for ``q``."""
        with contextlib.suppress(ValueError):
            self._subscribers.remove(q)

    def close(self) -> None:
        """finalize(): every waiter fails with ENGINE_FINALIZED; every
        notification iterator ends once drained."""
        self._closed = True
        for q in self._subscribers:
            q.end()
        for waiters in self._waiters.values():
            for _, _, fut in waiters:
                if not fut.done():
                    fut.set_exception(
                        make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "finalized while waiting")
                    )
