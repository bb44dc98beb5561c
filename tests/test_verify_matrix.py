"""The on-device verification matrix: `pytest -m verify` collects one test per (backend, route,
case); options --kda-backend, --kda-route, --kda-suite, --kda-case, --kda-report, --kda-device
(see verification/pytest_plugin.py).  Deselected, and never expanded, in a plain `pytest` run."""
from verification.pytest_plugin import verify  # noqa: F401  (expanded into the matrix by the plugin)
