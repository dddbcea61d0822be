"""SGLang prefill/decode servers and its router in child processes, on a
CPU-only host, for tests and benchmarks of the SGLang transfer backend.

* :func:`tiny_model`: a Llama with real random weights (hidden 256, 4
  layers, 4 heads, 2 KV heads, vocabulary 1024; ``initializer_range`` 0.3,
  so that the context changes the next token: a dummy-weights model ignores
  it and would hide a KV cache that never arrived); :data:`WIDE_KV_LLAMA`,
  the same with 16x the KV per token, for benchmarks.
* :func:`cpu_shim`: the workarounds SGLang 0.5.23 needs on a CPU without
  AMX (``../shared/recipes/sglang-cpu``): a torch stand-in for the one vLLM
  kernel its rotary embedding imports, and a plugin (entry point group
  ``sglang.srt.plugins``) that stops Mooncake's sender from pinning host
  memory with a CUDA event. A directory for ``PYTHONPATH``; nothing of
  SGLang is edited.
* :class:`Server`: ``sglang.launch_server`` in its own process group
  (``mode`` ``"plain"``, ``"prefill"`` or ``"decode"``, a transfer backend:
  ``"aiokvcache"`` or ``"mooncake_tcp"``, optionally pinned to ``cpus``),
  with the CPU flags (:data:`CPU_FLAGS`); :class:`Router`: ``sglang_router`` in front of a
  prefill and a decode; :class:`Deployment`: the three together.
* :func:`post` (JSON to a server's endpoint, e.g. ``/abort_request``);
  :func:`generate`: requests by token ids (the servers run without a
  tokenizer), greedy, in flight together; the output ids of each.

SGLang is imported in the servers' processes only; :func:`tiny_model` needs
torch and transformers in the running interpreter.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from .vllm import free_port

__all__ = [
    "CPU_FLAGS",
    "TINY_LLAMA",
    "WIDE_KV_LLAMA",
    "Deployment",
    "Router",
    "Server",
    "cpu_shim",
    "generate",
    "post",
    "tiny_model",
]

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: SGLang on a CPU without sgl-kernel's AMX build: torch-native attention and
#: sampling, no tokenizer (requests carry token ids), no overlap scheduler (it
#: records CUDA events on a prefix-cache hit), schedulers that sleep when idle
#: (else each spins a core: two servers would take this 2-core machine).
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--grammar-backend", "none", "--skip-tokenizer-init", "--disable-overlap-schedule",
    "--mem-fraction-static", "0.3", "--max-total-tokens", "32768", "--max-running-requests", "16",
    "--chunked-prefill-size", "-1", "--sleep-on-idle",
)  # fmt: skip


#: :data:`TINY_LLAMA` with 16x its KV per token (8 layers, 4 KV heads of 256,
#: 32 KiB a token in bf16) for little more compute: where the transfer, not
#: the model, is most of a request's time to first token.
WIDE_KV_LLAMA: dict[str, Any] = {
    **TINY_LLAMA,
    "num_hidden_layers": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}


def tiny_model(directory: str, seed: int = 0, config: dict[str, Any] | None = None) -> str:
    """Save a Llama (``config``, :data:`TINY_LLAMA` by default) with random
    weights (seeded) under ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (Path(directory) / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(config or TINY_LLAMA))).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


_SHIM_PLUGIN = '''"""CPU-only workarounds for SGLang (an sglang.srt.plugins entry point)."""


def load():
    try:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    except ImportError:
        return
    # prefill.py pins a host tensor and records a torch.cuda.Event when the
    # sender offers host-tensor indices; CPU torch has neither.
    MooncakeKVSender.supports_host_tensor_indices = False
'''

_SHIM_ROPE = '''"""A torch stand-in for vllm._custom_ops.rotary_embedding (SGLang imports it)."""
import torch


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    pos = positions.flatten()
    n = pos.shape[0]
    cos, sin = cos_sin_cache.index_select(0, pos).chunk(2, dim=-1)
    rot = cos.shape[-1] * 2
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    for t in (query, key):
        if t is None:
            continue
        xr = t.view(n, -1, head_size)[..., :rot]
        if is_neox:
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
            out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = xr[..., ::2], xr[..., 1::2]
            out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        xr.copy_(out)
'''


def cpu_shim(directory: str) -> str:
    """Write the CPU workarounds under ``directory``; the path for ``PYTHONPATH``."""
    root = Path(directory)
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_custom_ops.py").write_text(_SHIM_ROPE)
    (root / "akv_sglang_cpu.py").write_text(_SHIM_PLUGIN)
    info = root / "akv_sglang_cpu-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: akv-sglang-cpu\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\ncpu = akv_sglang_cpu:load\n")
    return str(root)


def _get(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body.strip().startswith((b"{", b"[")) else body


def post(url: str, payload: dict[str, Any], timeout: float) -> Any:
    """POST ``payload`` as JSON; the answer's JSON (None for an empty body)."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body.strip() else None


#: Sets its affinity to the cores in argv[1], then execs argv[2:].
_PIN = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(',')));"
    " os.execv(sys.argv[2], sys.argv[2:])"
)


class _Child:
    """A command in its own process group, its output in a log file."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log: str, cpus: Sequence[int] | None = None
    ) -> None:
        self.log_path = log
        self._log: IO[bytes] = open(log, "wb")  # closed in stop()
        if cpus is not None:  # the affinity, then the command: every process it starts inherits it
            argv = [sys.executable, "-c", _PIN, ",".join(map(str, cpus)), *argv]
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to its whole process group (the server's scheduler and
        detokenizer processes are in it)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


class Server(_Child):
    """``sglang.launch_server`` on 127.0.0.1 (:data:`CPU_FLAGS`)."""

    def __init__(
        self,
        model: str,
        workdir: str,
        mode: str = "plain",
        backend: str = "aiokvcache",
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        self.mode, self.backend = mode, backend
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else 0
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                "--host", "127.0.0.1", "--port", str(self.port), *CPU_FLAGS]  # fmt: skip
        if mode != "plain":
            argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
        if mode == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if mode == "decode":
            argv += ["--disaggregation-decode-retraction-backup", "none"]
        shim = cpu_shim(os.path.join(workdir, "shim"))
        full = dict(os.environ if env is None else env)
        full["PYTHONPATH"] = os.pathsep.join(p for p in (shim, full.get("PYTHONPATH")) if p)
        log = os.path.join(workdir, f"{mode}-{self.port}.log")
        super().__init__([*argv, *extra], full, log, cpus)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 240) -> None:
        """Until ``/health_generate`` answers (the model loaded, a step ran)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(f"sglang {self.mode} exited:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                _get(f"{self.url}/health", timeout=2)
                _get(f"{self.url}/get_model_info", timeout=2)
                return
            time.sleep(0.5)
        raise TimeoutError(f"sglang {self.mode} not ready in {timeout} s:\n{self.log_tail()}")


class Router(_Child):
    """``sglang_router`` in P/D mode in front of one prefill and one decode."""

    def __init__(self, prefill: Server, decode: Server, workdir: str) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--host", "127.0.0.1", "--port", str(self.port), "--prefill", prefill.url,
                str(prefill.bootstrap_port), "--decode", decode.url]  # fmt: skip
        super().__init__(argv, dict(os.environ), os.path.join(workdir, f"router-{self.port}.log"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        """Until both workers registered (its ``/health`` answers before that)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(f"router exited:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                workers = _get(f"{self.url}/workers", timeout=2)
                if isinstance(workers, dict) and len(workers.get("workers", [])) >= 2:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"router not ready in {timeout} s:\n{self.log_tail()}")


def generate(
    url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, timeout: float = 120
) -> list[dict[str, Any]]:
    """Each prompt to ``url``'s ``/generate``, all in flight together, greedy;
    each answer (``output_ids``, ``meta_info``), or ``{"error": ...}``."""

    def one(ids: Sequence[int]) -> dict[str, Any]:
        payload = {
            "input_ids": list(ids),
            "sampling_params": {
                "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True,
            },
        }  # fmt: skip
        try:
            out = post(f"{url}/generate", payload, timeout)
        except urllib.error.HTTPError as exc:
            return {"error": f"HTTP {exc.code}: {exc.read()[:300]!r}"}
        except (OSError, ValueError) as exc:
            return {"error": repr(exc)}
        return out if isinstance(out, dict) else {"error": repr(out)}

    with concurrent.futures.ThreadPoolExecutor(max(1, len(prompts))) as pool:
        return list(pool.map(one, prompts))


class Deployment:
    """A prefill, a decode and the router, started together; ``pinned``: the
    prefill's processes on core 0, the decode's on core 1 (else both on every
    core, as SGLang leaves them on a CPU without sgl-kernel's AMX build)."""

    def __init__(
        self,
        model: str,
        backend: str,
        workdir: str | None = None,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        pinned: bool = False,
    ) -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="akv-sglang-")
        self.workdir = workdir or (self._tmp.name if self._tmp else "")
        self.model, self.backend, self.extra, self.env = model, backend, extra, env
        self.cpus: tuple[Sequence[int] | None, ...] = ([0], [1]) if pinned else (None, None)
        self.prefill = self._server("prefill")
        self.decode = self._server("decode")
        self.router: Router | None = None

    def start(self, timeout: float = 300) -> Deployment:
        try:
            self.prefill.wait_ready(timeout)
            self.decode.wait_ready(timeout)
            self.router = Router(self.prefill, self.decode, self.workdir)
            self.router.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def replace_prefill(self, timeout: float = 300) -> None:
        """A new prefill (the old one stopped) and a new router in front of
        it and the same decode: what an operator does after a prefill died."""
        old, self.prefill = self.prefill, self._server("prefill")
        old.stop()
        if self.router is not None:
            self.router.stop()
            self.router = None
        self.prefill.wait_ready(timeout)
        self.router = Router(self.prefill, self.decode, self.workdir)
        self.router.wait_ready()

    def _server(self, mode: str) -> Server:
        cpus = self.cpus[0 if mode == "prefill" else 1]
        return Server(self.model, self.workdir, mode, self.backend, self.extra, self.env, cpus)

    def children(self) -> Iterator[_Child]:
        yield self.prefill
        yield self.decode
        if self.router is not None:
            yield self.router

    def stop(self) -> None:
        for child in self.children():
            child.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
