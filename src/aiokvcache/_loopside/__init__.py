"""The owner's async library, seen from the library: asyncio or trio.

An ``LLMDataDist`` is driven from one event loop, the one that ran its
``init()``. Everything the library does there (the completion eventfd, the
futures of job groups, deadlines, cancellation, a copy in a worker thread,
waiting for the peer-service thread, the layer-wise pipeline task) goes
through one :class:`LoopSide`, chosen when the instance starts
(:func:`current`) and never per call:

* :class:`AsyncioSide`: a persistent ``loop.add_reader`` on the eventfd,
  ``asyncio`` futures, ``asyncio.timeout``, ``asyncio.shield`` — the code
  the library always had, on its hot path unchanged;
* ``TrioSide`` (:mod:`._trioside`, imported only when trio runs): one system
  task of the instance waits on the eventfd with ``wait_readable``; wake-ups
  from the service thread go through the run's token; deadlines are cancel
  scopes; a release after a cancel is waited for in a shielded scope.

Under anyio the side is whichever library anyio runs on. Nothing below the
bridge (the native engine, the peer-service thread with its own asyncio
loop) knows which side drives it.

What both sides guarantee, and the core relies on: a :class:`Waiter` is set
only on the owner's thread; :meth:`LoopSide.settle` returns only once its
waiter is done, whatever cancellation arrives meanwhile, and then lets the
cancellation through; a :meth:`LoopSide.deadline` raises ``TimeoutError``
(the builtin) when it expires.
"""

from __future__ import annotations

import sniffio

from ._asyncio import AsyncioSide
from ._base import FINE, Deadline, LoopSide, ServiceGone, TaskHandle, Waiter, poll

__all__ = [
    "FINE",
    "AsyncioSide",
    "Deadline",
    "LoopSide",
    "ServiceGone",
    "TaskHandle",
    "Waiter",
    "current",
    "poll",
]


def current() -> LoopSide:
    """The side of the async library the caller runs under (an instance's
    ``init()``): asyncio (anyio on asyncio too) or trio; ``RuntimeError``
    for anything else or outside any."""
    try:
        lib = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        raise RuntimeError(
            "aiokvcache: init() must be awaited from a running asyncio or trio event loop"
        ) from None
    if lib == "asyncio":
        return AsyncioSide()
    if lib == "trio":
        from ._trio import TrioSide

        return TrioSide()
    raise RuntimeError(f"aiokvcache runs under asyncio or trio (also through anyio), not {lib}")
