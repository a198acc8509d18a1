"""Shared by every test directory."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _tutti_logger_as_found():
    """A connector built in a test's process routes the "tutti" loggers to vLLM's handlers and
    stops their propagation (tutti.vllm.logs); a later test in the same worker that reads tutti's
    warnings through pytest's caplog (a root handler) must still see them."""
    lg = logging.getLogger("tutti")
    saved = (list(lg.handlers), lg.level, lg.propagate)
    yield
    lg.handlers[:], lg.level, lg.propagate = saved[0], saved[1], saved[2]
