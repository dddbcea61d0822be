"""What the library needs of the owner's async library: :class:`LoopSide` and
the objects it makes (the interface both sides implement; see the package)."""


from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any, Protocol, TypeVar

import sniffio

__all__ = ["FINE", "Deadline", "LoopSide", "ServiceGone", "TaskHandle", "Waiter", "poll"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Polling intervals of :func:`poll` (the owner loop's and the service loop's).
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.02
#: :func:`poll`'s finer schedule, for short waits that a caller waits on in
#: turn (a link's probes): pauses from 50 us, half again each time. On
#: asyncio's selector loop a pause under 1 ms sleeps about 1 ms (epoll's
#: timeout is whole milliseconds), so in effect: a poll about every 1 ms for
#: the first ~8 ms, then half again each time (the default: 1, 2, 4, 8... ms).
FINE = (0.00005, 1.5)


class ServiceGone(RuntimeError):
    """The peer-service thread cancelled the work we awaited (it is stopping:
    finalize), not the caller."""


class Waiter(Protocol[T]):
    """A one-shot result set on the owner's thread and awaited there: an
    ``asyncio.Future`` under asyncio, its trio equivalent under trio."""

    def done(self) -> bool:
        """True once a result or an exception is set."""
        ...

    def set_result(self, result: T, /) -> None:
        """Set the result (once)."""
        ...

    def set_exception(self, exception: BaseException, /) -> None:
        """Set an exception (once)."""
        ...

    def result(self) -> T:
        """The result, or raise the exception set."""
        ...

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None:
        """Call ``fn(waiter)`` on the owner's loop once it is done."""
        ...

    def __await__(self) -> Generator[Any, None, T]: ...


class Deadline(Protocol):
    """``async with side.deadline(seconds)``: ``TimeoutError`` when it expires."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: Any) -> bool | None: ...

    def expired(self) -> bool:
        """True when the deadline ended the block."""
        ...


class TaskHandle(Protocol):
    """A background task of the instance (the layer-wise pipeline)."""

    def done(self) -> bool:
        """True once the task ended."""
        ...

    def cancelled(self) -> bool:
        """True if it ended because it was cancelled."""
        ...

    def cancel(self) -> bool:
        """Ask it to stop; False if it already ended."""
        ...

    async def join(self) -> None:
        """Wait until it ends. Cancelling the caller cancels the task and
        still waits for its end; a task that was cancelled raises here (the
        side's cancellation under asyncio, see the sides)."""
        ...

    async def wait_done(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for its end (never cancels it); True if it ended."""
        ...


class LoopSide:
    """What the library needs of the owner's async library (one per instance)."""

    #: "asyncio" or "trio".
    name: str = ""
    #: The exception a cancelled wait raises on this side.
    Cancelled: type[BaseException] = BaseException

    # Each method below is implemented by both sides.

    def is_current(self) -> bool:  # pragma: no cover - abstract
        """True when called from the loop (or trio run) this side belongs to."""
        raise NotImplementedError

    def describe_current(self) -> str:
        """What the calling code runs under, for an error message."""
        try:
            lib = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            return "no async library"
        return f"another {lib} loop" if lib == self.name else lib

    def check_can_close(self) -> None:  # pragma: no cover - abstract
        """Raise ``RuntimeError`` unless finalize() may run here."""
        raise NotImplementedError

    def time(self) -> float:  # pragma: no cover - abstract
        """Seconds in real time (``time.monotonic``; asyncio's loop clock is):
        what a call's ``timeout=`` is counted on."""
        raise NotImplementedError

    def future(self) -> Waiter[Any]:  # pragma: no cover - abstract
        """A new :class:`Waiter`."""
        raise NotImplementedError

    def watch_fd(
        self, fd: int, on_readable: Callable[[], None], busy: Callable[[], bool]
    ) -> None:  # pragma: no cover - abstract
        """Call ``on_readable()`` on the loop each time ``fd`` is readable, until
        unwatched. While ``busy()`` (someone waits for what ``fd`` reports) the
        watch outlives the loop's own shutdown: a waiter is never left without it."""
        raise NotImplementedError

    def unwatch_fd(self, fd: int) -> None:  # pragma: no cover - abstract
        """Stop watching ``fd`` (idempotent; on the loop's thread)."""
        raise NotImplementedError

    async def settle(self, fut: Waiter[Any]) -> None:  # pragma: no cover - abstract
        """Wait until ``fut`` is done, through any cancellation; then let a
        cancellation that arrived meanwhile through. ``fut``'s own outcome is
        left for the caller to read."""
        raise NotImplementedError

    def deadline(self, seconds: float | None) -> Deadline:  # pragma: no cover - abstract
        """A block that raises ``TimeoutError`` once ``seconds`` of real time
        pass (None: never), whatever clock the loop has: a timeout bounds what
        the native engine and peers do, which no virtual clock drives."""
        raise NotImplementedError

    async def sleep(self, seconds: float) -> None:  # pragma: no cover - abstract
        """Sleep on the loop."""
        raise NotImplementedError

    async def from_service(
        self, cf: concurrent.futures.Future[T]
    ) -> T:  # pragma: no cover - abstract
        """The result of work running on the peer-service thread, awaited
        here; cancelling the caller cancels ``cf`` (the service task).
        :class:`ServiceGone` when the service cancelled it (not the caller)."""
        raise NotImplementedError

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:  # pragma: no cover
        """``fn(*args)`` in a worker thread. Returns (or raises) only once it
        ended, even when cancelled meanwhile: then ``fn``'s own error, else
        the cancellation, comes after."""
        raise NotImplementedError

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:  # pragma: no cover - abstract
        """Run ``coro`` to its end even if the caller is cancelled (or
        interrupted) meanwhile; the cancellation comes after."""
        raise NotImplementedError

    def spawn(
        self, fn: Callable[[], Coroutine[Any, Any, None]], name: str
    ) -> TaskHandle:  # pragma: no cover - abstract
        """Run ``fn()`` as a background task of the instance."""
        raise NotImplementedError

    async def gather(self, aws: Sequence[Awaitable[T]]) -> list[T]:  # pragma: no cover
        """Run ``aws`` concurrently; their results in order, or the first error,
        plain (the rest are cancelled and waited for)."""
        raise NotImplementedError

    async def poll_until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Poll ``done()`` until it is true (True) or ``timeout`` seconds pass
        (False), backing off from 0.5 to 20 ms (:func:`poll`)."""
        return await poll(done, timeout, self.sleep, self.time)


async def poll(
    done: Callable[[], bool],
    timeout: float | None,
    sleep: Callable[[float], Awaitable[None]],
    now: Callable[[], float],
    schedule: tuple[float, float] = (_POLL_MIN_S, 2.0),
) -> bool:
    """Poll ``done()`` until it is true (True) or ``timeout`` seconds pass
    (False), backing off from _POLL_MIN_S to _POLL_MAX_S, so a short wait is
    short and a long one costs little. ``sleep`` and ``now``: the loop's.
    ``schedule``: (first pause, growth), :data:`FINE` for waits that set a
    caller's latency."""
    end = None if timeout is None else now() + timeout
    pause, growth = schedule
    while not done():
        if end is not None and now() >= end:
            return False
        await sleep(pause)
        pause = min(pause * growth, _POLL_MAX_S)
    return True
