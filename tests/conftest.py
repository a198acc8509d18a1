"""Shared by every test directory."""

from __future__ import annotations

import logging

import pytest


def _plain_tutti_logger() -> None:
    lg = logging.getLogger("tutti")
    lg.handlers.clear()
    lg.setLevel(logging.NOTSET)
    lg.propagate = True


@pytest.fixture(autouse=True)
def _tutti_logger_plain():
    """A connector built in a test's process (in a test or a module's fixture) routes the "tutti"
    loggers to vLLM's handlers and stops their propagation (tutti.vllm.logs); every test starts
    and ends with the plain logger, so one that reads tutti's warnings through pytest's caplog (a
    root handler) sees them whatever ran before it in the same worker."""
    _plain_tutti_logger()
    yield
    _plain_tutti_logger()
