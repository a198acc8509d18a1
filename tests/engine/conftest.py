"""The engine's tests share the worker tests' small geometry and helpers (worker/worker_helpers.py):
their folder goes on the path for the tests beside and under this one."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "worker"))
