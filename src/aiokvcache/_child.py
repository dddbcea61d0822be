"""Child processes spoken to in JSON lines: both ends of the protocol.

The parent's end: :class:`Child` (blocking) starts any program, writes lines
to its stdin and reads its stdout with deadlines, skipping lines that are
not what it asks for (log lines, build chatter); it always kills and reaps
the child when it closes. The child's end: :func:`say` prints one JSON
object per line, :func:`serve` answers each request line ``{"op": ..., ...}``
with one JSON line (``{"error": ...}`` when the request failed) until
``{"op": "exit"}`` or end of input.

``python -m aiokvcache bench`` runs its decode side this way
(:mod:`aiokvcache._benchpeer`), :mod:`aiokvcache.testing` its peer process
(:mod:`aiokvcache.testing.peer`). Standard library only.
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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, Any, Self

__all__ = [
    "Child",
    "Handler",
    "JsonPeer",
    "PeerError",
    "PeerExited",
    "checked",
    "is_answer",
    "json_object",
    "say",
    "serve",
    "unknown",
]

#: A child program's request handler: one request in, one answer out.
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class PeerError(RuntimeError):
    """A child process answered with an error, or broke the protocol."""


class PeerExited(PeerError):
    """A child process ended (or closed its stdout) while we waited for it."""


def json_object(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it is none."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def is_answer(reply: dict[str, Any], request_id: int) -> bool:
    """Whether ``reply`` answers request ``request_id``: a reply that carries
    another id is the late answer to an earlier request (one that timed out)."""
    return bool(reply.get("id", request_id) == request_id)


def checked(reply: dict[str, Any], op: str) -> dict[str, Any]:
    """``reply``, or :class:`PeerError` when it is an error answer to ``op``."""
    if "error" in reply:
        raise PeerError(f"peer failed {op!r}: {reply['error']}")
    return reply


# ---------------------------------------------------------------- child's end


def say(obj: dict[str, Any]) -> None:
    """Print one JSON line on stdout (the child's hello and answers)."""
    print(json.dumps(obj), flush=True)


def unknown(req: dict[str, Any]) -> dict[str, Any]:
    """The answer to an op the program does not know."""
    return {"error": f"unknown op {req['op']!r}"}


async def serve(handle: Handler) -> None:
    """Answer request lines on stdin until ``exit`` or end of input (asyncio)."""
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            return
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ValueError(f"not a request: {line.strip()!r}")
        except ValueError as exc:
            say({"error": str(exc)})
            continue
        if req["op"] == "exit":
            return
        try:
            reply = await handle(req)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if "id" in req:  # the asker matches answers to requests by it
            reply = {**reply, "id": req["id"]}
        say(reply)


# ---------------------------------------------------------------- parent's end


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
            # poll, not select: select() refuses a descriptor past 1023, and
            # a serving process (or a long test run) has more open than that.
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            if poller.poll(max(1, int(left * 1000))):
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
            obj = json_object(line)
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


class JsonPeer(Child):
    """A child program that speaks JSON lines, blocking: started, it waits for
    its hello line (:attr:`hello`); if that fails the process is killed and
    reaped before the error propagates."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        label: str | None = None,
        startup_timeout: float = 60,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        new_session: bool = False,
    ) -> None:
        super().__init__(argv, env=env, stderr=stderr, new_session=new_session)
        if label is not None:
            self.label = label
        try:
            self.hello: dict[str, Any] = self.read_json(startup_timeout)
        except BaseException:
            self.kill()
            self.close()
            raise

    @property
    def address(self) -> str:
        """Its control address, ``ip:port``, from its hello."""
        return str(self.hello["address"])

    def call(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, "id": n, **args}``; its answer (``PeerError`` if it
        is an error). Answers to earlier requests that timed out are skipped."""
        self._requests = getattr(self, "_requests", 0) + 1
        rid = self._requests
        self.send({"op": op, "id": rid, **args})
        deadline = time.monotonic() + timeout
        while True:
            reply = self.read_json(max(0.0, deadline - time.monotonic()))
            if is_answer(reply, rid):
                return checked(reply, op)
