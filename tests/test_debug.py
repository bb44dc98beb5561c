"""The per-pass debugger names the pass, and the first (sequence, head, chunk|segment, row),
where a planted error enters; on a correct pipeline it names none."""
import pytest
import torch

from kda_kernels.base import Route
from kda_ref.problems import generate
from verification.investigating.debug import debug_passes, format_reports, oracle_intermediates


def _problem(K=16, V=16, H=2):
    """Three sequences (40, 0, 130 tokens), fp32 inputs, a kv initial state of 0.1 N(0,1)."""
    return generate(dict(lens=[40, 0, 130], H=H, K=K, V=V, lb=-1.0, state="kv", state_scale=0.1,
                         dtype=torch.float32), seed=1)


STORAGE = {"ws_gt": torch.float32, "ws_beta": torch.float32, "ws_inv": torch.float16, "ws_mqk": torch.float16,
           "b_seg": torch.float32, "h_in": torch.float32, "final_state": torch.float32}


class OracleBackend:
    """A 'kernel' whose every pass is the oracle rounded to the FlashKDA storage dtypes, with an
    optional planted error."""
    name = "oracle-bf16"

    def __init__(self, plant=None):
        self.plant = plant  # (pass, tensor, index tuple, delta)

    def debug_plan(self, p, route):
        return dict(chunk_size=32, chunks_per_seg=2, passes=["K1", "A", "B", "C"])

    def run_pass(self, p, route, name, feed):
        ref = oracle_intermediates(p, 32, 2)["tensors"]
        outs = {"K1": ["ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk", "ws_beta"], "A": ["A_seg", "b_seg"],
                "B": ["h_in"], "C": ["o", "final_state"]}[name]
        res = {t: ref[t].to(STORAGE.get(t, torch.bfloat16)).double() for t in outs}
        if self.plant and self.plant[0] == name:
            _, t, idx, delta = self.plant
            res[t][idx] += delta * ref[t].norm(dim=-1).max()
        return res


def test_clean_pipeline_names_no_pass():
    reps = debug_passes(OracleBackend(), _problem(), Route("x"))
    assert [r.name for r in reps] == ["K1", "A", "B", "C"] and all(r.ok for r in reps), format_reports(reps)


@pytest.mark.parametrize("plant,where", [
    (("A", "A_seg", (3, 1, 5, 2), 1.0), dict(pass_="A", tensor="A_seg", seq=2, segment=1, head=1, row=5)),
    (("K1", "ws_kr", (5 + 7, 9, 3), 1.0), dict(pass_="K1", tensor="ws_kr", seq=2, chunk=3, head=1, row=9)),
    (("C", "o", (0, 50, 0, 1), 1.0), dict(pass_="C", tensor="o", seq=2, chunk=0, head=0, row=10)),
])
@pytest.mark.slow
def test_planted_error_is_localised(plant, where):
    reps = debug_passes(OracleBackend(plant), _problem(), Route("x"))
    bad = [r for r in reps if not r.ok]
    assert bad and bad[0].name == where["pass_"], format_reports(reps)
    t = [t for t in bad[0].tensors if not t.ok][0]
    assert t.name == where["tensor"]
    for key in ("seq", "segment", "chunk", "head", "row"):
        if key in where:
            assert t.first_over[key] == where[key], (key, t.first_over)
    assert f"pass {where['pass_']}" in format_reports(reps).splitlines()[-1]


def test_values_below_fp32_range_are_no_error():
    """A decay of 2^-254 stored as fp32 is 0: that must not be named as an error."""
    from verification.investigating.debug import compare_tensor
    ref = torch.full((4, 128), 2.0 ** -254, dtype=torch.float64)
    ctx = {"grid": None, "plan": None, "HV": 1}
    rep = compare_tensor("final_state_like", torch.zeros(4, 128), ref, ctx, thresholds={"final_state_like": 1e-4})
    assert rep.rows_over == 0


def test_a_failed_verdict_rule_flags_its_pass_and_is_printed():
    """A tensor whose rows are all within their threshold but which fails the verdict's rule
    (inverse_rule, for K1's ws_inv) makes its pass the one where the error enters."""
    from verification.investigating.debug import PassReport, TensorReport, reports_to_json
    t = TensorReport(name="ws_inv", rel_l2=1.4e-3, max_row_err=4e-3, threshold=3e-2, rows=64, rows_over=0,
                     first_over=None, rule_failed="ws_inv: rel_l2 0.0014 > 0.0012 = 2*0.0006+1e-06 (tolerance x)")
    ok = TensorReport(name="ws_kd", rel_l2=1e-3, max_row_err=2e-3, threshold=1e-2, rows=64, rows_over=0, first_over=None)
    reps = [PassReport("K1", [ok, t]), PassReport("C", [])]
    assert ok.ok and not t.ok and not reps[0].ok and reps[1].ok
    text = format_reports(reps)
    assert "pass K1: ERROR ENTERS HERE" in text
    assert "ws_inv: every row within its threshold, but the verdict's rule fails: ws_inv: rel_l2 0.0014" in text
    assert text.endswith("verdict: the error first exceeds a threshold in pass K1")
    assert reports_to_json(reps)[0]["tensors"][1]["rule_failed"].startswith("ws_inv: rel_l2")
