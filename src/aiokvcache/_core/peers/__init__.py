"""The peer plane: the service thread and everything it does for the links.

``servicethread`` (its own event loop), ``links`` and ``linker`` (the link
table, and making and breaking links), ``probe``, ``handler`` (answering a
peer's requests), ``lookups`` (learning a peer's caches), ``retire`` (freeing a
cache peers may hold), ``discovery`` (etcd), ``service`` (the thread's parts
held together). Imports the planes below it; never the transfer plane.
"""
