"""The argument checks shared by the library, and the integer bounds they use.

A wrong type raises ``TypeError``, an integer out of its range ``ValueError``,
semantic misuse ``LLMException(LLM_PARAM_INVALID)``; every message names the
argument.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any

from .errors import param_invalid

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "INVALID_ID",
    "MAX_SHAPE_DIMS",
    "MAX_TAG_BYTES",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "check_enum",
    "check_int",
    "check_int64",
    "check_isinstance",
    "check_layer_range",
    "check_tag",
    "check_uint32",
    "check_uint64",
    "is_valid_id",
]

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1

#: The "no id" value of a uint64 id field (LLM-DataDist's ``_INVALID_ID``).
INVALID_ID = UINT64_MAX
#: Most dimensions a :class:`CacheDesc` shape may have.
MAX_SHAPE_DIMS = 32
#: Longest transfer tag, in bytes (UTF-8 for a ``str`` tag).
MAX_TAG_BYTES = 4096


def _type_names(types: type | tuple[type, ...]) -> str:
    if isinstance(types, type):
        return types.__name__
    return " or ".join(t.__name__ for t in types)


def check_isinstance(name: str, value: Any, types: type | tuple[type, ...]) -> Any:
    """Return ``value`` if it is an instance of ``types``, else raise ``TypeError``."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {_type_names(types)}, got {type(value).__name__}")
    return value


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Check that ``value`` is an integer in ``[lo, hi]`` (a ``None`` bound is open).

    ``bool`` is not an integer here.  NumPy integers are accepted and
    returned as ``int``.  Raises ``TypeError`` for a non-integer and
    ``ValueError`` for one out of range; both messages name ``name``.
    """
    if type(value) is int:  # the common case, without the ABC check
        result = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    else:
        result = int(value)
    if (lo is not None and result < lo) or (hi is not None and result > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "+inf" if hi is None else str(hi)
        raise ValueError(f"{name} is out of range: {result} not in [{lo_s}, {hi_s}]")
    return result


def check_uint64(name: str, value: Any) -> int:
    """:func:`check_int` for ``[0, 2**64-1]``."""
    return check_int(name, value, 0, UINT64_MAX)


def check_uint32(name: str, value: Any) -> int:
    """:func:`check_int` for ``[0, 2**32-1]``."""
    return check_int(name, value, 0, UINT32_MAX)


def check_int64(name: str, value: Any) -> int:
    """:func:`check_int` for ``[-2**63, 2**63-1]``."""
    return check_int(name, value, INT64_MIN, INT64_MAX)


def check_layer_range(name: str, layer_range: Any) -> range | None:
    """Check a layer range: ``None``, or a ``range`` with step 1 and ``0 <= start < stop``.

    A value that is neither ``None`` nor a ``range`` raises ``TypeError``; a
    bad ``range`` raises ``LLMException(LLM_PARAM_INVALID)`` naming ``name``.
    """
    if layer_range is None:
        return None
    if not isinstance(layer_range, range):
        raise TypeError(f"{name} must be range or None, got {type(layer_range).__name__}")
    if layer_range.step != 1:
        raise param_invalid(f"{name}.step must be 1, got {name}={layer_range!r}")
    if not 0 <= layer_range.start < layer_range.stop:
        raise param_invalid(f"{name} must satisfy 0 <= start < stop, got {name}={layer_range!r}")
    return layer_range


def check_tag(name: str, tag: Any) -> str | bytes | None:
    """Check a transfer tag: ``None``, or a ``str`` / ``bytes`` of at most
    :data:`MAX_TAG_BYTES` bytes.  Returns it unchanged."""
    if tag is None:
        return None
    if not isinstance(tag, (str, bytes)):
        raise TypeError(f"{name} must be str, bytes or None, got {type(tag).__name__}")
    size = len(tag.encode("utf-8")) if isinstance(tag, str) else len(tag)
    if size > MAX_TAG_BYTES:
        raise ValueError(f"{name} is too long: {size} bytes > {MAX_TAG_BYTES}")
    return tag


def is_valid_id(value: int) -> bool:
    """Whether a uint64 id field holds a real id (anything but :data:`INVALID_ID`)."""
    return value != INVALID_ID


def check_enum(name: str, value: Any, enum_cls: type[enum.IntEnum]) -> Any:
    """``value`` as a member of ``enum_cls`` (a member, or its int value)."""
    if isinstance(value, enum_cls):
        return value
    number = check_int(name, value)
    try:
        return enum_cls(number)
    except ValueError:
        allowed = ", ".join(f"{m.name}={m.value}" for m in enum_cls)
        raise ValueError(f"{name} must be one of {allowed}, got {number}") from None
