"""What a :mod:`aiokvcache.testing.vllm` instance runs in its own process for
each generate command: greedy requests through vLLM's offline engine, all
at once (``generate``), stamped token by token (``generate_timed``), or
aborted part way (``generate_aborting``). vLLM is imported inside them only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["RUNNERS"]


def _generate(
    llm: Any, prompts: list[list[int]], max_tokens: int, params: list[dict[str, Any] | None]
) -> dict[str, Any]:
    """Greedy tokens for ``prompts``, request ``i`` with ``kv_transfer_params``
    ``params[i]``: per row ``tokens``, ``finish``, the ``params`` the engine
    returned, ``ttft`` (vLLM's own figure); and the call's ``seconds``."""
    from vllm.inputs import TokensPrompt

    sps = [_greedy(max_tokens, p) for p in params]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    took = time.perf_counter() - t0
    rows = []
    for o in outs:
        c = o.outputs[0]
        m = o.metrics
        first = getattr(m, "first_token_ts", None) if m is not None else None
        arrival = getattr(m, "arrival_time", None) if m is not None else None
        ttft = first - arrival if first and arrival else None
        rows.append(
            {
                "tokens": list(c.token_ids),
                "finish": c.finish_reason,
                "params": o.kv_transfer_params,
                "ttft": ttft,
            }
        )
    return {"rows": rows, "seconds": took}


_timed_ids = iter(range(1 << 62))


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
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    t0 = time.monotonic()
    order: list[tuple[str, str]] = []
    rows: dict[str, dict[str, Any]] = {}
    for prompt, p in zip(prompts, params, strict=True):
        own = _own_cache_count(p) if p is not None else None
        sp = _greedy(max_tokens, own, output_kind=RequestOutputKind.DELTA)
        rid = f"timed-{next(_timed_ids)}"
        internal = engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
        order.append((rid, internal))
        # Outputs carry the id given (vLLM adds a suffix to it inside).
        rows[rid] = rows[internal] = {
            "id": internal,
            "tokens": [],
            "times": [],
            "finish": None,
            "params": None,
            "num_cached_tokens": None,
        }
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        for o in outs:
            got = rows.get(o.request_id)
            if got is not None:
                _stamp(got, o, now)
    return {"rows": [rows[r] for r, _ in order], "start": t0, "seconds": time.monotonic() - t0}


def _stamp(row: dict[str, Any], out: Any, now: float) -> None:
    """Add a step's output (a ``RequestOutput``, its new tokens only) to ``row``."""
    c = out.outputs[0]
    new = list(c.token_ids)
    row["tokens"].extend(new)
    row["times"].extend([now] * len(new))
    if out.num_cached_tokens is not None:  # set on the first output only
        row["num_cached_tokens"] = max(row["num_cached_tokens"] or 0, out.num_cached_tokens)
    if out.finished:
        row["finish"] = c.finish_reason
        row["params"] = out.kv_transfer_params


def _greedy(max_tokens: int, params: dict[str, Any] | None, **kw: Any) -> Any:
    """Greedy ``SamplingParams`` of ``max_tokens`` tokens (EOS ignored),
    carrying ``params`` as the request's ``kv_transfer_params``."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        detokenize=False,
        ignore_eos=True,
        extra_args={"kv_transfer_params": dict(params)} if params is not None else None,
        **kw,
    )


def _own_cache_count(params: dict[str, Any]) -> dict[str, Any]:
    """A decode request's params without ``remote_prefill_cached_tokens``.

    vLLM reports that (the prefill's own prefix-cache hits) as the decode
    request's ``num_cached_tokens``; without it the decode reports the
    tokens it did not compute itself, those it loaded among them. Nothing
    else reads it."""
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def _generate_aborting(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    params: list[dict[str, Any] | None],
    abort_after: float,
) -> dict[str, Any]:
    """Like ``generate``, stepping the engine here: every request still
    unfinished ``abort_after`` seconds after it was added is aborted (a
    client that gave up: vLLM's engine aborts it, whatever its KV load is
    doing). Rows of aborted requests have ``finish`` ``"abort"``; the call
    returns once no request is left, the aborted ones gone."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    t0 = time.monotonic()
    ids: list[str] = []
    rows: dict[str, dict[str, Any]] = {}
    for prompt, p in zip(prompts, params, strict=True):
        sp = _greedy(max_tokens, p)
        rid = f"aborting-{next(_timed_ids)}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
        ids.append(rid)
    aborted = False
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                rows[o.request_id] = {"tokens": list(c.token_ids), "finish": c.finish_reason}
        if not aborted and time.monotonic() - t0 >= abort_after:
            left = [r for r in ids if r not in rows]
            engine.abort_request(left)
            rows.update({r: {"tokens": [], "finish": "abort"} for r in left})
            aborted = True
        time.sleep(0.002)  # a load waits on another process: do not spin
    return {"rows": [rows[r] for r in ids], "seconds": time.monotonic() - t0}


#: The generate commands, by name.
RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "generate": _generate,
    "generate_timed": _generate_timed,
    "generate_aborting": _generate_aborting,
}
