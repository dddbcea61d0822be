"""The control plane's wire: what crosses a socket between two peers.

``codec`` (the hardened value codec), ``frames`` (sealed frames),
``handshake``, ``connection`` and ``control`` (one control connection, its
listener and its handler), ``peerstatus`` (a peer's status is data, never our
verdict), ``messages`` (every request and its answer, typed). Imports the model
only: nothing here knows of memory, links or transfers.
"""
