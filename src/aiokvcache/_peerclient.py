"""The parent's side of the peer program (``python -m aiokvcache._peer``).

:class:`Child` speaks lines to any child process; :class:`Peer` and
:class:`AsyncPeer` speak the peer program's JSON requests. The protocol and
the modes are described in :mod:`aiokvcache.testing`, which makes these
names public.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, Any, Self

__all__ = ["AsyncPeer", "Child", "Peer", "PeerError", "PeerExited", "peer_argv"]


class PeerError(RuntimeError):
    """A child process answered with an error, or broke the protocol."""


class PeerExited(PeerError):
    """A child process ended (or closed its stdout) while we waited for it."""


def peer_argv(
    mode: str, *args: str, lifetime: float | None = None, netns: str | None = None
) -> list[str]:
    """The command line of the peer program in ``mode`` (see the module docs),
    run inside network namespace ``netns`` if given (``ip netns exec``, which
    execs the program itself: the child's pid is the peer's)."""
    argv = [sys.executable, "-m", "aiokvcache._peer", mode, *args]
    if lifetime is not None:
        argv.append(f"--lifetime={lifetime:g}")
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    return argv


def _json_object(line: str) -> dict[str, Any] | None:
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _checked(reply: dict[str, Any], op: str) -> dict[str, Any]:
    if "error" in reply:
        raise PeerError(f"peer failed {op!r}: {reply['error']}")
    return reply


class Child:
    """A child process spoken to in lines on its stdin and stdout.

    Lines are read with deadlines; lines that do not match what is asked for
    (build chatter, log lines) are skipped. :meth:`close` (also at the end
    of a ``with`` block, failing or not) ends it and reaps it: end of input
    first, then ``SIGKILL`` after a grace period.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stderr: int | IO[Any] | None = None,
        new_session: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=new_session,
            bufsize=0,
        )
        self.label = os.path.basename(self.argv[0])
        self._buf = b""
        self._eof = False
        self._skipped: collections.deque[str] = collections.deque(maxlen=5)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status, None while it runs."""
        return self.proc.poll()

    # ------------------------------------------------------------ lines

    def send_line(self, line: str) -> None:
        """Write one line to the child's stdin."""
        if self.proc.stdin is None or self.proc.stdin.closed:
            raise PeerExited("the child's stdin is closed")
        data = (line.rstrip("\n") + "\n").encode()
        fd = self.proc.stdin.fileno()
        try:
            while data:
                data = data[os.write(fd, data) :]
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise PeerExited(f"child exited (rc {self.proc.poll()})") from exc

    def send(self, obj: Mapping[str, Any]) -> None:
        """Write one JSON line."""
        self.send_line(json.dumps(dict(obj)))

    def _line(self, deadline: float) -> str | None:
        """The next line (no newline), None at end of output."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                raw, self._buf = self._buf[:nl], self._buf[nl + 1 :]
                return raw.decode(errors="replace").rstrip("\r")
            if self._eof:
                if self._buf:
                    raw, self._buf = self._buf, b""
                    return raw.decode(errors="replace")
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from {self.label}: last lines {list(self._skipped)}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._buf += chunk
                else:
                    self._eof = True

    def _exited(self) -> PeerExited:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1)
        return PeerExited(
            f"{self.label} exited (rc {self.proc.poll()}): last lines {list(self._skipped)}"
        )

    def read_line(self, prefix: str = "", timeout: float = 60) -> str:
        """The next line starting with ``prefix``, skipping others."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline)
            if line is None:
                raise self._exited()
            if line.startswith(prefix):
                return line
            self._skipped.append(line)

    def read_json(self, timeout: float = 60) -> dict[str, Any]:
        """The next line that is a JSON object, skipping others."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline)
            if line is None:
                raise self._exited()
            obj = _json_object(line)
            if obj is not None:
                return obj
            self._skipped.append(line)

    def read_rest(self, timeout: float = 60) -> str:
        """Everything it prints until it closes its stdout."""
        deadline = time.monotonic() + timeout
        out = []
        while (line := self._line(deadline)) is not None:
            out.append(line + "\n")
        return "".join(out)

    # ------------------------------------------------------------ lifetime

    def communicate(self, line: str | None = None, timeout: float = 60) -> str:
        """Send ``line`` (if any), close stdin, read the rest, wait; returns the rest."""
        if line is not None:
            self.send_line(line)
        self._close_stdin()
        out = self.read_rest(timeout)
        self.wait(timeout)
        return out

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit (``subprocess.TimeoutExpired`` past ``timeout``)."""
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """``SIGKILL`` it now and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def _close_stdin(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def close(self, grace: float = 10) -> int:
        """End it: close its stdin, give it ``grace`` seconds, then kill it. Idempotent."""
        self._close_stdin()
        if self.proc.poll() is None:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
        return self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Peer(Child):
    """The peer program (``python -m aiokvcache._peer MODE ...``), blocking.

    Starting it waits for its hello line (:attr:`hello`); if that fails the
    process is killed and reaped before the error propagates.
    """

    def __init__(
        self,
        mode: str,
        *args: str,
        startup_timeout: float = 60,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        new_session: bool = False,
    ) -> None:
        super().__init__(
            peer_argv(mode, *args, lifetime=lifetime),
            env=env,
            stderr=stderr,
            new_session=new_session,
        )
        self.mode = mode
        self.label = f"peer {mode}"
        try:
            self.hello: dict[str, Any] = self.read_json(startup_timeout)
        except BaseException:
            self.kill()
            self.close()
            raise

    @property
    def address(self) -> str:
        """Its control address, ``ip:port`` (modes ``decode`` and ``blocks``)."""
        return str(self.hello["address"])

    def call(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, **args}``; its answer (``PeerError`` if it is an error)."""
        self.send({"op": op, **args})
        return _checked(self.read_json(timeout), op)


class AsyncPeer:
    """The peer program on asyncio: ``async with AsyncPeer(mode, *args) as peer``.

    Started (up to its hello line) on entering the block, or by
    :meth:`start`; :meth:`close` (the end of the block, failing or not)
    ends it and reaps it.
    """

    def __init__(
        self,
        mode: str,
        *args: str,
        startup_timeout: float = 60,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        netns: str | None = None,
    ) -> None:
        self.mode = mode
        self.netns = netns
        self.argv = peer_argv(mode, *args, lifetime=lifetime, netns=netns)
        self._startup_timeout = startup_timeout
        self._env = None if env is None else dict(env)
        self._stderr = stderr
        self.proc: asyncio.subprocess.Process | None = None
        self.hello: dict[str, Any] = {}
        self._skipped: collections.deque[str] = collections.deque(maxlen=5)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc().pid

    @property
    def address(self) -> str:
        """Its control address, ``ip:port`` (modes ``decode`` and ``blocks``)."""
        return str(self.hello["address"])

    def _proc(self) -> asyncio.subprocess.Process:
        if self.proc is None:
            raise RuntimeError("the peer is not started")
        return self.proc

    async def start(self) -> Self:
        """Start it and wait for its hello line (killed and reaped if that fails)."""
        if self.proc is not None:
            raise RuntimeError("the peer is already started")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            limit=1 << 20,
        )
        try:
            self.hello = await self.read_json(self._startup_timeout)
        except BaseException:
            await self.kill()
            await self.close()
            raise
        return self

    async def send(self, obj: Mapping[str, Any]) -> None:
        """Write one JSON line."""
        stdin = self._proc().stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps(dict(obj)) + "\n").encode())
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise PeerExited(f"peer exited (rc {self._proc().returncode})") from exc

    async def read_json(self, timeout: float = 60) -> dict[str, Any]:
        """The next line that is a JSON object, skipping others."""
        stdout = self._proc().stdout
        assert stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                raw = await stdout.readline()
                if not raw:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._proc().wait(), 1)
                    raise PeerExited(
                        f"peer {self.mode} exited (rc {self._proc().returncode}): "
                        f"last lines {list(self._skipped)}"
                    )
                line = raw.decode(errors="replace")
                obj = _json_object(line)
                if obj is not None:
                    return obj
                self._skipped.append(line.rstrip())

    async def call(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, **args}``; its answer (``PeerError`` if it is an error)."""
        await self.send({"op": op, **args})
        return _checked(await self.read_json(timeout), op)

    def signal(self, sig: int) -> float:
        """Send ``sig`` (``signal.SIGSTOP``, ``SIGCONT``...); returns
        ``time.monotonic()`` just after it was sent."""
        self._proc().send_signal(sig)
        return time.monotonic()

    async def kill(self) -> None:
        """``SIGKILL`` it now and reap it."""
        proc = self._proc()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()

    async def close(self, grace: float = 10) -> int | None:
        """End it: end of input, ``grace`` seconds, then kill. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:  # a stopped peer would never read its end of input
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if proc.returncode is None:
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                await self.kill()
        return await proc.wait()

    async def __aenter__(self) -> Self:
        if self.proc is None:
            await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
