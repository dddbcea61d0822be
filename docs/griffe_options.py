"""A griffe extension for the API reference.

:class:`aiokvcache.LLMConfig`'s option properties are built from the option
table (and LLM-DataDist's options without effect from a helper) when the class
is created, so a static reading of the source sees ``name = _option_property(...)``
without a docstring. This gives each one its property's docstring.
"""

from __future__ import annotations

from typing import Any

import griffe


class OptionProperties(griffe.Extension):
    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.parent is None or attr.parent.name != "LLMConfig":
            return
        if not str(attr.value or "").startswith(("_option_property(", "_passthrough_str(")):
            return
        from aiokvcache.options import LLMConfig

        prop = getattr(LLMConfig, attr.name)
        attr.docstring = griffe.Docstring(prop.__doc__ or "", parent=attr)
        attr.labels -= {"class-attribute", "instance-attribute"}
        attr.labels.add("property")
        attr.labels.add("writable")
        attr.value = None
