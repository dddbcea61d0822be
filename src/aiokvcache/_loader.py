"""Loads UCX from the libucx wheel, then the native module that links to it.

``libucx.load_library()`` dlopens the wheel's libraries (or the system's when
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true``), so the dynamic loader finds
them by soname when ``_native`` is imported: no rpath, no LD_LIBRARY_PATH.
"""

from __future__ import annotations

import libucx

libucx.load_library()

from . import _native as native  # noqa: E402

__all__ = ["native"]
