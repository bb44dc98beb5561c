"""kda_ref/naive.py, the read-me-first token loop, is the definition the oracle computes: it agrees
with kda_ref.truth (the fastest exact form), head by head, with and without an initial state."""
import numpy as np
import pytest

from kda_ref import truth
from kda_ref.naive import kda_one_head
from verification.running.cases import get_case


def _naive(p, h, zero_v=False):
    v = p.v[0, :, h].double().numpy()
    S0 = None if p.initial_state is None else p.initial_state[0, h].double().numpy()
    return kda_one_head(p.q[0, :, h].double().numpy(), p.k[0, :, h].double().numpy(),
                        np.zeros_like(v) if zero_v else v, p.g[0, :, h].double().numpy(),
                        p.beta[0, :, h].double().numpy(), float(p.A_log[h]),
                        p.dt_bias.double().view(-1, p.K)[h].numpy(), p.lower_bound, S0=S0, scale=p.scale)


@pytest.mark.parametrize("case", ["smoke/dense-T64-lb-5", "smoke/initial-state-kv-lb-5"])
def test_naive_loop_agrees_with_the_oracle_head_by_head(case):
    p = get_case(case).build("cpu")
    assert p.gate == "lower_bound" and p.cu_seqlens is None and p.state_layout == "kv" and p.H == p.HV
    t = truth(p)
    for h in range(p.H):
        o, S = _naive(p, h)
        want_o, want_S = t.o[0, :, h].numpy(), t.final_state[0, h].numpy()
        assert np.abs(o - want_o).max() <= 1e-12 * np.abs(want_o).max()
        assert np.abs(S - want_S).max() <= 1e-12 * np.abs(want_S).max()


def test_the_comparison_can_fail():
    """A changed input (v set to zero) is far outside the 1e-12 the agreement above asks for."""
    p = get_case("smoke/initial-state-kv-lb-5").build("cpu")
    o, _ = _naive(p, 0, zero_v=True)
    want = truth(p).o[0, :, 0].numpy()
    assert np.abs(o - want).max() > 1e-3 * np.abs(want).max()
