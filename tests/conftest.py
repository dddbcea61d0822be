"""Shared fixtures: a guard on the loop's exception handler, transports, a linked pair."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from aiokvcache import testing
from aiokvcache.testing import Pair
from support.guards import BRIDGES, ServiceErrors, track_bridges

track_bridges()

TRANSPORTS = ("shm", "tcp")


@pytest.fixture(autouse=True)
async def loop_guard() -> AsyncIterator[None]:
    """Fail any test during which the event loop's exception handler ran.

    A callback that raised, a future whose exception nobody retrieved, a task
    destroyed while pending: all land there, and all are bugs.
    """
    loop = asyncio.get_running_loop()
    calls: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: calls.append(ctx))
    before = set(BRIDGES)
    with ServiceErrors() as service_errors:
        yield
        # Let done-callbacks and finalizers of this test run before judging.
        await asyncio.sleep(0)
    loop.set_exception_handler(previous)
    assert not calls, f"loop exception handler was called: {calls!r}"
    # The same for every peer-service loop the test ran.
    assert not service_errors.records, (
        f"a service loop's exception handler ran: {service_errors.describe()}"
    )
    # No native job may outlive the test that started it.
    for bridge in set(BRIDGES) - before:
        if not bridge.closed:
            assert bridge.pending_jobs == 0, f"{bridge.pending_jobs} jobs still pending"
            assert bridge.engine.stats()["live_jobs"] == 0, "native jobs still live"
            bridge.close()  # a test that leaked its engine: do not leak threads too


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each transport the suite must pass with (shm, tcp)."""
    return str(request.param)


@pytest.fixture
def tmp_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Environment for child processes: the same interpreter and paths."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    yield env


@pytest.fixture
async def pair(transport: str) -> AsyncIterator[Pair]:
    """A prompt (cluster 1) linked to a decoder (cluster 2) in this process, over
    each transport; finalized after the test, with no native job left live."""
    async with testing.pair(transport) as pr:
        yield pr
