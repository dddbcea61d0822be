"""The option values: the text parsers and property checks every option uses,
and the data-plane transports (the rows of ``ext/transports.def``).

Each parser raises :class:`BadValue`, which :mod:`.options` turns into its own
error type; :mod:`.table` names which parser each option uses.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._loader import native
from ..model.types import INT64_MAX, UINT16_MAX, check_int, check_isinstance


@dataclass(frozen=True)
class Transport:
    """A data-plane transport ``transport`` may name."""

    name: str
    #: UCX's ``TLS`` for it; None: UCX's own choice (``UCX_TLS`` honoured).
    ucx_tls: str | None
    means: str
    use_when: str


#: The data-plane transports, in the order the docs list them: the rows of
#: ``ext/transports.def``, which the engine reads too.
TRANSPORT_TABLE = tuple(
    Transport(name, tls or None, means, use_when)
    for name, tls, means, use_when in native.TRANSPORTS
)
#: Data-plane transports ``transport`` may name.
TRANSPORTS = tuple(t.name for t in TRANSPORT_TABLE)

# page_shift of a memory pool config, as LLM-DataDist checks it: [10, 31).
_PAGE_SHIFT_MIN, _PAGE_SHIFT_MAX = 10, 30


class BadValue(Exception):
    pass


_DIGITS = re.compile(r"[0-9]+")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def parse_uint(text: str, lo: int, hi: int) -> int:
    if not _DIGITS.fullmatch(text):
        raise BadValue(f"must be a decimal integer in [{lo}, {hi}], got {text!r}")
    value = int(text)
    if not lo <= value <= hi:
        raise BadValue(f"must be in [{lo}, {hi}], got {value}")
    return value


def parse_flag(text: str) -> bool:
    if text == "1":
        return True
    if text == "0":
        return False
    raise BadValue(f'must be "1" or "0", got {text!r}')


def check_host(host: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise BadValue(f"bad IPv6 address {host!r}") from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        # A dotted all-numeric name is a mistyped IPv4 address, not a host name.
        if not all(label.isdigit() for label in labels):
            return host
    raise BadValue(f"bad host {host!r}: expected an IPv4 address, [IPv6] or a host name")


def parse_listen(text: str) -> tuple[str, int]:
    if ";" in text:
        raise BadValue(f"only one listen address is supported, got {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise BadValue(f'must be "ip:port", got {text!r}')
    return check_host(host), parse_uint(port, 0, UINT16_MAX)


def parse_mem_pool(text: str) -> int:
    try:
        cfg = json.loads(text)
    except ValueError:
        raise BadValue(
            f"must be JSON such as '{{\"memory_size\": 1073741824}}', got {text!r}"
        ) from None
    if not isinstance(cfg, dict):
        raise BadValue(f"must be a JSON object, got {text!r}")
    size = cfg.get("memory_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= INT64_MAX:
        raise BadValue(f'needs "memory_size", a positive integer, got {text!r}')
    shift = cfg.get("page_shift")
    if shift is not None and (
        isinstance(shift, bool)
        or not isinstance(shift, int)
        or not _PAGE_SHIFT_MIN <= shift <= _PAGE_SHIFT_MAX
    ):
        raise BadValue(
            f'"page_shift" must be an integer in [{_PAGE_SHIFT_MIN}, {_PAGE_SHIFT_MAX}], '
            f"got {shift!r}"
        )
    return size


_NET_DEVICE = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


def parse_net_devices(text: str) -> str:
    names = text.split(",")
    if text != "all" and not all(_NET_DEVICE.fullmatch(n) for n in names):
        raise BadValue(f"must be 'all' or a comma list of interface names, got {text!r}")
    return text


def parse_etcd_endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadValue(f"must be host:port (etcd's client URL, e.g. 127.0.0.1:2379), got {text!r}")
    return text


_ETCD_PREFIX = re.compile(r"/([A-Za-z0-9._-]+/)*")


def parse_etcd_prefix(text: str) -> str:
    if not _ETCD_PREFIX.fullmatch(text):
        raise BadValue(
            f"must be a key prefix that starts and ends with '/' (e.g. /aiokvcache/), got {text!r}"
        )
    return text


def parse_transport(text: str) -> str:
    if text not in TRANSPORTS:
        raise BadValue(f"must be one of {', '.join(TRANSPORTS)}, got {text!r}")
    return text


def parse_auth_token(text: str) -> bytes:
    if not text:
        raise BadValue("must not be empty")
    return text.encode("utf-8")


def setter_value(name: str, parse: Any, text: str) -> Any:
    try:
        return parse(text)
    except BadValue as exc:
        raise ValueError(f"{name} {exc}") from None


def accept_int(
    lo: int, hi: int, *, digits: bool = False, gap: int = 0
) -> Callable[[str, Any], Any]:
    """An int in ``[lo, hi]`` (or a digit string when ``digits``); with
    ``gap``, the values in ``(0, gap)`` are refused."""

    def accept(name: str, value: Any) -> int:
        if digits and isinstance(value, str):
            return int(setter_value(name, lambda t: parse_uint(t, lo, hi), value))
        v = check_int(name, value, lo, hi)
        if 0 < v < gap:
            raise ValueError(f"{name} must be 0 or >= {gap} ms, got {v}")
        return v

    return accept


def accept_text(parse: Callable[[str], Any]) -> Callable[[str, Any], Any]:
    """A ``str`` that ``parse`` accepts, kept as given."""

    def accept(name: str, value: Any) -> str:
        check_isinstance(name, value, str)
        setter_value(name, parse, value)
        return str(value)

    return accept


def accept_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type(value).__name__}")
    return value


def accept_token(name: str, value: Any) -> str:
    check_isinstance(name, value, (str, bytes))
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{name} bytes must be UTF-8 (pass e.g. token.hex() instead)"
            ) from None
    setter_value(name, parse_auth_token, value)
    return str(value)


def emit_flag(value: Any) -> str:
    return "1" if value else "0"
