"""The device every test of the worker's pipeline runs on: the modules that test it ask for the
`device` fixture (pytestmark); the helpers in worker_helpers.py build their caches on it."""

import pytest

import worker_helpers


@pytest.fixture(params=worker_helpers.DEVICES)
def device(request):
    """Every test runs on the CPU (synchronous kernels) and, where CUDA exists, on the GPU
    (compiled Triton, side streams and events). A test module that reads `DEV` itself sees the
    same device as the helpers."""
    worker_helpers.DEV = request.param
    if hasattr(request.module, "DEV"):
        request.module.DEV = request.param
    yield request.param
