"""tutti: a layer-wise KV cache on NVMe and file storage for vLLM, in pure Python."""

__version__ = "0.1.0"
