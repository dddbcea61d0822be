"""Timeouts in real time whatever the run's clock: the test kit's waits are
for child processes and native engines, which no virtual clock
(``trio.testing.MockClock``) drives."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import anyio
import sniffio

__all__ = ["real_fail_after", "real_move_on_after"]


@contextlib.contextmanager
def real_move_on_after(seconds: float | None) -> Iterator[anyio.CancelScope]:
    """``anyio.move_on_after``, counted in real time."""
    if seconds is None or not _virtual():
        with anyio.move_on_after(seconds) as scope:
            yield scope
        return
    import trio

    from .._loopside._trio import REAL_TIMER, cancel_from_thread

    with anyio.CancelScope() as scope:
        token = trio.lowlevel.current_trio_token()
        timer = REAL_TIMER.call_at(
            time.monotonic() + seconds, functools.partial(cancel_from_thread, token, scope)
        )
        try:
            yield scope
        finally:
            REAL_TIMER.cancel(timer)


@contextlib.contextmanager
def real_fail_after(seconds: float | None) -> Iterator[anyio.CancelScope]:
    """``anyio.fail_after`` (``TimeoutError``), counted in real time."""
    with real_move_on_after(seconds) as scope:
        yield scope
    if scope.cancelled_caught:
        raise TimeoutError


def _virtual() -> bool:
    """Whether this is a trio run on a clock other than trio's own."""
    if sniffio.current_async_library() != "trio":
        return False
    from .._loopside._trio import real_clock

    return not real_clock()
