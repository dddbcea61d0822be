"""The memory plane: what the owner's loop and the service thread share.

``state`` (the one lock and the records under it: caches, leases, links),
``catalog`` (cache metadata, ours and the peers' we installed), ``ctlregion``
(the registered region of probe slots and retirement words). Imports the model,
the configuration and the wire.
"""
