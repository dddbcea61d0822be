"""Field specs: how a peer message's fields read from and write to its body.

A message class lists its fields once (``FIELDS``, see :mod:`.messages`);
one decoder reads them all and refuses a body with the words of the first
field that does not fit (``ValueError``), which the message class turns into
its own error: LLM_PARAM_INVALID for a request, ``BadReply`` for an answer.
A spec may set several attributes (a key from its parts, a nonce with its
slot); checks across fields are the message's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.errors import LLMException

__all__ = [
    "Field",
    "body",
    "dict_list",
    "int_list",
    "integer",
    "key",
    "nonce_and_slot",
    "packed",
    "positive_float",
    "problem_text",
]


@dataclass(frozen=True, slots=True)
class Field:
    """Attributes ``attrs`` of a message: ``read`` takes their values from a
    body (``ValueError`` with what is wrong), ``write`` puts them into one."""

    attrs: tuple[str, ...]
    read: Callable[[dict[str, Any]], tuple[Any, ...]]
    write: Callable[[tuple[Any, ...], dict[str, Any]], None]


def _put(name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], None]:
    def write(values: tuple[Any, ...], out: dict[str, Any]) -> None:
        out[name] = values[0]

    return write


def integer(
    attr: str,
    name: str | None = None,
    *,
    exact: bool = False,
    lo: int | None = None,
    hi: int | None = None,
) -> Field:
    """An int (``exact``: an int and not a bool) in ``[lo, hi)`` where given,
    under the key ``name`` (the attribute's name by default)."""
    name = name or attr

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        v = b.get(name)
        if not isinstance(v, int) or (exact and type(v) is not int):
            raise ValueError(f"{name} must be int")
        if (lo is not None and v < lo) or (hi is not None and v >= hi):
            raise ValueError(f"{name} must be in [{lo}, {hi})")
        return (v,)

    return Field((attr,), read, _put(name))


def positive_float(attr: str) -> Field:
    """A float above 0."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        v = b.get(attr)
        if not isinstance(v, float) or not v > 0:
            raise ValueError(f"{attr} must be a float > 0")
        return (v,)

    return Field((attr,), read, _put(attr))


def packed(attr: str) -> Field:
    """Bytes (a packed key)."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        v = b.get(attr)
        if not isinstance(v, bytes):
            raise ValueError(f"{attr} must be bytes")
        return (v,)

    return Field((attr,), read, _put(attr))


def problem_text(attr: str) -> Field:
    """What failed, as text: any empty value means nothing did; anything
    else is shown as the text it reads as."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        v = b.get(attr)
        return (f"{v}" if v else "",)

    return Field((attr,), read, _put(attr))


def int_list(attr: str, most: int) -> Field:
    """A list of at most ``most`` ints (a tuple on our side)."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        v = b.get(attr)
        if not isinstance(v, list) or len(v) > most or not all(isinstance(a, int) for a in v):
            raise ValueError(f"{attr} must be a list of ints")
        return (tuple(v),)

    def write(values: tuple[Any, ...], out: dict[str, Any]) -> None:
        out[attr] = list(values[0])

    return Field((attr,), read, write)


def dict_list(attr: str) -> Field:
    """A list of dicts (each checked where it is used)."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        v = b.get(attr)
        if not isinstance(v, list):
            raise ValueError(f"{attr} is not a list")
        if not all(isinstance(d, dict) for d in v):
            raise ValueError(f"an item of {attr} is not a dict")
        return (tuple(v),)

    def write(values: tuple[Any, ...], out: dict[str, Any]) -> None:
        out[attr] = list(values[0])

    return Field((attr,), read, write)


def body(attr: str) -> Field:
    """The whole body, as it came (a cache's metadata, checked on install);
    written as the body's own keys."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        return (b,)

    def write(values: tuple[Any, ...], out: dict[str, Any]) -> None:
        out.update(values[0])

    return Field((attr,), read, write)


def key(attr: str, build: Callable[..., Any], names: tuple[str, ...]) -> Field:
    """A key built from the keys ``names`` (its own checks refuse bad parts)."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        try:
            return (build(**{n: b[n] for n in names}),)
        except (KeyError, TypeError, ValueError, LLMException) as exc:
            raise ValueError(f"bad key: {exc}") from None

    def write(values: tuple[Any, ...], out: dict[str, Any]) -> None:
        out.update({n: getattr(values[0], n) for n in names})

    return Field((attr,), read, write)


def nonce_and_slot(nonce_bytes: int) -> Field:
    """A put probe's ``nonce`` (``nonce_bytes`` long) and ``slot``: both or
    neither (then ``b""`` and 0, and neither is written)."""

    def read(b: dict[str, Any]) -> tuple[Any, ...]:
        nonce, slot = b.get("nonce"), b.get("slot")
        if nonce is None and slot is None:
            return b"", 0
        if not isinstance(nonce, bytes) or len(nonce) != nonce_bytes or type(slot) is not int:
            raise ValueError(f"nonce must be {nonce_bytes} bytes and slot an int")
        return nonce, slot

    def write(values: tuple[Any, ...], out: dict[str, Any]) -> None:
        if values[0]:
            out.update(nonce=values[0], slot=values[1])

    return Field(("nonce", "slot"), read, write)
