"""Status codes and exceptions.

The numeric values of :class:`LLMStatusCode` are LLM-DataDist's, so logs and
dashboards written for it keep working.  Errors fall in three branches:

* misuse: ``TypeError``, ``ValueError`` or ``LLMException(LLM_PARAM_INVALID)``;
* transfer / peer failures: :class:`LLMException` with a status code
  (:class:`LLMTimeoutError` for ``LLM_TIMEOUT``);
* faults inside the library: :class:`InternalError`.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "InternalError",
    "LLMException",
    "LLMStatusCode",
    "LLMTimeoutError",
    "Status",
    "landed_text",
    "make_error",
    "param_invalid",
]

_BASE = 0x5010B000


def enum_str(self: enum.Enum) -> str:
    """``"LLMStatusCode.LLM_SUCCESS"``: how LLM-DataDist's enums print."""
    return f"{type(self).__name__}.{self.name}"


def enum_format(self: enum.Enum, format_spec: str) -> str:
    """f-strings print the name as ``str()`` does; a numeric spec formats the value."""
    if format_spec and format_spec[-1] in "bcdoxXn":
        return format(self.value, format_spec)
    return format(enum_str(self), format_spec)


class LLMStatusCode(enum.IntEnum):
    """Result codes, with LLM-DataDist's member names and numeric values."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_UNKNOWN_ERROR = -1
    LLM_WAIT_PROCESS_TIMEOUT = _BASE + 1
    LLM_KV_CACHE_NOT_EXIST = _BASE + 2
    LLM_REPEAT_REQUEST = _BASE + 3
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 4
    LLM_PARAM_INVALID = _BASE + 5
    LLM_ENGINE_FINALIZED = _BASE + 6
    LLM_NOT_YET_LINK = _BASE + 7
    LLM_ALREADY_LINK = _BASE + 8
    LLM_LINK_FAILED = _BASE + 9
    LLM_UNLINK_FAILED = _BASE + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 12
    LLM_PROCESSING_LINK = _BASE + 13
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 14
    LLM_PREFIX_ALREADY_EXIST = _BASE + 15
    LLM_PREFIX_NOT_EXIST = _BASE + 16
    # LLM-DataDist's Python package has only this spelling (its name and
    # str()); the C++ header's spelling is an alias.
    LLM_SEQ_LENOVERLIMIT = _BASE + 17
    LLM_SEQ_LEN_OVER_LIMIT = _BASE + 17
    LLM_NO_FREE_BLOCK = _BASE + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 19
    LLM_EXIST_LINK = _BASE + 24
    LLM_FEATURE_NOT_ENABLED = _BASE + 25
    LLM_TIMEOUT = _BASE + 26
    LLM_LINK_BUSY = _BASE + 27
    LLM_OUT_OF_MEMORY = _BASE + 28
    # CANN runtime codes LLM-DataDist passes through (ACL_ERROR_RT_*).
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057

    __str__ = enum_str
    __format__ = enum_format


def _coerce_status(code: int) -> LLMStatusCode:
    # Unknown numbers become LLM_FAILED, as LLM-DataDist's code_2_status does.
    if isinstance(code, LLMStatusCode):
        return code
    try:
        return LLMStatusCode(code)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


class LLMException(RuntimeError):
    """A failed operation, carrying an :class:`LLMStatusCode`.

    ``str()`` reads ``"[LLM_PARAM_INVALID] message"``.
    """

    _default_status = LLMStatusCode.LLM_FAILED
    #: When a call of several jobs failed: each job's native result, in order.
    results: list[Any] | None = None
    #: **[ours]** When a transfer call failed: the destination layers whose
    #: bytes had landed (a frozenset of layer indices, empty when none);
    #: None where the call moves no layers.
    landed: frozenset[int] | None = None
    #: **[ours]** When a deadline ended the call: which one,
    #: ``"timeout=30 s"`` (the call's ``timeout=``) or
    #: ``"sync_kv_timeout=1000 ms"`` (each layer job's own, from the
    #: options); None otherwise.
    deadline: str | None = None

    def __init__(self, message: str = "", status_code: int | None = None) -> None:
        super().__init__(message)
        self.message: str = message
        self.status_code: LLMStatusCode = (
            self._default_status if status_code is None else _coerce_status(status_code)
        )

    def __str__(self) -> str:
        return f"[{self.status_code.name}] {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, {self.status_code.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, int(self.status_code)), self.__dict__)


class Status:
    """LLM-DataDist's result wrapper: a status code with ``is_ok()``."""

    __slots__ = ("_status_code",)

    def __init__(self, status: int) -> None:
        self._status_code = _coerce_status(status)

    @property
    def status_code(self) -> LLMStatusCode:
        """The code."""
        return self._status_code

    def is_ok(self) -> bool:
        """Whether the code is ``LLM_SUCCESS``."""
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    def __repr__(self) -> str:
        return f"Status({self._status_code})"


class LLMTimeoutError(LLMException, TimeoutError):
    """An :class:`LLMException` with status ``LLM_TIMEOUT``.

    Also a ``TimeoutError``, so ``except TimeoutError`` catches it.
    """

    _default_status = LLMStatusCode.LLM_TIMEOUT

    def __new__(cls, message: str = "", status_code: int | None = None) -> LLMTimeoutError:
        # Hand OSError.__new__ the message alone: given two args it would
        # read them as (errno, strerror).
        return TimeoutError.__new__(cls, message)


class InternalError(LLMException):
    """A fault inside aiokvcache itself (status ``LLM_UNKNOWN_ERROR``)."""

    _default_status = LLMStatusCode.LLM_UNKNOWN_ERROR


# Status codes whose exceptions get their own class; everything else is a
# plain LLMException.
_ERROR_CLASSES: dict[LLMStatusCode, type[LLMException]] = {
    LLMStatusCode.LLM_TIMEOUT: LLMTimeoutError,
    LLMStatusCode.LLM_UNKNOWN_ERROR: InternalError,
}


def make_error(code: int, message: str) -> LLMException:
    """Build the exception for status ``code`` (an int or :class:`LLMStatusCode`).

    ``LLM_TIMEOUT`` gives :class:`LLMTimeoutError`, ``LLM_UNKNOWN_ERROR``
    gives :class:`InternalError`, any other code a plain
    :class:`LLMException`; a number that is no known code becomes
    ``LLM_FAILED``.
    """
    status = _coerce_status(code)
    cls = _ERROR_CLASSES.get(status, LLMException)
    return cls(message, status)


def landed_text(layers: Any) -> str:
    """What landed, as every message writes it: ``"layers 0, 1, 2"`` or ``"no layer"``."""
    ordered = sorted(layers)
    if not ordered:
        return "no layer"
    return ("layer " if len(ordered) == 1 else "layers ") + ", ".join(map(str, ordered))


def param_invalid(message: str) -> LLMException:
    """An :class:`LLMException` with status ``LLM_PARAM_INVALID``."""
    return LLMException(message, LLMStatusCode.LLM_PARAM_INVALID)
