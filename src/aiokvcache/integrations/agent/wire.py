"""The vLLM connector's messages on the wire: one dataclass per message.

A message travels as an aiokvcache notification tag (or a push's tag): a JSON
list ``["aiokv", op, field...]``, with no spaces, the fields in the order the
dataclass declares them. :func:`decode` checks what a message must hold to be
routed (its op and its field count) and raises :class:`BadMessage`
otherwise. Fields a state machine checks itself (a claim's key, deadline and
range; a registration's parts and runs) stay as the peer sent them, typed
``Any``: those machines answer a bad value (a refusal, a ``pushfail``), which a
dropped message would not.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .handoff import BadMessage

__all__ = [
    "PREFIX",
    "Cancel",
    "Claim",
    "Done",
    "Free",
    "Grant",
    "Layer",
    "Message",
    "Op",
    "PushFail",
    "Pushed",
    "Refused",
    "Reg",
    "Renew",
    "decode",
    "parse",
]

#: How every connector tag starts (others are not the connector's: ignored).
PREFIX = '["aiokv"'


class Op(enum.StrEnum):
    """What a message is (its second list item)."""

    CLAIM = "claim"  # D -> P: may I read a request's blocks until my deadline?
    GRANT = "grant"  # P -> D: yes, held until done or that deadline
    REFUSED = "refused"  # P -> D: no
    DONE = "done"  # D -> P: this claim's read ended (quiescent)
    FREE = "free"  # D -> P: this side will not read the request
    RENEW = "renew"  # D -> P: this side still holds the request's params: keep its blocks
    REG = "reg"  # D -> P: one part of a push transfer's destination blocks
    KV = "kv"  # P -> D: a push's tag
    PUSHED = "pushed"  # P -> D: every layer landed
    PUSHFAIL = "pushfail"  # P -> D: the transfer ended without that (and is quiescent)
    CANCEL = "cancel"  # D -> P: stop pushing


def _str(args: list[Any], i: int, default: str) -> str:
    return str(args[i]) if len(args) > i else default


def _count(args: list[Any], i: int) -> int:
    """Field ``i`` as a count in ``[0, 2**63)``, or -1 (missing, or anything else)."""
    v = args[i] if len(args) > i else None
    return v if type(v) is int and 0 <= v < 2**63 else -1


@dataclass(frozen=True)
class _Message:
    OP: ClassVar[Op]
    #: Fields a peer must send (those after it have defaults).
    ARITY: ClassVar[int]

    def encode(self) -> str:
        """The tag: ``["aiokv", op, field...]``, compact JSON."""
        values = [getattr(self, f.name) for f in fields(self)]
        return json.dumps(["aiokv", str(self.OP), *values], separators=(",", ":"))


@dataclass(frozen=True)
class Claim(_Message):
    """D asks to read blocks ``[first, last)`` of request ``rid``'s ``n``
    blocks (whose list hashes to ``digest``) for ``ttl`` seconds, with the
    request's grant ``key``, valid until ``until_ms``; ``nonce`` names the claim.
    ``readers``: how many decode workers read the request from this prefill
    worker (a decode of a larger tensor-parallel size: each reads its heads);
    the prefill holds the blocks until that many are done. ``heads``: the KV
    heads the decode takes each of this worker's blocks to hold (the prefill
    refuses another number)."""

    OP = Op.CLAIM
    ARITY = 9
    rid: str
    nonce: str
    key: Any
    ttl: Any
    first: Any
    last: Any
    n: Any
    digest: Any
    until_ms: Any
    readers: Any = 1
    heads: Any = 1

    @classmethod
    def from_args(cls, a: list[Any]) -> Claim:
        return cls(str(a[0]), str(a[1]), *a[2:9], *a[9:11])


@dataclass(frozen=True)
class Grant(_Message):
    """P granted claim ``nonce`` of ``rid``."""

    OP = Op.GRANT
    ARITY = 2
    rid: str
    nonce: str

    @classmethod
    def from_args(cls, a: list[Any]) -> Grant:
        return cls(str(a[0]), str(a[1]))


@dataclass(frozen=True)
class Refused(_Message):
    """P refused claim ``nonce`` of ``rid``, for ``why``."""

    OP = Op.REFUSED
    ARITY = 2
    rid: str
    nonce: str
    why: str = "refused"

    @classmethod
    def from_args(cls, a: list[Any]) -> Refused:
        return cls(str(a[0]), str(a[1]), _str(a, 2, "refused"))


@dataclass(frozen=True)
class Done(_Message):
    """D's claim ``nonce`` of ``rid`` ended: its read is quiescent."""

    OP = Op.DONE
    ARITY = 2
    rid: str
    nonce: str

    @classmethod
    def from_args(cls, a: list[Any]) -> Done:
        return cls(str(a[0]), str(a[1]))


@dataclass(frozen=True)
class _HandOver(_Message):
    """A decode's word about the hand-over of ``rid`` (its ``n`` blocks
    hashing to ``digest``), proven by the request's grant ``key``, valid
    until ``until_ms``."""

    ARITY = 5
    rid: str
    key: Any
    n: Any
    digest: Any
    until_ms: Any

    @classmethod
    def from_args(cls, a: list[Any]) -> Any:
        return cls(str(a[0]), *a[1:5])


@dataclass(frozen=True)
class Free(_HandOver):
    """D will not read ``rid``: P frees its blocks once no claim reads them."""

    OP = Op.FREE


@dataclass(frozen=True)
class Renew(_HandOver):
    """D still holds the params of ``rid`` and will claim it: P keeps its
    blocks another lease, up to the key's expiry."""

    OP = Op.RENEW


@dataclass(frozen=True)
class Reg(_Message):
    """Part ``part`` of ``parts`` of D's block ids for push transfer ``xid``,
    as ``[start, count]`` ``runs``, for P's blocks ``first``, ``first + 1``...;
    P's pushes end within ``ttl`` seconds. ``nonce`` names this load (one
    transfer may feed several: vLLM's ``n > 1`` children, a proxy's retry),
    ``key`` is the transfer's push key from the request's params (only a
    decode handed them may register), ``layout`` D's KV layout digest.

    Between instances of different tensor-parallel sizes (a head-major
    layout): ``heads`` is ``[p_heads, p_head, count, d_heads, d_head]``, P
    pushes heads ``[p_head, p_head + count)`` of its blocks (which D takes to
    hold ``p_heads``) into heads ``[d_head, d_head + count)`` of D's blocks
    (of ``d_heads``); ``None``: whole blocks, one size. ``readers``: how many
    decode workers register for the transfer with this prefill worker (each
    its heads); P takes loads until that many decode workers' ended.
    ``groups``: a model of several KV cache groups (vLLM's hybrid
    allocator): ``[first, count]`` of each group's positions, whose block
    ids ``runs`` lists one group after another (``None``: one group, from
    ``first``). ``tokens``: the tokens D takes the request to hold (it
    computes from there on): P fails a load that takes more than it
    computed (``None``: not said)."""

    OP = Op.REG
    ARITY = 9
    xid: str
    part: Any
    parts: Any
    runs: Any
    first: Any
    ttl: Any
    nonce: str
    key: Any
    layout: Any
    heads: Any = None
    readers: Any = 1
    groups: Any = None
    tokens: Any = None

    @classmethod
    def from_args(cls, a: list[Any]) -> Reg:
        return cls(str(a[0]), a[1], a[2], a[3], a[4], a[5], str(a[6]), a[7], a[8], *a[9:13])


@dataclass(frozen=True)
class Layer(_Message):
    """The tag of a push of transfer ``xid`` (D counts them)."""

    OP = Op.KV
    ARITY = 0
    xid: str = ""

    @classmethod
    def from_args(cls, a: list[Any]) -> Layer:
        return cls(_str(a, 0, ""))


@dataclass(frozen=True)
class Pushed(_Message):
    """Every layer of push transfer ``xid`` landed for load ``nonce``:
    ``nbytes`` and ``segments`` are what P's push calls moved, from their
    records (-1: not sent, or not a count; they feed the decode side's
    metrics only)."""

    OP = Op.PUSHED
    ARITY = 2
    xid: str
    nonce: str
    nbytes: int = -1
    segments: int = -1

    @classmethod
    def from_args(cls, a: list[Any]) -> Pushed:
        return cls(str(a[0]), str(a[1]), _count(a, 2), _count(a, 3))


@dataclass(frozen=True)
class PushFail(_Message):
    """Push transfer ``xid`` ended for load ``nonce`` without landing, for
    ``why``; P's pushes to that load are quiescent."""

    OP = Op.PUSHFAIL
    ARITY = 2
    xid: str
    nonce: str
    why: str = "failed"

    @classmethod
    def from_args(cls, a: list[Any]) -> PushFail:
        return cls(str(a[0]), str(a[1]), _str(a, 2, "failed"))


@dataclass(frozen=True)
class Cancel(_Message):
    """D gave load ``nonce`` of push transfer ``xid`` up: P stops pushing to
    it and answers ``pushfail`` once those pushes are quiescent."""

    OP = Op.CANCEL
    ARITY = 2
    xid: str
    nonce: str

    @classmethod
    def from_args(cls, a: list[Any]) -> Cancel:
        return cls(str(a[0]), str(a[1]))


Message = Claim | Grant | Refused | Done | Free | Renew | Reg | Layer | Pushed | PushFail | Cancel

_BY_OP: dict[Op, Any] = {
    cls.OP: cls
    for cls in (Claim, Grant, Refused, Done, Free, Renew, Reg, Layer, Pushed, PushFail, Cancel)
}


def parse(op: Any, args: list[Any]) -> Message:
    """The message ``op`` with fields ``args``; :class:`BadMessage` for an
    unknown op or too few fields (fields beyond the message's are ignored)."""
    try:
        cls = _BY_OP[Op(str(op))]
    except ValueError:
        raise BadMessage(f"unknown message {str(op)!r}") from None
    if len(args) < cls.ARITY:
        raise BadMessage(f"a {cls.OP} message of {len(args)} fields (needs {cls.ARITY})")
    msg: Message = cls.from_args(args)
    return msg


def decode(tag: str) -> Message:
    """The message a tag starting with :data:`PREFIX` carries."""
    msg = json.loads(tag)
    if not isinstance(msg, list) or len(msg) < 2:
        raise BadMessage("a connector message without an op")
    return parse(msg[1], msg[2:])
