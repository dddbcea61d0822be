"""Status codes and exceptions (LLM-DataDist's ``LLMStatusCode`` values).

Defined in the private core, which every layer shares; this module is the
public name for them.
"""

from __future__ import annotations

from ._core.errors import (
    InternalError,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    make_error,
    param_invalid,
)

__all__ = [
    "InternalError",
    "LLMException",
    "LLMStatusCode",
    "LLMTimeoutError",
    "make_error",
    "param_invalid",
]
