"""``docs/tuning.md``'s tables, generated from the option table.

``python -m aiokvcache._core.config.docs docs/tuning.md`` rewrites each
generated block (``transports``, ``options``) in place; a test checks the
file is current.
"""

from __future__ import annotations

import re

from .table import OPTIONS
from .values import TRANSPORT_TABLE


def tuning_table() -> str:
    """The engine options table of ``docs/tuning.md``, in Markdown."""
    rows = [
        "| key | `LLMConfig` property | default | range |",
        "|---|---|---|---|",
    ]
    for opt in sorted(OPTIONS, key=lambda o: not o.ours):
        if opt.effect:
            rows.append(f"| `{opt.key}` | `{opt.prop}` | {opt.default_text} | {opt.range_text} |")
    return "\n".join(rows) + "\n"


def transports_table() -> str:
    """The transports table of ``docs/tuning.md``, in Markdown."""
    rows = [
        "| transport | UCX transports | what it means | use it when |",
        "|---|---|---|---|",
    ]
    for t in TRANSPORT_TABLE:
        name = f"`{t.name}` (default)" if t.name == "auto" else f"`{t.name}`"
        tls = "UCX's own choice" if t.ucx_tls is None else f"`{t.ucx_tls}`"
        rows.append(f"| {name} | {tls} | {t.means} | {t.use_when} |")
    return "\n".join(rows) + "\n"


_GENERATED = re.compile(
    r"(<!-- generated: (\w+) \(python -m aiokvcache\._core\.config\.docs\) -->\n)"
    r"(.*?)(<!-- end generated -->)",
    re.S,
)


def regenerate(markdown: str) -> str:
    """``markdown`` with each generated block (``transports``, ``options``)
    rewritten from the option table."""
    tables = {"transports": transports_table, "options": tuning_table}
    return _GENERATED.sub(lambda m: m[1] + tables[m[2]]() + m[4], markdown)


if __name__ == "__main__":
    # python -m aiokvcache._core.config.docs docs/tuning.md: regenerate its tables.
    import sys

    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(regenerate(text))
