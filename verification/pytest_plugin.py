"""pytest plugin of kda-verify (registered through the pytest11 entry point)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "verify: the on-device verification matrix")
