"""The private core: everything the public classes stand on.

Layers, one direction of knowledge (``tests/test_layout.py`` holds it):
public modules -> ``_core`` -> ``_bridge`` -> ``_native``. Inside the core,
bottom up: ``errors``, ``types``, ``options`` (the vocabulary), ``planner``
(segment tables), ``control`` (the wire), ``state`` (what two threads share),
``catalog`` (cache metadata), ``runner`` (the one transfer path), ``notify``
(receiver notifications), ``service`` (the peer-service thread),
``transfers`` and ``layerwise`` (every transfer call), ``runtime``.
"""
