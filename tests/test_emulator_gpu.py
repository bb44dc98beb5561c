"""The emulator and the judging core on CUDA (run with `pytest -m gpu`): the same numbers as
on the CPU, and the production shapes within a time budget."""
import time

import pytest
import torch

from kda_kernels.base import Route
from kda_kernels.controls import run_in_recipe
from kda_kernels.emulator import RECIPES, emulate
from kda_ref.truth import truth
from verification.running.cases import get_case, get_suite
from verification.judging.metrics import compare
from verification.judging.tolerances import load_tolerances
from verification.judging.baselines import baseline_metrics
from verification.judging.verdict import judge

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cid", [c.id for c in get_suite("smoke")] + ["stress/fused-projection-bands-lb-1",
                                                                      "stress/exact-keys-gate-off-beta4"])
def test_cuda_gives_the_cpu_numbers(cid):
    c = get_case(cid)
    pc, pg = c.build("cpu"), c.build("cuda")
    for r in RECIPES:
        a, b = emulate(pc, r, taps=True), emulate(pg, r, taps=True)
        for name, x in a.tensors().items():
            y = b.tensors()[name].cpu()
            # the paged case's unread slots hold NaN on purpose: they must stay NaN in both places
            nan = torch.isnan(x)
            assert torch.equal(nan, torch.isnan(y)), (cid, r, name)
            x, y = x.double()[~nan], y.double()[~nan]
            # float64 sums may associate differently on the device: at most a last-bit flip
            # of a few rounded values, never a different error level
            assert (x - y).abs().max() <= 2 * x.abs().max() * 2.0 ** -8, (cid, r, name)
        ea = compare(a.tensors(), truth(pc).tensors(), pc)["o"]["rel_l2"]
        eb = compare(b.tensors(), truth(pg).tensors(), pg)["o"]["rel_l2"]
        assert abs(ea - eb) <= 1e-3 * ea, (cid, r, ea, eb)


@pytest.mark.parametrize("cid", ["default/B1-T16384-H12", "default/B1-T16384-H96", "default/B8-T2048-H16"])
def test_production_shapes_on_cuda(cid):
    p = get_case(cid).build("cuda")
    tr = truth(p)
    db = load_tolerances()
    for r in RECIPES:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        base = baseline_metrics(p, r, tr)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"{cid} {r}: baseline {dt:.2f}s o rel_l2 {base['o']['rel_l2']:.3g} "
              f"final_state {base['final_state']['rel_l2']:.3g}")
        assert dt < 120 and 1e-4 < base["o"]["rel_l2"] < 2e-2
    v = judge("emulator-bad", Route(name="mqk_no_diag", recipe="flashkda"), p,
              run_in_recipe(p, "mqk_no_diag"), tr, baseline_metrics(p, "flashkda", tr), db)
    assert v.status == "fail"
