"""Fixtures of the project's tests.  torch is imported where it is used, not here: under
pytest-xdist the controller, which runs no test, loads this file before it starts the workers,
and an import of torch there (seconds on a GPU host) delays every worker's start."""
import os

import pytest


@pytest.fixture
def one_thread():
    """Tiny problems: one CPU thread is faster than several contending for the cores."""
    # lazy: a torch import here would delay pytest-xdist's workers (module docstring)
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """The suite's tests count truths and baselines computed: kda-verify's disk cache
    (verification/running/cache.py) stays off in them and the processes they start (tests/test_cache.py
    turns it on, in a directory of its own).  A matrix cell of `pytest -m verify` is no function
    and keeps the session's setting."""
    monkeypatch.setenv("KDA_VERIFY_CACHE", "off")


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n auto``) each worker takes its share of the cores for
    torch's intra-op threads: n workers with every core's thread each contend (on 2 cores a tiny
    problem's step ran 5-50x slower with two threads than with one under load)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        # lazy: a torch import here would delay pytest-xdist's workers (module docstring)
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
