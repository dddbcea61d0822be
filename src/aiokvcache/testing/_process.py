"""Child processes from async tests, on asyncio or trio (anyio underneath).

:class:`JsonChild` starts any program that speaks JSON lines (it prints a
hello object when ready, then answers each request line with one line:
:mod:`aiokvcache._child`), and can stop it (``SIGSTOP``), let it go on
(``SIGCONT``), slow it down (run it only part of the time) or kill it.
:class:`PeerProcess` is the one users start: an ``LLMDataDist`` in a child
process (:mod:`aiokvcache.testing.peer`).

A frozen peer's process is stopped: its progress thread, its control plane
and its keep-alives all stop, as when a host hangs. A slowed peer is stopped
and continued in turn (``duty`` of every ``period`` running), from a thread
of this process, so it crawls whatever this process's loop does: over TCP
its reads of our puts crawl with it, so a push to it does; over shared
memory our puts land in its mapped memory whatever it does, and what crawls
is its answers (lookups, notifications).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, Any, Self

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .._child import PeerExited, checked, is_answer, json_object
from . import peer_argv
from ._clock import real_fail_after, real_move_on_after

__all__ = ["JsonChild", "PeerProcess", "freeze_process", "process_frozen"]

_MAX_LINE = 1 << 22


def process_frozen(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped now (``SIGSTOP``
    or a tracer). False for a process that is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = (_state(f"/proc/{pid}/task/{tid}/stat") for tid in tids)
    # None: a thread that just exited.
    return all(state in (None, b"T", b"t") for state in states)


def _state(stat: str) -> bytes | None:
    """The state letter in a ``/proc/.../stat`` file, None if it is gone."""
    try:
        with open(stat, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _wait_frozen(pid: int, timeout: float) -> float:
    end = time.monotonic() + timeout
    pause = 0.0002
    while not process_frozen(pid):
        if _state(f"/proc/{pid}/stat") in (
            None,
            b"Z",
            b"X",
        ):  # exited (a zombie not reaped yet too)
            raise ProcessLookupError(pid)
        if time.monotonic() > end:
            raise TimeoutError(f"process {pid} not stopped {timeout:g} s after SIGSTOP")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return time.monotonic()


def freeze_process(pid: int, timeout: float = 5.0) -> float:
    """``SIGSTOP`` process ``pid`` and return once every one of its threads
    is stopped: ``time.monotonic()`` then.

    ``kill()`` only queues the stop: each thread stops when it next runs
    kernel code, and on a busy machine a thread waiting for a core (a
    progress thread woken by our bytes, say) can still run for a while
    after ``kill()`` returned. A test that then asserts nothing was
    answered would fail for the machine's load. :class:`ProcessLookupError`
    if it is gone or exits meanwhile (a zombie included); :class:`TimeoutError`
    if it is not stopped in ``timeout`` seconds (a process in uninterruptible
    sleep stops only when it wakes)."""
    if _state(f"/proc/{pid}/stat") in (None, b"Z", b"X"):
        raise ProcessLookupError(pid)
    os.kill(pid, signal.SIGSTOP)
    return _wait_frozen(pid, timeout)


class _Slower:
    """Stops and continues a process in turn, from a thread, until stopped."""

    def __init__(self, pid: int, duty: float, period: float) -> None:
        self._pid = pid
        self._run_s = period * duty
        self._stop_s = period * (1 - duty)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name="aiokvcache-slow", daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self._pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _main(self) -> None:
        while not self._done.is_set():
            if not self._signal(signal.SIGCONT) or self._done.wait(self._run_s):
                break
            if not self._signal(signal.SIGSTOP):
                break
            self._done.wait(self._stop_s)
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop slowing; the process runs (continued) when this returns."""
        self._done.set()
        self._thread.join()


class JsonChild:
    """A child program speaking JSON lines: ``async with JsonChild(argv) as child``.

    Started (up to its hello line, :attr:`hello`) on entering the block or
    by :meth:`start`; :meth:`close` (the end of the block, failing or not,
    cancelled or not) ends it and reaps it. Lines on its stdout that are not
    JSON objects (log lines) are skipped; its stderr is ours unless
    ``stderr`` says otherwise.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        label: str | None = None,
        startup_timeout: float = 60,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.label = label or os.path.basename(self.argv[0])
        self.hello: dict[str, Any] = {}
        self.proc: anyio.abc.Process | None = None
        self._startup_timeout = startup_timeout
        self._env = None if env is None else dict(env)
        self._stderr = stderr
        self._out: BufferedByteReceiveStream | None = None
        self._skipped: list[str] = []
        self._slower: _Slower | None = None
        self._requests = 0
        self.killed = False

    # ------------------------------------------------------------ lifetime

    def _proc(self) -> anyio.abc.Process:
        if self.proc is None:
            raise RuntimeError(f"{self.label} is not started")
        return self.proc

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc().pid

    @property
    def returncode(self) -> int | None:
        """Its exit status; None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.returncode

    @property
    def address(self) -> str:
        """Its control-plane address, ``ip:port``, from its hello (``ValueError``
        if it does not listen)."""
        address = self.hello.get("address")
        if not address:
            raise ValueError(f"{self.label} does not listen")
        return str(address)

    async def start(self) -> Self:
        """Start it and wait for its hello line (killed and reaped if that fails)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.label} is already started")
        self.proc = await anyio.open_process(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
        )
        assert self.proc.stdout is not None
        self._out = BufferedByteReceiveStream(self.proc.stdout)
        try:
            self.hello = await self.read_json(self._startup_timeout)
        except BaseException:
            await self.close(grace=0)
            raise
        return self

    async def close(self, grace: float = 10) -> int | None:
        """End it: continue it if stopped, end its input, give it ``grace``
        seconds, then kill it; reap it. Idempotent, and it completes even
        when the caller is cancelled."""
        proc = self.proc
        if proc is None:
            return None
        with anyio.CancelScope(shield=True):
            self.slow(None)
            if proc.returncode is None:  # a stopped child would never read its end of input
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
            if proc.stdin is not None:
                with contextlib.suppress(Exception):
                    await proc.stdin.aclose()
            if proc.returncode is None:
                with real_move_on_after(grace):
                    await proc.wait()
            if proc.returncode is None:
                await self.kill()
            await proc.wait()
            with contextlib.suppress(Exception):
                await proc.aclose()
        return proc.returncode

    async def __aenter__(self) -> Self:
        if self.proc is None:
            await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ requests

    async def send(self, obj: Mapping[str, Any]) -> None:
        """Write one JSON line to its stdin."""
        stdin = self._proc().stdin
        assert stdin is not None
        try:
            await stdin.send((json.dumps(dict(obj)) + "\n").encode())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise PeerExited(f"{self.label} exited (rc {self.returncode})") from exc

    async def read_json(self, timeout: float = 60) -> dict[str, Any]:
        """The next line that is a JSON object, skipping others; ``TimeoutError``
        after ``timeout`` seconds, :class:`PeerExited` when it ends first."""
        out = self._out
        assert out is not None
        with real_fail_after(timeout):
            while True:
                try:
                    raw = await out.receive_until(b"\n", _MAX_LINE)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                    with real_move_on_after(1):
                        await self._proc().wait()
                    raise PeerExited(
                        f"{self.label} exited (rc {self.returncode}): "
                        f"last lines {self._skipped[-5:]}"
                    ) from None
                line = raw.decode(errors="replace")
                obj = json_object(line)
                if obj is not None:
                    return obj
                self._skipped = [*self._skipped[-4:], line.rstrip()]

    async def call(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, "id": n, **args}``; its answer (:class:`PeerError`
        if an error). The answers to earlier requests that timed out (or whose
        caller was cancelled) are skipped: they carry those requests' ids."""
        self._requests += 1
        rid = self._requests
        await self.send({"op": op, "id": rid, **args})
        with real_fail_after(timeout):
            while True:
                reply = await self.read_json(timeout)
                if is_answer(reply, rid):
                    return checked(reply, op)

    # ------------------------------------------------------------ faults

    def signal(self, sig: int) -> float:
        """Send ``sig``; ``time.monotonic()`` just after it was sent
        (:class:`PeerExited` if it is gone). ``SIGSTOP`` returns once every
        thread of the child is stopped (:func:`freeze_process`)."""
        proc = self._proc()
        try:
            # Through the process object, which knows whether it reaped the
            # child (its pid may belong to another process then).
            if proc.returncode is not None:
                raise ProcessLookupError(proc.pid)
            proc.send_signal(signal.Signals(sig))
            if sig == signal.SIGSTOP:
                return _wait_frozen(proc.pid, 5.0)
        except ProcessLookupError:
            raise PeerExited(f"{self.label} exited (rc {self.returncode})") from None
        return time.monotonic()

    def freeze(self) -> float:
        """Stop it (``SIGSTOP``): nothing in it runs until :meth:`thaw`.
        Returns once every thread of it is stopped, ``time.monotonic()``
        then."""
        self.slow(None)
        return self.signal(signal.SIGSTOP)

    def thaw(self) -> float:
        """Let a frozen (or slowed) child run again (``SIGCONT``). A child
        that is gone is no error here: a ``finally: peer.thaw()`` must not
        hide why the test failed."""
        self.slow(None)
        with contextlib.suppress(PeerExited):
            self.signal(signal.SIGCONT)
        return time.monotonic()

    def slow(self, duty: float | None, period: float = 0.02) -> None:
        """Run it only ``duty`` (0 < duty < 1) of every ``period`` seconds,
        stopped the rest, until ``slow(None)``, :meth:`thaw` or :meth:`close`."""
        if self._slower is not None:
            self._slower.stop()
            self._slower = None
        if duty is None:
            return
        if not 0 < duty < 1:
            raise ValueError(f"duty must be between 0 and 1 (exclusive), got {duty!r}")
        if not period > 0:
            raise ValueError(f"period must be > 0 seconds, got {period!r}")
        self._slower = _Slower(self.pid, duty, period)

    async def kill(self) -> None:
        """``SIGKILL`` it now and reap it."""
        proc = self._proc()
        self.killed = True
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.wait()


class PeerProcess(JsonChild):
    """An ``LLMDataDist`` in a child process: ``async with PeerProcess() as peer``.

    ``role`` "decoder" (cluster 2, listening on 127.0.0.1, the default) or
    "prefill" (cluster 1, listening only with ``listen``); ``options``: extra
    :class:`~aiokvcache.LLMConfig` attributes (``{"auth_token": ...}``;
    ``sync_kv_timeout`` is 60 s unless given); ``lifetime``: it exits after
    that many seconds whatever happens (a test killed hard leaves no
    process behind for long). Its hello gives
    :attr:`address` ("ip:port", when it listens), :attr:`cluster_id` and its
    pid. Caches are named by the caller; the requests (see
    :mod:`aiokvcache.testing.peer` for all of them) have methods here. A
    transfer's failure is an answer (``status``, an ``LLMStatusCode``
    name), not an exception.
    """

    def __init__(
        self,
        role: str = "decoder",
        transport: str = "auto",
        *,
        cluster_id: int | None = None,
        listen: str | None = None,
        options: Mapping[str, Any] | None = None,
        lifetime: float | None = 600,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        startup_timeout: float = 60,
    ) -> None:
        if role not in ("decoder", "prefill"):
            raise ValueError(f"role must be 'decoder' or 'prefill', got {role!r}")
        args = [transport]
        if cluster_id is not None:
            args.append(f"--cluster-id={cluster_id}")
        if listen is not None:
            args.append(f"--listen={listen}")
        if options:
            args.append(f"--options={json.dumps(dict(options))}")
        super().__init__(
            peer_argv(role, *args, lifetime=lifetime),
            label=f"peer {role}",
            startup_timeout=startup_timeout,
            env=env,
            stderr=stderr,
        )
        self.role = role

    @property
    def cluster_id(self) -> int:
        """Its cluster id."""
        return int(self.hello["cluster_id"])

    async def alloc(
        self,
        name: str,
        tensors: int,
        nbytes: int,
        *,
        blocks: int | None = None,
        seed: int | None = None,
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Allocate cache ``name``: ``tensors`` uint8 tensors of ``nbytes``
        each, shape ``[1, nbytes]``, or with ``blocks`` a blocks cache of
        ``[blocks, nbytes // blocks]`` bound to ``BlocksCacheKey(cluster_id,
        model_id=0)``; filled from ``seed`` if given. Returns its
        ``cache_id``, ``addrs`` and ``sha``."""
        return await self.call(
            "alloc", timeout, name=name, tensors=tensors, bytes=nbytes, blocks=blocks, seed=seed
        )

    async def sha(self, name: str, *, blocks: Sequence[int] | None = None) -> str:
        """sha256 of cache ``name``'s bytes (tensor by tensor; only ``blocks``
        of each, in that order, when given)."""
        reply = await self.call(
            "hash", name=name, blocks=None if blocks is None else [int(b) for b in blocks]
        )
        return str(reply["sha"])

    async def wait_for_layers(
        self, tag: str, layers: Sequence[int], timeout: float = 30
    ) -> dict[str, Any]:
        """Its ``wait_for_layers(tag, layers)``: ``status`` "LLM_SUCCESS" once
        every layer landed, else the failure's status."""
        return await self.call(
            "wait", timeout + 30, tag=tag, layers=[int(x) for x in layers], wait_timeout=timeout
        )

    async def push_layers(
        self,
        src: str,
        cluster_id: int,
        cache_id: int,
        tag: str,
        *,
        index: int = 0,
        layers: Sequence[int] | None = None,
        every_ms: float = 0,
        stop_after: int | None = None,
        freeze_at: int | None = None,
        call_timeout: float = 10,
    ) -> None:
        """Start pushing its cache ``src`` into batch ``index`` of cache
        ``cache_id`` of cluster ``cluster_id`` layer by layer, as a prefill
        does while it computes the next layer; returns at once
        (:meth:`join_layers` waits for the end). Each layer's push is tagged
        ``tag``, so the decode side's ``wait_for_layers`` and
        ``notifications()`` see it. ``layers`` (default every layer) in
        order, ``every_ms`` apart; only the first ``stop_after`` if given.
        With ``freeze_at`` k the peer stops itself (``SIGSTOP``) once layer
        k's jobs are submitted, its bytes moving, and pushes the next layers
        when :meth:`thaw` continues it; layers after k cannot land before. A
        :meth:`thaw` that comes before the freeze (after this call) cancels
        it."""
        await self.call(
            "push_layers", src=src, cluster_id=cluster_id, cache_id=cache_id, index=index,
            tag=tag, layers=None if layers is None else [int(x) for x in layers],
            every_ms=every_ms, stop_after=stop_after, freeze_at=freeze_at,
            call_timeout=call_timeout,
        )  # fmt: skip

    async def join_layers(self, tag: str, timeout: float = 60) -> dict[str, Any]:
        """Wait for :meth:`push_layers` of ``tag`` to end: ``layers`` (each
        layer's status name, keyed by the layer as a string), ``ok``,
        ``failed`` (the first failures, with their messages) and, with
        ``freeze_at``, ``froze_mid_layer`` (whether that layer's push was still
        moving when the peer stopped; None when a thaw cancelled the freeze)."""
        return await self.call("loop_join", timeout + 30, loop="layers:" + tag, wait=timeout)

    async def frozen(self) -> bool:
        """Whether it is stopped now, every thread of it (by :meth:`freeze`
        or by itself)."""
        return process_frozen(self.pid)

    async def link(self, address: str, cluster_id: int, timeout_ms: int = 5000) -> dict[str, Any]:
        """Link to ``address`` (cluster ``cluster_id``): ``status`` and ``per``."""
        return await self.call(
            "link", address=address, cluster_id=cluster_id, timeout_ms=timeout_ms
        )

    async def stats(self) -> dict[str, int]:
        """Its ``cache_manager.stats()``."""
        return {k: int(v) for k, v in (await self.call("stats")).items() if k != "id"}

    async def health(self, timeout: float = 30) -> dict[str, Any]:
        """Its native jobs still live (``live_jobs``) and the errors that
        reached its peer-service loop or that the library logged with a
        traceback (``service_errors``)."""
        return await self.call("health", timeout)
