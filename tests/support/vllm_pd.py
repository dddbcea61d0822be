"""What the vLLM end-to-end tests (``tests/integration/test_vllm_*.py``) share:
an instance's tokens, and requests that must fail their KV loads."""

from __future__ import annotations

import time
from typing import Any


def tokens(out: dict[str, Any]) -> list[list[int]]:
    """Each request's generated tokens, from an instance's ``generate``."""
    return [r["tokens"] for r in out["rows"]]


def run_failing(
    d: Any, ps: list[list[int]], max_tokens: int, params: list[dict[str, Any]]
) -> float:
    """Run requests whose KV loads must fail on decode instance ``d``: vLLM
    raises the load error, or no request ends as a normal finish. Returns
    how long that took."""
    t0 = time.monotonic()
    try:
        out = d.generate(ps, max_tokens, params)
    except RuntimeError:
        pass  # vLLM raised the load error
    else:
        assert all(r["finish"] not in ("length", "stop") for r in out["rows"]), out["rows"]
    return time.monotonic() - t0
