"""The test suite's clients of its peer program (``tests/support/peer_modes.py``).

:func:`peer_argv` is its command line (inside a network namespace with
``netns``); :class:`Peer` speaks to it blocking, :class:`AsyncPeer` from an
async test (asyncio or trio: it is :class:`aiokvcache.testing.JsonChild`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from aiokvcache._child import JsonPeer
from aiokvcache.testing import JsonChild

__all__ = ["PEER_MODES", "AsyncPeer", "Peer", "peer_argv"]

#: The peer program.
PEER_MODES = str(Path(__file__).with_name("peer_modes.py"))


def peer_argv(
    mode: str, *args: str, lifetime: float | None = None, netns: str | None = None
) -> list[str]:
    """The command line of the peer program in ``mode`` (see its docs), run
    inside network namespace ``netns`` if given (``ip netns exec``, which
    execs the program itself: the child's pid is the peer's)."""
    argv = [sys.executable, PEER_MODES, mode, *args]
    if lifetime is not None:
        argv.append(f"--lifetime={lifetime:g}")
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    return argv


class Peer(JsonPeer):
    """The peer program, blocking: started up to its hello line."""

    def __init__(
        self,
        mode: str,
        *args: str,
        startup_timeout: float = 60,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        new_session: bool = False,
    ) -> None:
        self.mode = mode
        super().__init__(
            peer_argv(mode, *args, lifetime=lifetime),
            label=f"peer {mode}",
            startup_timeout=startup_timeout,
            env=env,
            stderr=stderr,
            new_session=new_session,
        )


class AsyncPeer(JsonChild):
    """The peer program from an async test: ``async with AsyncPeer(mode, *args) as peer``."""

    def __init__(
        self,
        mode: str,
        *args: str,
        startup_timeout: float = 60,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        netns: str | None = None,
    ) -> None:
        super().__init__(
            peer_argv(mode, *args, lifetime=lifetime, netns=netns),
            label=f"peer {mode}",
            startup_timeout=startup_timeout,
            env=env,
            stderr=stderr,
        )
        self.mode = mode
        self.netns = netns

    @property
    def address(self) -> str:
        """Its control address, ``ip:port``."""
        return str(self.hello["address"])
