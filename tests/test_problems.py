"""kda_ref.problems: the one generator's spec, named shapes, GVA, gate kinds, dtypes and errors."""
from __future__ import annotations

import pytest
import torch

from kda_ref.problem import ProblemError
from kda_ref.problems import ProblemSpec, generate, problem_digest


def test_the_same_spec_gives_the_same_problem_and_another_seed_another():
    s = ProblemSpec(B=1, T=20, H=1, K=16, V=8, state="kv", seed=3)
    assert problem_digest(generate(s)) == problem_digest(generate(s))
    assert problem_digest(generate(s.replace(seed=4))) != problem_digest(generate(s))


def test_a_case_is_its_spec():
    from verification.running.cases import get_case
    c = get_case("smoke/paged-lb-5")
    assert problem_digest(c.build()) == problem_digest(generate(c.spec, meta={"case": c.id, "seed": c.seed}))
    assert c.spec.lengths == [20, 47] and c.spec.state == "paged" and c.lens == [20, 47]


def test_named_shapes():
    assert ProblemSpec.named("B2-T100-H3") == ProblemSpec(B=2, T=100, H=3)
    assert ProblemSpec.named("1x64x2x4", K=16) == ProblemSpec(B=1, T=64, H=2, HV=4, K=16)
    with pytest.raises(ProblemError, match=r"^shape: expected B<b>-T<t>-H<h>\[-HV<hv>\] or BxTxH\[xHV\], got 'B2'"):
        ProblemSpec.named("B2")


def test_gva_varlen_paged_and_its_slot_stride():
    p = generate(dict(lens=[5, 0, 9], H=1, HV=2, K=16, V=8, state="paged", paged_new=[1], slot_pad=3, slots=4),
                 seed=1)
    assert (p.H, p.HV, p.N, p.T) == (1, 2, 3, 14) and p.paged
    assert p.state_cache.shape == (4, 2, 8, 16) and p.state_cache.stride(0) == 2 * 8 * 16 + 3
    assert p.has_initial_state.tolist() == [True, False, True]


def test_gate_kinds_dtypes_and_magnitudes():
    pre = generate(dict(B=1, T=8, H=1, K=8, V=8, gate="pregated", beta_kind="pregated", dtype=torch.float32,
                        param_dtype=torch.float64, g_shift=3.0))
    assert pre.lower_bound is None and pre.gate == "pregated" and bool((pre.g <= 0).all())
    assert pre.q.dtype == torch.float32 and pre.beta.dtype == pre.A_log.dtype == torch.float64
    soft = generate(dict(B=1, T=8, H=1, K=8, V=8, gate="softplus"))
    assert soft.lower_bound is None and soft.A_log is not None
    base = generate(dict(B=1, T=8, H=1, K=8, V=8, dtype=torch.float32))
    big = generate(dict(B=1, T=8, H=1, K=8, V=8, dtype=torch.float32, v_scale=4.0, beta_scale=2.0))
    assert torch.equal(big.v, 4.0 * base.v) and torch.equal(big.beta, 2.0 * base.beta)
    assert torch.equal(big.q, base.q)


@pytest.mark.parametrize("fields, message", [
    (dict(HV=3), r"^HV: expected a multiple of H=2 \(GVA\), got 3$"),
    (dict(state="kk"), r"^state: expected one of none\|kv\|vk\|paged, got 'kk'$"),
    (dict(T=-1), r"^T: expected an integer >= 0, got -1$"),
    (dict(lens=[3], paged_new=[1], state="paged"), r"^paged_new: expected sequence indices in \[0, 1\), got \[1\]$"),
    (dict(draw="device", rho=0.5), r"^draw: expected draw=cpu with rho"),
    (dict(dtype=torch.int8), r"^dtype: expected a torch float dtype, got torch.int8$"),
])
def test_a_bad_field_is_named(fields, message):
    with pytest.raises(ProblemError, match=message):
        ProblemSpec(**fields)


def test_an_unknown_parameter_is_named():
    with pytest.raises(ProblemError, match=r"^params: expected parameters among .*, got wobble$"):
        ProblemSpec.from_params({"T": 4, "wobble": 1})


def test_device_draw_on_the_cpu_is_the_cpu_draw():
    s = ProblemSpec(B=1, T=16, H=2, K=16, V=16, state="vk", norm=True)
    assert problem_digest(generate(s)) == problem_digest(generate(s.replace(draw="device")))
