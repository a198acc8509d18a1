"""The load paths: the layer-wise pipeline (pipeline), whole loads through the file path
chunk-major (file_chunks) and copies from mapped RAM slabs (mapped)."""
