"""Send prompts through a prefill and a decode ``vllm serve`` as vLLM's
disaggregated proxy does, and check each answer against the decode server
alone (standard library only).

    python examples/vllm_disagg/proxy_client.py --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200

Each prompt goes to the prefill server with ``max_tokens: 1`` and the
``kv_transfer_params`` vLLM's proxy sends (``do_remote_decode``); the
``kv_transfer_params`` it returns go with the same prompt to the decode
server. Prompts are token ids, so a server started with
``--skip-tokenizer-init`` works.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from typing import Any

PROXY_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def complete(server: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{server}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.load(resp))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--prefill", default="127.0.0.1:8100", help="prefill server host:port")
    ap.add_argument("--decode", default="127.0.0.1:8200", help="decode server host:port")
    ap.add_argument("--model", default=None, help="model name (default: the servers' first)")
    ap.add_argument("--lengths", default="5,33,70,200", help="prompt lengths, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=6)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        with urllib.request.urlopen(f"http://{args.decode}/v1/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]
    ok = True
    for i, n in enumerate(int(x) for x in args.lengths.split(",")):
        prompt = [(7 * i + 13 * j) % 1000 + 3 for j in range(n)]
        base = {
            "model": model,
            "prompt": prompt,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        ref = complete(args.decode, {**base, "max_tokens": args.max_tokens})
        t0 = time.perf_counter()
        pre = complete(args.prefill, {**base, "max_tokens": 1, "kv_transfer_params": PROXY_PARAMS})
        out = complete(
            args.decode,
            {
                **base,
                "max_tokens": args.max_tokens,
                "kv_transfer_params": pre["kv_transfer_params"],
            },
        )
        took = time.perf_counter() - t0
        same = out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        ok &= same
        print(f"prompt of {n:3d} tokens: {'same' if same else 'DIFFERENT'} in {took * 1e3:.0f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
