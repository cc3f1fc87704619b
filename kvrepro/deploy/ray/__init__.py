"""The `ray` target: every run is a Ray task on a node of a cluster (``ray:`` in matrix.yaml).

This package imports nothing of Ray until the target is used (:func:`load`), so kvrepro without
the ``ray`` extra still starts and checks ``ray:`` settings. See docs/ray.md.

* ``settings.py``: ``ray:`` typed and checked;
* ``bundle.py``: a build's overlay packed once, content-addressed (sha256), and unpacked once per node;
* ``node.py``: what runs on a node (the Ray task): the build unpacked, a node-local target named by
  ``ray.engine`` (its own node-engine hooks, kvrepro.deploy.node_engine, make the build's artifact
  there), the runner's own run function, the run's files sent back;
* ``target.py``: the driver side (connects, checks the cluster can place a run, ships builds,
  holds a placement group per multi-node engine, submits, retries, cancels, progress).
"""

from __future__ import annotations

from ...errors import SetupError
from .records import TOP_LEVEL_BEFORE, where_ran
from .settings import check_environment, check_settings

# matrix.yaml's top-level section this target owns (kvrepro.deploy.target_sections): typed in settings.py
SECTIONS = ("ray",)
# one instance serves many runs of different matrices, each through a shallow copy holding its matrix:
# the connection, build bundles and progress actor are made once (kvrepro.deploy.shares_one_instance)
SHARED = True
INSTALL_HINT = "target ray needs Ray: pip install 'kvrepro[ray]' (or pip install 'ray>=2.9')"


def load() -> None:
    """Import Ray and register the target (kvrepro.deploy.get_target calls this); one line if Ray is missing."""
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # read when Ray is imported: without it Ray's driver installs absl's fatal-signal handler over
    # kvrepro's, and SIGTERM dumps a stack and aborts (exit -6) instead of stopping in order (130)
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SetupError(INSTALL_HINT) from None
    from . import target  # noqa: F401  (registers "ray")


def upstream_tests(loaded, base: str, on_line):
    """vLLM's own tests as a pytest job on the cluster of ``ray:`` (kvrepro.deploy.upstream_tests)."""
    load()
    from .upstream import RayPytest

    return RayPytest(loaded, base, on_line=on_line)


__all__ = ["SECTIONS", "SHARED", "INSTALL_HINT", "TOP_LEVEL_BEFORE", "check_environment", "check_settings", "load",
           "upstream_tests", "where_ran"]
