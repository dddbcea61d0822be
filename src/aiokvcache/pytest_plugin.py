"""pytest fixtures for test suites of code built on aiokvcache (the ``pytest11`` plugin).

Installed with the package and loaded by pytest automatically; the fixtures
need anyio's pytest plugin (``pip install "aiokvcache[pytest]"``) and run on
the test's anyio backend, asyncio or trio: mark the tests ``@pytest.mark.anyio``
(this works beside pytest-asyncio) and parametrize ``anyio_backend`` to run
them on both.

* ``kv_pair``: a prompt (cluster 1) linked to a listening decoder (cluster 2),
  both in this process (:class:`aiokvcache.testing.Pair`).
* ``kv_peer``: a decoder (cluster 2) in a child process
  (:class:`aiokvcache.testing.PeerProcess`), which the test can freeze,
  thaw, slow down or kill.
* ``kv_prompt``: a prompt :class:`~aiokvcache.LLMDataDist` (cluster 1) in this
  process, linked to ``kv_peer``.
* ``kv_decoder`` and ``kv_prefill_peer``: the other way round, a listening
  decoder (cluster 2) in this process and a prefill (cluster 1) in a child
  process linked to it, whose tagged layer-by-layer pushes can be paced,
  stopped or frozen mid-layer.
* ``kv_transport`` ("auto") and ``kv_options`` (``{}``: extra
  :class:`~aiokvcache.LLMConfig` attributes, ``{"sync_kv_timeout": 2000}``)
  configure them; override them in a ``conftest.py``, or give
  ``--kv-transports=shm,tcp`` (or the ini option ``kv_transports``) to run
  every test that uses them once per transport.

What the fixtures promise at teardown, each failing the test otherwise (the
guarantees aiokvcache's own suite holds itself to): no native transfer job
left live in an instance they made; no error reached a peer-service loop's
exception handler; the peer process did not die unless the test killed it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from aiokvcache import LLMDataDist
    from aiokvcache.testing import Pair, PeerProcess

__all__ = [
    "kv_decoder",
    "kv_options",
    "kv_pair",
    "kv_peer",
    "kv_prefill_peer",
    "kv_prompt",
    "kv_transport",
]

_TRANSPORTS_HELP = (
    "comma-separated transports (auto, shm, tcp, rdma) to run each test that uses "
    "aiokvcache's kv_* fixtures with (default: auto)"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--kv-transports`` and the ini option ``kv_transports``."""
    group = parser.getgroup("aiokvcache")
    group.addoption("--kv-transports", default=None, help=_TRANSPORTS_HELP)
    parser.addini("kv_transports", _TRANSPORTS_HELP, default="")


def _transports(config: pytest.Config) -> list[str]:
    text = config.getoption("--kv-transports") or config.getini("kv_transports") or ""
    return [t.strip() for t in str(text).split(",") if t.strip()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One run per transport given to ``--kv-transports`` (``kv_transport``'s value)."""
    if "kv_transport" not in metafunc.fixturenames:
        return
    transports = _transports(metafunc.config)
    if transports:
        metafunc.parametrize("kv_transport", transports, ids=[f"kv-{t}" for t in transports])


_FIXTURES = frozenset({"kv_decoder", "kv_pair", "kv_peer", "kv_prefill_peer", "kv_prompt"})


def _asyncio_mode(config: pytest.Config) -> str | None:
    """pytest-asyncio's mode in this run, or None where it is not loaded."""
    if not config.pluginmanager.hasplugin("asyncio"):
        return None
    try:
        mode = config.getoption("asyncio_mode", None) or config.getini("asyncio_mode")
    except ValueError:
        return None
    return str(getattr(mode, "value", mode) or "").lower() or None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One clear usage error where pytest-asyncio's *auto* mode would break
    every test that uses the fixtures: it claims each coroutine test and
    fixture, asyncio ones included, and runs them on a loop of its own
    ("Future attached to a different loop", trio's "Task got bad yield")."""
    if _asyncio_mode(config) != "auto":
        return
    users = [item.nodeid for item in items if _FIXTURES & set(getattr(item, "fixturenames", ()))]
    if not users:
        return
    shown = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
    raise pytest.UsageError(
        "aiokvcache's kv_* fixtures run on anyio's pytest plugin, and pytest-asyncio's "
        f"auto mode takes over their tests ({shown}): set asyncio_mode = strict (its default) "
        "in the pytest configuration, or run with --asyncio-mode=strict; mark the tests "
        "@pytest.mark.anyio (docs/testing.md)"
    )


@pytest.fixture
def kv_transport() -> str:
    """The data plane of the instances the fixtures make: "auto" (UCX picks)."""
    return "auto"


@pytest.fixture
def kv_options() -> dict[str, Any]:
    """Extra :class:`~aiokvcache.LLMConfig` attributes for every instance the
    fixtures make (``{"sync_kv_timeout": 2000, "peer_timeout": 1000}``)."""
    return {}


class _ServiceLoopErrors(logging.Handler):
    """What reached a peer-service loop's exception handler (logged at ERROR)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _no_service_errors(what: str) -> Iterator[None]:
    logger = logging.getLogger("aiokvcache.service")
    handler = _ServiceLoopErrors()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.messages:
        pytest.fail(f"{what}: an error reached a peer-service loop: {handler.messages}")


def _live_jobs(dd: LLMDataDist) -> int:
    try:
        return int(dd.cache_manager.stats()["live_jobs"])
    except RuntimeError:  # not initialized
        return 0


@pytest.fixture
async def kv_pair(
    anyio_backend: Any, kv_transport: str, kv_options: dict[str, Any]
) -> AsyncIterator[Pair]:
    """A prompt (cluster 1) linked to a listening decoder (cluster 2) in this
    process; finalized after the test, which fails if a native job was left."""
    from aiokvcache import testing

    with _no_service_errors("kv_pair"):
        async with testing.pair(kv_transport, **kv_options) as pr:
            yield pr


@contextlib.asynccontextmanager
async def _checked_peer(peer: PeerProcess, name: str) -> AsyncIterator[PeerProcess]:
    """``peer`` started for the block and ended after it; the test fails if
    it died unless it was killed through it, or if (thawed first, when left
    frozen) it still has native jobs live or an error reached its
    peer-service loop."""
    problems: list[str] = []
    async with peer:
        yield peer
        if peer.returncode is not None:
            if not peer.killed:
                problems.append(f"the peer process died during the test (rc {peer.returncode})")
        elif not peer.killed:
            peer.thaw()  # and its layer pushes go on: let them end first
            settled = await peer.call("settle", 60, wait=30)
            if settled["unsettled"]:
                problems.append("its push_layers still ran 30 s after the test")
            health = await peer.health()
            if health["live_jobs"]:
                problems.append(f"{health['live_jobs']} native jobs still live in the peer")
            if health["service_errors"]:
                errors = health["service_errors"]
                problems.append(f"an error reached the peer's service loop: {errors}")
    if problems:
        pytest.fail(f"{name}: " + "; ".join(problems))


@pytest.fixture
async def kv_peer(
    anyio_backend: Any, kv_transport: str, kv_options: dict[str, Any]
) -> AsyncIterator[PeerProcess]:
    """A listening decoder (cluster 2) in a child process, started for the
    test and ended after it. The test fails if the peer died unless it was
    killed through it (:meth:`~aiokvcache.testing.PeerProcess.kill`), or if
    the peer (thawed first, if the test left it frozen) still has native
    jobs live or an error reached its peer-service loop."""
    from aiokvcache.testing import PeerProcess

    async with _checked_peer(
        PeerProcess("decoder", kv_transport, options=kv_options), "kv_peer"
    ) as peer:
        yield peer


@contextlib.asynccontextmanager
async def _checked_instance(
    name: str, role: int, cluster_id: int, opts: Any
) -> AsyncIterator[LLMDataDist]:
    """An ``LLMDataDist`` started with ``opts`` for the block and finalized
    after it; the test fails if a native job was left or an error reached
    its peer-service loop."""
    from aiokvcache import LLMDataDist, LLMRole

    with _no_service_errors(name):
        dd = LLMDataDist(LLMRole(role), cluster_id)
        try:
            await dd.init(opts)
            yield dd
            left = _live_jobs(dd)
        finally:
            await dd.finalize()
    if left:
        pytest.fail(f"{name}: {left} native jobs still live after the test")


@pytest.fixture
async def kv_decoder(
    anyio_backend: Any, kv_transport: str, kv_options: dict[str, Any]
) -> AsyncIterator[LLMDataDist]:
    """A listening decoder (cluster 2) in this process: the decode side under
    test, which ``kv_prefill_peer`` pushes into. Finalized after the test,
    which fails if a native job was left."""
    from aiokvcache import LLMRole, testing

    opts = testing.options(kv_transport, listen=True, **kv_options)
    async with _checked_instance("kv_decoder", LLMRole.DECODER, testing.DECODER_ID, opts) as dd:
        yield dd


@pytest.fixture
async def kv_prefill_peer(
    anyio_backend: Any, kv_decoder: LLMDataDist, kv_transport: str, kv_options: dict[str, Any]
) -> AsyncIterator[PeerProcess]:
    """A prefill (cluster 1) in a child process, linked to ``kv_decoder``:
    its pushes carry tags and are paced, stopped or frozen mid-layer on
    demand (:meth:`~aiokvcache.testing.PeerProcess.push_layers`), so the
    decode side's ``wait_for_layers`` / ``notifications()`` code is tested
    against a peer that can hang or die. The same checks as ``kv_peer`` at
    teardown."""
    from aiokvcache.testing import PeerProcess

    peer = PeerProcess("prefill", kv_transport, options=kv_options)
    async with _checked_peer(peer, "kv_prefill_peer"):
        linked = await peer.link(str(kv_decoder.listen_address), kv_decoder.cluster_id, 10_000)
        if linked["status"] != "LLM_SUCCESS":
            raise RuntimeError(f"kv_prefill_peer: cannot link to kv_decoder: {linked}")
        yield peer


@pytest.fixture
async def kv_prompt(
    anyio_backend: Any, kv_peer: PeerProcess, kv_transport: str, kv_options: dict[str, Any]
) -> AsyncIterator[LLMDataDist]:
    """A prompt (cluster 1) in this process, linked to ``kv_peer``; finalized
    after the test, which fails if a native job was left."""
    from aiokvcache import LLMRole, LLMStatusCode, testing

    opts = testing.options(kv_transport, **kv_options)
    async with _checked_instance("kv_prompt", LLMRole.PROMPT, testing.PROMPT_ID, opts) as dd:
        info = testing.cluster_info(kv_peer.address, kv_peer.cluster_id)
        rc, per = await dd.link_clusters([info], timeout=10_000)
        if rc != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"kv_prompt: cannot link to kv_peer: {[s.name for s in per]}")
        yield dd
