"""What a status in a peer's error frame means here: data, never our verdict.

A peer's ERROR_RESPONSE carries a status and a message, and the peer chose
both. This module is the one place that decides what they become:

* **In a handshake** (:func:`handshake_refusal`) a refusal is always
  ``LLM_LINK_FAILED``. One that arrived only after the acceptor passed
  HELLO_REPLY's checks (the cluster id we dialled and, with a token, the
  proof of it; sealed then) keeps the peer's status as a hint,
  :attr:`LinkRefused.peer_status`, which the linker weighs against its own
  state: an acceptor that says it still holds a link to us is asked again
  until the call's deadline. The call's status is never the peer's.
* **Answering a request** (:meth:`PeerRefusal.verdict`), a status reaches
  the caller only as the request's table says (``wire.Request.peer_statuses``:
  the statuses a peer may report for that request, and what each becomes
  here); anything else, success-class statuses included, is ``LLM_FAILED``
  with the peer's status in the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..model.errors import LLMException, LLMStatusCode, make_error
from .frames import Kind, field

__all__ = ["COMMON", "LinkRefused", "PeerRefusal", "handshake_refusal"]

#: What any request's refusal may say: the peer is too busy (the caller may
#: try again), or it is going / holds no link for this connection (the link
#: is of no use: LINK_FAILED).
COMMON: Mapping[LLMStatusCode, LLMStatusCode] = {
    LLMStatusCode.LLM_LINK_BUSY: LLMStatusCode.LLM_LINK_BUSY,
    LLMStatusCode.LLM_ENGINE_FINALIZED: LLMStatusCode.LLM_LINK_FAILED,
    LLMStatusCode.LLM_NOT_YET_LINK: LLMStatusCode.LLM_LINK_FAILED,
}

_MAX_SHOWN = 512  # characters of a peer's message quoted in ours


def _name(status: int) -> str:
    try:
        return LLMStatusCode(status).name
    except ValueError:
        return f"status {status}"


class PeerRefusal(Exception):
    """A peer's ERROR_RESPONSE, as it said it: ``status`` (any int) and
    ``message``. Not an :class:`LLMException`: nothing may raise it to a
    caller before :meth:`verdict` or :func:`handshake_refusal` read it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> PeerRefusal:
        """The refusal an ERROR_RESPONSE's payload carries; ``ProtocolError``
        if it is malformed."""
        status = field(payload, "status", int, Kind.ERROR_RESPONSE)
        return cls(status, field(payload, "message", str, Kind.ERROR_RESPONSE))

    def __str__(self) -> str:
        return f"{_name(self.status)}: {self.message[:_MAX_SHOWN]}"

    def verdict(
        self, allowed: Mapping[LLMStatusCode, LLMStatusCode], what: str
    ) -> LLMException:
        """Our error for this refusal of ``what`` (say "cluster 2's answer to
        cache_by_id"): the status ``allowed`` maps the peer's to, else LLM_FAILED."""
        try:
            ours = allowed.get(LLMStatusCode(self.status))
        except ValueError:
            ours = None
        if ours is None:
            return make_error(LLMStatusCode.LLM_FAILED, f"{what}: the peer refused with {self}")
        return make_error(ours, f"{what}: {self.message[:_MAX_SHOWN]}")


class LinkRefused(LLMException):
    """A handshake the acceptor refused: always ``LLM_LINK_FAILED``.

    ``peer_status``: the status the acceptor named, kept only when it
    refused after passing HELLO_REPLY's checks (None before: it had proven
    nothing); a hint for the linker, never a call's status."""

    def __init__(self, message: str, peer_status: LLMStatusCode | None = None) -> None:
        super().__init__(message, LLMStatusCode.LLM_LINK_FAILED)
        self.peer_status = peer_status

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.peer_status), self.__dict__)


def handshake_refusal(refusal: PeerRefusal, *, checked: bool) -> LinkRefused:
    """A handshake refusal as :class:`LinkRefused`; ``checked``: it came after
    the acceptor's HELLO_REPLY passed our checks."""
    if not checked:
        return LinkRefused(f"refused before it proved anything ({refusal})")
    try:
        hint: LLMStatusCode | None = LLMStatusCode(refusal.status)
    except ValueError:
        hint = None
    return LinkRefused(f"refused ({refusal})", hint)
