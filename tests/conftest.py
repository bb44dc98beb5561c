import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny problems: one CPU thread is faster than several contending for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """The suite's tests count truths and baselines computed: kda-verify's disk cache
    (verification/cache.py) stays off in them and the processes they start (tests/test_cache.py
    turns it on, in a directory of its own).  A matrix cell of `pytest -m verify` is no function
    and keeps the session's setting."""
    monkeypatch.setenv("KDA_VERIFY_CACHE", "off")
