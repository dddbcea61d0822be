"""The control plane's value codec: a small tag-length-value encoding.

One tag byte, then a fixed-size value or a u32 length / count. It carries
None, bools, 64-bit ints, floats, str, bytes, lists and dicts with str keys;
:func:`decode` turns anything malformed into :class:`ProtocolError` and
nothing else, so a hostile payload cannot raise past the connection.
"""

from __future__ import annotations

import struct

__all__ = ["MAX_DEPTH", "MAX_ITEMS", "ProtocolError", "decode", "encode"]

MAX_DEPTH = 16
"""Most containers (lists / dicts) nested inside one another in a payload."""

MAX_ITEMS = 1 << 16
"""Most values (containers, scalars, dict entries) in one payload."""

_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")


class ProtocolError(Exception):
    """A peer sent bytes that break the control protocol (or the codec)."""


# One tag byte, then a fixed-size value or a u32 length / count.
_T_NONE, _T_FALSE, _T_TRUE, _T_INT, _T_UINT = range(5)  # int: i64; uint: only >= 2**63
_T_FLOAT, _T_STR, _T_BYTES, _T_LIST, _T_DICT = range(5, 10)


def encode(obj: object) -> bytes:
    """Encode ``obj`` (dict with str keys, list/tuple, str, bytes, int, bool, None, float).

    Ints must fit in signed or unsigned 64 bits.  Raises ``TypeError`` for an
    unsupported type or a non-str dict key, ``ValueError`` for an int out of
    range, nesting deeper than ``MAX_DEPTH`` or more than ``MAX_ITEMS``
    values.  Tuples come back from :func:`decode` as lists.
    """
    out = bytearray()
    _encode_into(obj, out, 0, [0])
    return bytes(out)


def _encode_into(obj: object, out: bytearray, depth: int, count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_ITEMS:
        raise ValueError(f"more than {MAX_ITEMS} values")
    if obj is None:
        out.append(_T_NONE)
    elif obj is True:
        out.append(_T_TRUE)
    elif obj is False:
        out.append(_T_FALSE)
    elif isinstance(obj, int):
        if -(1 << 63) <= obj < (1 << 63):
            out.append(_T_INT)
            out += _I64.pack(obj)
        elif (1 << 63) <= obj < (1 << 64):
            out.append(_T_UINT)
            out += _U64.pack(obj)
        else:
            raise ValueError(f"int {obj} does not fit in 64 bits")
    elif isinstance(obj, float):
        out.append(_T_FLOAT)
        out += _F64.pack(obj)
    elif isinstance(obj, str):
        out.append(_T_STR)
        _put_bytes(out, obj.encode("utf-8"))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        out.append(_T_BYTES)
        _put_bytes(out, bytes(obj))
    elif isinstance(obj, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH}")
        out.append(_T_LIST)
        out += _U32.pack(len(obj))
        for item in obj:
            _encode_into(item, out, depth + 1, count)
    elif isinstance(obj, dict):
        if depth >= MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH}")
        out.append(_T_DICT)
        out += _U32.pack(len(obj))
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"dict key must be str, not {type(key).__name__}")
            _put_bytes(out, key.encode("utf-8"))
            _encode_into(value, out, depth + 1, count)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__}")


def _put_bytes(out: bytearray, data: bytes) -> None:
    if len(data) > 0xFFFFFFFF:
        raise ValueError("string or bytes longer than 2**32 - 1")
    out += _U32.pack(len(data))
    out += data


class _Decoder:
    __slots__ = ("data", "items", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.items = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolError("truncated payload")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def u32(self) -> int:
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def text(self) -> str:
        raw = self.take(self.u32())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError("invalid utf-8 in string") from e

    def count(self, min_item_size: int) -> int:
        n = self.u32()
        # Every entry takes at least min_item_size bytes, so a count larger
        # than what is left is a lie; refuse it before allocating anything.
        if n * min_item_size > len(self.data) - self.pos:
            raise ProtocolError("container count exceeds payload size")
        if self.items + n > MAX_ITEMS:
            raise ProtocolError(f"more than {MAX_ITEMS} values")
        return n

    def value(self, depth: int) -> object:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise ProtocolError(f"more than {MAX_ITEMS} values")
        tag = self.take(1)[0]
        if tag == _T_NONE:
            return None
        if tag == _T_FALSE:
            return False
        if tag == _T_TRUE:
            return True
        if tag == _T_INT:
            signed: int = _I64.unpack(self.take(8))[0]
            return signed
        if tag == _T_UINT:
            unsigned: int = _U64.unpack(self.take(8))[0]
            if unsigned < (1 << 63):
                raise ProtocolError("non-canonical unsigned int")
            return unsigned
        if tag == _T_FLOAT:
            real: float = _F64.unpack(self.take(8))[0]
            return real
        if tag == _T_STR:
            return self.text()
        if tag == _T_BYTES:
            return self.take(self.u32())
        if tag in (_T_LIST, _T_DICT):
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"nesting deeper than {MAX_DEPTH}")
            if tag == _T_LIST:
                return [self.value(depth + 1) for _ in range(self.count(1))]
            result: dict[str, object] = {}
            for _ in range(self.count(5)):
                key = self.text()
                if key in result:
                    raise ProtocolError(f"duplicate dict key {key!r}")
                result[key] = self.value(depth + 1)
            return result
        raise ProtocolError(f"unknown tag {tag}")


def decode(data: bytes) -> object:
    """Decode one value produced by :func:`encode`.

    Any malformed input (truncated, trailing bytes, unknown tag, bad utf-8,
    duplicate keys, too deep, too many values) raises :class:`ProtocolError`
    and nothing else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() needs bytes, not {type(data).__name__}")
    dec = _Decoder(bytes(data))
    obj = dec.value(0)
    if dec.pos != len(dec.data):
        raise ProtocolError("trailing bytes after payload")
    return obj
