"""Timeouts in real time whatever the run's clock: the test kit's waits are
for child processes and native engines, which no virtual clock
(``trio.testing.MockClock``) drives."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import anyio
import sniffio

__all__ = ["real_fail_after", "real_move_on_after"]


@contextlib.contextmanager
def real_move_on_after(seconds: float | None) -> Iterator[Any]:
    """``anyio.move_on_after``, counted in real time (None or infinite: never)."""
    if seconds is not None and not math.isfinite(seconds):
        seconds = None
    if sniffio.current_async_library() != "trio":
        with anyio.move_on_after(seconds) as scope:
            yield scope
        return
    from .._loopside._trio import real_move_on_after as trio_move_on_after

    with trio_move_on_after(seconds) as scope:
        yield scope


@contextlib.contextmanager
def real_fail_after(seconds: float | None) -> Iterator[Any]:
    """``anyio.fail_after`` (``TimeoutError``), counted in real time."""
    with real_move_on_after(seconds) as scope:
        yield scope
    if scope.cancelled_caught:
        raise TimeoutError
