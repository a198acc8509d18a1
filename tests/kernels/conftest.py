"""Kernel tests run the real Triton kernels through the interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # The interpreter turns scalar kernel args into 1-element arrays and warns on every range().
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
