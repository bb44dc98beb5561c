"""The bundle of a shrunk failure: what an upstream bug report needs, in one directory.

    problem.safetensors   the shrunk problem (kda-verify-problem/1, verification.reporting.problem_file)
    truth.safetensors     its float64 oracle outputs (o, final_state or state_cache; ws_inv, the
                          oracle's exact (I - L)^{-1} at the tap's chunk size, when the kernel's was tapped)
    outputs.safetensors   what the kernel returned on it (kda-verify-outputs/1; ws_inv when tapped);
                          absent when the kernel killed its process there (shrink --isolate)
    repro.py              loads the problem, calls the kernel as the adapter does (taps on when a
                          check names ws_inv), compares with the truth, prints the error per tensor,
                          exits 1 when a check fails (REPRODUCED), 0 when every check holds
    REPORT.md             what fails, observed and expected numbers, the shrunk shape, the shrink
                          trace, the environment and the commands that reproduce, relative to the
                          bundle's directory (no absolute path: the bundle can be moved)
    shrink.json           the same as data (the original and final records' verdicts, the trace)

repro.py imports torch and safetensors, and the kernel's own library: ``flash_kda`` (moonshot),
``fla`` (fla), ``aiter`` (aiter); for the project's own backends (emulator, emulator-bad,
triton) it imports ``kda_kernels`` and ``kda_ref``.  Its measures are the verdict's
(verification.judging.metrics, verification.judging.verdict), re-implemented on plain tensors:

    rel_l2       ||x - r|| / ||r||                        (the paged cache: written slots only;
                                                          ws_inv [HV*tiles, C, C]: rows i < Lc of each
                                                          tile, columns j < i, as verification.judging.metrics.inverse_metrics)
    tail_rel_l2  rel_l2 over the last half of every sequence (o); rel_l2 for a state
    slice        sqrt(e2 / max(r2, NEGLIGIBLE^2 * ms * count)), ms = the kind's total r2 / count,
                 over the slice the verdict named (o: (sequence, head), (sequence, 16-token
                 block), a sequence's first 4 tokens; a state: (sequence, head) or (slot, head))

A check is (tensor, measure[, slice], threshold): the failure reproduces when the measure
exceeds the threshold; for a non-finite failure when the tensor holds NaN or Inf; for a
mistrusted one when more than 30% of it is exactly zero where the truth is not negligible
(|r| > 2^-24 max|r|); for the paged cache when a slot the problem does not write changed; for a
kernel that raised, when it raises.  Besides the failure's kinds, every judged tensor is checked
against the verdict itself (its judged metric against the recorded threshold, its worst slice
against that slice's), whether or not it failed when the bundle was made (``failed``): the repro
reproduces when any check fails, so a failure that changes form between processes (a kernel that
leaves memory unwritten: NaN in the state in one process, o wrong in the next) still reproduces,
its last line then naming what fails now and what was recorded, and a kernel that passes does
not.  ``write_bundle`` runs repro.py once in a fresh process from another directory
(``verify_repro``) and records whether it reproduced; REPORT.md states that outcome.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import kda_kernels
from kda_kernels.aiter import KERNEL_SETS, parse_route
from kda_kernels.fla import CHUNK_ROUTES
from kda_ref.workspace import workspace
from verification.investigating.shrink import _f, shape_text, size, underlying_status
from verification.judging.record import encode
from verification.reporting.problem_file import save_outputs, save_problem
from verification.reporting.provenance import device_info, git_info, software_info

OWN_BACKENDS = ("emulator", "emulator-bad", "triton")
CHECKED = ("o", "final_state", "state_cache", "ws_inv")     # ws_inv: the stored-inverse tap


def underlying_status_of(rec: dict) -> str:
    return underlying_status(rec)
LIBRARY = {"moonshot": "flash_kda", "fla": "fla", "aiter": "aiter"}


# ----------------------------------------------------------------------------------------
# Checks: what the repro holds the kernel to
# ----------------------------------------------------------------------------------------
def checks_from_record(rec: dict) -> list[dict]:
    """What repro.py holds the kernel to: the failure's own kinds (a raise, NaN / Inf, a missing
    tensor, changed unwritten slots, mostly zeros, a wrong dtype), then the verdict itself: for
    every judged tensor its judged metric against the recorded threshold, and its worst slice
    against that slice's threshold.  Each check says whether it failed when the bundle was made
    (``failed``); the repro reproduces when any check fails, so a failure that changes form between
    processes (memory a kernel leaves unwritten) still reproduces, and a pass does not."""
    out = []
    if underlying_status_of(rec) == "error":           # the kernel raised: the repro holds it to that
        out.append({"tensor": "run", "measure": "raises", "threshold": 0.0,
                    "observed": str(rec.get("reason", ""))[:300], "failed": True})
    for name, t in (rec.get("tensors") or {}).items():
        if not isinstance(t, dict) or name not in CHECKED:
            continue
        met = (rec.get("metrics") or {}).get(name) or {}
        if _f(met.get("nan_frac", 0.0)) > 0 or _f(met.get("inf_frac", 0.0)) > 0:
            out.append({"tensor": name, "measure": "finite", "threshold": 0.0, "failed": True,
                        "observed": f"{100 * _f(met.get('nan_frac', 0)):.3g}% NaN, "
                                    f"{100 * _f(met.get('inf_frac', 0)):.3g}% Inf"})
        elif met.get("missing"):
            out.append({"tensor": name, "measure": "present", "threshold": 0.0, "observed": "missing",
                        "failed": True})
            continue
        if _f(met.get("untouched_changed", 0) or 0) > 0:
            out.append({"tensor": name, "measure": "untouched", "threshold": 0.0, "failed": True,
                        "observed": f"{int(_f(met['untouched_changed']))} values changed in unwritten slots"})
        if met.get("mistrusted"):
            out.append({"tensor": name, "measure": "zeros", "threshold": 0.3, "failed": True,
                        "observed": f"{100 * _f(met.get('zero_frac', 0)):.3g}% exact zeros"})
        if t.get("dtype") and t.get("expected_dtype") and t["dtype"] != t["expected_dtype"]:
            out.append({"tensor": name, "measure": "dtype", "threshold": 0.0, "expected": t["expected_dtype"],
                        "observed": t["dtype"], "failed": True})
        thr = _f(t.get("threshold"))
        if t.get("metric") in ("rel_l2", "tail_rel_l2") and math.isfinite(thr):   # the verdict on the tensor
            whole = _f(t.get("tensor_margin", t.get("margin")))
            out.append({"tensor": name, "measure": t["metric"], "threshold": thr, "observed": _f(t["err"]),
                        "baseline": _f(t.get("baseline_err")), "failed": not whole <= 1})
        sl = t.get("slice")
        if isinstance(sl, dict) and math.isfinite(_f(sl.get("threshold"))):         # ... and on its worst slice
            out.append({"tensor": name, "measure": "slice", "kind": sl["kind"], "label": list(sl["label"]),
                        "where": sl.get("where", ""), "threshold": _f(sl["threshold"]), "observed": _f(sl["err"]),
                        "baseline": _f(sl.get("baseline_err")), "failed": not _f(sl.get("margin")) <= 1})
    return out


# ----------------------------------------------------------------------------------------
# repro.py
# ----------------------------------------------------------------------------------------
REPRO_HEAD = r'''#!/usr/bin/env python3
"""Standalone repro: {backend}/{route} on a shrunk KDA forward problem.

Needs: torch, safetensors{needs}.  Run from anywhere:  python repro.py [--device DEVICE]
Loads problem.safetensors, calls the kernel, compares with the float64 truth in
truth.safetensors, prints the error per tensor; exit 1 when a check below fails (the bug
reproduces), 0 when every check holds, 2 when the kernel cannot be called here.
"""
import json
import math
import os
import sys

import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
BACKEND = {backend!r}
ROUTE = {route!r}
FLAGS = json.loads({flags!r})
CHECKS = json.loads({checks!r})
TAPS = any(c["tensor"] == "ws_inv" for c in CHECKS)    # the failure is in the stored inverse: ask for it
NEGLIGIBLE = 1e-2      # a slice whose reference rms is below this share of the whole is measured on the whole's scale
SLICE_ROWS, START_ROWS = 16, 4


def load(name):
    with safe_open(os.path.join(HERE, name), framework="pt") as f:
        return {{k: f.get_tensor(k) for k in f.keys()}}, dict(f.metadata() or {{}})


def problem(device):
    """The problem's tensors and options (problem.safetensors, kda-verify-problem/1)."""
    t, meta = load("problem.safetensors")
    P = {{k: v.to(device) for k, v in t.items()}}
    num = lambda s: None if s.strip().lower() == "none" else float(s)
    P["scale"] = num(meta.get("scale", "none"))
    if P["scale"] is None:
        P["scale"] = float(P["q"].shape[3] ** -0.5)
    P["lower_bound"] = num(meta.get("lower_bound", "none"))
    P["gate"] = meta.get("gate", "lower_bound")
    P["beta_kind"] = meta.get("beta", "sigmoid")
    P["qk_l2norm"] = meta.get("qk_l2norm", "true") == "true"
    P["state_layout"] = meta.get("state_layout", "kv")
    P["output_final_state"] = meta.get("output_final_state", "true") == "true"
    P["norm_eps"] = float(meta.get("norm_eps", "1e-05"))       # with out_gate / norm_weight: the fused norm
    P["_meta"] = meta.get("meta")
    return P


def seq_bounds(P):
    B, T = P["q"].shape[0], P["q"].shape[1]
    cu = P.get("cu_seqlens")
    if cu is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    c = [int(x) for x in cu.tolist()]
    return list(zip(c[:-1], c[1:]))
'''

REPRO_TAIL = r'''

def _sq(x):
    return float(x.double().square().sum())


def _rel(d, r):
    num, den = _sq(d), _sq(r)
    return (0.0 if num == 0 else math.inf) if den == 0 else math.sqrt(num / den)


def inverse_entries(P, C):
    """[HV*tiles, C, C] bool: the entries of a stored inverse that carry information, rows i < Lc
    of each tile (Lc its valid rows; tiles = every sequence's ceil(len / C) chunks, head-major)
    and columns j < i."""
    lens = [min(C, e - b - c * C) for b, e in seq_bounds(P) for c in range(-(-(e - b) // C))]
    lc = torch.tensor(lens, dtype=torch.long).repeat(P["v"].shape[2])
    i = torch.arange(C)
    return (i[None, :, None] < lc[:, None, None]) & (i[None, None, :] < i[None, :, None])


def measures(P, name, x, ref):
    """(d, r) of a tensor as the verdict compares it: o packed [rows, HV, V]; a state [N, HV, *, *]
    (the paged cache: the written slots, in state_indices order); ws_inv the entries of
    inverse_entries."""
    x, ref = x.double().cpu(), ref.double().cpu()
    if name == "ws_inv":
        used = inverse_entries(P, ref.shape[-1])
        return x[used] - ref[used], ref[used]
    if name == "state_cache":
        idx = P["state_indices"].long().cpu()
        x, ref = x[idx], ref[idx]
    if name == "o":
        x, ref = x.reshape(-1, x.shape[2], x.shape[3]), ref.reshape(-1, ref.shape[2], ref.shape[3])
    return x - ref, ref


def slice_error(P, name, d, r, kind, label):
    """The verdict's slice error of slice ``label`` of ``kind`` (module docstring of repro)."""
    bounds = seq_bounds(P)
    if name == "o":
        e2, r2 = d.square().sum(-1), r.square().sum(-1)          # [rows, HV]
        V = d.shape[-1]
        if kind == "seq_head":
            parts = [(e2[b:e, h].sum(), r2[b:e, h].sum(), (e - b) * V) for b, e in bounds for h in range(d.shape[1])]
            labels = [(n, h) for n in range(len(bounds)) for h in range(d.shape[1])]
        elif kind == "seq_block":
            parts, labels = [], []
            for n, (b, e) in enumerate(bounds):
                for k in range(-(-(e - b) // SLICE_ROWS)):
                    lo, hi = b + SLICE_ROWS * k, min(e, b + SLICE_ROWS * (k + 1))
                    parts.append((e2[lo:hi].sum(), r2[lo:hi].sum(), (hi - lo) * d.shape[1] * V))
                    labels.append((n, k))
        else:                                                      # seq_start
            sel = [(n, b, min(e, b + START_ROWS)) for n, (b, e) in enumerate(bounds) if e - b > START_ROWS]
            parts = [(e2[b:e].sum(), r2[b:e].sum(), (e - b) * d.shape[1] * V) for _, b, e in sel]
            labels = [(n, e - b) for n, b, e in sel]
    else:
        N, HV = d.shape[0], d.shape[1]
        per = d.shape[2] * d.shape[3]
        e2, r2 = d.reshape(N, HV, -1).square().sum(-1), r.reshape(N, HV, -1).square().sum(-1)
        parts = [(e2[n, h], r2[n, h], per) for n in range(N) for h in range(HV)]
        if kind == "slot_head":
            slots = [int(s) for s in P["state_indices"].tolist()]
            labels = [(s, h) for s in slots for h in range(HV)]
        else:
            labels = [(n, h) for n in range(N) for h in range(HV)]
    ref_tot = sum(float(p[1]) for p in parts)
    cnt_tot = sum(p[2] for p in parts)
    ms = ref_tot / cnt_tot if cnt_tot else 0.0
    i = labels.index(tuple(label))
    e, rr, c = float(parts[i][0]), float(parts[i][1]), parts[i][2]
    den = max(rr, NEGLIGIBLE ** 2 * ms * c)
    return 0.0 if e == 0 else (math.inf if den == 0 else math.sqrt(e / den))


def tail_rel(P, d, r):
    rows = [i for b, e in seq_bounds(P) for i in range(b + (e - b) // 2, e)]
    if not rows:
        return 0.0
    ix = torch.tensor(rows, dtype=torch.long)
    return _rel(d[ix], r[ix])


def check_name(c):
    what = (c.get("where") or c["measure"]) if c["measure"] == "slice" else c["measure"]
    return f"{c['tensor']} {what}"


def outcome(failed):
    """The last line: NOT REPRODUCED when every check holds; REPRODUCED when the checks that failed
    when the bundle was made fail again; REPRODUCED in another form, naming what fails now and what
    the bundle recorded, when the failure changed form (a kernel that leaves memory unwritten)."""
    if not failed:
        return "NOT REPRODUCED"
    recorded = [c for c in CHECKS if c.get("failed", True)]
    if all(any(c is f for f in failed) for c in recorded):
        return "REPRODUCED"
    return (f"REPRODUCED in another form: now fails {', '.join(check_name(c) for c in failed)} "
            f"(the bundle recorded {', '.join(check_name(c) for c in recorded)})")


def main(argv):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "--device" in argv:
        device = argv[argv.index("--device") + 1]
    P = problem(device)
    truth, _ = load("truth.safetensors")
    try:
        outs = kernel(P)
    except ImportError as e:
        print(f"repro: cannot import the kernel's library: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a kernel that raises: what a "raises" check holds it to
        if not any(c["measure"] == "raises" for c in CHECKS):
            raise
        print(f"check the kernel returns: it raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"-> FAILS")
        print("REPRODUCED")
        return 1
    print(f"{BACKEND}/{ROUTE} on {device}; lens {[e - b for b, e in seq_bounds(P)]}, "
          f"H {P['q'].shape[2]}, HV {P['v'].shape[2]}, K {P['q'].shape[3]}, V {P['v'].shape[3]}")
    print(f"{'tensor':12} {'rel_l2':>10} {'tail_rel_l2':>12} {'max_abs':>10} {'nan':>6} {'inf':>6}  dtype")
    for name, ref in truth.items():
        x = outs.get(name)
        if x is None:
            print(f"{name:12} missing from the kernel's outputs")
            continue
        if tuple(x.shape) != tuple(ref.shape):
            print(f"{name:12} shape {list(x.shape)}, the truth's {list(ref.shape)}")
            continue
        d, r = measures(P, name, x, ref)
        nan, inf = int(torch.isnan(d).sum()), int(torch.isinf(d).sum())
        tail = tail_rel(P, d, r) if name == "o" else _rel(d, r)
        mx = float(d.abs().nan_to_num(nan=math.inf).max()) if d.numel() else 0.0
        print(f"{name:12} {_rel(d, r):10.3e} {tail:12.3e} {mx:10.3e} {nan:6d} {inf:6d}  "
              f"{str(x.dtype).replace('torch.', '')}")
    failed = []                                            # the checks that fail now
    for c in CHECKS:
        name = c["tensor"]
        if c["measure"] == "crash":
            print("check the kernel returns (it killed the process when the bundle was made): it returned -> holds")
            continue
        if c["measure"] == "raises":
            print("check the kernel returns (it raised when the bundle was made): it returned -> holds")
            continue
        x = outs.get(name)
        if c["measure"] == "present":
            bad, got = x is None, "missing" if x is None else "present"
            print(f"check {name} present: {got} -> {'FAILS' if bad else 'holds'}")
            failed += [c] if bad else []
            continue
        if x is None:
            print(f"check {name}: missing from the kernel's outputs -> FAILS")
            failed.append(c)
            continue
        if name in truth and tuple(x.shape) != tuple(truth[name].shape):
            print(f"check {name} shape: {list(x.shape)}, expected {list(truth[name].shape)} -> FAILS")
            failed.append(c)
            continue
        if c["measure"] == "dtype":
            got = str(x.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32") \
                .replace("float16", "fp16").replace("float64", "fp64")
            bad = got != c["expected"]
            print(f"check {name} dtype: {got}, expected {c['expected']} -> {'FAILS' if bad else 'holds'}")
            failed += [c] if bad else []
            continue
        if c["measure"] == "untouched":                              # slots the problem does not write
            keep = torch.ones(x.shape[0], dtype=torch.bool)
            keep[P["state_indices"].long().cpu()] = False
            xo, ro = x.double().cpu()[keep], truth[name].double()[keep]
            n = int((~((xo == ro) | (torch.isnan(xo) & torch.isnan(ro)))).sum())
            print(f"check {name} unwritten slots unchanged: {n} values changed -> {'FAILS' if n else 'holds'}")
            failed += [c] if n else []
            continue
        d, r = measures(P, name, x, truth[name])
        if c["measure"] == "zeros":                                  # mostly exact zeros where the truth is not negligible
            xx, rr = (d + r), r
            negligible = rr.abs() <= 2.0 ** -24 * float(rr.abs().max() if rr.numel() else 0.0)
            nn = max(rr.numel(), 1)
            zero, spurious = float((xx == 0).sum()) / nn, float(((xx == 0) & ~negligible).sum()) / nn
            bad = zero > c["threshold"] and spurious > c["threshold"]
            print(f"check {name} exact zeros: {100 * zero:.3g}% ({100 * spurious:.3g}% where the truth is not "
                  f"negligible) vs {100 * c['threshold']:.3g}% -> {'FAILS' if bad else 'holds'}")
            failed += [c] if bad else []
            continue
        if c["measure"] == "finite":
            nan, inf = int(torch.isnan(d).sum()), int(torch.isinf(d).sum())
            bad = nan + inf > 0
            print(f"check {name} finite: {nan} NaN, {inf} Inf -> {'FAILS' if bad else 'holds'}")
            failed += [c] if bad else []
            continue
        if c["measure"] == "slice":
            err = slice_error(P, name, d, r, c["kind"], c["label"])
            what = f"{name} {c.get('where') or c['kind'] + ' ' + str(c['label'])} rel_l2"
        elif c["measure"] == "tail_rel_l2":
            err, what = (tail_rel(P, d, r) if name == "o" else _rel(d, r)), f"{name} tail_rel_l2"
        else:
            err, what = _rel(d, r), f"{name} rel_l2"
        bad = not (err <= c["threshold"])
        print(f"check {what}: {err:.4g} vs threshold {c['threshold']:.4g} -> {'FAILS' if bad else 'holds'}")
        failed += [c] if bad else []
    if not CHECKS:
        print("repro: no check stated: nothing to reproduce (judge the stored outputs with kda-verify check)",
              file=sys.stderr)
        return 2
    print(outcome(failed))
    return 1 if failed else 0

'''

# the end of every repro script (this module's and verification/serving/shrink.py's): a failure of
# the script itself exits 2, never the 1 of REPRODUCED
REPRO_MAIN = r'''
if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception:  # noqa: BLE001 - the repro's own failure must not read as exit 1, REPRODUCED
        import traceback
        traceback.print_exc()
        print("repro: error: the repro itself failed (above), so it cannot tell whether the bug reproduces",
              file=sys.stderr)
        code = 2
    sys.exit(code)
'''

KERNEL_OWN = r'''

def kernel(P):
    """The backend {spec!r} (kda_kernels' built-in name, or package.module:factory), route {route!r}."""
    import json
    if BACKEND == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton's CPU interpreter, set before Triton is imported
    from kda_kernels.base import load_backend
    from kda_ref.problem import Problem, validate
    fields = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state", "state_cache",
              "state_indices", "has_initial_state", "out_gate", "norm_weight")
    meta = json.loads(P["_meta"]) if P.get("_meta") else {{}}
    prob = validate(Problem(scale=P["scale"], lower_bound=P["lower_bound"], gate=P["gate"], beta_kind=P["beta_kind"],
                            qk_l2norm=P["qk_l2norm"], state_layout=P["state_layout"],
                            output_final_state=P["output_final_state"], meta=meta, norm_eps=P["norm_eps"],
                            **{{k: P.get(k) for k in fields}}))
    backend = load_backend({spec!r})
    if hasattr(backend, "with_taps"):
        backend = backend.with_taps(TAPS)                 # the stored inverse, when a check names it
    routes = {{r.name: r for r in backend.routes()}}
    route = routes[ROUTE] if ROUTE in routes else backend.route(ROUTE)
    out = backend.run(prob, route)
    res = {{k: v for k, v in out.tensors().items()}}
    if TAPS and "ws_inv" in (getattr(out, "taps", None) or {{}}):
        res["ws_inv"] = out.taps["ws_inv"]
    return res
'''

KERNEL_MOONSHOT = r'''

def kernel_arguments(P):
    """flash_kda.fwd's keyword arguments, as kda_kernels.moonshot passes them."""
    bf, f32 = torch.bfloat16, torch.float32
    sdt = {"fp32": f32, "bf16": bf}[FLAGS.get("state_dtype", "fp32")]
    q = P["q"]
    H, K, V = q.shape[2], q.shape[3], P["v"].shape[3]
    cu = P.get("cu_seqlens")
    N = q.shape[0] if cu is None else cu.numel() - 1
    dt_bias = (torch.zeros(H, K, dtype=f32, device=q.device) if P.get("dt_bias") is None
               else P["dt_bias"].reshape(H, K).to(f32))
    kw = dict(q=q, k=P["k"], v=P["v"], g=P["g"], beta=P["beta"].to(bf), scale=P["scale"],
              out=torch.empty(P["v"].shape, dtype=bf, device=q.device), A_log=P["A_log"].to(f32),
              dt_bias=dt_bias, lower_bound=float(P["lower_bound"]))
    if P.get("initial_state") is not None:
        s = P["initial_state"]
        if P["state_layout"] == "kv":
            s = s.transpose(-1, -2)                      # flash_kda takes V-first states
        kw["initial_state"] = s.to(sdt).contiguous()
    if P["output_final_state"]:
        kw["final_state"] = torch.empty(N, H, V, K, dtype=sdt, device=q.device)
    if cu is not None:
        kw["cu_seqlens"] = cu.to(torch.int64)
    return kw


def kernel(P):
    import flash_kda
    kw = kernel_arguments(P)
    with torch.inference_mode():
        flash_kda.fwd(**kw)
    out = {"o": kw["out"]}
    fs = kw.get("final_state")
    if fs is not None:
        out["final_state"] = fs.transpose(-1, -2).contiguous() if P["state_layout"] == "kv" else fs
    return out
'''

KERNEL_FLA = r'''

def kernel_arguments(P):
    """(function name, keyword arguments) of fla's call, as kda_kernels.fla passes them."""
    kw = dict(q=P["q"], k=P["k"], v=P["v"], g=P["g"], beta=P["beta"], scale=P["scale"],
              output_final_state=bool(P["output_final_state"]), use_qk_l2norm_in_kernel=bool(P["qk_l2norm"]),
              use_beta_sigmoid_in_kernel=P["beta_kind"] in ("sigmoid", "sigmoid2"),
              allow_neg_eigval=P["beta_kind"] == "sigmoid2", state_v_first=P["state_layout"] == "vk")
    if P["gate"] in ("lower_bound", "softplus"):
        dt = P.get("dt_bias")
        kw.update(use_gate_in_kernel=True, A_log=P.get("A_log"), dt_bias=None if dt is None else dt.reshape(-1),
                  lower_bound=float(P["lower_bound"]) if P["gate"] == "lower_bound" else None)
    else:
        kw.update(use_gate_in_kernel=False)
    if P.get("initial_state") is not None:
        kw["initial_state"] = P["initial_state"].to(torch.float32).contiguous()
    if P.get("cu_seqlens") is not None:
        kw["cu_seqlens"] = P["cu_seqlens"].to(device=P["q"].device, dtype=torch.int64).clone()
    if ROUTE == "fused_recurrent":
        return "fused_recurrent_kda", kw
    kw.update(FLAGS["chunk_kwargs"])
    return "chunk_kda", kw


def kernel(P):
    os.environ["FLA_FLASH_KDA"] = "0"             # fla's own Triton path, not its FlashKDA dispatch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    name, kw = kernel_arguments(P)
    fn = {"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda}[name]
    with torch.inference_mode():
        o, final = fn(**kw)
    out = {"o": o}
    if P["output_final_state"]:
        out["final_state"] = final
    return out
'''

KERNEL_AITER = r'''
LAYOUTS = ("aiter.ops.triton._triton_kernels.kimi_delta_attn.flash_kda",
           "aiter.ops.triton._triton_kernels.chunk_delta_attn.flash_kda")


def module():
    import importlib
    os.environ.setdefault("AITER_TRITON_ONLY", "1")
    os.environ.pop("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", None)     # the explicit chunks_per_seg decides
    errors = []
    for path in LAYOUTS:
        try:
            return importlib.import_module(path)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{path}: {type(e).__name__}: {e}")
    raise ImportError(" | ".join(errors))


def kernel_arguments(P, mod):
    """flash_kda_fwd's keyword arguments, as kda_kernels.aiter passes them."""
    import inspect
    params = inspect.signature(mod.flash_kda_fwd).parameters
    paged = P["state_layout"] == "paged"
    dt = P.get("dt_bias")
    kw = dict(q=P["q"], k=P["k"], v=P["v"], g=P["g"], beta=P["beta"], A_log=P["A_log"].to(torch.float32),
              dt_bias=None if dt is None else dt.reshape(-1).to(torch.float32), scale=P["scale"],
              lower_bound=float(P["lower_bound"]), output_final_state=bool(P["output_final_state"]) and not paged,
              state_v_first=P["state_layout"] in ("vk", "paged"), chunks_per_seg=FLAGS["chunks_per_seg"])
    if P.get("cu_seqlens") is not None:
        kw["cu_seqlens"] = P["cu_seqlens"].to(device=P["q"].device, dtype=torch.int64).clone()
    if P.get("initial_state") is not None:
        kw["initial_state"] = P["initial_state"].to(torch.float32)
    if paged:                                                       # written in place: a private copy
        kw.update(state_cache=P["state_cache"].clone(), state_indices=P["state_indices"].to(torch.int32),
                  has_initial_state=P["has_initial_state"].bool())
    if paged or "out" in params:
        kw["out"] = torch.empty_like(P["v"])
    return kw


def kernel(P):
    mod = module()
    for name, value in (("AITER_FDA_USE_GLUON_K1", FLAGS["gluon_k1"]), ("AITER_FDA_USE_GLUON_K2", FLAGS["gluon_k2"]),
                        ("AITER_FDA_SCAN_PREFETCH", FLAGS["prefetch"])):
        if value is not None and hasattr(mod, name):
            setattr(mod, name, value)
    kw = kernel_arguments(P, mod)
    with torch.inference_mode():
        o, final = mod.flash_kda_fwd(**kw)
    if kw.get("out") is not None:
        o = kw["out"]
    if P["state_layout"] == "paged":
        return {"o": o, "state_cache": kw["state_cache"]}
    out = {"o": o}
    if P["output_final_state"]:
        out["final_state"] = final
    return out
'''

KERNEL_AITER_CHUNK_KDA = r'''

def kernel(P):
    """aiter's chunk_kda as kda_kernels.aiter calls it: one packed [1, B*T, H, 128] batch with
    int64 cu_seqlens, V-first fp32 states, o into an out buffer; on gfx1250 / gfx950 it runs its
    Gluon kernels, elsewhere its Triton fallback with the FlashKDA switch on."""
    import importlib
    os.environ.setdefault("AITER_TRITON_ONLY", "1")
    os.environ.pop("CHUNK_DELTA_ATTN_FLASH_KDA_SEG", None)
    ck = importlib.import_module("aiter.ops.triton.attention.chunk_kda")
    if FLAGS["kernels"] == "triton":
        fwd = importlib.import_module("aiter.ops.triton._triton_kernels.kimi_delta_attn.chunk_fwd")
        fwd.AITER_FDA_ENABLE = True
    q = P["q"]
    B, T, H, K = q.shape
    dev = q.device

    def packed(t):
        return t.reshape(1, B * T, *t.shape[2:]).contiguous()
    cu = P.get("cu_seqlens")
    cu = (torch.arange(B + 1, device=dev, dtype=torch.int64) * T if cu is None
          else cu.to(device=dev, dtype=torch.int64).clone())
    dt = P.get("dt_bias")
    dt = torch.zeros(H * K, device=dev) if dt is None else dt.reshape(-1).to(torch.float32).contiguous()
    paged = P["state_layout"] == "paged"
    kw = dict(q=packed(q), k=packed(P["k"]), v=packed(P["v"]), g=packed(P["g"]), beta=packed(P["beta"]),
              A_log=P["A_log"].reshape(-1).to(torch.float32).contiguous(), dt_bias=dt,
              lower_bound=float(P["lower_bound"]), cu_seqlens=cu, scale=P["scale"],
              output_final_state=bool(P["output_final_state"]) and not paged)
    if P.get("initial_state") is not None:
        h0 = P["initial_state"].to(torch.float32)
        kw["initial_state"] = (h0.transpose(-1, -2) if P["state_layout"] == "kv" else h0).contiguous()
    if paged:                                                       # written in place: a private copy
        kw.update(state_cache=P["state_cache"].clone(), state_indices=P["state_indices"].to(torch.int32),
                  has_initial_state=P["has_initial_state"].bool())
    if P.get("out_gate") is not None:                               # the walk's fused gated RMSNorm
        kw.update(out_gate=packed(P["out_gate"]), norm_weight=P["norm_weight"].contiguous(), norm_eps=P["norm_eps"])
    kw["out"] = torch.empty_like(kw["v"])
    with torch.inference_mode():
        _, final = ck.chunk_kda(**kw)
    o = kw["out"].reshape(P["v"].shape)
    if paged:
        return {"o": o, "state_cache": kw["state_cache"]}
    out = {"o": o}
    if P["output_final_state"]:
        out["final_state"] = final.transpose(-1, -2) if P["state_layout"] == "kv" else final
    return out
'''


def route_flags(backend: str, route) -> dict:
    """The literal settings repro.py needs for a route (what the adapter derives from its name)."""
    flags = dict(getattr(route, "flags", ()) or ())
    if backend == "fla" and route.name != "fused_recurrent":
        return {"chunk_kwargs": dict(CHUNK_ROUTES[route.name])}
    if backend == "aiter":
        r = parse_route(route.name)
        if r["entry"] == "chunk_kda":
            return {"entry": "chunk_kda", "kernels": r["kernels"]}
        k1, k2 = KERNEL_SETS[r["kernels"]]
        return {"gluon_k1": k1, "gluon_k2": k2, "prefetch": r["prefetch"], "chunks_per_seg": r["chunks_per_seg"]}
    if backend == "moonshot":
        return {"state_dtype": flags.get("state_dtype", "fp32")}
    return {k: v for k, v in flags.items() if isinstance(v, (str, int, float, bool, type(None)))}


def repro_source(backend: str, route, checks: list, spec: str = "") -> str:
    """The text of repro.py for ``backend`` / ``route`` with ``checks``; ``spec`` is how the
    backend is loaded (its built-in name, or package.module:factory; default ``backend``)."""
    if backend in LIBRARY:
        needs = f" and {LIBRARY[backend]} (the kernel's own library)"
        body = {"moonshot": KERNEL_MOONSHOT, "fla": KERNEL_FLA, "aiter": KERNEL_AITER}[backend]
        if backend == "aiter" and route_flags(backend, route).get("entry") == "chunk_kda":
            body = KERNEL_AITER_CHUNK_KDA
    else:
        needs = " and kda-verify's kda_kernels / kda_ref (the project's own backend)"
        body = KERNEL_OWN.format(spec=spec or backend, route=route.name)
    head = REPRO_HEAD.format(backend=backend, route=route.name, flags=json.dumps(route_flags(backend, route)),
                             checks=json.dumps(checks), needs=needs)
    return head + body + REPRO_TAIL + REPRO_MAIN


# ----------------------------------------------------------------------------------------
# Writing the bundle
# ----------------------------------------------------------------------------------------
def _cpu(t):
    return t.detach().cpu().contiguous()


def _fmt(x) -> str:
    v = _f(x)
    return "nan" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.3g}")


def environment(backend_version: str, device: str) -> dict:
    return {"device": device_info(device), "software": software_info(), "kda_verify_git": git_info(),
            "library": backend_version}


def write_bundle(out_dir, result, loaded, route, case, device: str, command: str) -> dict:
    """Write the bundle of a ShrinkResult into ``out_dir``; returns the shrink.json dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fin, orig = result.final, result.original
    p = fin.problem
    save_problem(str(out / "problem.safetensors"), p.to("cpu"))
    truth = {k: _cpu(v) for k, v in fin.truth.tensors().items() if k in ("o", "final_state", "state_cache")}
    crashed = fin.outputs is None          # the kernel killed its process on the final problem: no outputs
    taps = {} if crashed else (getattr(fin.outputs, "taps", None) or {})
    what = "float64 oracle (kda_ref.truth, chunked C=64)"
    if "ws_inv" in taps:                   # the tap is judged against the oracle's exact inverse at its C
        C = int(taps["ws_inv"].shape[-1])
        truth["ws_inv"] = _cpu(workspace(p, C=C, inverse="exact").ws_inv)
        what += f"; ws_inv: kda_ref.workspace's exact (I - L)^-1 at C={C}"
    save_outputs(str(out / "truth.safetensors"), truth, {"what": what})
    if not crashed:
        outs = {k: _cpu(v) for k, v in fin.outputs.tensors().items()}
        if "ws_inv" in taps:
            outs["ws_inv"] = _cpu(taps["ws_inv"])
        meta = {"backend": loaded.name, "route": route.name, "recipe": getattr(route, "recipe", "") or "",
                "device": str(device), "version": loaded.version}
        save_outputs(str(out / "outputs.safetensors"), outs, meta)
    checks = checks_from_record(fin.record)
    if crashed:
        checks = [{"tensor": "run", "measure": "crash", "threshold": 0.0,
                   "observed": str(fin.record.get("reason", ""))[:300]}]
    (out / "repro.py").write_text(repro_source(loaded.name, route, checks, spec=loaded.spec), encoding="utf-8")
    env = environment(loaded.version, device)
    check_cmd = "(none: the kernel killed the process, so there are no outputs to judge)" if crashed else (
                 f"kda-verify check --inputs problem.safetensors --outputs outputs.safetensors "
                 f"--recipe {getattr(route, 'recipe', 'flashkda')} "
                 f"--backend-name {shlex.quote(loaded.name)} --route {shlex.quote(route.name)}")
    data = {
        "backend": loaded.name, "backend_spec": loaded.spec, "route": route.name,
        "recipe": getattr(route, "recipe", ""), "case": case.id, "device": str(device),
        "original": {"shape": shape_text(orig.problem), "size": size(orig.problem),
                     "status": orig.record.get("status"), "reason": orig.record.get("reason"),
                     "failure": orig.signature.describe()},
        "final": {"shape": shape_text(p), "size": size(p), "status": fin.record.get("status"),
                  "reason": fin.record.get("reason"), "failure": fin.signature.describe(),
                  "lens": [e - b for b, e in p.seq_bounds()], "N": p.N, "H": p.H, "HV": p.HV, "T": p.B * p.T,
                  "tensors": fin.record.get("tensors"), "info": fin.record.get("info") or {},
                  "verdict_status": verdict_of(fin.record)[0],
                  "verdict_reason": verdict_of(fin.record)[1]},
        "checks": checks, "trace": result.trace, "runs": result.runs, "seconds": result.seconds,
        "stopped": result.stopped, "environment": env, "command": command, "check_command": check_cmd,
        "repro_command": "python repro.py",
    }
    data["repro_check"] = verify_repro(out, device, checks)
    (out / "shrink.json").write_text(json.dumps(encode(data), indent=1, allow_nan=False), encoding="utf-8")
    (out / "REPORT.md").write_text(report_md(data, p), encoding="utf-8")
    return data


def verify_repro(out: Path, device: str, checks: list, timeout_s: float = 600.0) -> dict:
    """Run ``out``/repro.py once as a user would, in a fresh process whose working directory is
    another (empty, temporary) one, with this kda-verify's kda_kernels / kda_ref first on the
    path and then this process's (a backend given as package.module:factory imports there too): {"exit": code, "reproduced": exit 1 (or, for a crash check, a process that died: any
    exit but 0, 1, 2), "last_line": its last output line}."""

    root = str(Path(kda_kernels.__file__).resolve().parent.parent)
    path = [root] + [x for x in sys.path if x and os.path.isdir(x) and x != root]   # what shrink itself imports from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    with tempfile.TemporaryDirectory(prefix="kda-repro-") as cwd:
        try:
            r = subprocess.run([sys.executable, str(Path(out).resolve() / "repro.py"), "--device", str(device)],
                               cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"exit": None, "reproduced": False, "last_line": f"timed out after {timeout_s:.0f} s"}
    lines = (r.stdout.strip() or r.stderr.strip() or "").splitlines()
    crash = any(c.get("measure") == "crash" for c in checks)     # reproduced by the process dying
    ok = r.returncode == 1 or (crash and r.returncode not in (0, 1, 2))
    return {"exit": r.returncode, "reproduced": ok, "last_line": lines[-1] if lines else ""}


def verdict_of(rec: dict) -> tuple[str, str]:
    """(status, reason) of the judge itself: a known-fail cell's underlying verdict, without the
    known-failure note run adds."""
    kf = rec.get("known_failure")
    if rec.get("status") != "known-fail" or not kf:
        return str(rec.get("status")), str(rec.get("reason", ""))
    reason = str(rec.get("reason", ""))
    marker = f"{kf.get('reason', '')}): "
    return str(kf.get("status", "fail")), reason.split(marker, 1)[1] if marker in reason else reason


def report_md(d: dict, p) -> str:
    """REPORT.md: ready to paste into an upstream issue."""
    fin, orig = d["final"], d["original"]
    lib = d["environment"]["library"]
    dev, sw = d["environment"]["device"], d["environment"]["software"]
    L = [f"# {d['backend']} / {d['route']}: {fin['failure']}", ""]
    nonfinite = any(c["measure"] == "finite" for c in d["checks"])
    what = ("kills the process" if any(c["measure"] == "crash" for c in d["checks"]) else
            "returns NaN / Inf where the float64 reference is finite" if nonfinite else
            "returns outputs that differ from a float64 reference beyond what its own precision recipe explains")
    L += [f"On a {fin['N']}-sequence problem (lengths {fin['lens']}, H={fin['H']}, HV={fin['HV']}, "
          f"K={p.K}, V={p.V}, {fin['T']} token{'s' if fin['T'] != 1 else ''}) the kernel {what}.", ""]
    L += ["## What fails", "", "| tensor | measure | observed | expected (threshold) | baseline (the recipe's own error) |",
          "|---|---|---|---|---|"]
    held = [c for c in d["checks"] if not c.get("failed", True)]
    for c in d["checks"]:
        if not c.get("failed", True):
            continue
        meas = c["measure"] + (f" {c.get('where')}" if c["measure"] == "slice" else "")
        exp = {"crash": "the call returns", "finite": "finite values", "present": "present", "dtype": c.get("expected", ""),
               "untouched": "unwritten slots unchanged", "zeros": "at most 30% exact zeros"}.get(
            c["measure"], _fmt(c["threshold"]))
        obs = c["observed"] if isinstance(c["observed"], str) else _fmt(c["observed"])
        L.append(f"| {c['tensor']} | {meas} | {obs} | {exp} | {_fmt(c.get('baseline', math.nan))} |")
    if not d["checks"]:
        L.append("| (workspace tap) | see the verdict below | | | |")
    if held:
        L += ["", "repro.py also checks what held when the bundle was made (a failure that changes form between "
              "processes still reproduces): " + "; ".join(
                  f"{c['tensor']} {c['measure']}" + (f" {c.get('where')}" if c["measure"] == "slice" else "")
                  + f" {_fmt(c['observed'])} <= {_fmt(c['threshold'])}" for c in held) + "."]
    L += ["", f"Verdict (kda-verify): {fin['verdict_status'].upper()}: {fin['verdict_reason']}"]
    if fin["status"] == "known-fail":
        L.append("(kda-verify lists this failure in its tolerances.yaml known_failures.)")
    L.append("")
    L += ["Expected: rel_l2 = ||x - r|| / ||r|| against the float64 reference r (truth.safetensors); the "
          "threshold is m x (the error of the kernel's own precision recipe, emulated) + floor, capped "
          "(tolerances.yaml).", ""]
    L += ["## Shrunk problem", "",
          f"- N = {fin['N']}, lengths {fin['lens']}, H = {fin['H']}, HV = {fin['HV']}, T = {fin['T']} tokens, "
          f"K = {p.K}, V = {p.V}",
          f"- {p.describe()}",
          f"- dtypes: q {str(p.q.dtype).replace('torch.', '')}, v {str(p.v.dtype).replace('torch.', '')}, beta "
          f"{str(p.beta.dtype).replace('torch.', '')}"
          + (f", initial_state {str(p.initial_state.dtype).replace('torch.', '')}" if p.initial_state is not None else "")
          + (f", state_cache {str(p.state_cache.dtype).replace('torch.', '')}" if p.state_cache is not None else ""),
          "", "## Shrink trace", "",
          f"Original: {d['case']}: {orig['shape']} (size N x T x HV = {orig['size']}): {orig['failure']}", ""]
    for s in d["trace"]:
        L.append(f"{s['step']}. {s['op']} -> {s['shape']}: {s['failure']}")
    L += ["", f"Final: {fin['shape']} (size {fin['size']}, {orig['size'] / max(fin['size'], 1):.3g}x smaller), "
          f"{d['runs']} runs, {d['seconds']:.1f} s; stopped: {d['stopped']}.", ""]
    L += ["## Environment", "",
          f"- library: {lib}",
          f"- device: {dev.get('gpu', 'none')}" + (f" (capability {dev['capability']}, driver {dev.get('driver')}, "
                                                   f"CUDA {dev.get('cuda_runtime')}, HIP {dev.get('hip_runtime')})"
                                                   if dev.get("type") == "cuda" else f" ({dev.get('device')})"),
          f"- torch {sw.get('torch')}, triton {sw.get('triton')}, python {sw.get('python')}",
          f"- kda-verify commit {d['environment']['kda_verify_git'].get('commit')}"]
    ran = (fin.get("info") or {}).get("route_ran")
    if ran:
        L.append(f"- what ran (the adapter's record): {ran}")
    L.append("")
    rc = d.get("repro_check") or {}
    said = (f"exit {rc.get('exit')}: the kernel kills the process: REPRODUCED"
            if rc.get("reproduced") and rc.get("exit") != 1 else
            f"exit 1: {rc.get('last_line') or 'REPRODUCED'}" if rc.get("reproduced") else
            f"did NOT reproduce when the bundle was written (exit {rc.get('exit')}: {rc.get('last_line', '')})")
    L += ["## Reproduce", "",
          "The bundle holds problem.safetensors, truth.safetensors (float64), outputs.safetensors (what the "
          "kernel returned) and repro.py. From the bundle's directory (repro.py itself runs from any):", "",
          "```bash", f"python repro.py          # {said}", "```", "",
          "With kda-verify: `" + d["check_command"] + "` judges the stored outputs; `" + d["command"]
          + "` shrinks again.", ""]
    return "\n".join(L)
