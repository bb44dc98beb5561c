"""fla's Triton kernels under Triton's CPU interpreter: the two fixes its kernels need there, test
scaffolding only (call after kda_kernels.triton._interpreter_compat.install(), in a process that
set TRITON_INTERPRET=1 before importing Triton):

- fla binds ``gather = tl.gather`` at import, so the interpreter's patched ``tl.gather`` is
  never seen; the alias in fla.ops.kda.chunk_intra is replaced by a call through ``tl``.
- chunk_gated_delta_rule_fwd_kernel_h_blockdim64 calls ``i_t.to(tl.int64)`` on its ``range``
  induction variable, a tensor when compiled and a Python int in the interpreter; that module's
  ``range`` yields the interpreter's int32 scalars instead.
"""
import builtins


def install_fla_interpreter_fixes() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    from kda_kernels.triton._interpreter_compat import install
    install()
    import fla.ops.common.chunk_delta_h as delta_h
    import fla.ops.kda.chunk_intra as intra

    def scalar(x):
        return int(np.asarray(x.handle.data).reshape(-1)[0]) if isinstance(x, tl.tensor) else int(x)

    def tensor_range(*args):
        for i in builtins.range(*[scalar(a) for a in args]):
            yield tl.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    intra.gather = lambda src, index, axis, _builder=None: tl.gather(src, index, axis)
    delta_h.range = tensor_range
