"""Autotuner pinning (kda_kernels._autotune_pin) and its use by the fla adapter, on the CPU.

Part 1 runs Triton's own Autotuner and Heuristics classes around a recording stand-in for the
compiled kernel: the rule's choice, pinned during the call, restored after it (also when the
call raises), heuristics wrappers, refusals.  Part 2 is a dry run of the real fla-core 0.6.0:
its Python code runs every route of the adapter on CPU tensors while compiled launches are
replaced by a recorder, so every autotuned kernel that the adapter's calls reach is seen with
the configs it holds at launch (outputs are garbage and never looked at).

Triton is imported inside the tests, never at collection: the interpreter test modules collected
after this one need Triton's first import to happen with TRITON_INTERPRET=1 set.  And fla cannot
be imported into a process whose Triton was first imported that way (its Gluon backend asserts
compiled functions), so part 2 runs in a fresh pytest process (test_fla_dry_runs_in_a_fresh_process)
and skips in this one.
"""
import importlib.util
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kda_kernels import _autotune_pin as pin
from kda_kernels import fla as fla_mod
from kda_kernels.base import Route
from kda_ref.problems import generate


def _tt():
    """Triton's classes, imported when a test runs (see the module docstring)."""
    import triton
    from triton.runtime.autotuner import Autotuner, Heuristics
    return types.SimpleNamespace(Config=triton.Config, Autotuner=Autotuner, Heuristics=Heuristics)


# ----- part 1: the helper on Triton's classes ----------------------------------------------------
class FakeJit:
    """Stands in for a JITFunction: records the meta-parameters of each launch."""

    def __init__(self):
        self.launches = []

        def kernel(x, BLOCK):
            pass
        self.fn = kernel
        self.arg_names = ["x", "BLOCK"]

    def run(self, *args, grid=None, warmup=False, **kwargs):
        self.launches.append(kwargs)


def make_tuner(configs, prune=None):
    jit = FakeJit()
    tuner = _tt().Autotuner(jit, jit.arg_names, configs, key=["x"], reset_to_zero=None, restore_value=None,
                      prune_configs_by={"early_config_prune": prune} if prune else None)
    return tuner, jit


@pytest.fixture
def CFGS():
    Config = _tt().Config
    return [Config({"BLOCK": 64}, num_warps=8, num_stages=2),
            Config({"BLOCK": 128}, num_warps=4, num_stages=2),
            Config({"BLOCK": 32}, num_warps=4, num_stages=3),
            Config({"BLOCK": 64}, num_warps=4, num_stages=2),
            Config({"BLOCK": 16}, num_warps=2, num_stages=1)]


def test_rule_prefers_four_warps_then_fewest_stages_then_smallest_tiles(CFGS):
    assert pin.choose_config(CFGS) is CFGS[3]        # w4 s2 BLOCK 64 beats w4 s2 128 and w4 s3 32
    no_four = [c for c in CFGS if c.num_warps != 4]
    assert pin.choose_config(no_four) is CFGS[4]     # no 4-warp config: the fewest warps
    twins = [_tt().Config({"BK": 32, "BV": 64}, num_warps=4, num_stages=2),
             _tt().Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2)]
    assert pin.choose_config(twins) is twins[1]      # tiles compared in sorted-name order: BK, then BV
    same = [_tt().Config({}, num_warps=4), _tt().Config({}, num_warps=4)]
    assert pin.choose_config(same) is same[0]        # then the library's order
    assert pin.describe(CFGS[3]) == "BLOCK=64 warps=4 stages=2"
    with pytest.raises(ValueError, match="configs: expected at least one"):
        pin.choose_config([])


def _aiter_lists():
    """aiter 2026-08's K2 lists (its global autotune flag off, then on) and K1's list (flag on)."""
    Config = _tt().Config
    off = [Config({"BW": 16}, num_warps=2, num_stages=2), Config({"BW": 32}, num_warps=2, num_stages=2),
           Config({"BW": 64}, num_warps=4, num_stages=2)]
    on = [Config({"BW": bw}, num_warps=nw, num_stages=ns) for bw in (16, 32, 64) for nw in (2, 4) for ns in (1, 2)]
    k1 = [Config({}, num_warps=nw, num_stages=ns) for nw in (2, 4) for ns in (1, 2)]
    return off, on, k1


def test_first_matching_keeps_the_librarys_order():
    off, on, k1 = _aiter_lists()
    rule = pin.first_matching(BW=32)
    assert pin.choose_config(off, rule) is off[1]     # BW=32, 2 warps ...
    assert pin.choose_config(off) is off[2]           # ... where the default rule takes BW=64, 4 warps
    assert pin.choose_config(on, rule) is on[4]       # the first BW=32 in order (2 warps, 1 stage),
    assert pin.choose_config(on) is on[2]             # not BW=16 with 4 warps, as the default rule takes
    assert pin.choose_config(k1, rule) is k1[0]       # no BW meta-parameter at all: the library's first
    assert pin.choose_config(k1) is k1[2]
    no_match = [_tt().Config({"BW": 64}), _tt().Config({"BW": 16})]
    assert pin.choose_config(no_match, rule) is no_match[0]
    both = [_tt().Config({"BW": 32, "BK": 32}), _tt().Config({"BW": 64, "BK": 64}),
            _tt().Config({"BW": 32, "BK": 64})]
    assert pin.choose_config(both, pin.first_matching(BW=32, BK=64)) is both[2]   # every name must match
    with pytest.raises(ValueError, match=r"meta: expected at least one meta-parameter to match"):
        pin.first_matching()


def test_pinned_applies_the_rule_it_is_given(CFGS):
    tuner, jit = make_tuner(list(CFGS))
    own = tuner.configs
    with pin.pinned({"k": tuner}, rule=pin.first_matching(BLOCK=64)) as record:
        assert tuner.configs == [CFGS[0]]               # the first BLOCK=64, with its 8 warps
        tuner.run(1, grid=(1,), warmup=False)
    assert tuner.configs is own
    assert record == {"k": {"config": "BLOCK=64 warps=8 stages=2", "of": 5, "launches": 1}}
    assert jit.launches[0]["BLOCK"] == 64 and jit.launches[0]["num_warps"] == 8


def test_pinned_during_the_call_and_restored_after(CFGS):
    tuner, jit = make_tuner(list(CFGS))
    own = tuner.configs
    with pin.pinned({"k": tuner}) as record:
        assert tuner.configs == [CFGS[3]]
        tuner.run(1, grid=(1,), warmup=False)       # one config: launched directly, no benchmark
        tuner.run(2, grid=(1,), warmup=False)
    assert tuner.configs is own and len(own) == len(CFGS)
    assert [launch["BLOCK"] for launch in jit.launches] == [64, 64]
    assert all(launch["num_warps"] == 4 and launch["num_stages"] == 2 for launch in jit.launches)
    assert record == {"k": {"config": "BLOCK=64 warps=4 stages=2", "of": 5, "launches": 2}}
    Autotuner = _tt().Autotuner
    assert "run" in Autotuner.__dict__ and Autotuner.run is Autotuner.__dict__["run"]
    assert inspect.getsourcefile(Autotuner.run).endswith("autotuner.py")   # Triton's own run is back


def test_the_choice_is_made_once_per_list_and_rule(CFGS, monkeypatch):
    """A 10^4-step serving trace pins every fla autotuner on each decode call: the rule runs once
    per (config list, rule), not once per call; a new list (a library that rebuilt it) or another
    rule is chosen again, and the choice is the rule's."""
    tuner, _ = make_tuner(list(CFGS))
    keys = []
    rule = lambda i, c: (keys.append(i), pin.rule_key(i, c))[1]   # noqa: E731
    for _ in range(3):
        with pin.pinned({"k": tuner}, rule=rule) as record:
            assert tuner.configs == [CFGS[3]]
    assert len(keys) == len(CFGS) and record["k"]["config"] == "BLOCK=64 warps=4 stages=2"
    tuner.configs = list(CFGS[:3])                                 # a new list: chosen again
    with pin.pinned({"k": tuner}, rule=rule):
        assert tuner.configs == [CFGS[1]]
    assert len(keys) == len(CFGS) + 3
    with pin.pinned({"k": tuner}, rule=pin.first_matching(BLOCK=32)):
        assert tuner.configs == [CFGS[2]]


def test_restored_when_the_call_raises(CFGS):
    tuner, _ = make_tuner(list(CFGS))
    Autotuner = _tt().Autotuner
    own, run = tuner.configs, Autotuner.run
    with pytest.raises(ZeroDivisionError):
        with pin.pinned({"k": tuner}):
            assert len(tuner.configs) == 1
            1 / 0
    assert tuner.configs is own and Autotuner.run is run


def test_heuristics_wrapper_is_looked_through(CFGS):
    tuner, jit = make_tuner(list(CFGS))
    Heuristics = _tt().Heuristics
    wrapped = Heuristics(Heuristics(tuner, jit.arg_names, {"EXTRA": lambda a: 7}), jit.arg_names, {})
    assert pin.find_autotuner(wrapped) is tuner
    with pin.pinned({"k": wrapped}) as record:
        assert tuner.configs == [CFGS[3]]
        wrapped[(1,)](0)
    assert tuner.configs is not None and len(tuner.configs) == len(CFGS)
    assert record["k"]["launches"] == 1 and jit.launches[0]["BLOCK"] == 64


def test_an_unpinned_autotuner_raises_instead_of_benchmarking(CFGS):
    pinned_one, _ = make_tuner(list(CFGS))
    stray, jit = make_tuner(list(CFGS))
    single, single_jit = make_tuner([CFGS[0]])
    with pin.pinned({"k": pinned_one}, context="fla route x"):
        with pytest.raises(pin.UnpinnedAutotuneError, match=r"kernel would autotune among 5 configs in fla route x"):
            stray.run(0, grid=(1,), warmup=False)
        single.run(0, grid=(1,), warmup=False)       # one config of its own: nothing to tune, allowed
    assert jit.launches == [] and len(single_jit.launches) == 1


def test_refusals_name_the_kernel(CFGS):
    pruning, _ = make_tuner(list(CFGS), prune=lambda configs, nargs, **kw: configs[:1])
    with pytest.raises(ValueError, match=r"kernels: 'p' prunes its configs per launch"):
        with pin.pinned({"p": pruning}):
            pass
    assert len(pruning.configs) == len(CFGS)
    with pytest.raises(ValueError, match=r"kernels: 'plain' is no autotuned kernel"):
        with pin.pinned({"plain": FakeJit()}):
            pass


def test_a_class_without_its_own_run_gets_its_inherited_run_back():
    class Base:
        def run(self, *args, **kwargs):
            return "base"

    class Tuner(Base):
        def __init__(self):
            self.configs = [_tt().Config({}, num_warps=8), _tt().Config({}, num_warps=4)]

    t = Tuner()
    with pin.pinned({"t": t}, autotuner_class=Tuner) as record:
        assert t.run() == "base" and "run" in Tuner.__dict__
    assert "run" not in Tuner.__dict__ and record["t"]["launches"] == 1 and len(t.configs) == 2


# ----- part 2: the real fla-core, dry run --------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
CHILD = os.environ.get("KDA_FLA_DRY_RUN_CHILD") == "1"
needs_fla = pytest.mark.skipif(not CHILD, reason="runs in a fresh process (test_fla_dry_runs_in_a_fresh_process)")


@pytest.mark.slow
def test_fla_dry_runs_in_a_fresh_process():
    """Part 2 (the tests named test_fla_dry_run_*) in a child pytest process; its failures are ours."""
    if CHILD:
        pytest.skip("this is the child process")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed")
    env = dict(os.environ, KDA_FLA_DRY_RUN_CHILD="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "fla_dry_run_",
                           str(Path(__file__))], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def _problem(lens=(40, 30), H=2, K=64, V=64, gate="lower_bound", beta_kind="sigmoid", l2=True, layout="kv"):
    """The generator's varlen problem with g = N(0,1) (pregated: -|N(0,1)|) and an N(0,1) state."""
    return generate(dict(lens=list(lens), H=H, K=K, V=V, gate=gate, beta_kind=beta_kind, qk_l2norm=l2, lb=-1.0,
                         g_scale=1.0, state=layout, state_scale=1.0), seed=0)


PROBLEMS = {
    "lower_bound": _problem(),
    "softplus-vk-sigmoid2": _problem(gate="softplus", beta_kind="sigmoid2", layout="vk"),
    "pregated-no-l2norm": _problem(gate="pregated", beta_kind="pregated", l2=False),
}


@pytest.fixture
def dry_run(monkeypatch):
    """Compiled launches recorded, not run; every autotuned launch recorded with its config count."""
    from triton.runtime.jit import JITFunction
    Autotuner = _tt().Autotuner
    fla_mod.autotuned_kernels()                  # fla imported, so its autotuners can be listed before a call
    seen = []
    triton_run = Autotuner.run

    def recording_run(self, *args, **kwargs):
        seen.append((self.base_fn.__name__, len(self.configs)))
        return triton_run(self, *args, **kwargs)
    monkeypatch.setattr(Autotuner, "run", recording_run)
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: None)
    return seen


def _all_fla_autotuners():
    """Every Autotuner in the fla modules imported now, by kernel name (heuristics looked through)."""
    import sys
    found = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] != "fla" or mod is None:
            continue
        for obj in list(vars(mod).values()):
            tuner = pin.find_autotuner(obj)
            if isinstance(tuner, _tt().Autotuner):
                found[tuner.base_fn.__name__ + "@" + tuner.base_fn.__module__] = tuner
    return found


@needs_fla
@pytest.mark.parametrize("case", sorted(PROBLEMS))
@pytest.mark.parametrize("route", sorted(fla_mod.CHUNK_ROUTES) + ["fused_recurrent"])
def test_fla_dry_run_every_autotuner_the_adapter_reaches_runs_pinned(dry_run, case, route):
    p = PROBLEMS[case]
    b = fla_mod.FlaBackend()
    ok, why = b.accepts(p, Route(route, recipe="fla"))
    if not ok:
        pytest.skip(why)
    before = {k: len(t.configs) for k, t in _all_fla_autotuners().items()}
    out = b.run(p, Route(route, recipe="fla"))
    assert all(n == 1 for _, n in dry_run), dry_run          # every one held exactly one config at launch
    launched = {name for name, _ in dry_run}
    assert launched <= set(fla_mod.AUTOTUNED) and launched == set(out.info["pinned_configs"])
    assert {k: len(t.configs) for k, t in _all_fla_autotuners().items()} == before   # all lists restored
    if route == "fused_recurrent":
        assert launched == set() and out.info["pinned_configs"] == {}
        return
    assert dry_run, "no autotuned launch seen"
    safe = fla_mod.CHUNK_ROUTES[route]["safe_gate"]
    expect = {"chunk_kda_fwd_kernel_inter_solve_fused", "recompute_w_u_fwd_kda_kernel",
              "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gla_fwd_kernel_o",
              "chunk_kda_fwd_kernel_intra_sub_chunk" if safe else "chunk_kda_fwd_kernel_intra_token_parallel",
              "chunk_local_cumsum_vector_kernel" if p.gate == "pregated" else "kda_gate_chunk_cumsum_vector_kernel"}
    if p.qk_l2norm:
        expect.add("l2norm_fwd_kernel")
    assert launched == expect
    assert "autotuned kernels pinned" in out.info["route_ran"]


@needs_fla
def test_fla_dry_run_the_per_pass_path_runs_pinned(dry_run):
    p = PROBLEMS["lower_bound"]
    b = fla_mod.FlaBackend()
    route = Route("chunk:exact:C=32", recipe="fla")
    assert b.debug_plan(p, route)["passes"] == list(fla_mod.FLA_PASSES)
    T, H, K, V, NT = p.T, p.H, p.K, p.V, 4
    feed = {"g_cumsum": torch.zeros(1, T, H, K), "kg": torch.zeros(1, T, H, K), "w": torch.zeros(1, T, H, K),
            "u": torch.zeros(1, T, H, V), "v_new": torch.zeros(1, T, H, V), "Aqk": torch.zeros(1, T, H, 32),
            "h": torch.zeros(1, NT, H, K, V)}
    want = {"gate": {"kda_gate_chunk_cumsum_vector_kernel"},
            "intra": {"chunk_kda_fwd_kernel_intra_token_parallel", "chunk_kda_fwd_kernel_inter_solve_fused",
                      "recompute_w_u_fwd_kda_kernel"},
            "h": {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64"},
            "o": {"chunk_gla_fwd_kernel_o"}}
    for name in fla_mod.FLA_PASSES:
        dry_run.clear()
        b.run_pass(p, route, name, feed)
        assert dry_run and all(n == 1 for _, n in dry_run), (name, dry_run)
        assert {k for k, _ in dry_run} == want[name] == set(b.last_pinned), name


@needs_fla
def test_fla_dry_run_the_pinned_configs_are_the_rule_applied_to_flas_own_lists():
    kernels = fla_mod.autotuned_kernels()
    assert set(kernels) == set(fla_mod.AUTOTUNED)
    for name, kernel in kernels.items():
        tuner = pin.find_autotuner(kernel)
        assert isinstance(tuner, _tt().Autotuner) and tuner.early_config_prune is None, name
        assert len(tuner.configs) > 1, name           # every one of them would autotune unpinned
    with fla_mod.pinned_autotuners() as record:
        for name, kernel in kernels.items():
            tuner = pin.find_autotuner(kernel)
            assert len(tuner.configs) == 1 and record[name]["config"] == pin.describe(tuner.configs[0])
            assert tuner.configs[0].num_warps == 4, name   # every list on the path offers 4 warps
    # on this machine's lists (fla builds some from the device's shared memory at import)
    assert record["chunk_gla_fwd_kernel_o"]["config"] == "BK=32 BV=64 warps=4 stages=2"
    assert record["chunk_kda_fwd_kernel_inter_solve_fused"]["config"] == "BK=32 warps=4 stages=3"


@needs_fla
def test_fla_dry_run_a_missing_fla_kernel_is_named(monkeypatch):
    monkeypatch.setitem(fla_mod.AUTOTUNED, "gone", ("fla.ops.kda.gate", "no_such_kernel"))
    with pytest.raises(RuntimeError, match="fla-core layout changed: fla.ops.kda.gate has no no_such_kernel"):
        fla_mod.autotuned_kernels()
