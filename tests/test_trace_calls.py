"""kda_kernels.trace_calls: how a trace step is split into kernel calls."""
import torch

from kda_kernels.trace_calls import assemble, group_rows, split_step
from kda_ref.trace_gen import generate


def test_padding_rides_with_decode_then_spec_then_alone():
    assert group_rows([0, 1, -1]) == {"prefill": [0], "decode": [1, 2]}
    assert group_rows([2, -1, 2]) == {"spec": [0, 1, 2]}
    assert group_rows([0, -1]) == {"prefill": [0], "decode": [1]}
    assert group_rows([1, 2, -1]) == {"decode": [0, 2], "spec": [1]}


def test_split_covers_every_token_once_and_keeps_the_step_arguments():
    tr = generate(3, "mixed")
    cache = tr.cache.allocate()
    seen_groups = set()
    for s in range(tr.steps):
        a = tr.step(s)
        calls = split_step(tr, s, cache)
        T = a["q"].shape[1]
        idx = torch.cat([c.token_index for c in calls]).sort().values
        assert torch.equal(idx, torch.arange(T))
        for c in calls:
            seen_groups.add(c.group)
            assert torch.equal(c.q[0], a["q"][0, c.token_index])
            assert c.cu_seqlens[-1].item() == c.tokens
            rows = (c.rows - int(tr.step_rows[s])).tolist()
            table = a["state_indices"][rows]
            assert torch.equal(c.state_indices, table if c.group == "spec" else table[:, 0])
            assert (c.num_accepted_tokens is None) == (c.group != "spec")
        o = assemble(calls, [c.v.to(torch.float64) for c in calls], T)
        assert torch.equal(o, a["v"][0].to(torch.float64))
    assert {"prefill", "decode"} <= seen_groups


def test_assemble_widens_to_the_calls_widest_dtype():
    """A bf16 prefill kernel beside an fp32 decode kernel (a pairing seen on the H200): the step's o
    keeps both exactly; before, the index put raised on the dtype mismatch."""
    tr = generate(3, "mixed")
    cache = tr.cache.allocate()
    for s in range(tr.steps):
        calls = split_step(tr, s, cache)
        if len(calls) > 1:
            break
    outs = [c.v.to(torch.bfloat16 if i == 0 else torch.float32) for i, c in enumerate(calls)]
    o = assemble(calls, outs, int(sum(c.tokens for c in calls)))
    assert o.dtype == torch.float32
    for c, out in zip(calls, outs):
        assert torch.equal(o[c.token_index], out[0].float())


def test_split_moves_inputs_to_a_device_without_blocking_and_the_model_once(monkeypatch):
    """A blocking host-to-device copy synchronises the stream; on a GPU shared by many workers a
    10^4-step trace paid about ten per step.  Every copy split_step and assemble make to a
    device is non-blocking, and with the run's ``trace_model`` none is of the model's tensors.
    (The meta device stands in for a GPU.)"""
    from kda_kernels.trace_calls import trace_model
    tr = generate(3, "mixed")
    dev = torch.device("meta")
    cache = tr.cache.allocate(device=dev)
    model = trace_model(tr, dev)
    copies = []
    to = torch.Tensor.to

    def spy(self, *a, **kw):
        out = to(self, *a, **kw)
        if self.device.type == "cpu" and out.device.type == "meta":
            copies.append((tuple(self.shape), bool(kw.get("non_blocking", False))))
        return out
    monkeypatch.setattr(torch.Tensor, "to", spy)
    for s in range(tr.steps):
        calls = split_step(tr, s, cache, model)
        assemble(calls, [torch.zeros((1, c.tokens, tr.HV, tr.V), device=dev) for c in calls],
                 int(sum(c.tokens for c in calls)))
    assert copies and all(nb for _, nb in copies), [c for c in copies if not c[1]][:3]
    copies.clear()
    split_step(tr, 0, cache, model)
    with_model = len(copies)
    copies.clear()
    split_step(tr, 0, cache)            # without the run's model: its tensors move again
    assert any(isinstance(x, torch.Tensor) for x in model.values())
    assert len(copies) == with_model + sum(isinstance(x, torch.Tensor) for x in model.values())
