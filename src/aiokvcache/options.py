"""``LLMConfig`` and the option keys it generates.

Defined in the private core; this module is their public home.
"""

from __future__ import annotations

from ._core.config.options import *  # noqa: F403 - this module is their public home
from ._core.config.options import __all__ as __all__
