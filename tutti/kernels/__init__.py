"""Triton kernels that move KV between vLLM's paged cache and packed layer segments."""
