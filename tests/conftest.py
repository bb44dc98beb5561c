import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny problems: one CPU thread is faster than several contending for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
