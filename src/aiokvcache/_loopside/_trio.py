"""The trio side of :mod:`aiokvcache._loopside` (imported only when an instance starts under trio).

* The completion eventfd is waited with ``trio.lowlevel.wait_readable`` in
  one system task of the instance, which drains the queue and resolves the
  waiters; :meth:`TrioSide.unwatch_fd` ends it with ``notify_closing``.
* The peer-service thread's results wake the run through its token
  (``run_sync_soon``): nothing blocks a thread on the run, and nothing but the
  run's own thread touches a :class:`TrioWaiter`.
* Deadlines are cancel scopes that raise the builtin ``TimeoutError``, in
  real time whatever the run's clock (under ``trio.testing.MockClock`` a
  thread of timers cancels them);
  cancellation is the caller's cancel scope (``fail_after``, ``move_on_after``,
  ``CancelScope.cancel``), and the release a cancelled transfer must wait for
  is awaited in a shielded scope, never re-awaited unshielded inside the
  cancel path.
* Background tasks (the layer-wise pipeline) are system tasks with a cancel
  scope of their own; ``finalize()`` cancels and waits for them, and the run
  ending cancels them too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator, Sequence
from typing import Any, TypeVar

import trio

from ._base import Deadline, LoopSide, ServiceGone, TaskHandle, Waiter

__all__ = [
    "REAL_TIMER",
    "TrioSide",
    "TrioWaiter",
    "cancel_from_thread",
    "real_clock",
    "real_move_on_after",
]

log = logging.getLogger("aiokvcache")

T = TypeVar("T")


class TrioWaiter:
    """A one-shot result for trio (the part of ``asyncio.Future`` the library uses)."""

    __slots__ = ("_callbacks", "_done", "_error", "_event", "_value")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Any], object]] | None = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any, /) -> None:
        if self._done:
            raise RuntimeError("waiter is already done")
        self._value = result
        self._finish()

    def set_exception(self, exception: BaseException, /) -> None:
        if self._done:
            raise RuntimeError("waiter is already done")
        self._error = exception
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._event.set()
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None:
        if self._done:
            fn(self)
        elif self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    def result(self) -> Any:
        if not self._done:
            raise RuntimeError("waiter is not done")
        if self._error is not None:
            raise self._error
        return self._value

    async def wait(self) -> None:
        """Until done (a checkpoint even when it already is)."""
        await self._event.wait()

    async def _get(self) -> Any:
        await self._event.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._get().__await__()


class _RealTimer:
    """One daemon thread that calls functions at ``time.monotonic()`` times:
    the deadlines of a run whose clock is not real time (``trio.testing.
    MockClock``, which jumps ahead whenever every task waits, a native
    completion or a peer's answer included). A cancelled entry is forgotten
    at once and the heap compacted when most of it is cancelled: deadlines
    that ended leave nothing behind a long one still pending."""

    _MAX_WAIT_S = 3600.0  # Condition.wait of a far deadline, in steps

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], object]] = {}
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def call_at(self, when: float, fn: Callable[[], object]) -> int | None:
        """``fn()`` on the timer thread at ``when``; None (never) for an
        infinite or NaN time."""
        if not math.isfinite(when):
            return None
        with self._cv:
            n = next(self._seq)
            self._live[n] = fn
            heapq.heappush(self._heap, (when, n))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="aiokvcache.real-deadlines", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return n

    def cancel(self, n: int | None) -> None:
        if n is None:
            return
        with self._cv:
            self._live.pop(n, None)
            if len(self._heap) > 32 and len(self._heap) > 2 * len(self._live):
                self._heap = [e for e in self._heap if e[1] in self._live]
                heapq.heapify(self._heap)

    def pending(self) -> int:
        """Entries still held (live or cancelled, not yet dropped)."""
        with self._cv:
            return len(self._heap)

    def _next(self) -> Callable[[], object]:
        """The next function due, once it is (under the lock)."""
        while True:
            if not self._heap:
                self._cv.wait()
                continue
            when, n = self._heap[0]
            if n not in self._live:
                heapq.heappop(self._heap)
                continue
            left = when - time.monotonic()
            if left > 0:
                self._cv.wait(min(left, self._MAX_WAIT_S))
                continue
            heapq.heappop(self._heap)
            return self._live.pop(n)

    def _run(self) -> None:
        while True:
            with self._cv:
                fn = self._next()
            try:
                fn()
            except Exception:  # never the thread: the next deadlines still fire
                log.exception("aiokvcache: a real-time deadline's callback failed")


REAL_TIMER = _RealTimer()


def real_clock() -> bool:
    """Whether this run's clock is trio's own (real time)."""
    clock = type(trio.lowlevel.current_clock())
    return clock.__name__ == "SystemClock" and clock.__module__.startswith("trio.")


def cancel_from_thread(token: trio.lowlevel.TrioToken, scope: Any) -> None:
    """``scope.cancel()`` on the run's thread, from any thread."""
    try:
        token.run_sync_soon(scope.cancel)
    except trio.RunFinishedError:
        pass  # the run ended: nothing waits on the scope


@contextlib.contextmanager
def real_move_on_after(seconds: float | None) -> Iterator[trio.CancelScope]:
    """``trio.move_on_after``, counted in real time whatever the run's clock
    (None or infinite: never)."""
    if seconds is None or not math.isfinite(seconds):
        with trio.CancelScope() as scope:
            yield scope
        return
    if real_clock():
        with trio.move_on_after(seconds) as scope:
            yield scope
        return
    with trio.CancelScope() as scope:
        token = trio.lowlevel.current_trio_token()
        timer = REAL_TIMER.call_at(
            time.monotonic() + seconds, functools.partial(cancel_from_thread, token, scope)
        )
        try:
            yield scope
        finally:
            REAL_TIMER.cancel(timer)


class _TrioDeadline:
    """A cancel scope that raises ``TimeoutError`` once ``seconds`` of real
    time passed, whatever clock the run has (:func:`real_move_on_after`,
    started when the block is entered)."""

    __slots__ = ("_block", "_scope")

    def __init__(self, seconds: float | None) -> None:
        self._block = real_move_on_after(seconds)
        self._scope: trio.CancelScope | None = None

    async def __aenter__(self) -> _TrioDeadline:
        self._scope = self._block.__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        suppressed = self._block.__exit__(*exc)
        if self.expired():
            raise TimeoutError
        return suppressed

    def expired(self) -> bool:
        return self._scope is not None and self._scope.cancelled_caught


class _TrioTask:
    """:class:`TaskHandle` over a system task with its own cancel scope."""

    __slots__ = ("_cancelled", "_done", "_scope")

    def __init__(self, fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._cancelled = False
        # The caller's context, as asyncio's create_task copies it (request
        # ids, tracing spans the layer synchronizer reads).
        trio.lowlevel.spawn_system_task(
            self._run, fn, name=name, context=contextvars.copy_context()
        )

    async def _run(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            with self._scope:
                # A cancel before the task first ran stops it here, before
                # anything is sent (an asyncio task cancelled before it
                # starts never runs).
                await trio.lowlevel.checkpoint_if_cancelled()
                await fn()
        except Exception:  # an error in a system task would end the whole run
            log.exception("aiokvcache: background task failed")
        finally:
            self._cancelled = self._scope.cancelled_caught
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        if self._done.is_set():
            return False
        self._scope.cancel()
        return True

    async def join(self) -> None:
        try:
            await self._done.wait()
        except trio.Cancelled:
            # Like awaiting an asyncio task: the caller's cancel stops the
            # task, and the caller resumes only once it ended.
            self._scope.cancel()
            with trio.CancelScope(shield=True):
                await self._done.wait()
            raise

    async def wait_done(self, timeout: float | None) -> bool:
        with real_move_on_after(timeout):
            await self._done.wait()
        return self._done.is_set()


class TrioSide(LoopSide):
    """The owner is a trio run (also anyio on trio)."""

    name = "trio"
    Cancelled = trio.Cancelled

    def __init__(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._watched: set[int] = set()

    def is_current(self) -> bool:
        try:
            return trio.lowlevel.current_trio_token() is self.token
        except RuntimeError:
            return False

    def check_can_close(self) -> None:
        if not self.is_current():
            raise RuntimeError(
                "aiokvcache: finalize() must be awaited in the trio run that ran init(), "
                f"not in {self.describe_current()}"
            )

    def time(self) -> float:
        # Real time, as deadline(): a call's timeout= bounds what the native
        # engine and peers do, which no virtual clock (MockClock) drives.
        return time.monotonic()

    def future(self) -> TrioWaiter:
        return TrioWaiter()

    def watch_fd(self, fd: int, on_readable: Callable[[], None], busy: Callable[[], bool]) -> None:
        self._watched.add(fd)
        trio.lowlevel.spawn_system_task(
            self._watch, fd, on_readable, busy, name=f"aiokvcache.completions(fd={fd})"
        )

    async def _watch(
        self, fd: int, on_readable: Callable[[], None], busy: Callable[[], bool]
    ) -> None:
        try:
            while fd in self._watched:
                await trio.lowlevel.wait_readable(fd)
                if fd in self._watched:
                    on_readable()
        except trio.ClosedResourceError:
            return  # unwatched
        except trio.Cancelled:
            # The run is ending and cancels every system task at once: a
            # cancelled transfer (the layer-wise task's) may still wait,
            # shielded, for releases only this watch reports. Report them.
            with trio.CancelScope(shield=True):
                await self._drain_while(fd, on_readable, busy)
            raise

    async def _drain_while(
        self, fd: int, on_readable: Callable[[], None], busy: Callable[[], bool]
    ) -> None:
        while fd in self._watched and busy():
            try:
                with real_move_on_after(0.05):  # a safety net, as the engine's
                    await trio.lowlevel.wait_readable(fd)
            except trio.ClosedResourceError:
                return
            if fd in self._watched:
                on_readable()

    def unwatch_fd(self, fd: int) -> None:
        if fd in self._watched:
            self._watched.discard(fd)
            trio.lowlevel.notify_closing(fd)

    @trio.lowlevel.enable_ki_protection
    async def settle(self, fut: Waiter[Any]) -> None:
        # Shielded from cancellation; and a Ctrl-C, which trio delivers to
        # the main task at any checkpoint, shields or not, is held until the
        # release (bounded by the engine's graces) and raised right after.
        assert isinstance(fut, TrioWaiter)
        interrupted = await _wait_holding_ki(fut.wait, fut.done)
        if interrupted is not None:
            raise interrupted
        await trio.lowlevel.checkpoint_if_cancelled()

    def deadline(self, seconds: float | None) -> Deadline:
        return _TrioDeadline(seconds)

    async def sleep(self, seconds: float) -> None:
        # Real time, as deadline(): the library sleeps to let native work or
        # a peer's bytes happen (testing.assert_still watches for late writes).
        if real_clock():
            await trio.sleep(seconds)
            return
        with real_move_on_after(seconds):
            await trio.sleep_forever()

    async def from_service(self, cf: concurrent.futures.Future[T]) -> T:
        event = trio.Event()
        token = self.token

        def wake(_: concurrent.futures.Future[T]) -> None:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass  # the run ended: nobody waits any more

        cf.add_done_callback(wake)
        try:
            await event.wait()
        except trio.Cancelled:
            cf.cancel()  # run_coroutine_threadsafe cancels the service task
            raise
        if cf.cancelled():
            raise ServiceGone("the peer-service thread stopped")
        return cf.result()

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        # abandon_on_cancel=False: a cancel waits for fn's end; fn's own
        # error comes first, else the cancellation.
        result = await trio.to_thread.run_sync(fn, *args)
        await trio.lowlevel.checkpoint_if_cancelled()
        return result

    @trio.lowlevel.enable_ki_protection
    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        # In a system task: trio cancels those only when the run ends (and it
        # cannot end while we wait here) and never delivers Ctrl-C to them,
        # so the work runs to its end whatever reaches the caller meanwhile.
        done = trio.Event()
        outcome: list[Any] = []

        async def work() -> None:
            try:
                outcome.append((True, await coro))
            except BaseException as exc:  # handed to the caller, below
                outcome.append((False, exc))
            finally:
                done.set()

        trio.lowlevel.spawn_system_task(
            work, name="aiokvcache.shielded", context=contextvars.copy_context()
        )
        interrupted = await _wait_holding_ki(done.wait, done.is_set)
        ok, value = outcome[0]
        if not ok:
            raise value
        if interrupted is not None:
            raise interrupted
        await trio.lowlevel.checkpoint_if_cancelled()
        return value  # type: ignore[no-any-return]

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> TaskHandle:
        return _TrioTask(fn, name)

    async def gather(self, aws: Sequence[Awaitable[T]]) -> list[T]:
        results: list[Any] = [None] * len(aws)
        first: list[Exception] = []
        try:
            await self._gather(aws, results, first)
        except BaseExceptionGroup as group:
            # The children keep Cancelled and errors to themselves: what comes
            # out is KeyboardInterrupt or SystemExit, raised plain.
            raise _first_leaf(group) from None
        await trio.lowlevel.checkpoint_if_cancelled()
        if first:
            raise first[0]
        return results

    async def _gather(
        self, aws: Sequence[Awaitable[T]], results: list[Any], first: list[Exception]
    ) -> None:
        async with trio.open_nursery() as nursery:

            async def one(i: int, aw: Awaitable[T]) -> None:
                try:
                    results[i] = await aw
                except trio.Cancelled:
                    # The scope that was cancelled stays cancelled: the
                    # checkpoint below raises for an outer one.
                    return
                except Exception as exc:
                    if not first:
                        first.append(exc)
                        nursery.cancel_scope.cancel()

            for i, aw in enumerate(aws):
                nursery.start_soon(one, i, aw)


async def _wait_holding_ki(
    wait: Callable[[], Awaitable[None]], done: Callable[[], bool]
) -> KeyboardInterrupt | None:
    """``wait()`` until ``done()``, shielded from cancellation, through any
    Ctrl-C (trio delivers it to the main task at checkpoints, shields or
    not): the interrupt that came meanwhile, for the caller to raise after."""
    interrupted: KeyboardInterrupt | None = None
    with trio.CancelScope(shield=True):
        while not done():
            try:
                await wait()
            except KeyboardInterrupt as exc:
                interrupted = exc
    return interrupted


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
