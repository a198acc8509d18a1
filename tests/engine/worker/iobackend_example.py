"""An IO backend defined outside tutti, as a user would write one: the threads backend with an
option of its own and a count of what it moved."""

from tutti.io.queue import register_backend
from tutti.io.threads import ThreadQueue


@register_backend("counting-example")  # a name: exists in a process that imported this module
class CountingQueue(ThreadQueue):
    name = "counting"

    def __init__(self, label: str = "", **kw) -> None:
        super().__init__(**kw)
        self.label = label
        self.submitted = 0

    def submit(self, requests):
        self.submitted += len(requests)
        return super().submit(requests)


def make(label: str = "made", workers: int = 2) -> CountingQueue:
    """A factory function works too."""
    return CountingQueue(label=label, workers=workers)
