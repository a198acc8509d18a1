"""Where bytes live and when they are durable: the chunk store over slab files, its namespace
(manifest, lock, writer directories), the journal, fingerprints and integrity tags, mapped RAM
slabs and a writer's announced extras. Knows nothing of vLLM or the engine; moves bytes through
`tutti.io` queues."""
