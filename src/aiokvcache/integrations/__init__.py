"""Adapters that plug aiokvcache into serving engines.

- :mod:`aiokvcache.integrations.vllm`: a vLLM KV connector (``AioKVConnector``).

Importing this package imports no engine; each submodule imports its own.
"""
