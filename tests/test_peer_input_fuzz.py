"""Every parser of a peer's bytes, fuzzed against a live instance in a child process.

The instance under attack (the *victim*) runs in a child, so that a crash is
its exit status; the fuzzer runs here, sends what a broken or hostile peer
would (valid inputs mutated: :mod:`support.fuzz`) through each state a peer
can reach, and checks after each run that the victim is alive, that nothing
reached its service loops, that it links and serves a legitimate peer, and
that its resident memory and open descriptors grew within bounds:

* a listener, through every handshake state (HELLO, the eager AUTH, a sealed
  AUTH for a token holder) and every frame a linked peer may send after it
  (requests of every op, events, answers nobody asked for, BYE);
* a dialler, through every answer an acceptor gives (HELLO_REPLY, AUTH_OK with
  its worker address and probe slot, refusals) and the link's data-path check;
* cache metadata and probe slots a linked peer serves (remote keys included);
* notifications (their payloads and block lists);
* the vLLM connector's messages, against its ``TransferAgent``.

Pure-Python parsers are fuzzed here too, in-process, with hypothesis. A
run's length and seed: :mod:`support.fuzz` (``AIOKVCACHE_FUZZ_SECONDS``,
``AIOKVCACHE_FUZZ_SEED``); the seed is printed when a run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import example, given, settings
from hypothesis import strategies as st

import aiokvcache as kv
from aiokvcache._bridge import OP_PUT
from aiokvcache._core.memory.catalog import desc_to_wire
from aiokvcache._core.memory.ctlregion import PROBE_BYTES
from aiokvcache._core.transfer.runner import run_jobs
from aiokvcache._core.wire import frames, handshake
from aiokvcache._core.wire import messages as wire
from aiokvcache._loader import native
from aiokvcache.testing import PeerExited, PeerProcess, cluster_info
from support.fuzz import SECONDS, Mutator, Run, encodable
from support.harness import BARE_ENGINE, TRUST, AsyncPeer, rss_kb
from support.instances import instance, runtime
from support.peer_ops_trust import from_json, to_json

S = kv.LLMStatusCode
K = frames.Kind
TOKEN = "fuzz-token"
RSS_BOUND_KB = 96 << 10  # what a victim's resident memory may grow by over a run
FD_BOUND = 48  # open descriptors it may gain
LINK_MS = 600  # a dialler's link attempt against the fuzzer's listener


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fuzzer_pids(victim: int) -> set[int]:
    """This process and its children but ``victim``: the fuzzer's engines
    (in-process, and the children that own what a mutated identity names)."""
    me, pids = os.getpid(), {os.getpid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == victim:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            pids.add(int(entry))
    return pids


def sockets_to_us(pid: int) -> int:
    """TCP connections between process ``pid`` and the fuzzer's processes.

    A link's UCX endpoint over TCP outlives the link while both processes
    live: UCX destroys an endpoint the peer connected back to only when its
    worker goes, unless it is force-closed, which it allows only with
    peer-failure handling (docs/design.md, *What a link leaves behind*). So
    every link the fuzzer's engines made with the victim leaves a connection
    per TCP lane on each side; they are not what the run checks for."""
    try:
        out = subprocess.run(
            ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    rows = [line.split() for line in out.splitlines()]
    tags = tuple(f"pid={p}," for p in fuzzer_pids(pid))
    ours = {r[2] for r in rows if len(r) >= 5 and any(t in r[-1] for t in tags)}
    return sum(1 for r in rows if len(r) >= 5 and f"pid={pid}," in r[-1] and r[3] in ours)


@dataclasses.dataclass
class Vitals:
    """A victim's resident memory and open descriptors when the run began."""

    pid: int
    rss: int
    fds: int

    @classmethod
    def of(cls, pid: int) -> Vitals:
        return cls(pid, rss_kb(pid), fds(pid) - sockets_to_us(pid))

    def check(self, run: Run) -> None:
        grew = rss_kb(self.pid) - self.rss
        assert grew < RSS_BOUND_KB, f"RSS grew by {grew} KiB\n{run.report()}"
        more = fds(self.pid) - sockets_to_us(self.pid) - self.fds
        assert more < FD_BOUND, f"{more} more open descriptors\n{run.report()}"


@pytest.fixture
def log() -> Any:
    """Where a victim's stderr goes (its log lines); quoted when a run fails."""
    with tempfile.TemporaryFile("w+") as f:
        yield f


def tail(log: Any) -> str:
    log.seek(0)
    return "".join(log.readlines()[-20:])


async def sound(victim: AsyncPeer | PeerProcess, run: Run, vitals: Vitals, log: Any) -> None:
    """The victim lives, nothing reached its service loops (nor did it log a
    traceback), it grew within bounds. ``log``: its stderr, quoted if it died."""
    if victim.returncode is not None:
        raise AssertionError(f"the victim died ({victim.returncode})\n{run.report()}\n{tail(log)}")
    health = await victim.call("health")
    assert not health.get("service_errors"), f"{health}\n{run.report()}"
    assert not health.get("loop_errors"), f"{health}\n{run.report()}"
    assert not health.get("live_jobs"), f"{health}\n{run.report()}"
    vitals.check(run)
    print(f"FUZZ {run.name}: {run.count} inputs, seed {run.seed}")


def frame(kind: int, payload: Any, seal: frames.Seal | None = None, rid: int = 0) -> bytes:
    """A frame of any kind byte carrying ``payload`` in the codec (one the
    codec cannot carry goes as a zero byte: the victim's parser must refuse
    it), sealed when ``seal`` is given."""
    header = bytes([frames.PROTOCOL_VERSION, kind & 0xFF]) + (rid % 2**32).to_bytes(4, "big")
    body = header + (encodable(payload) or b"\x00")
    return frames.to_wire(body[: frames.MAX_FRAME], seal)


async def read_some(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What arrives within ``seconds`` (until EOF)."""
    got = bytearray()
    with contextlib.suppress(TimeoutError, ConnectionError, OSError):
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(1 << 16):
                got += chunk
    return bytes(got)


# ------------------------------------------------------- a real identity


def boot_id() -> bytes:
    """This machine's host id, as a same-host peer's handshake carries it."""
    with open("/proc/sys/kernel/random/boot_id", "rb") as f:
        return f.read().strip()


class Identity:
    """A real engine's worker address and a probe slot in its memory: what a
    peer's handshake identity carries, before it is mutated.

    The engine lives in a child (the peer program's bare engine), not here:
    a victim puts its probe where the slot it was handed says, and over TCP
    the receiving engine applies a put at whatever address it names
    (docs/design.md, *What a linked peer can do*), so a mutated slot aims the
    victim's put at any address of the slot's owner. That owner is a child
    the run can lose (:meth:`revive` starts another), never the fuzzer."""

    def __init__(self) -> None:
        self.sink: AsyncPeer | None = None
        self.stack = contextlib.AsyncExitStack()
        self.worker_address, self.base, self.rkey = b"", 0, b""
        self.sinks = 0  # children started (more than one: a put killed one)

    async def revive(self) -> None:
        """Start the engine's child, or a new one if the last one died."""
        if self.sink is not None and self.sink.returncode is None:
            return
        size = "--size=65536"
        sink = AsyncPeer("none", "tcp", size, ops=[BARE_ENGINE], lifetime=600)
        self.sink = await self.stack.enter_async_context(sink)
        hello = self.sink.hello
        self.worker_address = bytes.fromhex(hello["worker"])
        self.base, self.rkey = int(hello["addr"]), bytes.fromhex(hello["rkey"])
        self.sinks += 1

    async def close(self) -> None:
        await self.stack.aclose()

    def probe(self) -> dict[str, Any]:
        return {
            "addr": self.base,
            "len": PROBE_BYTES,
            "base": self.base,
            "span": 1 << 16,
            "rkey": self.rkey,
            "put_probe": True,
        }

    def payload(self, note_key: bytes | None = None, host_id: bytes = b"") -> dict[str, Any]:
        return {
            "worker_address": self.worker_address,
            "host_id": host_id,
            "note_key": note_key or secrets.token_bytes(handshake.NOTE_KEY_LEN),
            "probe": self.probe(),
        }

    def cache_meta(self) -> dict[str, Any]:
        """Well-formed metadata of a 1-layer cache over the identity's region
        (what a ``caches`` answer names), before it is mutated."""
        desc = kv.CacheDesc(2, [1 << 15], kv.DataType.DT_UINT8, kv.Placement.HOST)
        return {
            "cache_id": 1,
            "desc": desc_to_wire(desc),
            "is_blocks": False,
            "addrs": [self.base, self.base + (1 << 15)],
            "regions": [{"base": self.base, "len": 1 << 16, "rkey": self.rkey}],
            "tensor_region": [0, 0],
            "guard": {"addr": self.base, "word": 1, "strict": False},
        }

    def mutated(self, m: Mutator, note_key: bytes | None = None) -> dict[str, Any]:
        """The identity with its worker address, probe slot or other fields mutated."""
        ident = self.payload(note_key)
        r = m.rng.random()
        if r < 0.35:
            ident["worker_address"] = m.bytes_(ident["worker_address"])
        elif r < 0.7:
            probe = dict(ident["probe"])
            if m.rng.random() < 0.6:
                probe["rkey"] = m.bytes_(probe["rkey"])
            else:
                probe = m.values(probe)
            ident["probe"] = probe
        else:
            ident = m.values(ident)
        return ident


def with_mac(mac: bytes, ident: Any) -> Any:
    """An AUTH / AUTH_OK payload: the mac and the identity's fields (a
    mutation may have made the identity no dict: then it is the payload)."""
    return {"mac": mac, **ident} if isinstance(ident, dict) else ident


@pytest_asyncio.fixture
async def identity() -> AsyncIterator[Identity]:
    ident = Identity()
    await ident.revive()
    try:
        yield ident
    finally:
        await ident.close()


def local_of(ident: Identity, cid: int, token: str | None) -> handshake.LocalInfo:
    return handshake.LocalInfo(
        cluster_id=cid,
        role=int(kv.LLMRole.PROMPT),
        worker_address=ident.worker_address,
        auth_token=None if token is None else token.encode(),
        probe=ident.probe,
    )


# ------------------------------------------------ frames a linked peer sends


def valid_bodies(cache_id: int, slot: int) -> dict[str, dict[str, Any]]:
    """A well-formed body for every request op (mutated before it is sent)."""
    return {
        "finalizing": {},
        "unlink": {},
        "alive": {},
        "probe_info": {},
        "probe_back": {"timeout": 0.2, "nonce": secrets.token_bytes(16), "slot": slot},
        "invalidate": {"cache_id": cache_id},
        "cache_by_id": {"cache_id": cache_id},
        "cache_by_key": {"cluster_id": 2, "req_id": 1, "model_id": 0, "prefix_id": -1},
        "blocks_by_key": {"cluster_id": 2, "model_id": 0},
        "cache_by_addr": {"addrs": [slot, slot + 64]},
        "caches": {},
    }


def test_every_request_op_has_a_body_to_mutate() -> None:
    assert set(valid_bodies(1, 0)) == {op.value for op in wire.RequestOp}


def linked_frames(m: Mutator, bodies: dict[str, dict[str, Any]], seal: Any) -> list[bytes]:
    """One to six frames a linked peer might send, mutated."""
    r = m.rng
    out = []
    for rid in range(r.randint(1, 16)):
        pick = r.randrange(10)
        if pick < 6:
            op = r.choice([*bodies, "nope", ""])
            body = bodies.get(op, {})
            if r.random() < 0.7:
                body = m.values(body)
            payload: Any = {"op": op, "body": body}
            if r.random() < 0.15:
                payload = m.values(payload)
            out.append(frame(K.REQUEST, payload, seal, rid + 1))
        elif pick == 6:
            event = {"op": r.choice(["link_up", "x"]), "body": {}}
            out.append(frame(K.EVENT, m.values(event) if r.random() < 0.6 else event, seal))
        elif pick == 7:
            answer = r.choice([K.RESPONSE, K.ERROR_RESPONSE])
            payload = {"body": {}} if answer is K.RESPONSE else {"status": 0, "message": ""}
            out.append(frame(answer, m.values(payload), seal, r.randrange(2**32)))
        elif pick == 8:
            kind = r.choice([K.BYE, K.HELLO, K.AUTH, K.AUTH_OK, 0, 0xEE])
            out.append(frame(kind, m.values({"reason": "x"}), seal))
        else:  # a valid request's bytes, mutated (a sealed one then fails to open)
            good = frame(K.REQUEST, {"op": "probe_info", "body": {}}, seal, 99)
            out.append(m.bytes_(good))
    return out


# ---------------------------------------------------------- the listener


class Dialler:
    """The fuzzer as the initiator of a control connection to the victim."""

    def __init__(self, run: Run, ident: Identity, address: str, token: str | None) -> None:
        self.run, self.ident, self.token = run, ident, token
        host, port = address.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.cid = 1000

    async def session(self, bodies: dict[str, dict[str, Any]]) -> None:
        """One connection: a valid prefix of the handshake, then mutations."""
        run, m = self.run, self.run.mutator
        self.cid += 1
        # A linked session leaves its UCX connections behind (sockets_to_us):
        # one in four, each sending more frames.
        stage = m.rng.choice((0, 0, 1, 1, 1, 2, 3))
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            return
        try:
            if stage == 0:
                await self._bad_hello(reader, writer)
            elif self.token is None:
                await self._eager(reader, writer, stage, bodies)
            else:
                await self._sealed(reader, writer, stage, bodies)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, frames.ProtocolError):
            pass
        finally:
            writer.transport.abort()
        del run

    def _hello(self, nonce: bytes) -> dict[str, Any]:
        local = local_of(self.ident, self.cid, self.token)
        hello = handshake.hello_payload(local, nonce)
        hello["expect"] = 2
        if self.token is None:
            hello["eager"] = True
        return hello

    async def _bad_hello(self, reader: Any, writer: Any) -> None:
        m = self.run.mutator
        hello = self._hello(secrets.token_bytes(handshake.NONCE_LEN))
        data = frame(K.HELLO, m.values(hello))
        if m.rng.random() < 0.4:
            data = m.bytes_(frame(K.HELLO, hello))
        if self.token is None and m.rng.random() < 0.5:
            data += frame(K.AUTH, with_mac(b"", self.ident.mutated(m)))
        self.run.note("HELLO", data)
        writer.write(data)
        await read_some(reader, 0.05)

    async def _eager(self, reader: Any, writer: Any, stage: int, bodies: Any) -> None:
        m = self.run.mutator
        hello = self._hello(secrets.token_bytes(handshake.NONCE_LEN))
        ident = self.ident.payload() if stage >= 2 else self.ident.mutated(m)
        data = frame(K.HELLO, hello) + frame(K.AUTH, with_mac(b"", ident))
        self.run.note("eager HELLO+AUTH", data)
        writer.write(data)
        if stage < 2:
            await read_some(reader, 0.05)
            return
        kind, _, _ = await frames.read_frame(reader)
        if kind is not K.HELLO_REPLY:
            return
        kind, _, ok = await frames.read_frame(reader)
        if kind is not K.AUTH_OK:
            return
        await self._linked(reader, writer, None, bodies, ok)

    async def _sealed(self, reader: Any, writer: Any, stage: int, bodies: Any) -> None:
        m = self.run.mutator
        token = self.token
        assert token is not None
        nonce = secrets.token_bytes(handshake.NONCE_LEN)
        hello = self._hello(nonce)
        writer.write(frame(K.HELLO, hello))
        kind, _, reply = await frames.read_frame(reader)
        if kind is not K.HELLO_REPLY:
            return
        ids = handshake.transcript(hello, reply)
        tx, rx = handshake.session_seals(token.encode(), nonce, reply["nonce"], ids)
        ident = self.ident.payload() if stage >= 2 else self.ident.mutated(m)
        try:
            mac = handshake.compute_mac(
                token.encode(), b"aiokvcache-c", reply["nonce"], nonce, ids, ident
            )
        except (KeyError, TypeError, ValueError):
            mac = secrets.token_bytes(32)  # an identity the mac cannot cover
        if stage < 2 and m.rng.random() < 0.2:
            mac = m.bytes_(mac)
        data = frame(K.AUTH, with_mac(mac, ident), tx)
        self.run.note("sealed AUTH", ident)
        writer.write(data)
        if stage < 2:
            await read_some(reader, 0.05)
            return
        kind, _, ok = await frames.read_frame(reader, rx)
        if kind is not K.AUTH_OK:
            return
        await self._linked(reader, writer, tx, bodies, ok)

    async def _linked(
        self, reader: Any, writer: Any, tx: Any, bodies: dict[str, Any], ok: dict[str, Any]
    ) -> None:
        m = self.run.mutator
        probe = ok.get("probe")
        slot = probe.get("addr", 0) if isinstance(probe, dict) else 0
        mine = {**bodies, "probe_back": {**bodies["probe_back"], "slot": slot}}
        for data in linked_frames(m, mine, tx):
            self.run.note("linked frame", data)
            writer.write(data)
        await read_some(reader, m.rng.choice((0.0, 0.02, 0.1)))


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
async def test_fuzz_a_listener_through_every_handshake_state(
    token: str | None, identity: Identity, log: Any
) -> None:
    """Mutated HELLOs, eager and sealed AUTHs (their worker addresses and probe
    slots included), and every frame a linked peer may send after them."""
    run = Run(f"listener-{token is not None}")
    opts = {} if token is None else {"auth_token": token}
    async with PeerProcess("decoder", "tcp", options=opts, stderr=log) as victim:
        made = await victim.alloc("c", 2, 4096, seed=1)
        vitals = Vitals.of(victim.pid)
        dialler = Dialler(run, identity, victim.address, token)
        bodies = valid_bodies(int(made["cache_id"]), int(made["addrs"][0]))
        for _ in run:
            if victim.returncode is not None:
                break  # the journal's last inputs are what killed it
            await identity.revive()
            await dialler.session(bodies)
        await asyncio.sleep(0.5)  # what it still reads and answers
        await sound(victim, run, vitals, log)
        print(f"FUZZ {run.name}: {identity.sinks} identity engines started")
        await legit_push_to(victim, "tcp", token)


async def legit_push_to(victim: PeerProcess, transport: str, token: str | None) -> None:
    """A legitimate prefill links to the victim decoder and pushes real bytes."""
    extra = {} if token is None else {"auth_token": token}
    made = await victim.alloc("legit", 2, 8192)
    async with instance(transport, 7, listen=False, **extra) as good:
        rc, per = await good.link_clusters([cluster_info(victim.address, 2)], timeout=10_000)
        assert rc == S.LLM_SUCCESS, per
        cm = good.cache_manager
        src = cm.allocate_cache(kv.CacheDesc(2, [1, 8192], kv.DataType.DT_UINT8, kv.Placement.HOST))
        for t in src.tensors:
            t[...] = np.random.default_rng(5).integers(0, 256, t.shape, np.uint8)
        key = kv.CacheKeyByIdAndIndex(2, int(made["cache_id"]), 0)
        await cm.push_cache(key, src, timeout=10)
        want = hashlib.sha256(b"".join(t.tobytes() for t in src.tensors))
        assert await victim.sha("legit") == want.hexdigest()


# ---------------------------------------------------------- the dialler


@contextlib.asynccontextmanager
async def listener(
    script: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(
            ConnectionError, OSError, asyncio.IncompleteReadError, frames.ProtocolError
        ):
            await script(reader, writer)
        writer.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        host, port = server.sockets[0].getsockname()[:2]
        yield f"{host}:{port}"
    finally:
        server.close()
        await server.wait_closed()


class Acceptor:
    """The fuzzer as the acceptor the victim dials: one script per link attempt."""

    def __init__(self, run: Run, ident: Identity, token: str | None) -> None:
        self.run, self.ident, self.token = run, ident, token
        self.stage = 0

    async def __call__(self, reader: Any, writer: Any) -> None:
        m = self.run.mutator
        token = None if self.token is None else self.token.encode()
        kind, _, hello = await frames.read_frame(reader)
        if kind is not K.HELLO:
            return
        local = dataclasses.replace(local_of(self.ident, 2, self.token), role=2)
        nonce = secrets.token_bytes(handshake.NONCE_LEN)
        reply = handshake.hello_payload(local, nonce)
        ids = handshake.transcript(hello, reply)
        reply["mac"] = handshake.compute_mac(token, b"aiokvcache-s", hello["nonce"], nonce, ids)
        if self.stage == 0:
            choice = m.rng.randrange(3)
            data = (
                frame(K.HELLO_REPLY, m.values(reply))
                if choice == 0
                else frame(K.ERROR_RESPONSE, m.values({"status": 0, "message": "x"}))
                if choice == 1
                else m.bytes_(frame(K.HELLO_REPLY, reply))
            )
            self.run.note("HELLO_REPLY", data)
            writer.write(data)
            await read_some(reader, 0.05)
            return
        rx, tx = handshake.session_seals(token, hello["nonce"], nonce, ids)
        writer.write(frame(K.HELLO_REPLY, reply))
        kind, _, _auth = await frames.read_frame(reader, rx)
        if kind is not K.AUTH:
            return
        ident = self.ident.payload() if self.stage == 2 else self.ident.mutated(m)
        if self.stage == 2 and m.rng.random() < 0.5:
            del ident["probe"]  # as an older peer: the victim asks probe_info
        if self.stage == 2 and m.rng.random() < 0.5:
            # As a peer on the victim's host: once linked, the victim asks
            # for its caches (Lookups.prefetch_soon) and installs the answer.
            ident["host_id"] = boot_id()
        try:
            mac = handshake.compute_mac(token, b"aiokvcache-a", hello["nonce"], nonce, ids, ident)
        except (KeyError, TypeError, ValueError):
            mac = b""
        if self.stage == 1 and m.rng.random() < 0.3:
            data = frame(K.ERROR_RESPONSE, m.values({"status": 0, "message": "x"}), tx)
        else:
            data = frame(K.AUTH_OK, with_mac(mac, ident), tx)
        self.run.note(f"AUTH_OK stage {self.stage}", ident)
        writer.write(data)
        if self.stage == 1:
            await read_some(reader, 0.05)
            return
        await self._answer(reader, writer, rx, tx)

    async def _answer(self, reader: Any, writer: Any, rx: Any, tx: Any) -> None:
        """Answer the victim's requests (its probe_back, probe_info) with mutations."""
        m = self.run.mutator
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                while True:
                    kind, rid, req = await frames.read_frame(reader, rx)
                    if kind is not K.REQUEST:
                        continue
                    answer = {
                        "probe_back": {"problem": "", "nonce": secrets.token_bytes(16), "slot": 0},
                        "probe_info": wire.ProbeSlot(
                            self.ident.base, PROBE_BYTES, self.ident.base, 1 << 16, self.ident.rkey
                        ).encode(),
                        "caches": {"caches": [self.ident.cache_meta()]},
                    }.get(req.get("op"), {})
                    body = m.values(answer) if m.rng.random() < 0.8 else answer
                    self.run.note(f"answer to {req.get('op')}", body)
                    writer.write(frame(K.RESPONSE, {"body": body}, tx, rid))


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
async def test_fuzz_a_dialler_through_every_handshake_state(
    token: str | None, identity: Identity, log: Any
) -> None:
    """The victim links to the fuzzer, which answers with mutated HELLO_REPLYs,
    refusals, AUTH_OKs (worker addresses, probe slots) and data-path answers.
    Before a well-formed AUTH_OK no link may be reported up."""
    run = Run(f"dialler-{token is not None}")
    opts = {} if token is None else {"auth_token": token}
    acceptor = Acceptor(run, identity, token)
    async with (
        listener(acceptor) as address,
        PeerProcess("prefill", "tcp", options=opts, stderr=log) as victim,
    ):
        vitals = Vitals.of(victim.pid)
        for _ in run:
            if victim.returncode is not None:
                break
            await identity.revive()
            acceptor.stage = run.rng.randrange(3)
            got = await victim.link(address, 2, timeout_ms=LINK_MS)
            if acceptor.stage < 2:
                assert got["status"] != "LLM_SUCCESS", f"{got}\n{run.report()}"
            if got["status"] == "LLM_SUCCESS":
                await victim.call("unlink", address=address, cluster_id=2, force=True)
        await sound(victim, run, vitals, log)
        print(f"FUZZ {run.name}: {identity.sinks} identity engines started")
        async with instance("tcp", 2, **({} if token is None else {"auth_token": token})) as dd:
            got = await victim.link(str(dd.listen_address), 2, timeout_ms=10_000)
            assert got["status"] == "LLM_SUCCESS", got


# ------------------------------------------- metadata and probe slots served


class Liar:
    """A linked peer that serves mutated cache metadata and probe slots: a
    child (the peer program with the trust ops), since the victim pushes and
    pulls where the metadata says and over TCP the liar's engine applies
    those puts and gets at any address they name (see :class:`Identity`).
    A run can lose it: :meth:`revive` starts another, with a real cache."""

    def __init__(self, transport: str, log: Any) -> None:
        self.transport, self.log = transport, log
        self.peer: AsyncPeer | None = None
        self.stack = contextlib.AsyncExitStack()
        self.address = ""
        self.cache_id = 0
        self.meta: dict[str, Any] = {}
        self.slot: dict[str, Any] = {}
        self.started = 0

    async def revive(self, victim: PeerProcess) -> None:
        """Start the liar if it is not running, and link the victim to it."""
        if self.peer is not None and self.peer.returncode is None:
            return
        if self.address:  # the dead one's link goes first
            await victim.call("unlink", address=self.address, cluster_id=2, force=True)
        peer = AsyncPeer("decoder", self.transport, ops=TRUST, stderr=self.log, lifetime=600)
        self.peer = await self.stack.enter_async_context(peer)
        self.address = self.peer.address
        made = await self.peer.call("alloc", name="real", tensors=2, bytes=4096, seed=9)
        self.cache_id = int(made["cache_id"])
        self.meta = from_json((await self.peer.call("meta", name="real"))["meta"])
        self.slot = from_json((await self.peer.call("evil_probe", slot=None))["slot"])
        self.started += 1
        got = await victim.link(self.address, 2, timeout_ms=5000)
        assert got["status"] == "LLM_SUCCESS", got

    async def serve(self, op: str, **args: Any) -> None:
        """Arm (or disarm) one of its evil ops; a liar that died is left dead."""
        assert self.peer is not None
        with contextlib.suppress(PeerExited):
            await self.peer.call(op, **{k: to_json(v) for k, v in args.items()})

    async def relink(self, victim: PeerProcess, slot: Any) -> None:
        """The victim relinks while the liar hands out ``slot``, then with the real one."""
        await self.serve("evil_probe", slot=slot)
        await victim.call("unlink", address=self.address, cluster_id=2, force=True)
        await victim.link(self.address, 2, timeout_ms=1000)
        await self.serve("evil_probe", slot=None)
        await victim.link(self.address, 2, timeout_ms=5000)

    async def close(self) -> None:
        await self.stack.aclose()


async def test_fuzz_cache_metadata_and_probe_slots(transport: str, log: Any) -> None:
    """A linked peer serves mutated cache metadata (its remote keys' bytes
    included) and, on relinks, mutated probe slots; the victim pushes to it."""
    run = Run(f"metadata-{transport}")
    m = run.mutator
    liar = Liar(transport, log)
    async with PeerProcess("prefill", transport, stderr=log) as victim:
        try:
            await victim.alloc("src", 2, 4096, seed=3)
            await liar.revive(victim)
            vitals = Vitals.of(victim.pid)
            fresh = 100_000
            for _ in run:
                if victim.returncode is not None:
                    break
                await liar.revive(victim)
                if m.rng.random() < 0.12:  # relink, with a mutated probe slot
                    slot = liar.slot
                    bad = (
                        dict(slot, rkey=m.bytes_(slot["rkey"]))
                        if m.rng.random() < 0.6
                        else m.values(slot)
                    )
                    if encodable(bad) is None:
                        continue  # our own handshake could not carry it
                    run.note("probe slot", bad)
                    await liar.relink(victim, bad)
                    continue
                fresh += 1
                meta = dict(liar.meta, cache_id=fresh)
                if m.rng.random() < 0.5:
                    meta["regions"] = [dict(r, rkey=m.bytes_(r["rkey"])) for r in meta["regions"]]
                else:
                    meta = m.values(meta)
                run.note("metadata", meta)
                await liar.serve("evil", op_name="*", meta=meta)
                op = m.rng.choice(("push", "pull"))
                extra = {"src": "src"} if op == "push" else {"dst": "src"}
                await victim.call(
                    op, cluster_id=2, cache_id=fresh, index=0, call_timeout=2, **extra
                )
            await sound(victim, run, vitals, log)
            print(f"FUZZ {run.name}: {liar.started} liars started")
            await liar.revive(victim)
            await liar.relink(victim, None)  # if the last relink failed
            await liar.serve("evil", op_name="*", meta=None)
            got = await victim.call(
                "push", cluster_id=2, cache_id=liar.cache_id, index=0, src="src"
            )
            assert got["status"] == "LLM_SUCCESS", got
            assert liar.peer is not None
            assert (await liar.peer.call("hash", name="real"))["sha"] == await victim.sha("src")
        finally:
            await liar.close()


# ------------------------------------------------------------- notifications


async def test_fuzz_notifications(transport: str, log: Any) -> None:
    """A linked peer sends notifications whose payloads (tag, cache id, batch
    index, layer, block list) are mutated or raw bytes."""
    from aiokvcache._core.transfer import notify

    run = Run(f"notifications-{transport}")
    m = run.mutator
    async with (
        PeerProcess("decoder", transport, stderr=log) as victim,
        instance(transport, 1, listen=False) as sender,
    ):
        made = await victim.alloc("dst", 2, 4096)
        rc, per = await sender.link_clusters([cluster_info(victim.address, 2)], timeout=10_000)
        assert rc == S.LLM_SUCCESS, per
        rt = runtime(sender)
        ep = rt.state.links[2].ep
        rows = np.zeros((0, 4), np.uint64)
        blocks = notify.encode_block_ids(np.arange(5, dtype=np.int64), 4096)
        valid = {"t": "tag", "i": 3, "b": 0, "l": 1, "k": blocks}
        vitals = Vitals.of(victim.pid)
        for _ in run:
            if victim.returncode is not None:
                break
            batch = []
            for _ in range(8):
                data = encodable(m.values(valid)) or b""
                if m.rng.random() < 0.3:
                    data = m.bytes_(notify.payload("tag", 3, 0, 1, blocks))
                batch.append(data[: native.MAX_PAYLOAD])
            run.note("payloads", batch[0])
            jobs = [(OP_PUT, ep, rows, data, 5000) for data in batch]
            with contextlib.suppress(kv.LLMException):
                await run_jobs(rt.bridge, jobs, timeout=5)
        await sound(victim, run, vitals, log)
        src = sender.cache_manager.allocate_cache(
            kv.CacheDesc(2, [1, 4096], kv.DataType.DT_UINT8, kv.Placement.HOST)
        )
        key = kv.CacheKeyByIdAndIndex(2, int(made["cache_id"]), 0)
        await sender.cache_manager.push_cache(key, src, tag="after-fuzz", timeout=10)
        got = await victim.wait_for_layers("after-fuzz", [0], timeout=10)
        assert got["status"] == "LLM_SUCCESS", got


# ------------------------------------------------- the vLLM connector's messages


def connector_messages(key: str, until_ms: int) -> list[list[Any]]:
    """One well-formed message of each kind, about the victim's live state
    (request r1's blocks 0-3 held for pull, transfer x2 expected from us)."""
    from aiokvcache.integrations.agent import wire as w
    from aiokvcache.integrations.agent.handoff import blocks_digest

    digest = blocks_digest([0, 1, 2, 3])
    msgs: list[Any] = [
        w.Claim("r1", "n1", key, 5.0, 0, 4, 4, digest, until_ms),
        w.Done("r1", "n1"),
        w.Free("r1", key, 4, digest, until_ms),
        w.Renew("r1", key, 4, digest, until_ms),
        w.Reg("x1", 0, 1, [[0, 4]], 0, 5.0, "n1", "k" * 32, "0" * 16),
        # Across tensor-parallel sizes: the heads of each block, and the readers.
        w.Reg("x1", 0, 1, [[0, 4]], 0, 5.0, "n3", "k" * 32, "0" * 16, [2, 0, 1, 1, 0], 2),
        # A hybrid model's: each KV cache group's positions, and the tokens loaded.
        w.Reg("x1", 0, 1, [[0, 4]], 0, 5.0, "n4", "k" * 32, "0" * 16, None, 1, [[0, 2], [0, 2]], 9),
        w.Cancel("x1", "n1"),
        w.Grant("r9", "n9"),
        w.Refused("r9", "n9", "no"),
        w.Layer("x2"),
        w.Pushed("x2", "n2", 1024, 2),
        w.PushFail("x2", "n2", "why"),
    ]
    return [json.loads(msg.encode()) for msg in msgs]


async def test_fuzz_connector_messages(transport: str, log: Any) -> None:
    """A linked peer sends the vLLM connector's messages, mutated, to a
    TransferAgent holding a request for pull and expecting a push; after it a
    legitimate decode agent pulls a request of it."""
    from aiokvcache.integrations.agent.kvlink import MAX_UNKNOWN, TransferAgent
    from aiokvcache.integrations.agent.kvtypes import Peer
    from support.peer_ops_agent import AGENT_BLOCK_BYTES, AGENT_BLOCKS, AGENT_LAYERS, agent_layout

    run = Run(f"connector-{transport}")
    m = run.mutator
    async with (
        AsyncPeer("none", transport, "--cluster-id=3", ops=["agent"], stderr=log) as victim,
        instance(transport, 9) as sender,
    ):
        held = await victim.call("hold", req_id="r1", blocks=[0, 1, 2, 3], seed=1)
        rc, per = await sender.link_clusters([cluster_info(victim.address, 3)], timeout=10_000)
        assert rc == S.LLM_SUCCESS, per
        await victim.call(
            "expect_push", req_id="d1", address=sender.listen_address, cluster_id=9,
            xid="x2", blocks=[8, 9],
        )  # fmt: skip
        valid = connector_messages(held["key"], held["until_ms"])
        cm = sender.cache_manager
        vitals = Vitals.of(victim.pid)
        for _ in run:
            if victim.returncode is not None:
                break
            msg = m.rng.choice(valid)
            value = m.values(msg) if m.rng.random() < 0.85 else msg
            tag = json.dumps(value, default=lambda v: v.hex() if isinstance(v, bytes) else str(v))
            if m.rng.random() < 0.1:
                tag = m.bytes_(tag.encode()).decode("utf-8", "replace")
            run.note("tag", tag)
            with contextlib.suppress(kv.LLMException, ValueError):
                await cm.notify(3, tag, timeout=5)
        await asyncio.sleep(0.3)
        await sound(victim, run, vitals, log)
        # What the peer asked for and never followed up is kept, bounded
        # (MAX_UNKNOWN per side) and reaped; the RSS bound above holds it.
        state = await victim.call("state")
        assert state["pending"] <= 3 * MAX_UNKNOWN, f"{state}\n{run.report()}"
        # A fresh hand-off works: a legitimate decode agent pulls it.
        again = await victim.call("hold", req_id="r2", blocks=[10, 11], seed=7)
        kv_d = [np.zeros((AGENT_BLOCKS, AGENT_BLOCK_BYTES), np.uint8) for _ in range(AGENT_LAYERS)]
        d = TransferAgent(4, agent_layout(tuple(a.ctypes.data for a in kv_d)), transport=transport)
        await asyncio.to_thread(d.start)
        try:
            host, port = victim.address.rsplit(":", 1)
            d.pull("q2", Peer(host, int(port), 3), "r2", [10, 11], [20, 21], None,
                   key=again["key"], until_ms=again["until_ms"])  # fmt: skip
            end = time.monotonic() + 20
            done: set[str] = set()
            while "q2" not in done and time.monotonic() < end:
                got = d.take_results()
                assert "q2" not in got.failed_recving, got
                done |= got.finished_recving
                await asyncio.sleep(0.02)
            assert "q2" in done
            assert d.block_digest([20, 21]) == again["digest"]
        finally:
            await asyncio.to_thread(d.close)


# --------------------------------------------- pure-Python parsers, in-process

#: Examples per parser (``AIOKVCACHE_FUZZ_SECONDS`` scales them for long runs).
PARSERS = settings(max_examples=int(50 * SECONDS), deadline=None)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
keys = st.sampled_from(
    ["cache_id", "timeout", "nonce", "slot", "addrs", "cluster_id", "req_id", "model_id",
     "prefix_id", "problem", "addr", "len", "base", "span", "rkey", "batch_index", "caches",
     "status", "message", "version", "role", "auth", "worker_address", "host_id", "note_key",
     "probe", "mac", "expect", "eager"]
)  # fmt: skip
bodies = st.dictionaries(keys | st.text(max_size=8), values, max_size=8)
REQUESTS = list(wire._REQUESTS.values())  # every request a peer can send


@PARSERS
@given(st.sampled_from([*(r.op.value for r in REQUESTS), "nope"]), bodies)
def test_a_peers_request_parses_or_is_param_invalid(op: str, body: dict[str, Any]) -> None:
    try:
        wire.parse_request(op, body)
    except kv.LLMException as exc:
        assert exc.status_code == S.LLM_PARAM_INVALID


@PARSERS
@given(st.sampled_from(REQUESTS), bodies)
def test_a_peers_answer_parses_or_is_a_bad_reply(request: Any, body: dict[str, Any]) -> None:
    instance = request.__new__(request)
    with contextlib.suppress(wire.BadReply):
        request.reply(instance, body)


@PARSERS
@given(bodies)
def test_a_peers_error_frame_parses_or_is_a_protocol_error(body: dict[str, Any]) -> None:
    from aiokvcache._core.wire.peerstatus import PeerRefusal

    with contextlib.suppress(frames.ProtocolError):
        refusal = PeerRefusal.from_payload(body)
        got = refusal.verdict(wire.CacheById.peer_statuses, "cluster 2")
        assert got.status_code != S.LLM_SUCCESS


@PARSERS
@given(bodies, st.sampled_from([K.HELLO, K.HELLO_REPLY, K.AUTH, K.AUTH_OK]))
def test_handshake_messages_parse_or_are_protocol_errors(body: dict[str, Any], kind: Any) -> None:
    with contextlib.suppress(frames.ProtocolError):
        handshake._check_hello(kind, body)
    with contextlib.suppress(frames.ProtocolError):
        handshake._check_identity(kind, body)


@PARSERS
@given(values | st.binary(max_size=300))
def test_a_notification_payload_is_taken_or_dropped(value: Any) -> None:
    from aiokvcache._core.transfer.notify import Receiver

    data = value if isinstance(value, bytes) else encodable(value)
    if data is None:
        return
    receiver = Receiver(_NullSide())
    receiver.on_notify(2, data)  # never raises: a malformed one is counted and dropped


@PARSERS
@given(values | st.text(max_size=200))
def test_a_connector_message_parses_or_is_refused(value: Any) -> None:
    from aiokvcache.integrations.agent import wire as _wire

    tag = value if isinstance(value, str) else json.dumps(value, default=repr)
    with contextlib.suppress(_wire.BadMessage, ValueError, RecursionError):
        _wire.decode(tag)


class _NullSide:
    """The loop side a Receiver needs when nobody waits on it."""

    def future(self) -> Any:
        raise AssertionError("nobody waits")


# ------------------------------------------------------ what the fuzzer reaches


def test_a_victims_health_names_any_traceback_the_library_logged() -> None:
    """What :func:`sound` holds a victim to (its health's ``service_errors``)
    includes an exception the library caught and logged with its traceback
    anywhere (a completion handler, a connection's reader), not only what
    reached a peer-service loop: input that raised what it should have
    refused is a finding even when the victim goes on."""
    import logging

    from aiokvcache.testing import peer

    peer.watch_service_errors()
    try:
        before = len(peer.service_errors())
        try:
            raise OverflowError("cannot convert float infinity to integer")
        except OverflowError:
            logging.getLogger("aiokvcache").exception("completion handler failed (kind 1)")
        logging.getLogger("aiokvcache.control").error("a plain error, no traceback")
        got = peer.service_errors()[before:]
        assert got == ["aiokvcache: completion handler failed (kind 1)"], got
    finally:
        logging.getLogger("aiokvcache").removeHandler(peer._SERVICE_ERRORS)


async def test_the_dialler_target_reaches_every_answer_it_fuzzes(identity: Identity) -> None:
    """The dialler target's acceptor mutates the answers to the victim's
    probe_back and probe_info requests (``Acceptor._answer``): in stage 2 (a
    valid AUTH_OK, with or without a probe slot) the victim asks both."""
    run = Run("dialler-reach", seconds=0)
    asked: dict[str, int] = {}
    note = run.note

    def counting(what: str, data: Any) -> None:
        if what.startswith("answer to "):
            asked[what] = asked.get(what, 0) + 1
        note(what, data)

    run.note = counting  # type: ignore[method-assign]
    acceptor = Acceptor(run, identity, None)
    acceptor.stage = 2
    async with listener(acceptor) as address, PeerProcess("prefill", "tcp") as victim:
        for _ in range(12):
            await victim.link(address, 2, timeout_ms=LINK_MS)
    assert asked.get("answer to probe_back"), asked
    assert asked.get("answer to probe_info"), asked


#: What a notification's numeric fields may hold: any number the codec carries.
note_numbers = st.floats(allow_nan=True) | st.integers(-(2**63), 2**64 - 1)


@PARSERS
@given(
    st.fixed_dictionaries(
        {"t": st.text(max_size=8), "i": note_numbers, "b": st.none() | note_numbers},
        optional={"l": note_numbers, "k": st.none() | st.binary(max_size=40) | values},
    )
)
@example({"t": "tag", "i": float("inf"), "b": 0, "l": 1})
def test_a_notification_with_its_fields_is_taken_or_dropped(fields: dict[str, Any]) -> None:
    """The notification parser, fed payloads that carry the fields it reads
    (t, i, b, l, k) with values of any type, ``inf`` and ``nan`` included:
    taken, or counted and dropped; never an exception."""
    from aiokvcache._core.transfer.notify import Receiver

    data = encodable(fields)
    if data is None:
        return
    Receiver(_NullSide()).on_notify(2, data)  # never raises
