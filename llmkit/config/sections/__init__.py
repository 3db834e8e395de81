"""The engine config's sections, by component kind; ``llmkit.config.schema`` assembles them
into ``EngineConfig`` and is where callers import them from."""
