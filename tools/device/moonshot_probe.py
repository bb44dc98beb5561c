"""Probes of Moonshot's flash_kda for the findings (run by tools/device/moonshot_job.sh on SM90):

1. correlated keys with a weak gate: o / state rel_l2 against the float64 oracle as the sequence
   grows from 2 to 64 tokens (one chunk is 16), kernel and the moonshot recipe side by side;
2. lower_bound near the documented -5: the final state's exact-zero fraction for lb from -5 to
   -5.5 with a saturated gate (the chunk's total decay 2^(16 lb log2 e) is below fp32's smallest
   normal, 2^-126, from lb < -126 / (16 log2 e) = -5.4575);
3. the collinear stress case (and the same recipe of inputs under another seed): finite or not,
   the first non-finite token, o rel_l2 per 16-token block along the sequence;
4. short sequences and short last chunks: o rel_l2 of the last chunk (1 to 4 tokens), kernel and
   recipe, for a sequence alone, last in a pack and first in a pack;
5. a problem without tokens (B*T = 0), in a child process: what flash_kda.fwd does.

    python3 tools/device/moonshot_probe.py [--json OUT.json] [--device cuda] [--no-long]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from kda_kernels.emulator import emulate
from kda_kernels.moonshot import MoonshotBackend
from kda_ref.truth import truth
from verification.running.cases import build_problem, get_case
from verification.judging.metrics import compare


def rel(x, r):
    x, r = x.double(), r.double()
    n = float(r.norm())
    return float((x - r).norm()) / n if n else math.nan


def errors(out, tr, p):
    m = compare(out.tensors(), tr.tensors(), p)
    return {k: round(v["rel_l2"], 5) for k, v in m.items() if "rel_l2" in v} | \
           {f"{k}_zero": round(v["zero_frac"], 4) for k, v in m.items() if "zero_frac" in v}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-long", action="store_true", help="leave out part 3 (16384 tokens)")
    ap.add_argument("--parts", default="1,2,3,4,5", help="which parts to run (comma list, default all)")
    args = ap.parse_args()
    dev = args.device
    b = MoonshotBackend()
    ok, why = b.available()
    if not ok:
        print(f"moonshot unavailable: {why}")
        return 2
    route = b.routes()[0]
    res = {"version": b.version()}
    parts = set(args.parts.split(","))
    if "4" in parts:
        short_chunks(b, route, dev, res)
    if "5" in parts:
        empty_problem(res)
    if "1" not in parts:
        return _dump(args, res)

    print("1. correlated keys, weak gate: T sweep (kernel | moonshot recipe), H=1, beta_raw 4, lb -0.01")
    res["corr_T"] = []
    for rho in (0.9, 1.0):
        for T in (2, 4, 8, 12, 13, 14, 15, 16, 32, 64):
            p = build_problem(dict(B=1, T=T, H=1, lb=-0.01, rho=rho, beta_raw=4.0), 7, device=dev)
            tr = truth(p)
            k, e = errors(b.run(p, route), tr, p), errors(emulate(p, "moonshot"), tr, p)
            res["corr_T"].append({"rho": rho, "T": T, "kernel": k, "recipe": e})
            print(f"  rho {rho} T {T:3d}: kernel o {k['o']:.3g} state {k['final_state']:.3g} | "
                  f"recipe o {e['o']:.3g} state {e['final_state']:.3g}", flush=True)

    if "2" not in parts:
        return _dump(args, res)
    print("2. saturated gate (g = N(0,1) + 12): final-state exact zeros vs lower_bound")
    res["lb"] = []
    for lb in (-5.0, -5.3, -5.45, -5.46, -5.47, -5.5):
        p = build_problem(dict(B=1, T=96, H=2, lb=lb, g_scale=1.0, g_shift=12.0), 11, device=dev)
        tr = truth(p)
        k = errors(b.run(p, route), tr, p)
        res["lb"].append({"lb": lb, "kernel": k})
        print(f"  lb {lb:6.2f}: o {k['o']:.3g} state {k['final_state']:.3g} state zeros "
              f"{100 * k['final_state_zero']:.3g}%", flush=True)

    if args.no_long or "3" not in parts:
        return _dump(args, res)
    print("3. collinear keys, gate -12, beta logit 8, T 16384 (the stress case, and seed 123)")
    res["collinear"] = []
    for label, p in (("stress case", get_case("stress/collinear-keys-T16384-gate-12-beta8-lb-5").build(device=dev)),
                     ("seed 123", build_problem(dict(B=1, T=16384, H=2, rho=1.0, g_scale=0.0, g_shift=-12.0,
                                                     beta_raw=8.0), 123, device=dev))):
        tr = truth(p)
        out = b.run(p, route)
        o, r = out.o[0], tr.o[0]
        bad = ~torch.isfinite(o.float())
        first = int(bad.any(-1).any(-1).nonzero()[0]) if bool(bad.any()) else None
        blocks = {t0: rel(o[t0:t0 + 16], r[t0:t0 + 16]) for t0 in (0, 64, 256, 1024, 2048, 4096, 8192, 16368)}
        k = errors(out, tr, p)
        res["collinear"].append({"which": label, "kernel": k, "first_nonfinite": first, "blocks": blocks,
                                 "state_finite": bool(torch.isfinite(out.final_state).all())})
        print(f"  {label}: o {k['o']:.3g} state {k['final_state']:.3g}; first non-finite token {first}; "
              + ", ".join(f"{t}: {v:.3g}" for t, v in blocks.items()), flush=True)
    return _dump(args, res)


def short_chunks(b, route, dev, res) -> None:
    print("4. short last chunks: o rel_l2 of the last chunk (kernel | recipe), H=2, lb -0.1, saturated gate")
    res["short"] = []
    for n in (1, 2, 3, 4, 17, 33):
        for where, lens in (("alone", [n]), ("last", [33, n]), ("first", [n, 33])):
            p = build_problem(dict(lens=lens, H=2, lb=-0.1, g_scale=1.0, g_shift=12.0), 1165, device=dev)
            tr = truth(p)
            k, e = b.run(p, route), emulate(p, "moonshot")
            s = lens.index(n) if where != "last" else 1
            bos, eos = p.seq_bounds()[s]
            a = bos + ((eos - bos - 1) // 16) * 16
            row = {"n": n, "where": where, "kernel": rel(k.o[0, a:eos], tr.o[0, a:eos]),
                   "recipe": rel(e.o[0, a:eos], tr.o[0, a:eos]),
                   "kernel_vs_recipe": rel(k.o[0, a:eos], e.o[0, a:eos])}
            res["short"].append(row)
            print(f"  {n:2d} tokens, {where:5}: last chunk o kernel {row['kernel']:.3g} | recipe {row['recipe']:.3g} "
                  f"| kernel vs recipe {row['kernel_vs_recipe']:.3g}", flush=True)
    for cid in ("fuzz/fuzz0-1165", "fuzz/fuzz0-177", "fuzz/fuzz0-463", "fuzz/fuzz0-789"):
        p = get_case(cid, n=2000).build(device=dev)
        tr = truth(p)
        k, e = b.run(p, route), emulate(p, "moonshot")
        for s_, (bos, eos) in enumerate(p.seq_bounds()):
            if eos == bos:
                continue
            a = bos + ((eos - bos - 1) // 16) * 16
            kb, eb = rel(k.o[0, a:eos], tr.o[0, a:eos]), rel(e.o[0, a:eos], tr.o[0, a:eos])
            res["short"].append({"case": cid, "seq": s_, "len": eos - bos, "kernel": kb, "recipe": eb})
            print(f"  {cid} seq {s_} ({eos - bos} tokens): last chunk ({eos - a}) o kernel {kb:.3g} | recipe {eb:.3g}",
                  flush=True)


def empty_problem(res) -> None:
    import subprocess
    import sys
    code = ("import torch, flash_kda; z = lambda *s, d=torch.bfloat16: torch.zeros(*s, dtype=d, device='cuda');"
            "flash_kda.fwd(z(1,0,2,128), z(1,0,2,128), z(1,0,2,128), z(1,0,2,128), z(1,0,2), 0.088, z(1,0,2,128),"
            " z(2, d=torch.float32), z(2,128, d=torch.float32), -5.0); torch.cuda.synchronize(); print('returned')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    res["empty"] = {"returncode": r.returncode, "tail": tail[0][:300]}
    print(f"5. B*T = 0: flash_kda.fwd in a child process: return code {r.returncode} ({tail[0][:200]})", flush=True)


def _dump(args, res) -> int:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
