"""Status codes and exceptions (LLM-DataDist's ``LLMStatusCode`` values).

Defined in the private core, which every layer shares; this module is the
public name for them.
"""

from __future__ import annotations

from ._core.model.errors import *  # noqa: F403 - this module is their public home
from ._core.model.errors import __all__ as __all__
