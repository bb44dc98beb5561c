"""aiter's FlashKDA one pass at a time (AiterBackend.debug_plan / run_pass) in Triton's CPU
interpreter, against the float64 oracle through the per-pass debugger.

aiter is never part of this repository: the module skips unless a copy of its ``aiter/`` tree
lies in ``.vendor/``.  aiter asks the active GPU for its arch when imported; without a GPU the
import gets a stand-in ``arch_info`` (gfx942, no Gluon), a stand-in Triton driver reporting
that target and a ``get_device_properties`` that raises RuntimeError (what aiter expects when
there is no device), for the import only.  The interpreter gets the project's fixes
(kda_kernels.triton._interpreter_compat: loop bounds, bf16 dots, bf16 rounding).  Everything is put back afterwards, aiter's modules
included, so later test modules see the machine as it is.  Like every interpreter test, this
module skips on a GPU machine (Triton's interpreter would break compiled kernels there).

Thresholds are the debugger's row thresholds (verification.debug.THRESHOLDS).
"""
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

VENDOR = Path(__file__).resolve().parents[1] / ".vendor"
FLASH_KDA = "aiter.ops.triton._triton_kernels.chunk_delta_attn.flash_kda"

if not (VENDOR / "aiter").is_dir():
    pytest.skip(f"no copy of aiter's source in {VENDOR} (it is never committed)", allow_module_level=True)
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter tests run on machines without a GPU (or with TRITON_INTERPRET=1)",
                allow_module_level=True)

from kda_kernels.aiter import AiterBackend  # noqa: E402
from kda_kernels.base import Route  # noqa: E402
from kda_ref.problems import generate  # noqa: E402
from verification.debug import debug_passes, format_reports  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)  # inf in the masked upper triangle


def _arch_stub() -> types.ModuleType:
    m = types.ModuleType("aiter.ops.triton.utils._triton.arch_info")
    m.get_arch = lambda: "gfx942"
    for name in ("is_gluon_avail", "is_fp4_avail", "is_mx_scale_preshuffling_avail", "is_tdm_avail"):
        setattr(m, name, lambda: False)
    m.is_fp8_avail = lambda: True
    m._LDS_CAP_BYTES = {"gfx942": 65536}
    return m


class _TargetOnlyDriver:
    """Answers aiter's import-time target queries; launches go through the interpreter."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("hip", "gfx942", 64)

    def get_current_device(self):
        return 0


def _no_device(*args, **kwargs):
    raise RuntimeError("no GPU on this machine")


@pytest.fixture(scope="module")
def flash_kda():
    saved_env = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "AITER_TRITON_ONLY")}
    saved_modules = set(sys.modules)

    def restore():
        if str(VENDOR) in sys.path:
            sys.path.remove(str(VENDOR))
        for name in set(sys.modules) - saved_modules:
            if name == "aiter" or name.startswith("aiter."):
                del sys.modules[name]
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    # before Triton's first import: triton.language's own functions are built as interpreted ones
    os.environ.update(TRITON_INTERPRET="1", AITER_TRITON_ONLY="1")
    import triton.language as tl
    from triton.runtime.driver import driver
    if type(tl.standard.sum).__name__ != "InterpretedFunction":
        restore()
        pytest.skip("Triton was imported in this process before TRITON_INTERPRET=1 was set, so its own "
                    "functions are compiled ones; run this module in a fresh process")

    from kda_kernels.triton._interpreter_compat import install
    install()   # loop bounds from loaded scalars, bf16 dots and round-to-nearest bf16 casts, as on a GPU
    saved_props, saved_driver = torch.cuda.get_device_properties, driver._active
    sys.path.insert(0, str(VENDOR))
    sys.modules["aiter.ops.triton.utils._triton.arch_info"] = _arch_stub()
    torch.cuda.get_device_properties, driver._active = _no_device, _TargetOnlyDriver()
    try:
        import importlib
        mod = importlib.import_module(FLASH_KDA)
    except Exception:
        restore()
        raise
    finally:
        torch.cuda.get_device_properties, driver._active = saved_props, saved_driver
    yield mod
    restore()


def make(lens=None, B=1, T=0, H=1, lb=-1.0, state=None, seed=0):
    """A bf16 problem, K = V = 128 (the generator's): varlen (B = 1) when ``lens`` is given, else B x T."""
    sizes = dict(lens=list(lens)) if lens is not None else dict(B=B, T=T)
    return generate(dict(sizes, H=H, lb=lb, state=state or "none"), seed=seed)


def route(name):
    return Route(name, recipe="flashkda")


def test_debug_plan_resolves_segments_as_aiter_does(flash_kda, monkeypatch):
    b = AiterBackend(module=flash_kda)
    p = make([40, 0, 70])                      # 2 and 3 chunks
    assert b.debug_plan(p, route("triton:seg:cps=1")) == dict(
        form="flashkda", chunk_size=32, chunks_per_seg=1, passes=["K1", "A", "B", "C"])
    assert b.debug_plan(p, route("triton:seg:cps=2"))["passes"] == ["K1", "A", "B", "C"]
    # every sequence fits one segment of 4 chunks: aiter runs pass C alone
    assert b.debug_plan(p, route("triton:seg:cps=4")) == dict(
        form="flashkda", chunk_size=32, chunks_per_seg=None, passes=["K1", "C"])
    assert b.debug_plan(p, route("triton:unseg"))["passes"] == ["K1", "C"]
    # the heuristic route asks aiter's _choose_chunks_per_seg; it needs the CU count
    monkeypatch.setattr(flash_kda, "_num_cus", lambda device_index=0: 256)
    monkeypatch.setenv("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", "1")   # ignored, as run() ignores it
    assert b.debug_plan(p, route("triton:seg"))["passes"] == ["K1", "C"]   # 3 chunks: too shallow
    assert os.environ["CHUNK_DELTA_ATTN_FLASH_KDA_SEG"] == "1"


def test_run_pass_refuses_what_it_cannot_run(flash_kda):
    b = AiterBackend(module=flash_kda)
    p = make([40, 70])
    with pytest.raises(ValueError, match="--pass: expected one of K1|A|B|C, got 'D'"):
        b.run_pass(p, route("triton:seg:cps=1"), "D", {})
    with pytest.raises(ValueError, match="has no pass A on this problem"):
        b.run_pass(p, route("triton:unseg"), "A", {})
    with pytest.raises(ValueError, match="per-pass runs use aiter's Triton launchers"):
        b.run_pass(p, route("gluon:seg:cps=1"), "K1", {})
    with pytest.raises(ValueError, match="feed: pass B needs A_seg, b_seg"):
        b.run_pass(p, route("triton:seg:cps=1"), "B", {})
    with pytest.raises(ValueError, match="not applicable: FlashKDA needs bf16"):
        b.run_pass(p.replace(q=p.q.float()), route("triton:seg:cps=1"), "K1", {})
    with pytest.raises(ValueError, match=r"feed: ws_kd expected shape \[5, 32, 128\], got \[4, 32, 128\]"):
        b.run_pass(p, route("triton:seg:cps=1"), "C", {n: torch.zeros(4, 32, 128) for n in
                   ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk")})


def test_a_kernel_with_other_arguments_is_refused_before_launch(flash_kda, monkeypatch):
    """Another aiter version's scan (here: one that also wants a paged cache) is named, not mis-bound."""
    class OtherScan:
        arg_names = ["A_seg", "b_seg", "h_in", "h0", "state_cache", "seq_seg_off", "H", "K", "V", "BV", "HAS_H0"]
        values = {"HAS_H0": lambda args: args["h0"] is not None}

        def __getitem__(self, grid):
            raise AssertionError("launched a kernel whose arguments differ")

    monkeypatch.setattr(flash_kda, "_flash_kda_seg_scan_kernel", OtherScan())
    b = AiterBackend(module=flash_kda)
    p = make([40, 70])
    feed = {"A_seg": torch.zeros(5, 1, 128, 128), "b_seg": torch.zeros(5, 1, 128, 128)}
    with pytest.raises(ValueError, match=r"_flash_kda_seg_scan_kernel takes other arguments .*missing \['state_cache'\]"):
        b.run_pass(p, route("triton:seg:cps=1"), "B", feed)


def test_every_pass_within_thresholds_segmented(flash_kda):
    """Two sequences of 2 and 3 chunks at one chunk per segment, a K-first initial state:
    K1's workspace and every pass against the oracle, each pass fed the oracle's inputs."""
    b = AiterBackend(module=flash_kda)
    p = make([40, 70], lb=-0.3, state="kv", seed=3)
    reports = debug_passes(b, p, route("triton:seg:cps=1"))
    text = format_reports(reports)
    assert [x.name for x in reports] == ["K1", "A", "B", "C"], text
    assert [t.name for t in reports[0].tensors] == ["ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk"], text
    assert [t.name for t in reports[1].tensors] == ["A_seg", "b_seg"], text
    assert [t.name for t in reports[3].tensors] == ["o", "final_state"], text
    assert all(x.ok for x in reports), text
    # measured on this case: the bf16 tiles at bf16's rounding, o and the state well under 1e-2
    worst = {t.name: t.max_row_err for x in reports for t in x.tensors}
    assert worst["ws_kd"] < 4e-3 and worst["ws_gt"] < 1e-5 and worst["o"] < 1e-2, text


def test_batched_dense_problem_k1_and_pass_c(flash_kda):
    """B = 2 without cu_seqlens: K1's grid is (NT, B*H) and the tiles of batch b follow those of b-1."""
    b = AiterBackend(module=flash_kda)
    p = make(B=2, T=40, H=2, lb=-2.0, state="kv", seed=9)
    reports = debug_passes(b, p, route("triton:unseg"))
    assert [x.name for x in reports] == ["K1", "C"] and all(x.ok for x in reports), format_reports(reports)


def test_unsegmented_pass_c_starts_from_a_v_first_state(flash_kda):
    """Unsegmented: pass C alone from the Problem's V-first initial state (transposed as aiter does);
    a wrong state fed to C shows as an error in o and the final state."""
    b = AiterBackend(module=flash_kda)
    p = make([33, 20], lb=-0.5, state="vk", seed=5)
    reports = debug_passes(b, p, route("triton:unseg"), ["C"])
    assert reports[0].ok, format_reports(reports)
    wrong = p.replace(initial_state=p.initial_state.transpose(-1, -2).contiguous())
    from verification.debug import compare_tensor, oracle_intermediates
    ref = oracle_intermediates(p, 32, None)
    got = b.run_pass(wrong, route("triton:unseg"), "C", {k: ref["tensors"][k] for k in
                     ("ws_kd", "ws_qd", "ws_kr", "ws_gt", "ws_inv", "ws_mqk")})
    ctx = dict(ref, T=p.T, B=p.B)
    rep = compare_tensor("o", got["o"].reshape(ref["tensors"]["o"].shape), ref["tensors"]["o"], ctx)
    assert not rep.ok and (rep.first_over["seq"], rep.first_over["chunk"], rep.first_over["row"]) == (0, 0, 0)
    assert not compare_tensor("final_state", got["final_state"], ref["tensors"]["final_state"], ctx).ok
