"""The transfer agent: everything a serving-engine connector needs that does
not depend on the engine.

:class:`.kvlink.TransferAgent` runs one ``LLMDataDist`` on a thread of its
own and offers the calls an engine's connector makes (register the KV cache,
start a pull or a push for a request, take the finished ones), never blocking
the engine's scheduler. Its parts: ``prefill_pull`` and ``prefill_push`` (the
prefill side, P), ``decode`` (the decode side, D), ``links`` (the links to
peers), ``handoff`` (claims, registrations, the keys and digests a handoff is
checked with), ``wire`` (the agent's messages, typed), ``kvtypes``,
``results`` and ``calls``. Engine glue sits beside this folder and uses the
agent (``integrations/vllm.py`` and its ``_vllm_*`` modules for vLLM);
nothing here imports an engine (``tests/test_layout.py``). Private: not a
public API.
"""
