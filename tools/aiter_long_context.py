"""Error against T of the aiter chunk_kda Gluon recipes (CPU), for docs/long-context.md.

    python tools/aiter_long_context.py --T 1024,4096,16384,65536 --out runs/aiter-long.json
    python tools/aiter_long_context.py --plot runs/aiter-long.json --png docs/aiter-long-context.png

For each T: one sequence, H = 1, the long suite's weak gate (lb -0.05 from an initial state,
where the state persists and the walk's rounding could accumulate) and its lb -5; the float64
truth streamed (kda_ref.truth), then the rel-L2 error of o and the final state for

    aiter-gfx1250          the recipe: the state's bf16 operand in every chunk (W1250:116)
    aiter-gfx1250-fp32op   the same recipe with that operand kept fp32 (nothing else changed)
    aiter-gfx950           the gfx950 recipe, its group count by the host rule (one sequence,
                           one head: G = min(128, T/256, 32) from T = 1536 tokens; the scan's
                           entry states go through bf16)

Each T's figures are written to the JSON file as they come, after the truth and after each
recipe (a row's ``done`` lists the recipes it holds; a long T can be stopped and the rest kept),
with a progress line on stderr at each.  The plot is o and state error against T, log axes (the
recipes a row holds)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

GATES = ((-0.05, "kv"), (-5.0, "none"))


def recipes():
    from kda_kernels.emulator import FP32, RECIPES
    return {"aiter-gfx1250": RECIPES["aiter-gfx1250"],
            "aiter-gfx1250-fp32op": replace(RECIPES["aiter-gfx1250"], name="aiter-gfx1250-fp32op", operand_dtype=FP32),
            "aiter-gfx950": RECIPES["aiter-gfx950"]}


def measure(T: int, lb: float, state: str, emit=lambda row: None) -> dict:
    """One T and gate: the row of figures; ``emit(row)`` after the truth and after each recipe, so
    a long T leaves what it has measured so far (the row's ``done`` lists the recipes in it)."""
    from kda_kernels.emulator import aiter_gfx950_groups, emulate
    from kda_ref.truth import truth
    from verification.running.cases import _case
    from verification.judging.metrics import compare
    t0 = time.time()
    p = _case("long", f"T{T}-H1-lb{lb:g}", B=1, T=T, H=1, lb=lb, state=state).build()
    row = {"T": T, "lb": lb, "state": state, "build_s": round(time.time() - t0, 1),
           "gfx950_groups": aiter_gfx950_groups(1, 1, -(-T // 64)), "done": []}
    t0 = time.time()
    tr = truth(p)
    row["truth_s"] = round(time.time() - t0, 1)
    emit(row)
    for name, r in recipes().items():
        t0 = time.time()
        m = compare(emulate(p, r).tensors(), tr.tensors(), p)
        row[name] = {"o": m["o"]["rel_l2"], "o_tail": m["o"]["tail_rel_l2"],
                     "state": m["final_state"]["rel_l2"], "seconds": round(time.time() - t0, 1)}
        row["done"].append(name)
        emit(row)
    return row


def plot(rows: list, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for ax, what in zip(axes, ("o", "state")):
        for lb, _ in GATES:
            sel = sorted((r for r in rows if r and r["lb"] == lb), key=lambda r: r["T"])
            for name, style in (("aiter-gfx1250", "-o"), ("aiter-gfx1250-fp32op", "--s"), ("aiter-gfx950", ":^")):
                pts = [r for r in sel if name in r]
                if pts:
                    ax.plot([r["T"] for r in pts], [r[name][what] for r in pts], style, ms=3,
                            label=f"{name} lb {lb:g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens, one sequence, H 1)")
        ax.set_title(f"{what} rel-L2 vs float64")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="1024,4096,16384,65536", help="comma-separated token counts")
    ap.add_argument("--lb", default="-0.05,-5", help="comma-separated gates of GATES to run (default both)")
    ap.add_argument("--out", help="JSON file the rows are appended to")
    ap.add_argument("--plot", help="JSON file to plot instead of measuring")
    ap.add_argument("--png", help="where the plot goes (with --plot)")
    a = ap.parse_args(argv)
    if a.plot:
        rows = json.loads(Path(a.plot).read_text())
        plot(rows, a.png)
        return 0
    try:
        Ts = [int(x) for x in a.T.split(",")]
    except ValueError:
        print(f"--T: expected comma-separated integers, got {a.T!r}", file=sys.stderr)
        return 2
    try:
        want = {float(x) for x in a.lb.split(",")}
    except ValueError:
        print(f"--lb: expected comma-separated numbers, got {a.lb!r}", file=sys.stderr)
        return 2
    gates = [g for g in GATES if g[0] in want]
    if not gates:
        print(f"--lb: expected some of {', '.join(f'{lb:g}' for lb, _ in GATES)}, got {a.lb!r}", file=sys.stderr)
        return 2
    if not a.out:
        print("--out: expected a JSON file to append the rows to, got none", file=sys.stderr)
        return 2
    out = Path(a.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    for T in Ts:
        for lb, state in gates:
            at = len(rows)
            rows.append(None)

            def emit(row, at=at, t0=time.time()):
                rows[at] = dict(row)
                out.write_text(json.dumps(rows, indent=1))
                print(f"[{time.strftime('%H:%M:%S')}] T={T} lb={lb:g}: {', '.join(['truth'] + row['done'])} "
                      f"done, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            row = measure(T, lb, state, emit)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
