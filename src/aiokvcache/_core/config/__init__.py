"""The configuration: every option an engine takes, declared once.

``table`` declares the options and the transport list, ``options`` parses an
``LLMConfig`` into ``EngineOptions``, ``docs`` writes their reference into
``docs/tuning.md``. Imports the model only.
"""
