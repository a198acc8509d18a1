"""The engine: chunk index, planning, staging ring and the layer-wise pipeline."""
