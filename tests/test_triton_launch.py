"""The Triton package's launch state is explicit: recording, the target platform and the buffer
allocator live in a LaunchContext set for a block (launch_context), and importing the kernels
patches nothing; the interpreter fixes come with the first interpreted launch."""
import os
import subprocess
import sys

import torch

from kda_kernels.triton.launch import LaunchContext, current_context, launch_context, use_allocator


def _problem(T=40, H=1):
    z = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt)  # noqa: E731
    return dict(q=z(1, T, H, 128), k=z(1, T, H, 128), v=z(1, T, H, 128), g=z(1, T, H, 128),
                beta=z(1, T, H, dt=torch.float32), A_log=z(H, dt=torch.float32))


def test_recording_is_scoped_to_its_block_and_runs_nothing():
    from kda_kernels.triton import flashkda_forward
    assert current_context() == LaunchContext()
    with launch_context(recorder=[], target_is_hip=True) as ctx:
        assert current_context().hip
        flashkda_forward(**_problem(), route="seg:cps=1")
    assert current_context() == LaunchContext()
    names = [k.__name__ for k, *_ in ctx.recorder]
    assert names == ["k1_prepare_kernel", "k1_inverse_kernel", "segment_map_kernel", "scan_kernel", "segment_kernel"]
    scan_kwargs = ctx.recorder[3][3]
    assert scan_kwargs["num_warps"] == 4                      # AMD target: the split scan keeps 4 warps
    with launch_context(recorder=[], target_is_hip=False) as ctx:
        flashkda_forward(**_problem(), route="seg:cps=1")
    assert ctx.recorder[3][3]["num_warps"] == 8               # NVIDIA: 8


def test_allocator_makes_every_buffer_inside_its_block_only():
    from kda_kernels.triton import flashkda_forward
    made = []

    def alloc(name, shape, dtype, device):
        made.append(name)
        return torch.empty(shape, dtype=dtype, device=device)

    with use_allocator(alloc), launch_context(recorder=[]):
        flashkda_forward(**_problem(), route="seg:cps=1")
    assert {"o", "final_state", "ws_kd", "ws_inv", "ws_L", "A_seg", "b_seg", "h_in"} <= set(made)
    n = len(made)
    with launch_context(recorder=[]):
        flashkda_forward(**_problem(), route="seg:cps=1")
    assert len(made) == n and current_context().allocator is None


def test_importing_the_kernels_patches_no_interpreter():
    code = ("import triton.runtime.interpreter as I, kda_kernels.triton.kernels, kda_kernels.triton.forward\n"
            "assert not getattr(I, '_kda_index_compat', False), 'patched at import'\n"
            "import torch\n"
            "from kda_kernels.triton import flashkda_forward\n"
            "z = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)\n"
            "flashkda_forward(z(1, 8, 1, 128), z(1, 8, 1, 128), z(1, 8, 1, 128), z(1, 8, 1, 128),\n"
            "                 torch.zeros(1, 8, 1), torch.zeros(1), route='unseg')\n"
            "assert I._kda_index_compat, 'not patched by the launch'\n")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
