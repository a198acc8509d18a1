"""Old name of tutti.engine.build (kept so that notebooks written against it still import)."""

from tutti.engine.build import *  # noqa: F401,F403
from tutti.engine.build import Geometry, ReplicaReader, build_planner, build_worker  # noqa: F401
