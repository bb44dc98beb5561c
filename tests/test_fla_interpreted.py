"""fla's chunk_kda routes with pinned autotuners, run by Triton's CPU interpreter, against the
float64 oracle.

The run happens in a child process (this file run as a script): fla's kernels must be built
under TRITON_INTERPRET=1, which only works when Triton is first imported with it set, and
building Triton's own functions interpreted in this process would break compiled kernels of
later test modules.  Like every interpreter test, the module skips on a GPU machine (there the
verify matrix runs fla's compiled kernels).

The child installs the project's interpreter fixes (kda_kernels.triton._interpreter_compat:
loop bounds, bf16 dots, bf16 rounding) and the two fla's kernels need (tests/interpreted_fla.py).

Tolerances (bf16 unit roundoff u = 2^-8): o and the final state within 2u relative (Frobenius)
of the oracle, as for our own Triton kernels (tests/test_triton_flashkda.py); measured here
3.8e-3 (o) and 3.3e-3 (state) for the chunk routes, 4.1e-3 / 3.1e-3 for the same routes compiled
on an H200.  The per-pass run (run_pass) is judged by the debugger's row
thresholds (verification.investigating.debug.THRESHOLDS).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 2 * 2.0 ** -8
ROUTES = ("chunk:safe_gate", "chunk:exact:C=32", "fused_recurrent")


def _child() -> dict:
    """Runs in the child process: every route of ROUTES and the per-pass debugger, as JSON."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["FLA_FLASH_KDA"] = "0"
    import warnings
    warnings.simplefilter("ignore")
    import torch

    from interpreted_fla import install_fla_interpreter_fixes
    install_fla_interpreter_fixes()

    from kda_kernels.base import Route
    from kda_kernels.fla import FlaBackend
    from kda_ref import Problem, truth
    from verification.investigating.debug import debug_passes, format_reports

    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    lens, H, K, V = (70, 30), 2, 128, 128
    T = sum(lens)
    p = Problem(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, V).bfloat16(),
                g=(0.5 * r(1, T, H, K)).bfloat16(), beta=r(1, T, H), A_log=0.5 * r(H).abs(), dt_bias=0.1 * r(H * K),
                lower_bound=-1.0, cu_seqlens=torch.tensor([0, lens[0], T]),
                initial_state=0.5 * r(len(lens), H, V, K), state_layout="vk")
    ref = truth(p)
    rel = lambda x, y: float((x.double() - y.double()).norm() / y.double().norm())  # noqa: E731
    out = {"routes": {}}
    b = FlaBackend()
    for name in ROUTES:
        res = b.run(p, Route(name, recipe="fla"))
        out["routes"][name] = dict(o=rel(res.o, ref.o), final_state=rel(res.final_state, ref.final_state),
                                   pinned=res.info["pinned_configs"], route_ran=res.info["route_ran"])
    reports = debug_passes(b, p, Route("chunk:safe_gate", recipe="fla"))
    out["passes"] = dict(ok=all(x.ok for x in reports), names=[x.name for x in reports],
                         text=format_reports(reports), pinned_o=b.last_pinned)
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child()))
    sys.exit(0)

import pytest  # noqa: E402
import torch  # noqa: E402

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter tests run on machines without a GPU (or with TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("fla", reason="fla-core is not installed")

pytestmark = pytest.mark.slow   # one child process runs fla's chunk_kda in the interpreter (about 50 s)


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("route", ROUTES)
def test_pinned_route_matches_the_oracle(result, route):
    r = result["routes"][route]
    assert r["o"] < TOL and r["final_state"] < TOL, r
    if route == "fused_recurrent":
        assert r["pinned"] == {}                      # no autotuned kernel on this route
        return
    intra = ("chunk_kda_fwd_kernel_intra_sub_chunk" if "safe_gate" in route
             else "chunk_kda_fwd_kernel_intra_token_parallel")
    assert {"l2norm_fwd_kernel", "kda_gate_chunk_cumsum_vector_kernel", intra, "chunk_kda_fwd_kernel_inter_solve_fused",
            "recompute_w_u_fwd_kda_kernel", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
            "chunk_gla_fwd_kernel_o"} == set(r["pinned"]), r["pinned"]
    assert all(" warps=4 " in f" {c} " for c in r["pinned"].values()), r["pinned"]


def test_every_pass_pinned_and_within_thresholds(result):
    x = result["passes"]
    assert x["names"] == ["gate", "intra", "h", "o"], x["text"]
    assert x["ok"], x["text"]
    assert x["pinned_o"] == {"chunk_gla_fwd_kernel_o": "BK=32 BV=64 warps=4 stages=2"}
