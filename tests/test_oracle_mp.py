"""The float64 oracle against a 40-digit mpmath evaluation of the whole forward."""
import pytest
import torch

from kda_ref import truth
from kda_ref.mp_ref import mp_recurrence
from verification.investigating.selfcheck import mp_problems, rel

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py



def test_float64_oracle_agrees_with_mpmath():
    for name, p in mp_problems(quick=True)[:3]:
        o_mp, f_mp = mp_recurrence(p, dps=40)
        for method in ("recurrence", "chunked"):
            t = truth(p, method=method, chunk_size=16)
            fs = t.final_state
            if p.state_layout == "vk":
                fs = fs.transpose(-1, -2)
            assert rel(t.o, o_mp) <= 1e-13, (name, method)
            assert rel(fs, f_mp) <= 1e-13, (name, method)


def test_mpmath_sees_a_one_ulp_change():
    _, p = mp_problems(quick=True)[0]
    o1, _ = mp_recurrence(p, dps=40)
    q = p.q.clone()
    q[0, 1, 0, 0] = torch.nextafter(q[0, 1, 0, 0], torch.tensor(10.0, dtype=q.dtype))
    o2, _ = mp_recurrence(p.replace(q=q), dps=40)
    assert not torch.equal(o1, o2)
