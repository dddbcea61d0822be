"""Shared fixtures: guards on every test, transports, a linked pair.

Most test modules run on asyncio (pytest-asyncio): :func:`pytest_collectstart`
marks each module ``asyncio`` unless it is marked ``pytest.mark.anyio``. The
API tests are: they run on asyncio and on trio, through anyio's pytest plugin,
with the fixtures of aiokvcache's own plugin (``kv_pair``, ``kv_peer``,
``kv_prompt``), which :func:`anyio_backend` and :func:`kv_transport`
parametrize over both backends and both transports.

Every test is guarded (:func:`native_guard`, and the loop guard its kind gets):
no native job may outlive it, no error may reach a peer-service loop, and on
asyncio nothing may reach the loop's exception handler.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
import sniffio

from aiokvcache import testing
from aiokvcache.testing import Pair
from support.guards import BRIDGES, ServiceErrors, track_bridges

track_bridges()

TRANSPORTS = ("shm", "tcp")
BACKENDS = ("asyncio", "trio")


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The API tests (``pytest.mark.anyio``) run on asyncio and on trio."""
    return str(request.param)


def _coroutine_tests(ns: Any) -> Iterator[Any]:
    for name, obj in vars(ns).items():
        if name.startswith("test") and inspect.iscoroutinefunction(obj):
            yield obj
        elif name.startswith("Test") and isinstance(obj, type):
            yield from _coroutine_tests(obj)


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Each test module runs on asyncio (pytest-asyncio: its coroutine tests are
    marked ``asyncio``) unless it is marked anyio; it gets the loop guard of its kind."""
    if not isinstance(collector, pytest.Module):
        return
    try:
        mod = collector.obj  # imported now; its pytestmark is the module's markers
    except BaseException:  # an import error or importorskip: collection reports it
        return
    if collector.get_closest_marker("anyio") is not None:
        collector.add_marker(pytest.mark.usefixtures("anyio_loop_guard"))
        return
    for fn in _coroutine_tests(mod):
        pytest.mark.asyncio(fn)
    collector.add_marker(pytest.mark.usefixtures("asyncio_loop_guard"))


@pytest.fixture(autouse=True)
def native_guard() -> Iterator[None]:
    """Fail a test during which an error reached a peer-service loop, or that
    left a native job live in an engine it started."""
    before = set(BRIDGES)
    with ServiceErrors() as service_errors:
        yield
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


def _handler_guard(loop: asyncio.AbstractEventLoop, calls: list[dict[str, Any]]) -> Any:
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: calls.append(ctx))
    return previous


@pytest_asyncio.fixture
async def asyncio_loop_guard() -> AsyncIterator[None]:
    """Fail an asyncio test during which the loop's exception handler ran.

    A callback that raised, a future whose exception nobody retrieved, a task
    destroyed while pending: all land there, and all are bugs.
    """
    loop = asyncio.get_running_loop()
    calls: list[dict[str, Any]] = []
    previous = _handler_guard(loop, calls)
    yield
    await asyncio.sleep(0)  # done-callbacks and finalizers of the test run first
    loop.set_exception_handler(previous)
    assert not calls, f"loop exception handler was called: {calls!r}"


@pytest.fixture
async def anyio_loop_guard(anyio_backend: str) -> AsyncIterator[None]:
    """:func:`asyncio_loop_guard` for the anyio tests on asyncio. (Under trio an
    error in one of the library's system tasks ends the run: the test fails.)"""
    if sniffio.current_async_library() != "asyncio":
        yield
        return
    loop = asyncio.get_running_loop()
    calls: list[dict[str, Any]] = []
    previous = _handler_guard(loop, calls)
    yield
    await anyio.lowlevel.checkpoint()
    loop.set_exception_handler(previous)
    assert not calls, f"loop exception handler was called: {calls!r}"


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each transport the suite must pass with (shm, tcp)."""
    return str(request.param)


@pytest.fixture
def kv_transport(transport: str) -> str:
    """The plugin's fixtures over each transport of :func:`transport`."""
    return transport


@pytest.fixture
def tmp_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Environment for child processes: the same interpreter and paths."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    yield env


@pytest_asyncio.fixture
async def pair(transport: str) -> AsyncIterator[Pair]:
    """A prompt (cluster 1) linked to a decoder (cluster 2) in this process, over
    each transport; finalized after the test, with no native job left live."""
    async with testing.pair(transport) as pr:
        yield pr


@pytest.fixture
def registry() -> Iterator[Any]:
    """A fresh Prometheus registry with aiokvcache's collector, metrics on
    for the test only (skipped without prometheus_client)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from aiokvcache import metrics

    reg = prometheus_client.CollectorRegistry()
    metrics.reset()
    metrics.enable(reg, tracing=False)
    try:
        yield reg
    finally:
        metrics.disable()
        metrics.reset()
        reg.unregister(metrics._get_collector())


@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a real etcd (:func:`support.etcd.etcd_server`)."""
    from support import etcd

    with etcd.etcd_server(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


@pytest.fixture
def prefix() -> str:
    """An etcd key prefix of this test's own: tests do not see each other's instances."""
    import uuid

    return f"/akvtest/{uuid.uuid4().hex}/"
