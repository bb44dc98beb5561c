"""The judging of one cell reads from the device to the host once: ``compare`` (and ``judge``,
which measures through it) queues every tensor's reductions and reads all their values in one
``tolist``; no host->device copy waits on the device's stream.  The metric dicts are exactly
(==, NaN equal to NaN) those of the code before the restructuring, kept verbatim in
tests/metrics_before_one_read.py.

Counted on the CPU, where the same code runs: a read is a call of ``Tensor.tolist``, ``.item``,
``bool(t)``, ``float(t)``, ``int(t)``, ``operator.index(t)``, ``.cpu()``, ``.numpy()`` or
``np.asarray(t)``, or an operator that must read its result's size from the device (``nonzero``,
``masked_select``, a boolean mask index, ``unique``, ``repeat_interleave`` without output_size);
a blocking host->device copy is a ``Tensor.to``/``.cuda`` naming a device with non_blocking false
on a host tensor, or ``torch.tensor``/``torch.as_tensor`` given a device."""
import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kda_kernels.base import Outputs, Route
from kda_kernels.emulator import emulate
from kda_ref.problems import generate
from kda_ref.truth import truth
from metrics_before_one_read import before_compare, before_tensor_metrics
from verification.judging.baselines import baseline_metrics
from verification.judging.metrics import compare, tensor_metrics
from verification.judging.tolerances import load_tolerances
from verification.judging.verdict import judge

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

F64 = torch.float64
GVA = dict(lens=[5, 40, 0, 71], H=2, HV=4, K=32, V=32, lb=-1.0)     # an empty and a 5-token sequence
READ_METHODS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__array__")
aten = torch.ops.aten
SIZE_FROM_DEVICE = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                    aten.unique_dim.default, aten.unique_consecutive.default}


class _Counter:
    def __init__(self):
        self.reads, self.blocking, self._depth = [], [], 0


class _SizeReads(TorchDispatchMode):
    """Operators whose result's size is read from the device (a synchronisation on a GPU)."""

    def __init__(self, counter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.c._depth == 0:
            bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
            no_size = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
            if func in SIZE_FROM_DEVICE or bool_index or no_size:
                self.c.reads.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting(monkeypatch):
    """Count the host reads and blocking host->device copies made inside the block."""
    c = _Counter()
    with monkeypatch.context() as m:
        def wrap(name):
            orig = getattr(torch.Tensor, name)

            def read(self, *a, **k):
                c.reads.append(name)
                c._depth += 1
                try:
                    return orig(self, *a, **k)
                finally:
                    c._depth -= 1
            m.setattr(torch.Tensor, name, read)
        for name in READ_METHODS:
            wrap(name)
        to, cuda, tensor, as_tensor = torch.Tensor.to, torch.Tensor.cuda, torch.tensor, torch.as_tensor

        def to_(self, *a, **k):
            dev, _, non_blocking, _ = torch._C._nn._parse_to(*a, **k)
            if dev is not None and self.device.type == "cpu" and not non_blocking:
                c.blocking.append(f"to {list(self.shape)}")
            return to(self, *a, **k)

        def cuda_(self, *a, **k):
            if not k.get("non_blocking", False):
                c.blocking.append("cuda")
            return cuda(self, *a, **k)

        def made(fn, what):
            def make(*a, **k):
                if k.get("device") is not None:
                    c.blocking.append(what)
                return fn(*a, **k)
            return make
        m.setattr(torch.Tensor, "to", to_)
        m.setattr(torch.Tensor, "cuda", cuda_)
        m.setattr(torch, "tensor", made(tensor, "torch.tensor"))
        m.setattr(torch, "as_tensor", made(as_tensor, "torch.as_tensor"))
        with _SizeReads(c):
            yield c


def _outputs(p, refs, seed=0, plant=None, dtypes=None):
    """Outputs near ``refs``: noise 1e-3 of the mean |ref|, cast to the kernel's dtypes; a paged
    cache keeps its unwritten slots bit-equal but one; ``plant`` "nan" or "zeros" spoils o."""
    g = torch.Generator().manual_seed(seed)
    dtypes = {"o": p.v.dtype, "final_state": torch.float32, "state_cache": torch.float32, **(dtypes or {})}
    outs = {}
    for k, ref in refs.items():
        x = ref + 1e-3 * ref.nan_to_num().abs().mean() * torch.randn(ref.shape, generator=g, dtype=F64)
        if k == "state_cache":
            keep = torch.ones(x.shape[0], dtype=torch.bool)
            keep[p.state_indices.long()] = False
            x[keep] = ref[keep]
            x[keep.nonzero()[:1, 0]] = 0.0                     # an unwritten (NaN) slot changed
        x = x.to(dtypes[k])
        if plant == "nan" and k == "o":
            x.view(-1)[7] = float("nan")
        if plant == "zeros" and k == "o":
            x.view(-1)[: int(0.6 * x.numel())] = 0
        outs[k] = x
    return outs


def _cell(state, seed=3, **over):
    """A fresh GVA varlen problem, its references (a paged problem's with a final_state too: the
    written slots as [N, HV, K, V]) and outputs near them."""
    p = generate(dict(GVA, state=state, **over), seed=seed)
    refs = truth(p).tensors()
    if state == "paged":
        refs["final_state"] = refs["state_cache"][p.state_indices.long()].transpose(-1, -2).contiguous()
    return p, refs


def _exactly(a, b, path="", rel=0.0):
    """a == b, NaN equal to NaN, the same types all the way down (floats within ``rel`` of each
    other when it is given)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _exactly(a[k], b[k], f"{path}.{k}", rel)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (u, v) in enumerate(zip(a, b)):
            _exactly(u, v, f"{path}[{i}]", rel)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), (path, a, b)
    elif isinstance(a, float) and rel:
        assert a == b or abs(a - b) <= rel * max(abs(a), abs(b)), (path, a, b)
    else:
        assert a == b, (path, a, b)


# ----------------------------------------------------------------------------- one read per cell
def test_a_cell_of_o_final_state_and_a_paged_cache_reads_the_device_once(monkeypatch):
    p, refs = _cell("paged")
    outs = _outputs(p, refs)
    assert set(refs) == {"o", "final_state", "state_cache"}
    reads = []
    for _ in range(3):                          # the cells of one case: the same Problem
        with counting(monkeypatch) as c:
            got = compare(outs, refs, p)
        assert c.blocking == [], c.blocking
        reads.append(c.reads)
    # the first cell also reads the problem's cu_seqlens (the sequence bounds, kept per tensor)
    assert reads == [["tolist", "tolist"], ["tolist"], ["tolist"]], reads
    assert got["state_cache"]["untouched_changed"] == 32 * 32 * 4 and "slices" in got["state_cache"]


def test_a_dense_problem_reads_once_from_the_first_cell(monkeypatch):
    p = generate(dict(B=2, T=37, H=2, HV=4, K=32, V=32, lb=-1.0, state="kv"), seed=4)
    refs = truth(p).tensors()
    outs = _outputs(p, refs)
    for _ in range(2):
        with counting(monkeypatch) as c:
            compare(outs, refs, p)
        assert (c.reads, c.blocking) == (["tolist"], [])


@pytest.mark.parametrize("state", ["paged", "kv"])
def test_judge_reads_once_per_cell(monkeypatch, state):
    p = generate(dict(GVA, state=state), seed=5)
    tr = truth(p)
    base = baseline_metrics(p, "flashkda", tr)          # measures through compare: the bounds are read there
    db, route = load_tolerances(), Route(name="flashkda", recipe="flashkda")
    out = emulate(p, "flashkda")
    with counting(monkeypatch) as c:
        v = judge("some-kernel", route, p, out, tr, base, db)
    assert v.status == "pass", v.reason
    assert set(v.metrics) == set(tr.tensors()) and all("slices" in m for m in v.metrics.values())
    assert (c.reads, c.blocking) == (["tolist"], [])


def test_judge_still_fails_a_misshapen_tensor_alone(monkeypatch):
    p = generate(dict(GVA, state="kv"), seed=5)
    tr = truth(p)
    base = baseline_metrics(p, "flashkda", tr)
    good = emulate(p, "flashkda")
    bad = Outputs(o=good.o, final_state=good.final_state[:, :2])
    with counting(monkeypatch) as c:
        v = judge("some-kernel", Route(name="flashkda", recipe="flashkda"), p, bad, tr, base, load_tolerances())
    assert c.reads == ["tolist"]
    assert v.status == "fail" and v.reason.startswith("final_state: expected shape [4, 4, 32, 32]")
    assert v.tensors["final_state"]["metric"] == "shape" and v.metrics["final_state"]["missing"]
    assert v.tensors["o"]["margin"] <= 1 and "slices" in v.metrics["o"]
    with pytest.raises(ValueError, match=r"final_state: expected shape \[4, 4, 32, 32\]"):
        compare(bad.tensors(), tr.tensors(), p)


# ----------------------------------------------------------------------------- the same numbers
CELLS = [("kv", 0, None, {}), ("paged", 1, None, {}), ("paged", 2, "nan", {"state_cache": torch.bfloat16}),
         ("kv", 3, "zeros", {"final_state": torch.bfloat16}), ("vk", 4, None, {"o": torch.float16}),
         ("kv", 5, None, {"o": torch.float32})]


@pytest.mark.parametrize("state,seed,plant,dtypes", CELLS, ids=lambda v: str(v))
def test_the_metrics_are_exactly_the_ones_before(state, seed, plant, dtypes):
    p, refs = _cell(state, seed=seed)
    outs = _outputs(p, refs, seed=seed, plant=plant, dtypes=dtypes)
    for chunk in (16, 32):
        _exactly(before_compare(outs, refs, p, chunk=chunk), compare(outs, refs, p, chunk=chunk), f"chunk={chunk}")
    for name, ref in refs.items():
        for rows in (1, 7, None):
            _exactly(before_tensor_metrics(outs[name], ref, problem=p, tensor=name, rows_per_block=rows),
                     tensor_metrics(outs[name], ref, problem=p, tensor=name, rows_per_block=rows), f"{name}/{rows}")
    got = compare(outs, refs, p)
    if plant == "nan":
        assert math.isnan(got["o"]["rel_l2"]) and "slices" not in got["o"]
    if state == "paged":
        assert got["state_cache"]["untouched_changed"] > 0


def test_empty_and_problem_free_tensors_are_exactly_the_ones_before():
    g = torch.Generator().manual_seed(6)
    r = torch.randn(3, 4, 5, 6, dtype=F64, generator=g)
    for x, ref, tensor in [(torch.zeros(0), torch.zeros(0, dtype=F64), "ws_inv"),
                           (torch.zeros(1, 0, 5, 6), torch.zeros(1, 0, 5, 6, dtype=F64), "o"),
                           (r.bfloat16(), r, "o"), (r.float(), r, "final_state"), (r[0, 0].half(), r[0, 0], "ws_inv")]:
        for rows in (1, None):
            _exactly(before_tensor_metrics(x, ref, tensor=tensor, rows_per_block=rows),
                     tensor_metrics(x, ref, tensor=tensor, rows_per_block=rows), f"{tensor} {list(x.shape)}")


def test_the_kept_sequence_bounds_follow_an_in_place_change_of_cu_seqlens():
    p, refs = _cell("kv", seed=7)
    outs = _outputs(p, refs, seed=7)
    first = compare(outs, refs, p)
    p.cu_seqlens.copy_(torch.tensor([0, 40, 45, 45, 116]))               # lens [40, 5, 0, 71]: same T
    again = compare(outs, refs, p)
    _exactly(before_compare(outs, refs, p), again)
    assert again["o"]["slices"]["seq_block"]["labels"][:3] == [[0, 0, 15], [0, 16, 39], [1, 0, 4]]
    assert first["o"]["slices"]["seq_block"]["labels"][0] == [0, 0, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("state,seed,plant,dtypes", CELLS[:4], ids=lambda v: str(v))
def test_on_a_gpu_the_metrics_are_exactly_the_ones_before(state, seed, plant, dtypes):
    """The same on CUDA tensors, where the non-blocking copies and the one read really run.  Equal
    to 1e-12 relative, not bit for bit: CUDA's index_add_ (the per-chunk and per-slice sums, in the
    code before as after) adds with atomics in no fixed order, so two float64 sums of the same
    terms differ in their last bits (measured on the H200: 2 ulp, e.g. 1.8297225634104095e-06 vs
    1.82972256341041e-06).  Counts, shapes, NaN and every label are still exact."""
    p, refs = _cell(state, seed=seed)
    outs = _outputs(p, refs, seed=seed, plant=plant, dtypes=dtypes)
    pc = p.to("cuda")
    refs_c = {k: v.cuda() for k, v in refs.items()}
    outs_c = {k: v.cuda() for k, v in outs.items()}
    _exactly(before_compare(outs_c, refs_c, pc), compare(outs_c, refs_c, pc), "cuda", rel=1e-12)
