"""Hostile control-plane peers do not take a decoder down.

A listening decoder (the harness peer's ``decoder`` mode, with an
``auth_token``) is attacked on its control port — random bytes, huge
length prefixes, truncated frames, a valid handshake followed by garbage,
idle connections held open, connect/close storms, wrong and missing tokens —
while a legitimate prefill in this process keeps linking, pushing and
unlinking. The legitimate peer must succeed throughout (the worst link time
is printed, ``MEASURED`` lines, ``pytest -s``), and the decoder's resident
memory must stay bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aiokvcache as kv
from aiokvcache._core.wire import control, frames, handshake
from aiokvcache._loader import native
from aiokvcache.testing import cluster_info, options
from support.harness import AsyncPeer, rss_kb

TOKEN = "s3cret-token"
TENSORS, TENSOR_BYTES = 4, 256 << 10
LINK_BOUND_S = 3.0  # every legitimate link must succeed within this
RSS_GROWTH_BOUND_KB = 64 << 10  # 64 MiB
MIN_CYCLES = 5
ATTACK_MIN_S = 2.0

Attack = Callable[[str, int], Awaitable[None]]


def measured(what: str, **values: Any) -> None:
    text = " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
    print(f"MEASURED {what}: {text}")


async def _drain_until_closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Read until the server closes; whether it did within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        pass
    return True


async def _send_and_wait(host: str, port: int, data: bytes, close_after: bool) -> None:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()
        if not close_after:
            await _drain_until_closed(reader, 2.0)
    finally:
        writer.transport.abort()


# ----------------------------------------------------------------- attacks


async def random_bytes(host: str, port: int) -> None:
    rng = np.random.default_rng(1)
    for i in range(100):
        data = rng.integers(0, 256, int(rng.integers(1, 65536)), dtype=np.uint8).tobytes()
        await _send_and_wait(host, port, data, close_after=i % 2 == 0)


async def huge_length(host: str, port: int) -> None:
    for n in (0xFFFFFFFF, 0x7FFFFFFF, control.MAX_FRAME + 1, 1 << 30):
        for _ in range(10):
            await _send_and_wait(host, port, n.to_bytes(4, "big") + b"x" * 1000, False)


async def truncated_frames(host: str, port: int) -> None:
    hello = frames.pack_frame(
        frames.Kind.HELLO,
        0,
        handshake.hello_payload(
            control.LocalInfo(99, 0, b"w" * 64, auth_token=TOKEN.encode()),
            secrets.token_bytes(handshake.NONCE_LEN),
        ),
    )
    sends = [
        _send_and_wait(host, port, hello[:cut], close_after)
        for cut in (1, 3, 4, 5, 10, len(hello) // 2, len(hello) - 1)
        for close_after in (True, False)
    ]
    # A length that promises more than follows, then silence: held 2 s here
    # (the handshake timeout reclaims such a socket).
    sends.append(_send_and_wait(host, port, (1000).to_bytes(4, "big") + b"y" * 10, False))
    await asyncio.gather(*sends)


async def handshake_then_garbage(host: str, port: int) -> None:
    eng = native.Engine("tcp")  # a real worker address for the decoder to reach
    try:
        for i in range(20):
            cid = 100 + i
            reader, writer = await asyncio.open_connection(host, port)
            try:
                local = control.LocalInfo(
                    cid, 0, bytes(eng.worker_address), auth_token=TOKEN.encode()
                )
                nonce = secrets.token_bytes(handshake.NONCE_LEN)
                hello = handshake.hello_payload(local, nonce)
                writer.write(frames.pack_frame(frames.Kind.HELLO, 0, hello))
                kind, _, reply = await frames.read_frame(reader)
                assert kind is frames.Kind.HELLO_REPLY, kind
                ids = handshake.transcript(hello, reply)
                mine = handshake.identity_payload(local, secrets.token_bytes(control.NOTE_KEY_LEN))
                mac = handshake.compute_mac(
                    local.auth_token, b"aiokvcache-c", reply["nonce"], nonce, ids, mine
                )
                tx, rx = handshake.session_seals(local.auth_token, nonce, reply["nonce"], ids)
                auth = frames.pack_frame(frames.Kind.AUTH, 0, {"mac": mac, **mine}, tx)
                writer.write(auth)
                kind, _, _ = await frames.read_frame(reader, rx)
                assert kind is frames.Kind.AUTH_OK, kind
                garbage = [
                    secrets.token_bytes(512),  # not a frame at all
                    (8).to_bytes(4, "big") + b"\x01\x07" + secrets.token_bytes(6),  # bad kind
                    (0xFFFFFFF0).to_bytes(4, "big"),  # huge
                ][i % 3]
                writer.write(garbage)
                # Garbage closes it at once; a random length that fits MAX_FRAME
                # leaves the frame pending until the heartbeat (peer_timeout 5 s).
                assert await _drain_until_closed(reader, 10.0), "garbage did not close it"
            finally:
                writer.transport.abort()
    finally:
        eng.close()


IDLE_CONNECTIONS = 200


async def slowloris(host: str, port: int) -> None:
    held = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            with contextlib.suppress(OSError):
                held.append(await asyncio.open_connection(host, port))
        await asyncio.sleep(4.0)  # legitimate links meanwhile
    finally:
        for _, writer in held:
            writer.transport.abort()


async def connect_close(host: str, port: int) -> None:
    for _ in range(2000):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, port)
            writer.transport.abort()


async def bad_auth(host: str, port: int) -> None:
    wrong = kv.LLMDataDist(kv.LLMRole.PROMPT, 40)
    none = kv.LLMDataDist(kv.LLMRole.PROMPT, 41)
    await wrong.init(options("tcp", auth_token="guess"))
    await none.init(options("tcp"))
    try:
        for _ in range(20):
            for dd in (wrong, none):
                _, per = await dd.link_clusters([cluster_info(f"{host}:{port}", 2)], timeout=2000)
                assert per == [kv.LLMStatusCode.LLM_LINK_FAILED], per
    finally:
        await wrong.finalize()
        await none.finalize()


ATTACKS: dict[str, Attack] = {
    "random_bytes": random_bytes,
    "huge_length": huge_length,
    "truncated_frames": truncated_frames,
    "handshake_then_garbage": handshake_then_garbage,
    "slowloris": slowloris,
    "connect_close": connect_close,
    "bad_auth": bad_auth,
}

KNOWN = {}


@pytest.mark.parametrize(
    "attack", [pytest.param(name, marks=KNOWN.get(name, ())) for name in ATTACKS]
)
async def test_hostile_peer(attack: str) -> None:
    async with (
        AsyncPeer("decoder", "tcp", f"--auth-token={TOKEN}", lifetime=110) as dec,
        kv.LLMDataDist(kv.LLMRole.PROMPT, 1) as prompt,
    ):
        await prompt.init(options("tcp", auth_token=TOKEN))
        dst = await dec.call("alloc", name="dst", tensors=TENSORS, bytes=TENSOR_BYTES)
        desc = kv.CacheDesc(TENSORS, [1, TENSOR_BYTES], kv.DataType.DT_UINT8, kv.Placement.HOST)
        src = prompt.cache_manager.allocate_cache(desc)
        rng = np.random.default_rng(5)
        for t in src.tensors:
            t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
        info = cluster_info(dec.address, 2)
        key = kv.CacheKeyByIdAndIndex(2, dst["cache_id"], 0)
        host, port = dec.address.rsplit(":", 1)
        rss_before = rss_kb(dec.pid)

        failures: list[str] = []
        link_times: list[float] = []
        done = asyncio.Event()

        async def legit() -> None:
            cycles = 0
            while cycles < MIN_CYCLES or not done.is_set():
                t0 = time.monotonic()
                _, per = await prompt.link_clusters([info], timeout=int(LINK_BOUND_S * 1000))
                link_times.append(time.monotonic() - t0)
                if per != [kv.LLMStatusCode.LLM_SUCCESS]:
                    failures.append(f"link {per[0].name} after {link_times[-1]:.2f}s")
                    await asyncio.sleep(0.05)
                    continue
                try:
                    await prompt.cache_manager.push_cache(key, src, timeout=3)
                except kv.LLMException as exc:
                    failures.append(f"push {exc.status_code.name}")
                await prompt.unlink_clusters([info])
                cycles += 1
                await asyncio.sleep(0.02)

        async def attacker() -> None:
            # Repeated for at least ATTACK_MIN_S, so the legitimate peer
            # links many times while it lasts.
            end = time.monotonic() + ATTACK_MIN_S
            try:
                await ATTACKS[attack](host, int(port))
                while time.monotonic() < end:
                    await ATTACKS[attack](host, int(port))
            finally:
                done.set()

        t0 = time.monotonic()
        async with asyncio.timeout(90):
            await asyncio.gather(legit(), attacker())
        attack_s = time.monotonic() - t0
        rss_after = rss_kb(dec.pid)
        # The decoder still serves: a last link and push, bytes checked.
        _, per = await prompt.link_clusters([info], timeout=int(LINK_BOUND_S * 1000))
        assert per == [kv.LLMStatusCode.LLM_SUCCESS], per
        await prompt.cache_manager.push_cache(key, src, timeout=3)
        want = hashlib.sha256(b"".join(t.tobytes() for t in src.tensors))
        assert (await dec.call("hash", name="dst"))["sha"] == want.hexdigest()
        measured(
            f"hostile {attack}",
            attack_s=attack_s,
            legit_links=len(link_times),
            legit_failures=len(failures),
            worst_link_s=max(link_times),
            rss_before_kb=rss_before,
            rss_after_kb=rss_after,
            first_failures=failures[:3],
        )
        assert not failures, failures[:10]
        assert max(link_times) < LINK_BOUND_S
        assert rss_after - rss_before < RSS_GROWTH_BOUND_KB, (rss_before, rss_after)
        assert dec.proc is not None and dec.proc.returncode is None, "the decoder died"
