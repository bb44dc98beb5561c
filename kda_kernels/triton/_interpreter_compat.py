"""Four fixes to Triton's CPU interpreter (TRITON_INTERPRET=1, 3.3 to 3.9); compiled kernels are untouched.

1. Loop bounds: the interpreter holds every scalar as a 1-element array and turns it into a
   loop bound with ``int(array)``, which NumPy 2.3+ rejects for arrays of ndim > 0, so
   ``for j in range(0, n)`` with a loaded ``n`` fails.  ``__index__`` takes the single element.
2. bf16 dots: the interpreter stores bf16 as raw uint16 bits and ``tl.dot`` multiplies those
   bit patterns.  The patched dot widens bf16 operands to fp32 first (bf16 x bf16 products are
   exact in fp32), which is what the hardware's bf16 MMA with fp32 accumulation computes.
3. fp32 -> bf16 casts: the interpreter truncates the mantissa; GPUs round to nearest even
   (cvt.rn.bf16.f32).  The patched cast rounds to nearest even, so the interpreter's errors
   are the GPU's and not twice as large.
4. Comparisons (Triton 3.9): the interpreter tags a comparison's boolean result with its operands'
   dtype (``n != 0`` for an int32 ``n`` is an int32 handle holding bools) although the language
   types it int1.  Splatting such a scalar against a block then widens it to int32, and a load or
   store masked by it fails with ``mask has unsupported dtype``.  The patched comparisons return
   int1 handles, as the language (and the compiled kernel) types them.

Nothing is patched at import: the launcher (``launch.launch``) calls ``install(force=True)`` before
the first launch of an interpreted kernel, and code that runs other projects' kernels under the
interpreter calls ``install()``, which patches only when TRITON_INTERPRET=1.  Patching is done
once per process (a second call returns at once).
"""
from __future__ import annotations

import os

import numpy as np
import triton.language as tl
import triton.language as tl_lang
from triton.runtime import interpreter


def f32_to_bf16_bits(x):
    """bf16 bit patterns (uint16) of fp32 values, rounded to nearest even; NaN stays NaN."""

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was built for Triton's interpreter (an InterpretedFunction), not compiled."""
    return type(kernel).__name__ == "InterpretedFunction"


def install(force: bool = False) -> None:
    """Apply the fixes to Triton's interpreter, once: when TRITON_INTERPRET=1, or with ``force``
    (a kernel built under the interpreter is about to run, whatever the environment says now)."""
    if not force and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return

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
        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x

        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = dot

    original_cast = builder_cls.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(f32_to_bf16_bits(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder_cls.cast_impl = cast_impl

    def boolean_result(compare):
        def patched_compare(self, lhs, rhs):
            out = compare(self, lhs, rhs)
            return interpreter.TensorHandle(np.asarray(out.data, dtype=np.bool_), tl_int1)
        return patched_compare


    tl_int1 = tl_lang.int1
    for name in dir(builder_cls):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(builder_cls, name, boolean_result(getattr(builder_cls, name)))
    interpreter._kda_index_compat = True
