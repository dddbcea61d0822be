"""The requests linked peers send each other, typed: one op, one request, one answer.

Each op is named once, in :class:`RequestOp` (its value is the string on the wire).
Each has a frozen request class and a frozen answer class, with ``encode()``
(the dict a control connection carries) and a validating ``decode()``. A
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
    """A request or an answer: a frozen value with a wire form."""

    __slots__ = ()

    def encode(self) -> dict[str, Any]:
        """The body the control connection carries."""
        raise NotImplementedError

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        """The message ``body`` carries, checked field by field."""
        raise NotImplementedError


class _Empty(Message):
    """A message without fields; whatever a peer puts in its body is ignored."""

    __slots__ = ()

    def encode(self) -> dict[str, Any]:
        return {}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        return cls()


R = TypeVar("R", bound=Message)


class Request(Message, Generic[R]):
    """A request to a linked peer; ``R`` is its answer.

    ``peer_statuses``: the statuses the peer may refuse it with and what
    each becomes for our caller; any other is LLM_FAILED (see
    :mod:`.peerstatus`)."""

    __slots__ = ()
    op: ClassVar[RequestOp]
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = COMMON

    def reply(self, body: dict[str, Any]) -> R:
        """The peer's answer to it, checked (:class:`BadReply`)."""
        raise NotImplementedError


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
class Served(_Empty):
    """The answer of a request served with nothing to say."""


@dataclass(frozen=True, slots=True)
class ProbeSlot(Message):
    """A probe slot of the answering peer (``addr``, ``PROBE_BYTES`` long) and
    the key to its whole control region (``base``, ``span``, packed ``rkey``)."""

    addr: int
    length: int
    base: int
    span: int
    rkey: bytes

    def encode(self) -> dict[str, Any]:
        return {
            "addr": self.addr,
            "len": self.length,
            "base": self.base,
            "span": self.span,
            "rkey": self.rkey,
        }

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        fields = [body.get(k) for k in ("addr", "len", "base", "span")]
        packed = body.get("rkey")
        if not all(type(v) is int for v in fields) or not isinstance(packed, bytes):
            raise BadReply("the peer sent a bad probe buffer")
        addr, length, base, span = (int(v) for v in fields)  # type: ignore[arg-type]
        if not (
            length == PROBE_BYTES
            and 0 < base
            and 0 < span <= 1 << 30
            and base <= addr
            and addr + PROBE_BYTES <= base + span < 2**64
        ):
            raise BadReply("the peer sent a bad probe buffer")
        return cls(addr, length, base, span, packed)


#: Bytes of the nonce a data-path probe puts to the peer.
PROBE_NONCE_BYTES = 16


def _nonce_and_slot(body: dict[str, Any]) -> tuple[bytes, int]:
    """A put probe's ``nonce`` and ``slot`` (both or neither: (b"", 0));
    ValueError when they are malformed."""
    nonce, slot = body.get("nonce"), body.get("slot")
    if nonce is None and slot is None:
        return b"", 0
    if not isinstance(nonce, bytes) or len(nonce) != PROBE_NONCE_BYTES or type(slot) is not int:
        raise ValueError(f"nonce must be {PROBE_NONCE_BYTES} bytes and slot an int")
    return nonce, int(slot)


@dataclass(frozen=True, slots=True)
class ProbeResult(Message):
    """How the peer's half of a data-path check went: '' or what failed.

    After a put probe (:class:`ProbeBack` with a nonce), also the nonce the
    peer put into our probe slot at ``slot``, for us to find there."""

    problem: str
    nonce: bytes = b""
    slot: int = 0

    def encode(self) -> dict[str, Any]:
        body: dict[str, Any] = {"problem": self.problem}
        if self.nonce:
            body.update(nonce=self.nonce, slot=self.slot)
        return body

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        # Any empty value means the half worked; anything else is shown as text.
        problem = body.get("problem")
        try:
            nonce, slot = _nonce_and_slot(body)
        except ValueError as exc:
            raise BadReply(f"probe result: {exc}") from None
        return cls(f"{problem}" if problem else "", nonce, slot)


@dataclass(frozen=True, slots=True)
class CacheMeta(Message):
    """One cache's metadata (:func:`.catalog.metadata`, checked on install)."""

    meta: dict[str, Any]

    def encode(self) -> dict[str, Any]:
        return self.meta

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        return cls(body)


@dataclass(frozen=True, slots=True)
class KeyedCacheMeta(Message):
    """The metadata of the cache bound to a key, and the key's batch index."""

    meta: dict[str, Any]
    batch_index: int

    def encode(self) -> dict[str, Any]:
        return {**self.meta, "batch_index": self.batch_index}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        index = body.get("batch_index")
        if type(index) is not int or not 0 <= index < 2**63:
            raise BadReply("no valid batch_index")
        return cls(body, index)


@dataclass(frozen=True, slots=True)
class CacheMetas(Message):
    """The metadata of every cache that holds one of the asked addresses."""

    caches: tuple[dict[str, Any], ...]

    def encode(self) -> dict[str, Any]:
        return {"caches": list(self.caches)}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        caches = body.get("caches")
        if not isinstance(caches, list):
            raise BadReply("caches is not a list")
        if not all(isinstance(meta, dict) for meta in caches):
            raise BadReply("a cache's metadata is not a dict")
        return cls(tuple(caches))


# ----------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class Finalizing(_Empty, Request[Served]):
    """We are finalizing: the peer breaks its link to us now."""

    op: ClassVar[RequestOp] = RequestOp.FINALIZING

    def reply(self, body: dict[str, Any]) -> Served:
        return Served.decode(body)


@dataclass(frozen=True, slots=True)
class Unlink(_Empty, Request[Served]):
    """A plain unlink: the peer answers once its jobs on the link are released."""

    op: ClassVar[RequestOp] = RequestOp.UNLINK

    def reply(self, body: dict[str, Any]) -> Served:
        return Served.decode(body)


@dataclass(frozen=True, slots=True)
class Alive(_Empty, Request[Served]):
    """Are you there? Asked when the data path fell silent: an answer on
    the control connection is something arriving from the peer too (a
    congested data path queues the keep-alives behind bulk bytes)."""

    op: ClassVar[RequestOp] = RequestOp.ALIVE

    def reply(self, body: dict[str, Any]) -> Served:
        return Served.decode(body)


@dataclass(frozen=True, slots=True)
class ProbeInfo(_Empty, Request[ProbeSlot]):
    """Ask for a probe slot and the key to the peer's control region."""

    op: ClassVar[RequestOp] = RequestOp.PROBE_INFO

    def reply(self, body: dict[str, Any]) -> ProbeSlot:
        return ProbeSlot.decode(body)


@dataclass(frozen=True, slots=True)
class ProbeBack(Request[ProbeResult]):
    """Ask the peer to probe its half of the data path, within ``timeout`` s.

    With a ``nonce``: a put probe. We put that nonce into the peer's probe
    slot at ``slot`` meanwhile; the peer answers once its own put to us is
    done and it found our nonce in its slot (see :mod:`.probe`). Without:
    the peer puts a nonce of its own and reads it back."""

    op: ClassVar[RequestOp] = RequestOp.PROBE_BACK
    timeout: float
    nonce: bytes = b""
    slot: int = 0

    def encode(self) -> dict[str, Any]:
        body: dict[str, Any] = {"timeout": self.timeout}
        if self.nonce:
            body.update(nonce=self.nonce, slot=self.slot)
        return body

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        tmo = body.get("timeout")
        if not isinstance(tmo, float) or not tmo > 0:
            raise param_invalid("probe_back: timeout must be a float > 0")
        try:
            nonce, slot = _nonce_and_slot(body)
        except ValueError as exc:
            raise param_invalid(f"probe_back: {exc}") from None
        return cls(tmo, nonce, slot)

    def reply(self, body: dict[str, Any]) -> ProbeResult:
        return ProbeResult.decode(body)


@dataclass(frozen=True, slots=True)
class Invalidate(Request[Served]):
    """Our cache ``cache_id`` goes: the peer answers once it stopped using it."""

    op: ClassVar[RequestOp] = RequestOp.INVALIDATE
    cache_id: int

    def encode(self) -> dict[str, Any]:
        return {"cache_id": self.cache_id}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        cid = body.get("cache_id")
        if not isinstance(cid, int):
            raise param_invalid("invalidate: cache_id must be int")
        return cls(cid)

    def reply(self, body: dict[str, Any]) -> Served:
        return Served.decode(body)


@dataclass(frozen=True, slots=True)
class CacheById(Request[CacheMeta]):
    """The metadata of the peer's cache ``cache_id``."""

    op: ClassVar[RequestOp] = RequestOp.CACHE_BY_ID
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = LOOKUP_STATUSES
    cache_id: int

    def encode(self) -> dict[str, Any]:
        return {"cache_id": self.cache_id}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        cid = body.get("cache_id")
        if not isinstance(cid, int):
            raise param_invalid("cache_by_id: cache_id must be int")
        return cls(cid)

    def reply(self, body: dict[str, Any]) -> CacheMeta:
        return CacheMeta.decode(body)


@dataclass(frozen=True, slots=True)
class CacheByKey(Request[KeyedCacheMeta]):
    """The peer's cache bound to ``key``, and the key's batch index."""

    op: ClassVar[RequestOp] = RequestOp.CACHE_BY_KEY
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = LOOKUP_STATUSES
    key: CacheKey

    def encode(self) -> dict[str, Any]:
        k = self.key
        return {
            "cluster_id": k.cluster_id,
            "req_id": k.req_id,
            "model_id": k.model_id,
            "prefix_id": k.prefix_id,
        }

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        try:
            key = CacheKey(
                cluster_id=body["cluster_id"],
                req_id=body["req_id"],
                model_id=body["model_id"],
                prefix_id=body["prefix_id"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise param_invalid(f"cache_by_key: bad key: {exc}") from None
        return cls(key)

    def reply(self, body: dict[str, Any]) -> KeyedCacheMeta:
        return KeyedCacheMeta.decode(body)


@dataclass(frozen=True, slots=True)
class BlocksByKey(Request[CacheMeta]):
    """The peer's blocks cache bound to ``key``."""

    op: ClassVar[RequestOp] = RequestOp.BLOCKS_BY_KEY
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = LOOKUP_STATUSES
    key: BlocksCacheKey

    def encode(self) -> dict[str, Any]:
        return {"cluster_id": self.key.cluster_id, "model_id": self.key.model_id}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        try:
            key = BlocksCacheKey(body["cluster_id"], body["model_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise param_invalid(f"blocks_by_key: bad key: {exc}") from None
        return cls(key)

    def reply(self, body: dict[str, Any]) -> CacheMeta:
        return CacheMeta.decode(body)


@dataclass(frozen=True, slots=True)
class CacheByAddr(Request[CacheMetas]):
    """The peer's caches that hold any of ``addrs`` (at most
    :data:`MAX_ADDRS_PER_REQUEST`)."""

    op: ClassVar[RequestOp] = RequestOp.CACHE_BY_ADDR
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = LOOKUP_STATUSES
    addrs: tuple[int, ...]

    def encode(self) -> dict[str, Any]:
        return {"addrs": list(self.addrs)}

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Self:
        addrs = body.get("addrs")
        if (
            not isinstance(addrs, list)
            or len(addrs) > MAX_ADDRS_PER_REQUEST
            or not all(isinstance(a, int) for a in addrs)
        ):
            raise param_invalid("cache_by_addr: addrs must be a list of ints")
        return cls(tuple(addrs))

    def reply(self, body: dict[str, Any]) -> CacheMetas:
        return CacheMetas.decode(body)


@dataclass(frozen=True, slots=True)
class Caches(_Empty, Request[CacheMetas]):
    """The metadata of the caches the peer serves (the newest
    :data:`MAX_CACHES_PER_ANSWER`): asked once a link to a same-host peer is
    up, so that its mappings are made before the first transfer."""

    op: ClassVar[RequestOp] = RequestOp.CACHES
    peer_statuses: ClassVar[Mapping[LLMStatusCode, LLMStatusCode]] = LOOKUP_STATUSES

    def reply(self, body: dict[str, Any]) -> CacheMetas:
        return CacheMetas.decode(body)


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
