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

import importlib.util
import os
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


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_aiokvcache_decodes_the_reference_tokens(
    model: str, reference: list[list[int]], tmp_path: os.PathLike[str], transport: str
) -> None:
    """``--disaggregation-transfer-backend aiokvcache`` (the plugin entry
    point registers it; no SGLang file edited): every request's tokens
    equal the plain server's, over TCP and over what ``auto`` picks on one
    host (shared memory)."""
    env = dict(os.environ, AIOKVCACHE_SGLANG_TRANSPORT=transport)
    with driver.Deployment(model, "aiokvcache", str(tmp_path), env=env) as pd:
        got = driver.generate(pd.url, prompts(LENGTHS), MAX_NEW)
        again = driver.generate(pd.url, prompts(LENGTHS[:2]), MAX_NEW)
    assert [o.get("output_ids") for o in got] == reference, got
    assert [o.get("output_ids") for o in again] == reference[:2], again
