"""MkDocs hook for the documentation site (``hooks:`` in mkdocs.yml).

The docstrings are reST-flavoured: ``:class:`X``` and friends come through
mkdocstrings as the role's name followed by a code span.  This drops the
role's name, leaving the code span, so the generated reference reads
``X`` rather than ``:class:X``.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|meth|attr|func|mod|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub("", html)
