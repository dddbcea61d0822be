"""An integration's aiokvcache engine on an asyncio loop of its own thread.

A serving engine's scheduler and worker code is synchronous; the vLLM
connector's :class:`~aiokvcache.integrations.agent.TransferAgent` and the
SGLang backend's ``RankEngine`` each run their ``LLMDataDist`` on a loop in a
daemon thread and post work to it. :class:`LoopThread` is that thread:
``start`` runs the subclass's ``_init`` on the new loop (its result returned,
its error raised in the caller), the loop then serves until ``close``, which
runs ``_shutdown`` on it last. ``_post`` hands a callable to the loop and
raises once the engine is closing; ``_spawn`` starts a task the shutdown
cancels.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class LoopThread:
    """A daemon thread running an asyncio loop for one engine."""

    thread_name = "aiokvcache"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = threading.Lock()
        self._closed = False
        self.address = ""

    async def _init(self) -> str:
        """Runs first on the loop: starts the engine; its listen address."""
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """Runs last on the loop, after ``close``."""

    def _enter_thread(self) -> None:
        """Runs first on the new thread (before its loop exists)."""

    def _exit_thread(self) -> None:
        """Runs last on the thread."""

    def start(self, timeout: float = 60.0) -> str:
        """Start the thread and the engine; the ``"host:port"`` it listens on."""
        started = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            self._enter_thread()
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                box["address"] = loop.run_until_complete(self._with_loop(loop))
            except BaseException as exc:  # reported to start()'s caller
                box["error"] = exc
                started.set()
                loop.close()
                self._exit_thread()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()
                self._exit_thread()

        self._thread = threading.Thread(target=main, name=self.thread_name, daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"aiokvcache did not start within {timeout} s")
        if "error" in box:
            raise RuntimeError(f"aiokvcache failed to start: {box['error']}") from box["error"]
        self.address = str(box["address"])
        return self.address

    async def _with_loop(self, loop: asyncio.AbstractEventLoop) -> str:
        self._loop = loop
        return await self._init()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: what is in flight is cancelled (and quiescent) first."""
        loop, thread = self._loop, self._thread
        with self._closing:
            self._closed = True
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` on the engine's loop; ``RuntimeError`` once it is closing."""
        with self._closing:
            loop = self._loop
            if self._closed or loop is None or loop.is_closed():
                raise RuntimeError("the aiokvcache engine is closed")
            loop.call_soon_threadsafe(fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _cancel_tasks(self) -> None:
        """Cancel every spawned task, and those spawned meanwhile; wait for all."""
        while self._tasks:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
