"""The oracle on CUDA gives what it gives on the CPU (run with: pytest -m gpu tests/test_oracle_gpu.py)."""
import pytest
import torch

from kda_ref import truth
from kda_ref.preprocess import prepare
from kda_ref.workspace import inverse_report, workspace_prepared
from verification.investigating.selfcheck import RECIPES, build, rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_cuda_truth_matches_cpu(recipe):
    p = build(recipe, 4)
    cpu = truth(p, workspace=True, chunk_size=32, chunks_per_seg=2)
    for method in ("chunked", "segmented", "recurrence", "fla"):
        gpu = truth(p.to("cuda"), method=method, chunk_size=32, chunks_per_seg=2, workspace=method == "chunked")
        for name, want in cpu.tensors().items():
            if method != "chunked" and name not in ("o", "final_state", "state_cache"):
                continue
            got = gpu.tensors()[name]
            assert got.device.type == "cuda", name
            if want.is_floating_point():
                assert rel(torch.nan_to_num(got), torch.nan_to_num(want)) < 1e-12, (method, name)
            else:
                assert torch.equal(got.cpu(), want), (method, name)


def test_cuda_inverse_ratios():
    pp = prepare(build([r for r in RECIPES if r.name == "corr-1.0-beta-1"][0], 0).to("cuda"))
    for C in (16, 32, 64):
        rep = inverse_report(workspace_prepared(pp, C))
        for k in ("ratio_exact", "ratio_prod64", "ratio_prod32"):
            assert float(rep[k].max()) <= 30, (C, k)


def test_selfcheck_quick_on_cuda():
    from verification.investigating.selfcheck import selfcheck_report
    rep = selfcheck_report(quick=True, device="cuda")
    assert rep["passed"], [r for r in rep["rows"] if not r["passed"]]
