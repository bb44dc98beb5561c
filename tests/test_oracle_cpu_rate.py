"""What the streamed truth's speed rests on, checked without timing anything: its lone-sequence
steps (written into reused block buffers) agree with the whole-problem chunked form, the buffers
are allocated once and not per block, and the fast paths of validation and preprocessing give
the same answers as the plain ones."""
import pytest
import torch

import kda_ref.chunked as ch
from kda_ref import truth
from kda_ref.preprocess import gate_activation, l2norm, prepare
from kda_ref.problem import ProblemError, _finite, validate
from kda_ref.problems import generate
from kda_ref.workspace import BlockBuffers
from verification.commands.oracle_bench import make_problem
from verification.investigating.selfcheck import rel

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

TOL = 1e-13


def _problem(T=640, H=2, K=32, V=32, seed=0):
    return make_problem(1, T, H, K, V, torch.device("cpu"), seed=seed)


def _agree(a, b):
    return max(rel(a.o, b.o), rel(a.final_state, b.final_state))


@pytest.mark.parametrize("C", [16, 32, 64])
def test_lone_sequence_blocks_match_the_chunked_form(C):
    p = _problem()
    ref = truth(p, method="chunked", chunk_size=C)
    for bt in (C, 3 * C, 640, None):
        assert _agree(truth(p, chunk_size=C, block_tokens=bt), ref) <= TOL, (C, bt)


def test_varlen_gva_blocks_match_the_chunked_form():
    """Blocks that hold several sequences (and pieces of them) take the general path."""
    p = generate(dict(lens=[5, 195, 0, 317, 183], H=1, HV=4, K=32, V=32, g_scale=1.0, state="kv", state_scale=1.0,
                      dtype=torch.float32), seed=2)
    ref = truth(p, method="chunked")
    for bt in (64, 256, None):
        assert _agree(truth(p, block_tokens=bt), ref) <= TOL, bt


def test_a_wrong_lone_sequence_step_is_caught(monkeypatch):
    p = _problem()
    ref = truth(p, method="chunked")
    real = ch._one_sequence_steps

    def off(*args, **kwargs):
        return real(*args, **kwargs) * (1 + 1e-9)

    monkeypatch.setattr(ch, "_one_sequence_steps", off)
    assert _agree(truth(p, block_tokens=128), ref) > 1e-11


def test_block_buffers_are_allocated_once_not_per_block(monkeypatch):
    """Every block of one shape reuses the arrays of the first: after the first block no new
    array is made until the last (shorter) block."""
    p = _problem(T=64 * 7 + 10)
    made = []
    real_get = BlockBuffers.get

    def counting_get(self, name, shape):
        before = self.arrays.get(name)
        x = real_get(self, name, shape)
        made.append(self.arrays[name] is not before)      # a new array kept (a view of the kept one is not)
        return x

    seen_blocks = []
    real_prep = ch.prepare_tokens

    def spy(p_, t0, t1, S0, buffers=None):
        seen_blocks.append(len(made))
        return real_prep(p_, t0, t1, S0, buffers)

    monkeypatch.setattr(BlockBuffers, "get", counting_get)
    monkeypatch.setattr(ch, "prepare_tokens", spy)
    ch.streamed(p, 64, block_tokens=128)
    assert len(seen_blocks) == 4                      # 128, 128, 128, 74 tokens
    first, last = seen_blocks[1], seen_blocks[3]
    assert any(made[:first]) and not any(made[first:last])


def test_block_buffers_share_one_array_under_one_name_whatever_the_shape():
    buf = BlockBuffers()
    a = buf.get("x", (2, 3))
    b = buf.get("x", (3, 2))                          # as many elements: a view of the same array
    assert b.shape == (3, 2) and b.data_ptr() == a.data_ptr() and buf.bytes() == 6 * 8
    c = buf.get("x", (4,))                            # other size: a new array under that name
    assert c.shape == (4,) and buf.bytes() == 4 * 8 and buf.arrays["x"] is c


def test_prepare_tokens_outside_a_streamed_run_returns_its_own_arrays():
    p = validate(_problem(T=128))
    a = ch.prepare_tokens(p, 0, 64, None)
    b = ch.prepare_tokens(p, 64, 128, None)
    assert a.q.data_ptr() != b.q.data_ptr() and a.v.data_ptr() != b.v.data_ptr()
    whole = prepare(p)
    for name in ("q", "k", "v", "a", "beta"):
        assert torch.equal(getattr(a, name), getattr(whole, name)[:64]), name


def test_finite_check_fast_path_still_names_every_bad_value():
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.randn(1000).to(dt)
        _finite("x", x)
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[7] = bad
            want = r"x: expected finite values, got 1 NaN/Inf \(first at index \(7,\)\)"
            with pytest.raises(ProblemError, match=want):
                _finite("x", y)
    _finite("h", torch.full((100,), 60000.0, dtype=torch.float16))   # the sum overflows, every value is finite
    _finite("e", torch.empty(0))
    y = torch.ones(4, 4)
    y[1, 2], y[3, 0] = float("inf"), -float("inf")                    # infinities of both signs: the sum is NaN
    with pytest.raises(ProblemError, match=r"got 2 NaN/Inf \(first at index \(1, 2\)\)"):
        _finite("y", y)


@pytest.mark.parametrize("kind", ["lower_bound", "softplus", "pregated"])
def test_in_place_preprocessing_equals_the_plain_one_and_spares_the_callers_tensor(kind):
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(50, 2, 16, dtype=torch.float64, generator=g)
    if kind == "pregated":
        raw = -raw.abs()
    A, dt = torch.rand(2, generator=g), torch.randn(32, generator=g)
    keep = raw.clone()
    plain = gate_activation(raw, kind, A, dt, -5.0)
    assert torch.equal(raw, keep)                                      # not written into
    mine = raw.clone()
    assert torch.equal(gate_activation(mine, kind, A, dt, -5.0, inplace=True), plain)
    x = torch.randn(50, 2, 16, dtype=torch.float64, generator=g)
    ref = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.equal(l2norm(x), ref)
    assert torch.equal(l2norm(x.clone(), inplace=True, tmp=torch.empty_like(x)), ref)


def test_a_block_of_other_shapes_starts_from_empty_buffers(monkeypatch):
    """The arrays of the previous shapes are dropped before a block of other shapes is built, so a
    run never holds two blocks' working sets at once."""
    p = _problem(T=64 * 7 + 10)
    held = []
    real_prep = ch.prepare_tokens

    def spy(p_, t0, t1, S0, buffers=None):
        held.append(sum(x.numel() for x in buffers.arrays.values()))
        return real_prep(p_, t0, t1, S0, buffers)

    monkeypatch.setattr(ch, "prepare_tokens", spy)
    ch.streamed(p, 64, block_tokens=128)
    assert held[0] == 0 and held[1] == held[2] > 0 and held[3] == 0


def test_outputs_after_the_loop_equal_the_outputs_in_it(monkeypatch):
    """The lone-sequence outputs taken in the loop (the CPU's choice) and after it from the kept
    states and deltas (CUDA's) agree, and both agree with the whole-problem chunked form."""
    p = _problem(T=64 * 5 + 23)                         # the last tile partial
    ref = truth(p, method="chunked")
    assert ch.outputs_in_loop(torch.device("cpu")) and not ch.outputs_in_loop(torch.device("cuda"))
    in_loop = truth(p, block_tokens=128)
    monkeypatch.setattr(ch, "outputs_in_loop", lambda device: False)
    after = truth(p, block_tokens=128)
    assert _agree(in_loop, after) <= TOL and _agree(in_loop, ref) <= TOL and _agree(after, ref) <= TOL
