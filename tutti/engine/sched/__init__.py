"""The scheduler's half of the engine: decisions only (the planner, the chunk index, the hit,
admission and eviction policies). Moves no bytes."""
