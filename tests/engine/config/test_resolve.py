"""Every "auto" is decided in tutti.engine.config.resolve, from the facts it names, with a reason;
a configured value passes through unchanged and says no reason."""

from tutti.engine.config import resolve
from tutti.engine.config.values import DEFAULT_WRITE_WINDOW


def test_each_auto_follows_its_facts():
    assert resolve.io_backend("auto", on_ram=True).value == "threads"
    assert resolve.io_backend("auto", on_ram=False).value == "auto"  # the queue's own auto (io_uring or threads)
    assert resolve.write_window_bytes("auto", on_ram=True).value is None
    assert resolve.write_window_bytes("auto", on_ram=False).value == DEFAULT_WRITE_WINDOW
    assert resolve.mapped_loads("auto", on_ram=True, shared=False, secret=False).value is True
    assert resolve.mapped_loads("auto", on_ram=True, shared=True, secret=False).value is False
    assert resolve.mapped_loads(True, on_ram=True, shared=False, secret=True).value is False  # never with a secret
    assert resolve.reads_first("auto", window=DEFAULT_WRITE_WINDOW).value is True
    assert resolve.reads_first(True, window=None).value is False  # no window: nothing to yield
    assert resolve.async_loads("auto", hybrid=False, schedules_async=True).value is True
    assert resolve.async_loads(False, hybrid=True, schedules_async=False).value is True  # hybrid: always
    assert resolve.async_launch("auto", can=True, cuda=False).value == "thread"
    assert resolve.async_launch("auto", can=True, cuda=True).value == "step"
    assert resolve.async_launch("step", can=False, cuda=True).value == "thread"
    assert resolve.idle_load_wait_s("auto", on_step=False).value == resolve.IDLE_WAIT_THREAD_S
    assert resolve.idle_load_wait_s("auto", on_step=True).value == 0.0
    assert resolve.mapped_store_copy("auto", cuda=True).value == "dma_chunk"
    assert resolve.mapped_store_copy("dma", cuda=False).value == "host"
    assert resolve.lookahead("auto", num_layers=32).value == 32
    assert resolve.kernel_variant("auto", cuda=False).value == "torch"


def test_a_configured_value_passes_through_without_a_reason():
    for choice in (resolve.io_backend("uring", on_ram=True), resolve.write_window_bytes(1 << 20, on_ram=True),
                   resolve.lookahead(3, num_layers=32), resolve.kernel_variant("triton", cuda=False)):
        assert choice.why == ""
    assert resolve.io_backend("uring", on_ram=True).value == "uring"


def test_the_ready_lines_decisions_name_each_auto_and_its_reason():
    d = resolve.Decisions()
    d.take("io_backend", resolve.io_backend("auto", on_ram=True))
    d.take("write_window_bytes", resolve.write_window_bytes("auto", on_ram=False))
    d.take("lookahead", resolve.lookahead(2, num_layers=32))  # configured: not listed
    assert d.describe() == "io_backend=threads (RAM root) write_window_bytes=64MiB (a drive)"
