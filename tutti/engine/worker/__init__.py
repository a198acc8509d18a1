"""The worker's half of the engine: moving bytes between the paged KV cache and the store
(the worker pipeline, staging, stores, the writer thread, asynchronous loads and the load paths)."""
