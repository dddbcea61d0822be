"""A peer to link to: :class:`LLMClusterInfo` and the :class:`LLMRole` it names."""

from __future__ import annotations

import enum
import ipaddress
import socket
from typing import Any

from .checks import UINT16_MAX, UINT32_MAX, check_enum, check_int, check_uint64
from .errors import enum_format, enum_str

__all__ = ["LLMClusterInfo", "LLMRole"]


class LLMRole(enum.IntEnum):
    """Role of an LLMDataDist instance."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    __str__ = enum_str
    __format__ = enum_format


def _ip_to_str(name: str, ip: Any) -> str:
    if isinstance(ip, str):
        try:
            return str(ipaddress.IPv4Address(ip))
        except ValueError:
            raise ValueError(f"{name} is not a dotted-quad IPv4 address: {ip!r}") from None
    # LLM-DataDist's int form: the 4 address bytes read as a little-endian
    # uint32 (what int.from_bytes(socket.inet_aton(ip), "little") gives).
    number = check_int(name, ip, 0, UINT32_MAX)
    return socket.inet_ntoa(number.to_bytes(4, "little"))


def _ip_to_int(ip: str) -> int:
    return int.from_bytes(socket.inet_aton(ip), "little")


class LLMClusterInfo:
    """A peer to link to: its cluster id, role and addresses.

    ``ip`` is a dotted-quad ``str`` or LLM-DataDist's ``int`` form (the
    address bytes as a little-endian uint32); ``port`` is in ``[0, 65535]``.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | None = None
        self._local_ip_info: list[tuple[str, int]] = []
        self._remote_ip_info: list[tuple[str, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id (uint64), or None until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_uint64("remote_cluster_id", value)

    @property
    def remote_role_type(self) -> LLMRole | None:
        """The peer's role, or None until set."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        self._remote_role_type = check_enum("remote_role_type", value, LLMRole)

    @staticmethod
    def _ip_port(ip: Any, port: Any) -> tuple[str, int]:
        if not isinstance(ip, (str, int)) or isinstance(ip, bool):
            raise TypeError(f"ip must be str or int, got {type(ip).__name__}")
        return _ip_to_str("ip", ip), check_int("port", port, 0, UINT16_MAX)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local address to link from."""
        self._local_ip_info.append(self._ip_port(ip, port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add an address of the peer."""
        self._remote_ip_info.append(self._ip_port(ip, port))

    @property
    def local_ip_info(self) -> list[tuple[str, int]]:
        """Local addresses as ``(ip_str, port)``."""
        return list(self._local_ip_info)

    @property
    def remote_ip_info(self) -> list[tuple[str, int]]:
        """Peer addresses as ``(ip_str, port)``."""
        return list(self._remote_ip_info)

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """Local addresses in LLM-DataDist's form ``(ip_int, port)``."""
        return [(_ip_to_int(ip), port) for ip, port in self._local_ip_info]

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """Peer addresses in LLM-DataDist's form ``(ip_int, port)``."""
        return [(_ip_to_int(ip), port) for ip, port in self._remote_ip_info]

    def __repr__(self) -> str:
        role = None if self._remote_role_type is None else self._remote_role_type.name
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={role}, local_ip_info={self._local_ip_info}, "
            f"remote_ip_info={self._remote_ip_info})"
        )
