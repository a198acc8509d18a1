"""tutti.engine.worker.context.Throttled: a repeating failure is said once a minute, with a count."""

from __future__ import annotations

import logging

from tutti.engine.worker.context import Throttled


def test_a_repeating_warning_is_said_once_per_interval_with_what_was_held_back(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tutti.engine.worker.context.time.monotonic", lambda: clock[0])
    said = Throttled(interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="tutti"):
        assert said.warning("write:OSError:28", "store of chunk %s failed", "a")
        assert not any(said.warning("write:OSError:28", "store of chunk %s failed", c) for c in "bcd")
        assert said.warning("sync:5", "making %d chunks durable failed", 2)  # another kind: said at once
        clock[0] += 61
        assert said.warning("write:OSError:28", "store of chunk %s failed", "e")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["store of chunk a failed", "making 2 chunks durable failed",
                     "store of chunk e failed (3 more like it in the last 61 s)"]
