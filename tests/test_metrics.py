"""Metrics of one tensor against the oracle."""
import math

import pytest
import torch

from kda_ref.problems import generate
from verification.judging.metrics import ZERO_TRUST, compare, max_ulp, rel_l2, tensor_metrics

F64 = torch.float64


@pytest.fixture(scope="module")
def varlen():
    # two sequences, 40 and 70 tokens: chunk 32 gives chunks 0, 1 (both) and 2 (second only)
    return generate(dict(lens=[40, 70], H=1, lb=-1.0, state="kv"), seed=1)


def test_rel_l2_and_its_degenerate_cases():
    r = torch.tensor([3.0, 4.0], dtype=F64)
    assert rel_l2(r + torch.tensor([0.3, 0.4], dtype=F64), r) == pytest.approx(0.1)
    z = torch.zeros(2, dtype=F64)
    assert rel_l2(z, z) == 0.0 and rel_l2(r, z) == math.inf


def test_max_ulp_counts_representable_steps_across_zero():
    one = torch.tensor([1.0, -1.0, 0.0], dtype=F64)
    step = torch.tensor([1.0 + 2 ** -7, -1.0 - 2 ** -7, -0.0])
    assert max_ulp(step.bfloat16(), one, torch.bfloat16) == 1.0
    tiny = torch.tensor([2.0 ** -149])
    assert max_ulp(-tiny, tiny.double(), torch.float32) == 2.0
    assert max_ulp(torch.tensor([float("nan")]), one[:1], torch.float32) == math.inf


def test_tail_and_chunk_curve_locate_an_error(varlen):
    p = varlen
    ref = torch.randn(p.B, p.T, p.HV, p.V, dtype=F64, generator=torch.Generator().manual_seed(0))
    x = ref.clone()
    x[0, 40 + 64:40 + 70] *= 1.5          # only the last 6 tokens of sequence 2 (its chunk 2)
    m = tensor_metrics(x, ref, dtype=F64, problem=p, tensor="o", chunk=32)
    assert m["tail_rel_l2"] > m["rel_l2"] > 0
    curve = m["chunk_rel_l2"]
    assert len(curve) == 3 and curve[0] == 0.0 and curve[1] == 0.0 and curve[2] == pytest.approx(0.5)
    assert m["nan_frac"] == m["inf_frac"] == 0 and not m["mistrusted"]


def test_nan_and_inf_are_counted_and_poison_the_error(varlen):
    p = varlen
    ref = torch.ones(p.B, p.T, p.HV, p.V, dtype=F64)
    x = ref.clone().float()
    x[0, 0, 0, :4] = float("nan")
    x[0, 1, 0, :2] = float("inf")
    m = tensor_metrics(x, ref, problem=p, tensor="o")
    n = x.numel()
    assert m["nan_frac"] == pytest.approx(4 / n) and m["inf_frac"] == pytest.approx(2 / n)
    assert math.isnan(m["rel_l2"]) and math.isnan(m["tail_rel_l2"]) and m["max_ulp"] == math.inf


def test_mostly_zero_output_is_mistrusted_unless_the_reference_is(varlen):
    p = varlen
    ref = torch.randn(p.B, p.T, p.HV, p.V, dtype=F64)
    x = ref.clone()
    x[0, : int(p.T * (ZERO_TRUST + 0.05))] = 0
    assert tensor_metrics(x, ref, problem=p)["mistrusted"]
    ref0 = ref.clone()
    ref0[0, : int(p.T * 0.5)] = 0
    x0 = ref0.clone()
    assert not tensor_metrics(x0, ref0, problem=p)["mistrusted"]


def test_state_cache_is_compared_on_written_slots_and_untouched_ones_bitwise():
    p = generate(dict(lens=[20, 30], H=1, state="paged", paged_new=[1]), seed=2)
    ref = p.state_cache.double().clone()
    written = p.state_indices.long()
    ref[written] = 1.0
    x = ref.float().clone()
    m = tensor_metrics(x, ref, problem=p, tensor="state_cache")
    assert m["untouched_changed"] == 0 and m["rel_l2"] == 0 and m["numel"] == 2 * p.HV * p.V * p.K
    free = [s for s in range(p.state_cache.shape[0]) if s not in set(written.tolist())][0]
    x[free, 0, 0, 0] = 0.0                 # a NaN slot the problem does not write was touched
    assert tensor_metrics(x, ref, problem=p, tensor="state_cache")["untouched_changed"] == 1


def test_compare_reports_missing_tensors_and_shape_errors(varlen):
    p = varlen
    ref = {"o": torch.zeros(p.B, p.T, p.HV, p.V, dtype=F64), "final_state": torch.zeros(p.N, p.HV, p.K, p.V, dtype=F64)}
    m = compare({"o": ref["o"].bfloat16()}, ref, p)
    assert m["final_state"]["missing"] and math.isnan(m["final_state"]["rel_l2"])
    with pytest.raises(ValueError, match=r"final_state: expected shape \[2, 1, 128, 128\]"):
        compare({"o": ref["o"], "final_state": torch.zeros(2, 1, 128, 64)}, ref, p)


def test_flushing_negligible_values_is_not_mistrusted(varlen):
    # a kernel may flush values far below its precision (fp16 underflow of a decayed inverse)
    p = varlen
    ref = torch.randn(p.B, p.T, p.HV, p.V, dtype=F64)
    ref[0, : p.T // 2] *= 1e-30
    x = ref.clone()
    x[0, : p.T // 2] = 0
    m = tensor_metrics(x, ref, problem=p)
    assert m["zero_frac"] > ZERO_TRUST and m["spurious_zero_frac"] == 0 and not m["mistrusted"]


def test_host_reads_do_not_grow_with_the_sequence():
    """On a GPU every read of a device scalar is a synchronisation: the per-chunk curve must be
    reduced on the device and read back at once, not two reads per chunk point."""
    from torch.overrides import TorchFunctionMode

    from kda_ref.truth import truth
    from kda_ref.problems import generate
    from verification.judging.metrics import tensor_metrics

    reads = {"n": 0}

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("tolist", "item", "__float__", "__int__", "__bool__"):
                reads["n"] += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for T in (96, 1300):                       # 3 and 41 chunk points
        p = generate(dict(B=1, T=T, H=1, lb=-1.0), seed=5)
        tr = truth(p)
        x = (tr.o * (1 + 1e-3 * torch.randn_like(tr.o))).to(torch.bfloat16)
        reads["n"] = 0
        with Count():
            m = tensor_metrics(x, tr.o, problem=p, tensor="o")
        counts.append(reads["n"])
        assert len(m["chunk_rel_l2"]) == -(-T // 32)
    assert counts[0] == counts[1] and counts[1] <= 8, counts
