"""SGLang prefill/decode disaggregation on this CPU-only host, end to end: a
prefill, a decode and sglang-router as processes on 127.0.0.1
(:mod:`aiokvcache.testing.sglang`), their tokens checked against one plain
server's, request for request.

The baseline the aiokvcache transfer backend (issue 37) is measured against:
SGLang's default backend, Mooncake's transfer engine over TCP
(``mooncake_tcp``). A KV cache that never arrived shows: the tiny model has
real random weights, and with the KV send made a no-op its decode tokens
differ from the second token on (``../shared/recipes/sglang-cpu``).

Needs SGLang 0.5.23 with Mooncake and sglang-router (the CI builds that venv
as the recipe does and runs this file there); skipped otherwise.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import signal
import time
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None:
    pytest.skip(
        "SGLang is not installed here (../shared/recipes/sglang-cpu, see .ci/run)",
        allow_module_level=True,
    )

from aiokvcache.testing import sglang as driver
from aiokvcache.testing.vllm import prompts

pytestmark = pytest.mark.timeout(900)

# One token, a few, several dozen: all in flight together.
LENGTHS = [1, 7, 16, 33, 64, 120]
MAX_NEW = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return driver.tiny_model(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[list[int]]]:
    """Each prompt's tokens from one plain server (no disaggregation)."""
    work = str(tmp_path_factory.mktemp("plain"))
    server = driver.Server(model, work)
    try:
        server.wait_ready()
        out = driver.generate(server.url, prompts(LENGTHS), MAX_NEW)
    finally:
        server.stop()
    assert all("output_ids" in o for o in out), out
    yield [o["output_ids"] for o in out]


def test_mooncake_tcp_decodes_the_reference_tokens(
    model: str, reference: list[list[int]], tmp_path: os.PathLike[str]
) -> None:
    """Prefill and decode through the router, KV over Mooncake's TCP
    transport: every request's tokens equal the plain server's."""
    with driver.Deployment(model, "mooncake_tcp", str(tmp_path)) as pd:
        got = driver.generate(pd.url, prompts(LENGTHS), MAX_NEW)
        again = driver.generate(pd.url, prompts(LENGTHS[:2]), MAX_NEW)  # a prefix-cache hit
    assert [o.get("output_ids") for o in got] == reference, got
    assert [o.get("output_ids") for o in again] == reference[:2], again
    assert all(len(ids) == MAX_NEW for ids in reference)


def test_aiokvcache_over_tcp_decodes_the_reference_tokens(
    model: str, reference: list[list[int]], tmp_path: os.PathLike[str]
) -> None:
    """``--disaggregation-transfer-backend aiokvcache`` over TCP: every
    request's tokens equal the plain server's."""
    env = dict(os.environ, AIOKVCACHE_SGLANG_TRANSPORT="tcp")
    with driver.Deployment(model, "aiokvcache", str(tmp_path), env=env) as pd:
        got = driver.generate(pd.url, prompts(LENGTHS), MAX_NEW)
    assert [o.get("output_ids") for o in got] == reference, got


@pytest.fixture(scope="module")
def aiokv(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[driver.Deployment]:
    """One aiokvcache deployment (transport ``auto``: shared memory on one
    host) for the tests below, in their order; the decode learns of a dead
    prefill from SGLang's heartbeat, every 2 s here."""
    env = dict(
        os.environ,
        AIOKVCACHE_SGLANG_TRANSPORT="auto",
        SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2",
    )
    pd = driver.Deployment(model, "aiokvcache", str(tmp_path_factory.mktemp("aiokv")), env=env)
    with pd:
        yield pd


def test_aiokvcache_decodes_the_reference_tokens(
    aiokv: driver.Deployment, reference: list[list[int]]
) -> None:
    """The plugin entry point registers the backend (no SGLang file edited):
    every request's tokens equal the plain server's, a prefix-cache hit's too."""
    got = driver.generate(aiokv.url, prompts(LENGTHS), MAX_NEW)
    again = driver.generate(aiokv.url, prompts(LENGTHS[:2]), MAX_NEW)
    assert [o.get("output_ids") for o in got] == reference, got
    assert [o.get("output_ids") for o in again] == reference[:2], again


def _abort_all(server: driver.Server, delay: float) -> None:
    time.sleep(delay)
    driver.post(f"{server.url}/abort_request", {"abort_all": True}, timeout=10)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_aiokvcache_an_abort_on_either_side_ends_its_requests(
    aiokv: driver.Deployment, reference: list[list[int]], side: str
) -> None:
    """Every request in flight is aborted on one side while the others run:
    each ends (an error or its tokens, never a hang), and the next requests
    get the reference tokens."""
    server = aiokv.prefill if side == "prefill" else aiokv.decode
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        aborting = pool.submit(_abort_all, server, 0.5)
        start = time.monotonic()
        out = driver.generate(aiokv.url, prompts([900] * 6), 60, timeout=150)
        aborting.result()
    assert all("output_ids" in o or "error" in o for o in out), out
    assert not any("timed out" in o.get("error", "") for o in out), out
    assert time.monotonic() - start < 120
    got = driver.generate(aiokv.url, prompts(LENGTHS), MAX_NEW)
    assert [o.get("output_ids") for o in got] == reference, got


def test_aiokvcache_a_killed_prefill_fails_its_requests_and_the_decode_serves_on(
    aiokv: driver.Deployment, reference: list[list[int]]
) -> None:
    """The prefill is killed with requests in flight (frozen first, so that
    none can have been computed: otherwise a fast one finishes before the
    kill): each fails within the heartbeat's deadline, the decode lives, and
    with a new prefill it serves the next requests with the reference
    tokens (no restart)."""
    aiokv.prefill.kill(signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(driver.generate, aiokv.url, prompts([900] * 6), 60, 150)
        time.sleep(1.0)
        killed = time.monotonic()
        aiokv.prefill.kill()
        out = running.result()
    assert time.monotonic() - killed < 60, out
    assert all("error" in o for o in out), out
    assert aiokv.decode.alive()
    aiokv.replace_prefill()
    got = driver.generate(aiokv.url, prompts(LENGTHS), MAX_NEW)
    assert [o.get("output_ids") for o in got] == reference, got
