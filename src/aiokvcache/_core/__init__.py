"""The private core: everything the public classes stand on.

Layers, one direction of knowledge (``tests/test_layout.py`` holds it):
public modules -> ``_core`` -> ``_bridge`` -> ``_native``. Inside the core,
planes, bottom up, each importing only those before it: ``model`` (errors,
checks, descriptors, keys), ``config`` (the options), ``wire`` (what crosses a
socket), ``memory`` (what two threads share), ``peers`` (the service thread
and the links), ``transfer`` (every cache and transfer call). On top of them,
``caches`` (registering and freeing local caches) and ``runtime`` (one engine,
assembled).
"""
