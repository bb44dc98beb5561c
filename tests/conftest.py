import os

import pytest
import torch

# pytester's in-process runs (runpytest_inprocess) drop from sys.modules what they imported, and
# libtriton refuses to initialise twice in one process (nanobind aborts it: "refusing to add
# duplicate key"), so a test that first imports triton inside such a run kills the session.
# Triton is imported here, before any test, the way the test modules need it: where the
# interpreter tests run (no CUDA, or TRITON_INTERPRET=1) with our kernels built for the
# interpreter (tests/interpreted_triton.py: triton.language's own functions are built then).
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
else:
    from interpreted_triton import interpreted_kernels
    interpreted_kernels()


@pytest.fixture
def one_thread():
    """Tiny problems: one CPU thread is faster than several contending for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
