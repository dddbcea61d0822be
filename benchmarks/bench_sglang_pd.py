"""SGLang disaggregated prefill/decode: aiokvcache's transfer backend beside
Mooncake's (SGLang's default, over TCP), on one CPU host, in one run.

A benchmark, not a test: run it on a quiet machine. Needs the SGLang venv
(``.ci/sglang_venv.sh DIR``, then ``DIR/bin/pip install .``)::

    DIR/bin/python benchmarks/bench_sglang_pd.py --requests 8 --concurrency 1,4

The run: one plain server generates every prompt greedily (the reference
tokens); then, for each backend, a prefill, a decode and the router
(:mod:`aiokvcache.testing.sglang`, both backends on TCP), one unmeasured
warm-up round, then ``--requests`` distinct prompts in rounds of
``--concurrency``, streamed through the router. Figures, per backend and
concurrency:

- *TTFT*: from a request's send to its first streamed token (prefill,
  transfer, the decode's first step), p50 and p99;
- *ITL*: gaps between a request's streamed tokens, pooled, p50 and p99;
- *equal*: requests whose tokens equal the reference's;
- *CPU/req*: CPU seconds the prefill's and the decode's processes (every
  thread: model, scheduler and the backend's) burnt over the measured
  rounds, per request. The model's share is the same for both backends;
- *idle CPU*: CPU the two servers burn per second while no request is in
  flight (a polling transfer thread shows here).

``--model wide-kv`` serves :data:`aiokvcache.testing.sglang.WIDE_KV_LLAMA`
(32 KiB of KV a token, 12 MiB a 384-token prompt; the default model has
2 KiB a token), where the transfer is a larger part of the time to first
token. ``--pinned`` puts the prefill's processes on core 0 and the decode's
on core 1 (the reference on core 0); without it every process may run on
every core (SGLang binds no thread on a CPU without sgl-kernel's AMX build).

Ratios: aiokvcache over Mooncake, measured in the same run (the issue's goal:
TTFT <= 0.6x Mooncake's, CPU per request below Mooncake's).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
import urllib.request
from typing import Any

from _common import group_pids, percentile

from aiokvcache.testing import sglang as driver
from aiokvcache.testing.vllm import prompts

TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every process in process group ``pgid``."""
    total = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def stream(url: str, ids: list[int], max_new: int) -> dict[str, Any]:
    """One request, streamed: its tokens and when each arrived."""
    payload = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        f"{url}/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    start = time.monotonic()
    stamps: list[float] = []
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ids_now = json.loads(line[5:]).get("output_ids", [])
            now = time.monotonic()
            if len(ids_now) > len(tokens):
                stamps += [now] * (len(ids_now) - len(tokens))
                tokens = list(ids_now)
    return {"start": start, "stamps": stamps, "tokens": tokens}


def measure(
    url: str, pids: list[int], ps: list[list[int]], conc: int, max_new: int, ref: list[list[int]]
) -> dict[str, float]:
    with concurrent.futures.ThreadPoolExecutor(conc) as pool:
        list(pool.map(lambda p: stream(url, p, max_new), ps[:conc]))  # warm-up round
        cpu0 = sum(group_cpu_s(p) for p in pids)
        rows: list[dict[str, Any]] = []
        for i in range(0, len(ps), conc):
            rows += pool.map(lambda p: stream(url, p, max_new), ps[i : i + conc])
        cpu = sum(group_cpu_s(p) for p in pids) - cpu0
    ttft = [r["stamps"][0] - r["start"] for r in rows if r["stamps"]]
    itl = [b - a for r in rows for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    equal = sum(r["tokens"] == want for r, want in zip(rows, ref, strict=True))
    c0 = sum(group_cpu_s(p) for p in pids)
    time.sleep(5)
    idle = (sum(group_cpu_s(p) for p in pids) - c0) / 5
    return {
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
        "equal": equal, "n": len(rows), "cpu_per_req": cpu / max(1, len(rows)), "idle_cpu": idle,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--backends", default="mooncake_tcp,aiokvcache")
    ap.add_argument(
        "--model",
        choices=("tiny", "wide-kv"),
        default="tiny",
        help="tiny: TINY_LLAMA (2 KiB of KV a token); wide-kv: WIDE_KV_LLAMA (32 KiB a token)",
    )
    ap.add_argument(
        "--pinned",
        action="store_true",
        help="prefill on core 0, decode on core 1 (the reference on core 0); else every core",
    )
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    work = tempfile.mkdtemp(prefix="akv-bench-sglang-")
    config = driver.WIDE_KV_LLAMA if args.model == "wide-kv" else driver.TINY_LLAMA
    model = driver.tiny_model(os.path.join(work, "model"), config=config)
    ps = [
        [(p[0] + i) % 1000 + 3, *p[1:]]
        for i, p in enumerate(prompts([args.prompt_len] * args.requests))
    ]
    plain = driver.Server(model, work, cpus=[0] if args.pinned else None)
    try:
        plain.wait_ready()
        ref = [o["output_ids"] for o in driver.generate(plain.url, ps, args.max_tokens)]
    finally:
        plain.stop()
    results: dict[str, dict[int, dict[str, float]]] = {}
    for backend in args.backends.split(","):
        env = dict(os.environ, AIOKVCACHE_SGLANG_TRANSPORT="tcp")
        pd_dir = os.path.join(work, backend)
        with driver.Deployment(model, backend, pd_dir, env=env, pinned=args.pinned) as pd:
            pids = [pd.prefill.pid, pd.decode.pid]
            results[backend] = {
                c: measure(pd.url, pids, ps, c, args.max_tokens, ref) for c in concs
            }
    print(f"model {args.model}, {'pinned (P core 0, D core 1)' if args.pinned else 'unpinned'}")
    head = ("backend", "conc", "TTFT p50", "p99", "ITL p50", "p99", "equal", "CPU/req", "idle CPU")
    print("".join(f"{h:>10}" for h in head))
    for backend, by_c in results.items():
        for c, r in by_c.items():
            cells = [backend[:10], str(c)]
            cells += [f"{r[k] * 1e3:.1f}ms" for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
            cells += [f"{int(r['equal'])}/{int(r['n'])}", f"{r['cpu_per_req']:.3f}s"]
            cells += [f"{r['idle_cpu']:.3f}"]
            print("".join(f"{x:>10}" for x in cells))
    if {"aiokvcache", "mooncake_tcp"} <= results.keys():
        for c in concs:
            a, m = results["aiokvcache"][c], results["mooncake_tcp"][c]
            ratios = {k: a[k] / m[k] for k in ("ttft_p50", "ttft_p99", "cpu_per_req")}
            print(f"aiokvcache/mooncake_tcp at {c} in flight: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in ratios.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
