"""The private core: everything the public classes stand on.

Layers, one direction of knowledge (``tests/test_layout.py`` holds it):
public modules -> ``_core`` -> ``_bridge`` -> ``_native``. Inside the core,
bottom up: ``errors``, ``types`` (gathering ``checks``, ``cachedesc``,
``keys``, ``clusterinfo``, ``transferconfigs``), ``option_table`` and
``options`` (the vocabulary), ``planner`` (segment tables), ``codec``,
``frames``, ``handshake``, ``connection``, ``control`` and ``wire`` (the
control plane's wire), ``state`` (what two threads share), ``catalog`` (cache
metadata), ``runner`` (the one transfer path), ``notify`` (receiver
notifications), ``servicethread``, ``links``, ``linker``, ``probe``,
``handler``, ``lookups``, ``retire`` (the peer service's parts, held by
``service``), ``caches``, ``copies``, ``slots``, ``transfers``, ``layerprep``
and ``layerwise`` (every cache and transfer call), ``runtime``.
"""
