"""Our Triton kernels built for Triton's CPU interpreter, for test modules that run them.

Importing Triton under the interpreter builds triton.language's own functions as interpreted ones
for the whole process, which breaks every compiled kernel after it (ours, fla's, aiter's) in a
`pytest -m verify` run on a GPU; there the gpu-marked test files cover the kernels instead.
"""
import importlib
import os

import pytest
import torch


def interpreted_kernels():
    """Skip the calling module on a GPU machine (unless TRITON_INTERPRET=1 was set by the user);
    else build the kernels under the interpreter and leave the environment as it was."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter tests run on machines without a GPU (or with TRITON_INTERPRET=1)",
                    allow_module_level=True)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"        # the kernels are built as interpreted functions at import
    import kda_kernels.triton.kernels as kernels
    if not type(kernels.segment_kernel).__name__.startswith("Interpreted"):
        # imported earlier without the interpreter: rebuild them, each module after the ones it
        # takes JIT helpers from, then the re-exports
        for name in kernels.KERNEL_MODULES:
            importlib.reload(importlib.import_module(name))
        importlib.reload(kernels)
    if saved is None:                            # leave the environment of later test modules as it was
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = saved
    return kernels
