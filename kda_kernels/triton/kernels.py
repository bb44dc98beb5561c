"""Every Triton kernel of our FlashKDA forward, re-exported from the pass that launches it:

    k1.py     k1_prepare_kernel, k1_inverse_kernel, k1_prepare_halves_kernel   (K1)
    scan.py   segment_map_kernel (pass A), scan_kernel (pass B)
    walk.py   segment_kernel (pass C)
    common.py the JIT helpers passes A, B and C share, and the initial-state modes H0_*

The math of each pass is in its module's docstring.  KERNEL_MODULES lists the modules that build
kernels, in import order (a module after the ones it takes JIT helpers from).
"""
from __future__ import annotations

from .common import H0_NONE, H0_SEG, H0_SEQ  # noqa: F401
from .k1 import k1_inverse_kernel, k1_prepare_halves_kernel, k1_prepare_kernel  # noqa: F401
from .scan import MODE_A, MODE_AB, MODE_B, scan_kernel, segment_map_kernel  # noqa: F401
from .walk import segment_kernel  # noqa: F401

KERNEL_MODULES = ("kda_kernels.triton.common", "kda_kernels.triton.k1", "kda_kernels.triton.scan",
                  "kda_kernels.triton.walk")
