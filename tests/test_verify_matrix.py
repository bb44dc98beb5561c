"""The on-device verification matrix: `pytest -m verify` collects one test per (backend, route,
case); options --kda-backend, --kda-route, --kda-suite, --kda-case, --kda-report, --kda-device
(see verification/pytest_plugin.py).  Deselected, and never expanded, in a plain `pytest` run."""
import pytest

from verification.pytest_plugin import verify  # noqa: F401  (expanded into the matrix by the plugin)


@pytest.mark.verify
def test_kda_verify_plugin_is_registered():
    """Collected only where the plugin is not registered (it hides this test when it is)."""
    pytest.fail("the kda-verify pytest plugin is not registered, so `verify` was not expanded: install the "
                "package (pip install -e ., pytest11 entry point) or run pytest -p verification.pytest_plugin")


test_kda_verify_plugin_is_registered._kda_plugin_probe = True
