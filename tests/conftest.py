import pytest
import torch

try:
    # pytester's in-process runs (runpytest_inprocess) drop from sys.modules what they imported,
    # and libtriton refuses to initialise twice in one process (nanobind aborts it: "refusing to
    # add duplicate key"), so a test that first imports triton inside such a run kills the
    # session; imported here, triton is in every run's snapshot.
    import triton  # noqa: F401
except ImportError:
    pass


@pytest.fixture
def one_thread():
    """Tiny problems: one CPU thread is faster than several contending for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
