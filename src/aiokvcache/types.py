"""Public data types: descriptors, caches, keys, cluster infos, transfer configs.

Defined in the private core; this module is their public home.
"""

from __future__ import annotations

from ._core.model.types import *  # noqa: F403 - this module is their public home
from ._core.model.types import __all__ as __all__
