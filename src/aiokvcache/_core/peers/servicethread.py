"""The peer-service thread: its own asyncio loop, and how other threads reach it.

The owner reaches the loop through :meth:`ServiceThread.call` (a coroutine
run on the service loop; the owner awaits the ``concurrent.futures.Future``
through its :class:`~aiokvcache._loopside.LoopSide`, which is woken on the
owner's own loop, asyncio or trio) and :meth:`ServiceThread.spawn` (fire and
track). Nothing here completes a future of the owner's loop itself.

An error that reaches the service loop's exception handler is a bug: it is
logged on the ``aiokvcache.service`` logger at ERROR.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..._loopside import FINE, poll

__all__ = ["ReleaseWatch", "ServiceThread", "until"]

log = logging.getLogger("aiokvcache")
service_log = logging.getLogger("aiokvcache.service")

T = TypeVar("T")

# Native releases and endpoint closes are polled (never waited for in an
# executor thread a hostile peer could tie up): _loopside.poll.


async def until(
    done: Callable[[], bool], timeout: float | None = None, fine: bool = False
) -> bool:
    """Poll ``done()`` on the running (service) loop until it is true (True)
    or ``timeout`` seconds pass (False), backing off from 0.5 to 20 ms
    (``fine``: :data:`_loopside.FINE`, about 1 ms steps for the first ~8 ms)."""
    loop = asyncio.get_running_loop()
    if fine:
        return await poll(done, timeout, asyncio.sleep, loop.time, FINE)
    return await poll(done, timeout, asyncio.sleep, loop.time)


class ReleaseWatch:
    """Wakes service-loop waiters when the engine releases a job: one reader
    on the engine's release signal (``Engine.release_fd``) for all of them.

    A waiter arms the signal, then checks its condition, then waits for the
    signal (or a pause of the default schedule, as a backstop): a release
    after the check writes the eventfd, whose reader runs only once the
    waiter waits (one thread). A probe's put, seen about 1 ms late by
    :data:`_loopside.FINE`'s polls on asyncio's selector loop, is now seen
    as soon as the engine releases it.
    """

    #: The backstop's pauses: from this, doubling up to ``backstop_max_s``.
    backstop_first_s = 0.0005
    backstop_max_s = 0.02

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1  # our dup of the engine's descriptor (it closes its own at close)
        self._waiters: set[asyncio.Future[None]] = set()
        self._closed = False

    def _watch(self, loop: asyncio.AbstractEventLoop) -> bool:
        if self._closed:
            return False
        if self._loop is None:
            try:
                fd = os.dup(self._engine.release_fd)  # -1 once the engine closed
            except OSError:
                self._closed = True  # poll
                return False
            try:
                loop.add_reader(fd, self._on_signal)
            except (OSError, ValueError, NotImplementedError):
                os.close(fd)
                self._closed = True  # no reader here: poll
                return False
            self._fd, self._loop = fd, loop
        return self._loop is loop

    def _on_signal(self) -> None:
        try:
            os.read(self._fd, 8)
        except OSError:
            pass  # read empty already (BlockingIOError)
        self._wake_all()

    async def until(self, done: Callable[[], bool], timeout: float) -> bool:
        """:func:`until` for a condition that only a job's release makes true."""
        loop = asyncio.get_running_loop()
        if not self._watch(loop):
            return await until(done, timeout, fine=True)
        end = loop.time() + timeout
        pause = self.backstop_first_s
        while True:
            self._engine.arm_release_signal()
            if done():
                return True
            left = end - loop.time()
            if left <= 0:
                return False
            fut = loop.create_future()
            self._waiters.add(fut)
            backstop = loop.call_later(min(pause, left), _wake, fut)
            try:
                await fut
            finally:
                backstop.cancel()
                self._waiters.discard(fut)
            pause = min(pause * 2, self.backstop_max_s)

    def close(self) -> None:
        """Stop watching and close our descriptor (service loop); later waits poll."""
        self._closed = True
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd, self._loop = -1, None
        self._wake_all()

    def __del__(self) -> None:
        # Never closed (a service that never finalized): nothing watches it
        # any more, since a loop's reader would have kept this object alive.
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            _wake(fut)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    if _grpc_event_for_a_closed_loop(context, exc):
        # grpc's aio poller (etcd discovery, aetcd) hands each completion to
        # the loop its call was made on, from whichever loop reads the
        # events: an RPC of another instance of this process that ended with
        # its loop (finalized) arrives here late. Nothing of ours.
        service_log.debug("aiokvcache: grpc event for a closed loop ignored: %s", exc)
        return
    service_log.error(
        "aiokvcache: unhandled error on the peer-service loop: %s",
        context.get("message", "?"),
        exc_info=(type(exc), exc, exc.__traceback__) if isinstance(exc, BaseException) else None,
        extra={"context": context},
    )


def _grpc_event_for_a_closed_loop(context: dict[str, Any], exc: object) -> bool:
    """A grpc aio poller callback that failed on another loop being closed."""
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and "PollerCompletionQueue" in repr(context.get("handle"))
    )


def _name_os_thread(name: bytes) -> None:
    """The calling thread's OS name (Linux, 15 bytes; best effort)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class ServiceThread:
    """One daemon thread running one asyncio loop, and the background tasks on it."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_on_loop_error)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        _name_os_thread(b"akv-service")  # top -H, /proc/PID/task/*/comm
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The service loop (use it from the service thread only)."""
        return self._loop

    def in_service(self) -> bool:
        """True when called on the service thread."""
        return threading.current_thread() is self._thread

    def call(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the service loop; its result, for the caller's
        :meth:`~aiokvcache._loopside.LoopSide.from_service` to await.

        Cancelling the returned future cancels the coroutine's task.
        """
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the service loop in the background (from any thread)."""
        return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)

    async def _tracked(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokvcache: background task failed")
            return None
        finally:
            self._tasks.discard(task)

    async def cancel_spawned(self) -> None:
        """Cancel every task :meth:`spawn` started and wait until they ended (service loop)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def stop(self) -> None:
        """Stop the loop (pending tasks are cancelled) and join the thread."""
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if not self.in_service():
            self._thread.join(timeout=10)
