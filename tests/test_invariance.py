"""Invariances (verification/investigating/invariance.py) of our Triton FlashKDA in Triton's CPU interpreter,
on `unseg:BW=32` and the segmented `seg:cps=1:BW=32`, small cases; the memory guards on the real
kernels; and deliberately broken torch backends that each invariance must catch.

tests/test_invariance_gpu.py runs the same checks compiled on CUDA over more routes and shapes.
"""
import os
import warnings

import pytest
import torch

from interpreted_triton import interpreted_kernels  # noqa: E402

_kernels = interpreted_kernels()

from kda_kernels.base import Outputs, Route  # noqa: E402
from kda_kernels.triton.backend import TritonBackend  # noqa: E402
from kda_ref import truth  # noqa: E402
from verification.investigating import invariance as inv  # noqa: E402
from kda_ref.problems import generate  # noqa: E402
from verification.running.guards import guarded_run  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)

ROUTES = ["unseg:BW=32", "seg:cps=1:BW=32"]


@pytest.fixture(scope="module")
def backend():
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"          # available() reads it
    try:
        yield TritonBackend()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(scope="module")
def problems():
    return dict(
        varlen=generate(dict(lens=[40, 33], H=1, state="kv"), seed=1),
        batch=generate(dict(B=2, T=40, H=2, state="vk"), seed=2),
        one=generate(dict(B=1, T=80, H=1, state="kv"), seed=3),
        paged=generate(dict(lens=[20, 47], H=1, state="paged", paged_new=[1], slot_pad=64, slots=5), seed=4),
    )


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.slow
def test_bitwise_invariances(backend, problems, route):
    r = backend.route(route)
    results = [inv.determinism(backend, r, problems["one"], repeats=2),
               inv.varlen_slice(backend, r, problems["varlen"]),
               inv.batch_slice(backend, r, problems["batch"]),
               inv.paged_vs_dense(backend, r, problems["paged"]),
               inv.paged_vs_dense(backend, r, problems["batch"]),          # dense vk -> a paged cache
               inv.strided_vs_packed(backend, r, problems["varlen"]),
               inv.causality(backend, r, problems["varlen"]),              # P = 32 in both sequences
               inv.head_permutation(backend, r, problems["batch"])]
    for res in results:
        assert res.kind == "bitwise", str(res)
        assert res.ok and res.diff == 0, str(res)
        assert res.details, str(res)                                       # something was compared


def test_split_and_carry(backend, problems):
    unseg, seg = backend.route("unseg:BW=32"), backend.route("seg:cps=1:BW=32")
    at_chunk = inv.split_carry(backend, unseg, problems["one"], split=64)
    assert at_chunk.kind == "bitwise" and at_chunk.ok, str(at_chunk)
    mid_chunk = inv.split_carry(backend, unseg, problems["one"], split=40)
    assert mid_chunk.kind == "tolerance" and mid_chunk.ok, str(mid_chunk)
    assert 0 < mid_chunk.diff < inv.SEGMENTATION_TOL                       # another rounding path, measured
    segmented = inv.split_carry(backend, seg, problems["one"], split=64)
    assert segmented.kind == "tolerance" and segmented.ok, str(segmented)


def test_causality_inside_a_chunk_is_only_within_tolerance(backend, problems):
    res = inv.causality(backend, backend.route("unseg:BW=32"), problems["varlen"], prefix=20)
    assert res.kind == "tolerance" and res.ok, str(res)
    assert res.diff > 0          # the pivot row of a 16-block moves with later rows: not bitwise


@pytest.mark.parametrize("route", ROUTES)
def test_guards_hold_on_our_kernels(backend, problems, route):
    r = backend.route(route)
    for name in ("paged", "batch"):
        _, rep = guarded_run(backend, problems[name], r)
        assert rep.ok, rep.violations
        assert {"o", "ws_kd", "ws_inv", "ws_mqk"} <= set(rep.buffers)
        assert ("state_cache" in rep.buffers) == (name == "paged")
        assert ("final_state" in rep.buffers) == (name == "batch")
        if route.startswith("seg"):
            assert {"A_seg", "b_seg", "h_in"} <= set(rep.buffers)


# ------------------------------------------------------------------ broken backends are caught
class Broken:
    """The oracle's outputs (in the input dtype) with one deliberate defect."""

    def __init__(self, defect):
        self.defect = defect
        self.name = f"broken-{defect}"
        self.calls = 0

    def run(self, problem, route):
        self.calls += 1
        t = truth(problem)
        o = t.o.to(problem.v.dtype)
        if self.defect == "noisy" and self.calls % 2 == 0:
            o = o.clone()
            o.view(torch.int16).view(-1)[0] += 1          # one last-bit change on every second call
        if self.defect == "non_causal":
            o = (o.double() + problem.v.double().mean(dim=(0, 1), keepdim=True)).to(o.dtype)   # reads the future
        if self.defect == "head_scaled":
            o = (o.double() * (1 + 1e-2 * torch.arange(problem.HV).view(1, 1, -1, 1))).to(o.dtype)
        return Outputs(o=o, final_state=None if t.final_state is None else t.final_state.float(),
                       state_cache=None if t.state_cache is None else t.state_cache.float())


@pytest.mark.parametrize("defect, check", [("noisy", "determinism"), ("non_causal", "causality"),
                                           ("head_scaled", "head_permutation")])
def test_each_invariance_catches_its_defect(problems, defect, check):
    route = Route(name="oracle", recipe="flashkda")
    prob = problems["batch"]
    good = inv.CHECKS[check](Broken(None), route, prob)
    bad = inv.CHECKS[check](Broken(defect), route, prob)
    assert good.ok, str(good)
    assert not bad.ok and bad.diff > 0, str(bad)


def test_bad_arguments_are_named(problems):
    route = Route(name="oracle")
    with pytest.raises(ValueError, match=r"^problem: expected a varlen Problem"):
        inv.varlen_slice(Broken(None), route, problems["batch"])
    with pytest.raises(ValueError, match=r"^split: expected 0 < split < T=80, got 80"):
        inv.split_carry(Broken(None), route, problems["one"], split=80)


def test_the_chunk_size_of_a_route_is_its_recipes():
    # the fixed FlashKDA build's recipe (moonshot-fwdsub) keeps moonshot's 16-token chunks: its
    # causality prefix and bitwise split points are multiples of 16, not of the unknown-recipe 64
    from kda_kernels.base import Route
    from verification.investigating.invariance import CAUSAL_ALIGN, chunk_size_of
    assert [chunk_size_of(Route("r", recipe=n)) for n in ("flashkda", "fla", "moonshot", "moonshot-fwdsub")] == \
        [32, 64, 16, 16]
    assert chunk_size_of(Route("r", recipe="fp32")) == chunk_size_of(Route("r", recipe="nope")) == CAUSAL_ALIGN
