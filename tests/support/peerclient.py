"""The test suite's clients of the peer program (:mod:`aiokvcache.testing.peer`).

:class:`AsyncPeer` (from an async test, asyncio or trio: an
:class:`aiokvcache.testing.JsonChild`) and :class:`Peer` (blocking) start
``python -m aiokvcache.testing.peer ROLE ARGS...`` with the ops modules
``ops`` names: a subject of the suite's, for its
``tests/support/peer_ops_<subject>.py``, or a module's dotted name
(:data:`BARE_ENGINE`). :data:`LIFETIMES`, :data:`MEMORY` and :data:`TRUST`
are the stacks the process tests of those subjects load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from aiokvcache._child import JsonPeer
from aiokvcache.testing import BARE_ENGINE, JsonChild, peer_argv

__all__ = [
    "BARE_ENGINE",
    "LIFETIMES",
    "MEMORY",
    "TRUST",
    "AsyncPeer",
    "Peer",
    "ops_spec",
    "suite_peer_argv",
]

#: Pushes into caches being retired (tests/test_lifetimes.py).
LIFETIMES = ("transfers", "lifetimes")
#: tests/test_memory_safety.py's: the lifetimes' ops, allocations with no zero byte.
MEMORY = ("transfers", "lifetimes", "memory")
#: A peer that attacks or is attacked (tests/test_trust.py, tests/test_liveness.py).
TRUST = ("transfers", "trust")


def ops_spec(name: str) -> str:
    """What ``--ops`` takes for ``name``: a dotted name as it is, a subject
    as the path of ``tests/support/peer_ops_<subject>.py``."""
    if "." in name:
        return name
    return str(Path(__file__).with_name(f"peer_ops_{name}.py"))


def suite_peer_argv(
    role: str,
    *args: str,
    ops: Sequence[str] = (),
    lifetime: float | None = None,
    netns: str | None = None,
) -> list[str]:
    """:func:`aiokvcache.testing.peer_argv` with the ops named as :func:`ops_spec` reads them."""
    specs = [ops_spec(name) for name in ops]
    return peer_argv(role, *args, ops=specs, lifetime=lifetime, netns=netns)


def _label(role: str, ops: Sequence[str]) -> str:
    return f"peer {role}" + (f" ({', '.join(ops)})" if ops else "")


class Peer(JsonPeer):
    """The peer program, blocking: started up to its hello line."""

    def __init__(
        self,
        role: str,
        *args: str,
        ops: Sequence[str] = (),
        startup_timeout: float = 60,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        new_session: bool = False,
    ) -> None:
        self.mode = role
        super().__init__(
            suite_peer_argv(role, *args, ops=ops, lifetime=lifetime),
            label=_label(role, ops),
            startup_timeout=startup_timeout,
            env=env,
            stderr=stderr,
            new_session=new_session,
        )


class AsyncPeer(JsonChild):
    """The peer program from an async test: ``async with AsyncPeer(role, *args) as peer``."""

    def __init__(
        self,
        role: str,
        *args: str,
        ops: Sequence[str] = (),
        startup_timeout: float = 60,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        netns: str | None = None,
    ) -> None:
        super().__init__(
            suite_peer_argv(role, *args, ops=ops, lifetime=lifetime, netns=netns),
            label=_label(role, ops),
            startup_timeout=startup_timeout,
            env=env,
            stderr=stderr,
        )
        self.mode = role
        self.netns = netns
