"""Two fixes to Triton 3.6's CPU interpreter (TRITON_INTERPRET=1); compiled kernels are untouched.

1. Loop bounds: the interpreter holds every scalar as a 1-element array and turns it into a
   loop bound with ``int(array)``, which NumPy 2.3+ rejects for arrays of ndim > 0, so
   ``for j in range(0, n)`` with a loaded ``n`` fails.  ``__index__`` takes the single element.
2. bf16 dots: the interpreter stores bf16 as raw uint16 bits and ``tl.dot`` multiplies those
   bit patterns.  The patched dot widens bf16 operands to fp32 first (bf16 x bf16 products are
   exact in fp32), which is what the hardware's bf16 MMA with fp32 accumulation computes.
"""
from __future__ import annotations

import os


def install() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_kda_index_compat", False) or not hasattr(interpreter, "_patch_lang_tensor"):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    builder_cls = interpreter.InterpreterBuilder
    original_dot = builder_cls.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x

        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = dot
    interpreter._kda_index_compat = True
