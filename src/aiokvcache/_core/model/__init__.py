"""The model: what the API speaks of, and nothing that moves.

Errors and status codes, argument checks, cache descriptors, cache keys,
cluster info and transfer configs (``types`` gathers them). The bottom plane:
it imports no other part of the core.
"""
