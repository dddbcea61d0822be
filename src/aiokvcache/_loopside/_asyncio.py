"""The asyncio side of :mod:`aiokvcache._loopside` (also anyio on asyncio)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ._base import Deadline, LoopSide, ServiceGone, TaskHandle, Waiter

__all__ = ["AsyncioSide", "settle"]

T = TypeVar("T")

_running_loop = asyncio.events._get_running_loop

async def settle(fut: asyncio.Future[Any]) -> None:
    """Wait until the asyncio future ``fut`` is done, even through
    cancellation, then re-raise the cancellation (see :meth:`LoopSide.settle`)."""
    interrupted: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            interrupted = exc
        except Exception:
            break  # done, with an error the caller reads from fut
    if interrupted is not None:
        raise interrupted


class _AsyncioTask:
    """:class:`TaskHandle` over an ``asyncio.Task``."""

    __slots__ = ("_task",)

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    def done(self) -> bool:
        return self._task.done()

    def cancelled(self) -> bool:
        return self._task.done() and self._task.cancelled()

    def cancel(self) -> bool:
        return self._task.cancel()

    async def join(self) -> None:
        # Like awaiting the task itself: cancelling the caller cancels it,
        # and the caller resumes only once it ended.
        await self._task

    async def wait_done(self, timeout: float | None) -> bool:
        if self._task.done():
            return True
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        return bool(done)


class _AsyncioDeadline:
    """:class:`Deadline` over ``asyncio.timeout``."""

    __slots__ = ("_cm",)

    def __init__(self, seconds: float | None) -> None:
        self._cm = asyncio.timeout(seconds)

    async def __aenter__(self) -> _AsyncioDeadline:
        await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        await self._cm.__aexit__(*exc)
        return None

    def expired(self) -> bool:
        return self._cm.expired()


class AsyncioSide(LoopSide):
    """The owner loop is an asyncio loop (also anyio on asyncio)."""

    name = "asyncio"
    Cancelled = asyncio.CancelledError

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()

    def is_current(self) -> bool:
        # Per transfer call: the C function that returns None off-loop.
        return _running_loop() is self.loop

    def check_can_close(self) -> None:
        # The loop that ran init(), or any asyncio loop once that one no
        # longer runs (closed, or stopped): then nobody is left to wake. While
        # it runs in another thread, its waiters and its reader are its own.
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("aiokvcache: finalize() must be awaited on an event loop") from None
        owner = self.loop
        if running is not owner and owner.is_running() and not owner.is_closed():
            raise RuntimeError(
                "aiokvcache: finalize() must be awaited on the event loop that ran init() "
                "while that loop runs (it runs in another thread)"
            )

    def time(self) -> float:
        return self.loop.time()

    def future(self) -> asyncio.Future[Any]:
        return self.loop.create_future()

    def watch_fd(self, fd: int, on_readable: Callable[[], None], busy: Callable[[], bool]) -> None:
        # A reader outlives the tasks: asyncio.run's shutdown still runs it.
        self.loop.add_reader(fd, on_readable)

    def unwatch_fd(self, fd: int) -> None:
        self.loop.remove_reader(fd)

    async def settle(self, fut: Waiter[Any]) -> None:
        assert isinstance(fut, asyncio.Future)
        await settle(fut)

    def deadline(self, seconds: float | None) -> Deadline:
        return _AsyncioDeadline(seconds)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def from_service(self, cf: concurrent.futures.Future[T]) -> T:
        # wrap_future's result is set on the running loop; cancelling it cancels cf.
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if cf.cancelled() and task is not None and not task.cancelling():
                raise ServiceGone("the peer-service thread stopped") from None
            raise

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            await settle(work)  # returns only once fn ended
        finally:
            if work.done() and not work.cancelled():
                work.result()  # fn's own error comes first (and is retrieved)
        return work.result()

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        work = asyncio.ensure_future(coro)
        await settle(work)
        return work.result()

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> TaskHandle:
        return _AsyncioTask(self.loop.create_task(fn(), name=name))

    async def gather(self, aws: Sequence[Awaitable[T]]) -> list[T]:
        tasks = [asyncio.ensure_future(aw) for aw in aws]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await settle(asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True)))
            raise
