"""Helpers for tests, benchmarks and examples: a linked pair, a peer process.

Not part of the transfer API; it uses nothing but that API (``aiokvcache``),
the standard library and NumPy.

In one process:

* :func:`pair` (an async context manager) and :func:`make_pair`: a prompt
  :class:`~aiokvcache.LLMDataDist` (cluster 1) linked to a listening decoder
  (cluster 2), as a :class:`Pair`; :func:`options` and :func:`cluster_info`
  build what :meth:`~aiokvcache.LLMDataDist.init` and
  :meth:`~aiokvcache.LLMDataDist.link_clusters` take.
* :func:`fill`, :func:`snapshot`, :func:`same`, :func:`assert_still`,
  :func:`status_of`, :func:`blocks_desc`: small checks on caches.

Across processes:

* :class:`Child`: any child process spoken to in lines on stdin/stdout,
  always killed and reaped on :meth:`~Child.close` (a ``with`` block).
* :class:`Peer` (blocking) and :class:`AsyncPeer` (asyncio): the peer
  program, ``python -m aiokvcache._peer MODE ...``, spoken to in JSON lines:
  it prints one JSON object when ready (:attr:`Peer.hello`), then answers
  each request ``{"op": ..., ...}`` with one JSON object. Its modes:

  ``decode``
      the decode side of ``python -m aiokvcache bench``: a decoder
      (cluster 2) owning one KV cache of the bench's shape options;
      ``hello = {"address", "cache_id"}``; ops ``wait`` (``tag``: every
      layer of that tag landed), ``digest``.
  ``blocks TRANSPORT TENSORS BLOCKS BLOCK_BYTES``
      a decoder owning two uint8 blocks caches, ``BlocksCacheKey(2, 0)``
      zeroed and ``BlocksCacheKey(2, 1)`` filled from seed 99 (unless
      ``--no-pattern``); ``hello = {"address"}``; op ``hash`` (``cache``,
      ``tensor``, ``blocks``).
  ``blocked TRANSPORT``
      a decoder that blocks its own event loop on request (``time.sleep``
      or a pure-Python busy loop), to show that peers are served meanwhile;
      ``hello = {"address", "push", "pull", "gone"}`` (cache ids); ops
      ``block`` (``how``, ``seconds``: answers ``{"blocking": true}``, then
      ``{"unblocked_at", "sha"}``) and, while blocked, ``dealloc``.
  ``engine TRANSPORT SIZE``
      a bare native engine owning one zeroed region; ``hello = {"worker",
      "addr", "size", "rkey", "pid"}``; ops ``hash`` (``offset``,
      ``length``), ``fill`` (``seed``), ``notes`` (``count``).

  ``prefill TRANSPORT`` / ``decoder TRANSPORT``
      an :class:`~aiokvcache.LLMDataDist` driven op by op (prompt role,
      cluster 1 / decoder role, cluster 2 by default; ``--cluster-id``,
      ``--listen IP:PORT`` (the decoder's default 127.0.0.1:0),
      ``--auth-token``, ``--sync-kv-timeout MS``); ``hello = {"address",
      "pid", "cluster_id", "rss_kb"}``. Caches are named by the caller:
      ``alloc`` (``name``, ``tensors``, ``bytes``, ``seed``: uint8 tensors
      of ``[1, bytes]``; answers ``cache_id``, ``addrs``, ``sha``),
      ``fill``, ``hash``, ``free``; links: ``link`` / ``unlink``
      (``address``, ``cluster_id``, ``timeout_ms``; answer ``status``,
      ``per``, ``seconds``); transfers: ``push`` / ``pull`` (``cluster_id``,
      ``cache_id``, ``src`` / ``dst``, ``call_timeout``: the call's ``timeout=``,
      seconds, default 5) answer ``status`` (an
      ``LLMStatusCode`` name, ``"LLM_SUCCESS"`` included: a failed transfer
      is a result, not an error), ``start`` and ``end`` (``time.monotonic()``,
      the same clock as the caller's on one machine), ``seconds`` and
      ``message``; ``loop`` (``loop``, ``count``, ``seconds``, ``srcs``,
      ``stop_on_error``) pushes back to back in the background,
      ``loop_status`` / ``loop_join`` (``wait`` seconds) report on it; ``reinit`` replaces the
      LLMDataDist by a fresh one; ``rss``, ``stats``.

  Every mode exits on ``{"op": "exit"}`` or end of input, ignores SIGINT
  (its parent decides when it ends) and takes ``--lifetime SECONDS``.
  :class:`AsyncPeer` runs it inside a network namespace with ``netns=``.

Across hosts (network namespaces, root only): :class:`NetCluster` makes N
hosts cabled to one bridge, :meth:`NetCluster.peer` starts the peer program
inside one, :meth:`NetCluster.cut` / :meth:`~NetCluster.restore` take a
host's cable down and up; :meth:`AsyncPeer.signal` stops, continues or kills
a host's process; :func:`read_memory` reads a (stopped) process's memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Self

import numpy as np

from aiokvcache import (
    Cache,
    CacheDesc,
    CacheManager,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

__all__ = [
    "DECODER_ID",
    "NETNS_PREFIX",
    "NETNS_SUBNET",
    "PROMPT_ID",
    "AsyncPeer",
    "Child",
    "NetCluster",
    "NetHost",
    "Pair",
    "Peer",
    "PeerError",
    "PeerExited",
    "assert_still",
    "blocks_desc",
    "cluster_info",
    "fill",
    "make_pair",
    "netns_cleanup_stale",
    "netns_unavailable",
    "options",
    "pair",
    "peer_argv",
    "read_memory",
    "rss_kb",
    "same",
    "snapshot",
    "status_of",
    "threads_cpu_s",
]

PROMPT_ID, DECODER_ID = 1, 2

# ---------------------------------------------------------------- in one process


def options(transport: str = "auto", listen: bool = False, **extra: Any) -> dict[str, str]:
    """:meth:`LLMDataDist.init` options: ``transport``, a listen address on
    127.0.0.1 (any port) if ``listen``, and any :class:`LLMConfig` attribute
    as a keyword (``sync_kv_timeout=60_000``, ``max_inflight_bytes=...``)."""
    cfg = LLMConfig()
    cfg.transport = transport
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    for k, v in extra.items():
        if not hasattr(type(cfg), k):
            raise AttributeError(f"LLMConfig has no option {k!r}")
        setattr(cfg, k, v)
    return cfg.generate_options()


def cluster_info(target: LLMDataDist | str, cluster_id: int | None = None) -> LLMClusterInfo:
    """Where to link to: a listening ``LLMDataDist`` or an ``"ip:port"`` address.

    ``cluster_id`` is the id we expect to find there: by default the
    instance's own; required with an address.
    """
    if isinstance(target, LLMDataDist):
        address = target.listen_address
        if address is None:
            raise ValueError("that LLMDataDist does not listen")
        cid = target.cluster_id if cluster_id is None else cluster_id
    else:
        if cluster_id is None:
            raise ValueError("cluster_id is required with an address")
        address, cid = target, cluster_id
    host, port = address.rsplit(":", 1)
    info = LLMClusterInfo()
    info.remote_cluster_id = cid
    info.append_remote_ip_info(host, int(port))
    return info


@dataclass
class Pair:
    """A prompt (cluster 1) linked to a listening decoder (cluster 2), one process."""

    prompt: LLMDataDist  # cluster 1, links to the decoder
    decoder: LLMDataDist  # cluster 2, listens

    @property
    def p(self) -> CacheManager:
        """The prompt's cache manager."""
        return self.prompt.cache_manager

    @property
    def d(self) -> CacheManager:
        """The decoder's cache manager."""
        return self.decoder.cache_manager

    def submitted(self) -> int:
        """Native jobs both engines were given so far."""
        return int(self.p.stats()["jobs_submitted"]) + int(self.d.stats()["jobs_submitted"])

    def live_jobs(self) -> int:
        """Native jobs not yet released, both engines together."""
        return int(self.p.stats()["live_jobs"]) + int(self.d.stats()["live_jobs"])

    async def close(self) -> None:
        """Finalize both (idempotent)."""
        try:
            await self.prompt.finalize()
        finally:
            await self.decoder.finalize()


async def make_pair(transport: str = "auto", **extra: Any) -> Pair:
    """Start a decoder and a prompt with :func:`options` ``(transport, **extra)``
    and link them; the caller closes the pair (or use :func:`pair`)."""
    decoder = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    prompt = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    try:
        await decoder.init(options(transport, listen=True, **extra))
        await prompt.init(options(transport, **extra))
        rc, per = await prompt.link_clusters([cluster_info(decoder)], timeout=5000)
        if rc != LLMStatusCode.LLM_SUCCESS or per != [LLMStatusCode.LLM_SUCCESS]:
            raise AssertionError(f"link failed: {rc.name} {[s.name for s in per]}")
    except BaseException:
        await Pair(prompt, decoder).close()
        raise
    return Pair(prompt, decoder)


@contextlib.asynccontextmanager
async def pair(transport: str = "auto", **extra: Any) -> AsyncIterator[Pair]:
    """A linked :class:`Pair` for the ``async with`` block; finalized after it.

    When the block ends normally, no native job may be left live in either
    engine (``AssertionError`` otherwise).
    """
    pr = await make_pair(transport, **extra)
    try:
        yield pr
    except BaseException:
        await pr.close()
        raise
    await pr.close()
    for dd in (pr.prompt, pr.decoder):
        live = dd.cache_manager.stats()["live_jobs"]
        if live:
            raise AssertionError(f"{live} native jobs still live in cluster {dd.cluster_id}")


def blocks_desc(layers: int = 3, blocks: int = 16, tokens: int = 4, dim: int = 8) -> CacheDesc:
    """2 tensors (K, V) per layer, ``blocks`` blocks of ``tokens x dim`` fp16."""
    return CacheDesc(2 * layers, [blocks, tokens, dim], DataType.DT_FLOAT16, Placement.HOST)


def fill(cache: Cache, seed: int) -> None:
    """Every tensor of ``cache`` from ``seed``: random bytes, or normals for floats."""
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        if t.dtype == np.uint8:
            t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
        else:
            t[...] = rng.standard_normal(t.shape).astype(t.dtype)


def snapshot(cache: Cache) -> list[np.ndarray]:
    """Copies of every tensor of ``cache``."""
    return [t.copy() for t in cache.tensors]


def same(before: Sequence[np.ndarray], cache: Cache) -> bool:
    """Whether ``cache`` still holds what :func:`snapshot` took."""
    return all(np.array_equal(x, y) for x, y in zip(before, cache.tensors, strict=True))


async def assert_still(cache: Cache, wait: float = 0.2) -> None:
    """Nothing writes into ``cache`` for ``wait`` seconds (``AssertionError`` otherwise)."""
    before = snapshot(cache)
    await asyncio.sleep(wait)
    if not same(before, cache):
        raise AssertionError("write after the call returned")


async def status_of(aw: Awaitable[Any]) -> LLMStatusCode:
    """The status code of the :class:`LLMException` ``aw`` raises.

    ``AssertionError`` if it raises none; any other exception propagates.
    """
    try:
        await aw
    except LLMException as exc:
        return exc.status_code
    raise AssertionError("no LLMException raised")


# ---------------------------------------------------------------- processes


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


# ---------------------------------------------------------------- network namespaces

#: Every namespace a :class:`NetCluster` makes is named ``akvc-<pid>-<n>-...``.
NETNS_PREFIX = "akvc"
#: The hosts' addresses: ``198.18.0.<i + 1>/24`` (RFC 2544 benchmarking space),
#: on a bridge of each cluster's own, so clusters never share a wire.
NETNS_SUBNET = "198.18.0"

_ip_lock = threading.Lock()
_clusters_made = 0


#: Addresses the cluster's hosts use (198.18.0.0/15, the benchmarking range).
_CLUSTER_NETS = ("198.18.0.0/15",)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why :class:`NetCluster` cannot work here (a skip reason), or None."""
    if shutil.which("ip") is None:
        return "no iproute2: `ip` is not on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is not allowed)"
    probe = f"{NETNS_PREFIX}-{os.getpid()}-probe"
    _ip("netns", "del", probe, check=False)
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _netns_list() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_delete(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def netns_cleanup_stale() -> list[str]:
    """Delete the namespaces of runs that died without cleaning up: those of
    :data:`NETNS_PREFIX` whose creating process is gone. Returns their names."""
    gone = []
    for name in _netns_list():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != NETNS_PREFIX or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue  # a live run's (ours included: create() deletes its own names)
        _netns_delete(name)
        gone.append(name)
    return gone


@dataclass
class NetHost:
    """One host of a :class:`NetCluster`: a network namespace with loopback
    and ``eth0`` (``ip``/24), cabled to the cluster's bridge."""

    name: str  # "h1", "h2", ...
    netns: str  # its namespace
    ip: str  # eth0's address
    cable: str  # the bridge-side end of its veth pair, in the bridge's namespace

    def address(self, port: int) -> str:
        """``"ip:port"`` on this host."""
        return f"{self.ip}:{port}"


class NetCluster:
    """N hosts in network namespaces joined by veth pairs to one bridge.

    The bridge lives in a namespace of its own, so the root namespace is
    untouched; every name is ``akvc-<pid>-<n>-...`` (``n`` counts the
    clusters this process made), so parallel runs never collide, and
    :meth:`create` first removes what a killed run left (see
    :func:`netns_cleanup_stale`). :meth:`close` (also at the end of a
    ``with`` block, failing or not) kills every process left in the hosts
    and deletes every namespace. Needs root: see :func:`netns_unavailable`.

    Faults: :meth:`cut` / :meth:`restore` take a host's cable down / up (its
    ``eth0`` keeps its address and sees no carrier: packets vanish, nothing
    is reset); :class:`AsyncPeer` ``.signal()`` / ``.kill()`` stop, continue
    or kill a host's process.
    """

    def __init__(self, hosts: int, *, uplink: bool = False) -> None:
        global _clusters_made
        if not 1 <= hosts <= 200:
            raise ValueError("1 to 200 hosts")
        #: Give every host a second interface, ``up0`` (198.19.<i>.1/24, one
        #: end of a veth pair whose other end is up in the same host: it
        #: reaches nothing) holding the default route, as on a multi-homed
        #: host whose default route is not the cluster network.
        self.uplink = uplink
        with _ip_lock:
            _clusters_made += 1
            n = _clusters_made
        self.tag = f"{NETNS_PREFIX}-{os.getpid()}-{n}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = [
            NetHost(f"h{i}", f"{self.tag}-h{i}", f"{NETNS_SUBNET}.{i + 1}", f"c{i}")
            for i in range(1, hosts + 1)
        ]
        self._made: list[str] = []
        self._routes: list[str] = []  # root-namespace guard routes we added

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster (the bridge's first)."""
        return [self.bridge_ns, *(h.netns for h in self.hosts)]

    def create(self) -> Self:
        """Make the bridge and the hosts (everything made so far is removed if it fails)."""
        netns_cleanup_stale()
        for name in self.namespaces:  # a killed run of ours under the same name
            if name in _netns_list():
                _netns_delete(name)
        try:
            # A safety belt: should anything in the root namespace ever aim at
            # a cluster address, the kernel refuses it here instead of routing
            # it off the machine through the default gateway.
            for net in _CLUSTER_NETS:
                if _ip("route", "add", "unreachable", net, check=False).returncode == 0:
                    self._routes.append(net)
            br = self.bridge_ns
            _ip("netns", "add", br)
            self._made.append(br)
            _ip("-n", br, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip(
                    "-n", br, "link", "add", h.cable, "type", "veth",
                    "peer", "name", "eth0", "netns", h.netns,
                )  # fmt: skip
                _ip("-n", br, "link", "set", h.cable, "master", "br0", "up")
                _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                if self.uplink:
                    i = self.hosts.index(h) + 1
                    ns = h.netns
                    _ip("-n", ns, "link", "add", "up0", "type", "veth", "peer", "name", "up0x")
                    _ip("-n", ns, "addr", "add", f"198.19.{i}.1/24", "dev", "up0")
                    _ip("-n", ns, "link", "set", "up0x", "up")
                    _ip("-n", ns, "link", "set", "up0", "up")
                    _ip("-n", ns, "route", "add", "default", "via", f"198.19.{i}.254")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill what runs in the hosts and delete every namespace. Idempotent."""
        for name in reversed(self._made):
            _netns_delete(name)
        self._made.clear()
        for net in self._routes:
            _ip("route", "del", "unreachable", net, check=False)
        self._routes.clear()

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def cut(self, host: NetHost) -> float:
        """Take ``host``'s cable down; ``time.monotonic()`` just after."""
        _ip("-n", self.bridge_ns, "link", "set", host.cable, "down")
        return time.monotonic()

    def restore(self, host: NetHost) -> float:
        """Put ``host``'s cable back up; ``time.monotonic()`` just after."""
        _ip("-n", self.bridge_ns, "link", "set", host.cable, "up")
        return time.monotonic()

    def run(
        self, host: NetHost, *argv: str, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``host`` and wait for it."""
        return subprocess.run(
            ["ip", "netns", "exec", host.netns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def peer(self, host: NetHost, mode: str, *args: str, **kw: Any) -> AsyncPeer:
        """The peer program in ``mode`` inside ``host`` (not started yet:
        ``async with`` it); keywords as :class:`AsyncPeer`'s."""
        return AsyncPeer(mode, *args, netns=host.netns, **kw)


def read_memory(pid: int, address: int, length: int) -> bytes:
    """``length`` bytes at ``address`` in process ``pid`` (``/proc/PID/mem``;
    works while it is stopped; needs ptrace rights over it, e.g. root)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(address)
        out = bytearray()
        while len(out) < length:
            chunk = f.read(length - len(out))
            if not chunk:
                raise OSError(f"short read at {address + len(out):#x} in pid {pid}")
            out += chunk
        return bytes(out)


def threads_cpu_s(name: str = "akv-progress") -> float:
    """CPU seconds (user + system) this process's threads named ``name`` used
    so far: ``akv-progress`` (the engines' progress threads), ``akv-copy``
    (their copy lanes)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_kb(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS`` in ``/proc/PID/status``), KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError(f"no VmRSS for pid {pid}")
