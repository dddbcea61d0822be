"""The requests linked peers send each other, typed: one op, one request, one answer.

Each op is named once, in :class:`RequestOp` (its value is the string on the wire).
Each has a frozen request class and a frozen answer class that declare their
fields once (``FIELDS``, :mod:`.fields`); one ``encode()`` writes the dict a
control connection carries and one ``decode()`` checks it. A
peer's malformed request raises LLM_PARAM_INVALID, which goes back to it as
its request's error; a peer's malformed answer raises :class:`BadReply`,
which the asking side turns into its own error. A cache's metadata travels
as the dict :func:`.catalog.metadata` builds and is checked field by field
where it is installed (:func:`.catalog.install_remote`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar

from ..model.errors import LLMStatusCode, param_invalid
from ..model.types import BlocksCacheKey, CacheKey
from .control import ControlConnection
from .fields import (
    Field,
    body,
    dict_list,
    int_list,
    integer,
    key,
    nonce_and_slot,
    packed,
    positive_float,
    problem_text,
)
from .peerstatus import COMMON, PeerRefusal

__all__ = [
    "LINK_UP",
    "LOOKUPS",
    "MAX_ADDRS_PER_REQUEST",
    "MAX_CACHES_PER_ANSWER",
    "PROBE_BYTES",
    "PROBE_NONCE_BYTES",
    "Alive",
    "BadReply",
    "BlocksByKey",
    "CacheByAddr",
    "CacheById",
    "CacheByKey",
    "CacheMeta",
    "CacheMetas",
    "Caches",
    "Finalizing",
    "Invalidate",
    "KeyedCacheMeta",
    "Message",
    "ProbeBack",
    "ProbeInfo",
    "ProbeResult",
    "ProbeSlot",
    "Request",
    "RequestOp",
    "Served",
    "Unlink",
    "ask",
    "parse_request",
]

#: One probe slot (in each peer's control region): a nonce put to the peer,
#: and the nonce read back.
PROBE_BYTES = 64

#: The most addresses one cache_by_addr request may name.
MAX_ADDRS_PER_REQUEST = 4096


class RequestOp(enum.StrEnum):
    """A peer request's name on the wire."""

    FINALIZING = "finalizing"
    UNLINK = "unlink"
    ALIVE = "alive"
    PROBE_INFO = "probe_info"
    PROBE_BACK = "probe_back"
    INVALIDATE = "invalidate"
    CACHE_BY_ID = "cache_by_id"
    CACHE_BY_KEY = "cache_by_key"
    BLOCKS_BY_KEY = "blocks_by_key"
    CACHE_BY_ADDR = "cache_by_addr"
    CACHES = "caches"


#: The event the initiator of a link sends once both halves of its data path
#: worked (its own and the peer's probe_back): the acceptor's link is up then.
LINK_UP = "link_up"


#: The metadata lookups: served with no await between the cache-table check and
#: the queued answer (see ``PeerHandler.handle_request``).
LOOKUPS = frozenset(
    {
        RequestOp.CACHE_BY_ID,
        RequestOp.CACHE_BY_KEY,
        RequestOp.BLOCKS_BY_KEY,
        RequestOp.CACHE_BY_ADDR,
        RequestOp.CACHES,
    }
)

#: The most caches one ``caches`` answer names (the newest), and the most an
#: asker installs from one.
MAX_CACHES_PER_ANSWER = 32

#: What a lookup may be refused with, beyond :data:`.peerstatus.COMMON`: the
#: cache does not exist (any more), or the peer does not serve it.
LOOKUP_STATUSES: Mapping[LLMStatusCode, LLMStatusCode] = {
    **COMMON,
    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST: LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    LLMStatusCode.LLM_FEATURE_NOT_ENABLED: LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
}


class BadReply(ValueError):
    """A peer's answer that does not fit the request it answers."""


class Message:
    """A request or an answer: a frozen value with a wire form.

    Its fields are declared once, in ``FIELDS`` (:mod:`.fields`): the one
    :meth:`encode` writes them and the one :meth:`decode` checks them, and a
    body that does not fit is refused with :meth:`malformed`'s error."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    #: What an answer is, in a refusal's words.
    WHAT: ClassVar[str] = ""

    def encode(self) -> dict[str, Any]:
        """The body the control connection carries."""
        out: dict[str, Any] = {}
        for f in self.FIELDS:
            f.write(tuple(getattr(self, a) for a in f.attrs), out)
        return out

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        """The message ``body`` carries, checked field by field (anything a
        peer adds beyond the fields is ignored)."""
        values: dict[str, Any] = {}
        try:
            for f in cls.FIELDS:
                values.update(zip(f.attrs, f.read(body), strict=True))
            msg = cls(**values)
            msg.check()
        except ValueError as exc:
            raise cls.malformed(str(exc)) from None
        return msg

    def check(self) -> None:
        """Checks across fields, after each field's own (``ValueError``)."""

    @classmethod
    def malformed(cls, words: str) -> Exception:
        """The error for a body that does not fit: an answer's :class:`BadReply`."""
        return BadReply(f"{cls.WHAT}: {words}")


R = TypeVar("R", bound=Message)


class Request(Message, Generic[R]):
    """A request to a linked peer; ``R`` is its answer.

    ``peer_statuses``: the statuses the peer may refuse it with and what
    each becomes for our caller; any other is LLM_FAILED (see
    :mod:`.peerstatus`). A malformed request is LLM_PARAM_INVALID, which goes
    back to the peer as its request's error."""

    __slots__ = ()
    op: ClassVar[RequestOp]
    answer: ClassVar[type[Message]]
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = COMMON

    @classmethod
    def malformed(cls, words: str) -> Exception:
        return param_invalid(f"{cls.op.value}: {words}")

    def reply(self, body: dict[str, Any]) -> R:
        """The peer's answer to it, checked (:class:`BadReply`)."""
        return self.answer.decode(body)  # type: ignore[return-value]


async def ask(conn: ControlConnection, request: Request[R], timeout: float | None) -> R:
    """Send ``request`` on ``conn`` and return the peer's checked answer.

    Raises what :meth:`.control.ControlConnection.request` raises, but a
    peer's refusal as the error ``request.peer_statuses`` makes of it (see
    :mod:`.peerstatus`), and :class:`BadReply` for an answer that does not fit.
    """
    try:
        body = await conn.request(request.op.value, request.encode(), timeout=timeout)
    except PeerRefusal as refusal:
        what = f"cluster {conn.peer_cluster_id}'s answer to {request.op.value}"
        raise refusal.verdict(request.peer_statuses, what) from None
    return request.reply(body)


# ------------------------------------------------------------------ answers


@dataclass(frozen=True, slots=True)
class Served(Message):
    """The answer of a request served with nothing to say."""

    WHAT = "answer"


@dataclass(frozen=True, slots=True)
class ProbeSlot(Message):
    """A probe slot of the answering peer (``addr``, ``PROBE_BYTES`` long) and
    the key to its whole control region (``base``, ``span``, packed ``rkey``)."""

    FIELDS = (
        integer("addr", exact=True),
        integer("length", "len", exact=True),
        integer("base", exact=True),
        integer("span", exact=True),
        packed("rkey"),
    )
    WHAT = "the peer sent a bad probe buffer"
    addr: int
    length: int
    base: int
    span: int
    rkey: bytes

    def check(self) -> None:
        addr, base, span = self.addr, self.base, self.span
        if not (
            self.length == PROBE_BYTES
            and 0 < base
            and 0 < span <= 1 << 30
            and base <= addr
            and addr + PROBE_BYTES <= base + span < 2**64
        ):
            raise ValueError("not a probe slot inside the region it names")


#: Bytes of the nonce a data-path probe puts to the peer.
PROBE_NONCE_BYTES = 16


@dataclass(frozen=True, slots=True)
class ProbeResult(Message):
    """How the peer's half of a data-path check went: '' or what failed.

    After a put probe (:class:`ProbeBack` with a nonce), also the nonce the
    peer put into our probe slot at ``slot``, for us to find there."""

    FIELDS = (problem_text("problem"), nonce_and_slot(PROBE_NONCE_BYTES))
    WHAT = "probe result"
    problem: str
    nonce: bytes = b""
    slot: int = 0


@dataclass(frozen=True, slots=True)
class CacheMeta(Message):
    """One cache's metadata (:func:`.catalog.metadata`, checked on install)."""

    FIELDS = (body("meta"),)
    WHAT = "cache metadata"
    meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class KeyedCacheMeta(Message):
    """The metadata of the cache bound to a key, and the key's batch index."""

    FIELDS = (body("meta"), integer("batch_index", exact=True, lo=0, hi=2**63))
    WHAT = "keyed cache metadata"
    meta: dict[str, Any]
    batch_index: int


@dataclass(frozen=True, slots=True)
class CacheMetas(Message):
    """The metadata of every cache that holds one of the asked addresses."""

    FIELDS = (dict_list("caches"),)
    WHAT = "cache metadata list"
    caches: tuple[dict[str, Any], ...]


# ----------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class Finalizing(Request[Served]):
    """We are finalizing: the peer breaks its link to us now."""

    op = RequestOp.FINALIZING
    answer = Served


@dataclass(frozen=True, slots=True)
class Unlink(Request[Served]):
    """A plain unlink: the peer answers once its jobs on the link are released."""

    op = RequestOp.UNLINK
    answer = Served


@dataclass(frozen=True, slots=True)
class Alive(Request[Served]):
    """Are you there? Asked when the data path fell silent: an answer on
    the control connection is something arriving from the peer too (a
    congested data path queues the keep-alives behind bulk bytes)."""

    op = RequestOp.ALIVE
    answer = Served


@dataclass(frozen=True, slots=True)
class ProbeInfo(Request[ProbeSlot]):
    """Ask for a probe slot and the key to the peer's control region."""

    op = RequestOp.PROBE_INFO
    answer = ProbeSlot


@dataclass(frozen=True, slots=True)
class ProbeBack(Request[ProbeResult]):
    """Ask the peer to probe its half of the data path, within ``timeout`` s.

    With a ``nonce``: a put probe. We put that nonce into the peer's probe
    slot at ``slot`` meanwhile; the peer answers once its own put to us is
    done and it found our nonce in its slot (see :mod:`.probe`). Without:
    the peer puts a nonce of its own and reads it back."""

    op = RequestOp.PROBE_BACK
    answer = ProbeResult
    FIELDS = (positive_float("timeout"), nonce_and_slot(PROBE_NONCE_BYTES))
    timeout: float
    nonce: bytes = b""
    slot: int = 0


@dataclass(frozen=True, slots=True)
class Invalidate(Request[Served]):
    """Our cache ``cache_id`` goes: the peer answers once it stopped using it."""

    op = RequestOp.INVALIDATE
    answer = Served
    FIELDS = (integer("cache_id"),)
    cache_id: int


@dataclass(frozen=True, slots=True)
class CacheById(Request[CacheMeta]):
    """The metadata of the peer's cache ``cache_id``."""

    op = RequestOp.CACHE_BY_ID
    answer = CacheMeta
    peer_statuses = LOOKUP_STATUSES
    FIELDS = (integer("cache_id"),)
    cache_id: int


@dataclass(frozen=True, slots=True)
class CacheByKey(Request[KeyedCacheMeta]):
    """The peer's cache bound to ``key``, and the key's batch index."""

    op = RequestOp.CACHE_BY_KEY
    answer = KeyedCacheMeta
    peer_statuses = LOOKUP_STATUSES
    FIELDS = (key("key", CacheKey, ("cluster_id", "req_id", "model_id", "prefix_id")),)
    key: CacheKey


@dataclass(frozen=True, slots=True)
class BlocksByKey(Request[CacheMeta]):
    """The peer's blocks cache bound to ``key``."""

    op = RequestOp.BLOCKS_BY_KEY
    answer = CacheMeta
    peer_statuses = LOOKUP_STATUSES
    FIELDS = (key("key", BlocksCacheKey, ("cluster_id", "model_id")),)
    key: BlocksCacheKey


@dataclass(frozen=True, slots=True)
class CacheByAddr(Request[CacheMetas]):
    """The peer's caches that hold any of ``addrs`` (at most
    :data:`MAX_ADDRS_PER_REQUEST`)."""

    op = RequestOp.CACHE_BY_ADDR
    answer = CacheMetas
    peer_statuses = LOOKUP_STATUSES
    FIELDS = (int_list("addrs", MAX_ADDRS_PER_REQUEST),)
    addrs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Caches(Request[CacheMetas]):
    """The metadata of the caches the peer serves (the newest
    :data:`MAX_CACHES_PER_ANSWER`): asked once a link to a same-host peer is
    up, so that its mappings are made before the first transfer."""

    op = RequestOp.CACHES
    answer = CacheMetas
    peer_statuses = LOOKUP_STATUSES


_REQUESTS: dict[str, type[Request[Any]]] = {
    cls.op.value: cls
    for cls in (
        Finalizing,
        Unlink,
        Alive,
        ProbeInfo,
        ProbeBack,
        Invalidate,
        CacheById,
        CacheByKey,
        BlocksByKey,
        CacheByAddr,
        Caches,
    )
}


def parse_request(op: str, body: dict[str, Any]) -> Request[Any]:
    """A peer's request, checked; LLM_PARAM_INVALID for an unknown op or a bad body."""
    cls = _REQUESTS.get(op)
    if cls is None:
        raise param_invalid(f"unknown request {op!r}")
    return cls.decode(body)
