"""The vLLM connector: translates vLLM's callbacks to the engine."""
