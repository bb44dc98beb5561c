"""kda_ref.norm.gated_rmsnorm: the float64 gated RMSNorm of a fused output norm."""
import math

import pytest
import torch

from kda_ref.norm import gated_rmsnorm


def test_one_row_by_hand():
    o = torch.tensor([[3.0, 4.0]])                   # mean square 12.5
    y = gated_rmsnorm(o, torch.zeros(1, 2), torch.tensor([1.0, 2.0]), eps=0.5)
    s = 1 / math.sqrt(12.5 + 0.5)
    assert y.dtype == torch.float64
    assert torch.allclose(y, torch.tensor([[3 * s * 0.5, 4 * s * 2 * 0.5]], dtype=torch.float64), rtol=0, atol=1e-15)


def test_each_row_normalised_on_its_own_and_gated_per_channel():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64)
    o[1] *= 1e3                                       # the scale of a row does not reach y
    gate = torch.full_like(o, 40.0)                   # sigmoid(40) = 1 - 4e-18
    y = gated_rmsnorm(o, gate, torch.ones(16), eps=1e-30)
    assert torch.allclose(y.square().mean(-1), torch.ones(2, 5, 3, dtype=torch.float64), rtol=1e-12, atol=0)
    y0 = gated_rmsnorm(o, torch.zeros_like(o), torch.ones(16), eps=1e-30)
    assert torch.allclose(y0, 0.5 * y, rtol=1e-12, atol=0)


def test_bf16_inputs_are_taken_exactly():
    o = torch.randn(4, 8).bfloat16()
    y = gated_rmsnorm(o, torch.zeros(4, 8).bfloat16(), torch.ones(8))
    ref = o.double() / torch.sqrt(o.double().square().mean(-1, keepdim=True) + 1e-5) * 0.5
    assert torch.equal(y, ref) or torch.allclose(y, ref, rtol=1e-15, atol=0)


@pytest.mark.parametrize("kw, name", [(dict(gate=torch.zeros(2, 3)), "gate"), (dict(weight=torch.ones(3)), "weight"),
                                      (dict(eps=0.0), "eps")])
def test_bad_arguments_name_themselves(kw, name):
    args = dict(o=torch.zeros(2, 4), gate=torch.zeros(2, 4), weight=torch.ones(4), eps=1e-5)
    args.update(kw)
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        gated_rmsnorm(**args)
