"""The transfer plane: every cache and transfer call of the owner's loop.

``planner`` (segment tables), ``runner`` (the one path a job takes: leases,
native deadlines, cancel-and-settle, status mapping), ``slots``, ``copies``,
``notify`` (receiver notifications), ``transfers``, ``layerprep`` and
``layerwise`` (per-layer pushes). The top plane: it may import every plane
below it.
"""
