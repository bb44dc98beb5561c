"""Shrinking a failing serving cell to the smallest trace that fails the same way, and its bundle.

The cell (case, prefill side, decode side) is run and judged as ``run --suite serving`` judges it
(``execute.run_pairing`` against the oracle and the emulator baseline of ``cells.baseline_pairing``,
tolerances of ``cells.tolerances_for``).  While it fails, the trace is reduced greedily and
deterministically, each step kept only when the reduced trace is consistent (kda_ref.trace's
``validate_trace``) and still fails the same way:

    steps      keep the first half of the steps; drop the last step; drop any one step (a dropped
               decode leaves the request's slot holding its previous state, which the next row
               then reads: still consistent)
    requests   drop every row of one request
    padding    drop one padding row
    tokens     cut a prefill row to half its tokens, or by one (the request's later rows read the
               state after its accepted tokens, whatever their number)
    heads      keep one value head (q, k, v, g, beta, A_log, dt_bias sliced; the cache's HV with it)

The families run in that order, each until none of its steps is kept; rounds repeat until one
keeps nothing or ``max_runs`` cells have run.

The same failure (``TraceSignature``): the status class (fail or error) and the mark of the first
failing item of the original run among the marks of the reduced run's failing items.  A mark is
(kind, what): ``("untouched", "null-block" | "slot" | "guard" | "padding")`` for an element the
step does not write that changed (a write outside the step's slots), ``("o", phase)`` for o drift,
``("state", phase)`` for slot drift, ``("error", "raised <Type>")`` for a call that raised.

The bundle (``write_trace_bundle``): a trace dump of the final trace (``verification.serving.dump``,
so ``kda-verify check .`` judges it), ``truth.safetensors`` (the float64 references of the
checked items), ``repro.py`` (needs torch, safetensors, kda-verify's kda_ref and kda_kernels and
the kernel's library; it replays the trace through kda_kernels' adapter of the backend, the calls
an engine makes, from the dump's initial cache, and holds each failing item to the threshold the
verdict recorded: an untouched element changed, o of a (request, step) or a written slot's rel_l2
over its threshold; exit 1 ``REPRODUCED``, 0 ``NOT REPRODUCED``, 2 when the kernel cannot be
called), ``REPORT.md`` and ``shrink.json``; repro.py is run once in a fresh process from another
directory (``verification.reporting.bundle.verify_repro``).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from kda_ref.problem import ProblemError
from kda_ref.trace import PAD, PREFILL, Trace, validate_trace
from kda_ref.trace_oracle import trace_oracle
from verification.judging.metrics import dtype_name
from verification.judging.record import encode as jsonable
from verification.judging.verdict import NEGLIGIBLE_SLICE
from verification.investigating.shrink import greedy_reduce
from verification.reporting.bundle import REPRO_MAIN, environment, verify_repro
from verification.serving.cells import tolerances_for
from verification.serving.dump import write_dump
from verification.serving.execute import PairingResult, pairing_refusal, run_pairing

DEFAULT_MAX_RUNS = 200


# ----------------------------------------------------------------------------------------
# Signatures
# ----------------------------------------------------------------------------------------
def mark(item) -> tuple:
    """(kind, what) of a failing judge Item (module docstring)."""
    if item.kind == "untouched":
        w = item.where or ""
        what = ("null-block" if "NULL block" in w else "guard" if "guard rows" in w
                else "padding" if "padding after" in w else "slot")
        return ("untouched", what)
    return (item.kind, item.phase or "")


@dataclass(frozen=True)
class TraceSignature:
    status: str                  # fail | error | "" (does not fail)
    marks: tuple                 # every failing item's mark, the first failure's first

    @property
    def failing(self) -> bool:
        return bool(self.status) and bool(self.marks)

    def keeps(self, other: "TraceSignature") -> bool:
        return self.failing and other.failing and other.status == self.status and self.marks[0] in other.marks

    def describe(self) -> str:
        if not self.failing:
            return "no failure"
        k, w = self.marks[0]
        return {"untouched": f"a write outside the step's slots ({w})", "o": f"o drift ({w})",
                "state": f"slot drift ({w})", "error": f"the kernel {w}"}.get(k, f"{k} {w}")


def signature_of(res) -> TraceSignature:
    """The TraceSignature of an execute.PairingResult."""
    if res.status == "error":
        m = re.search(r"raised (\w+)", res.reason or "")
        return TraceSignature("error", (("error", f"raised {m.group(1) if m else 'an exception'}"),))
    if res.status != "fail" or res.first_failure is None:
        return TraceSignature("", ())
    marks = [mark(res.first_failure)] + [mark(i) for i in res.failures]
    return TraceSignature("fail", tuple(dict.fromkeys(marks)))


# ----------------------------------------------------------------------------------------
# Trace surgery
# ----------------------------------------------------------------------------------------
def size_of(tr: Trace) -> dict:
    """steps, requests, live rows, padding rows, tokens and value heads of a trace."""
    ph = tr.row_phase.tolist()
    return {"steps": tr.steps, "requests": len(set(tr.row_request.tolist()) - {-1}),
            "rows": sum(1 for p in ph if p != PAD), "padding_rows": ph.count(PAD), "tokens": tr.tokens, "HV": tr.HV}


def measure_key(tr: Trace) -> tuple:
    """What a reduction must lower (compared as a tuple, each field no larger and one smaller)."""
    s = size_of(tr)
    return (s["steps"], s["requests"], s["rows"] + s["padding_rows"], s["tokens"], s["HV"])


def smaller(a: Trace, b: Trace) -> bool:
    x, y = measure_key(a), measure_key(b)
    return all(p <= q for p, q in zip(x, y)) and x != y


def subtrace(tr: Trace, rows: list, lens: Optional[dict] = None, heads: Optional[list] = None) -> Optional[Trace]:
    """The trace of ``rows`` (trace row numbers, in order) with row n cut to its first ``lens[n]``
    tokens, steps left without a row dropped, and the value heads ``heads`` (None: all); None when
    the result is not a consistent trace."""
    lens = lens or {}
    rt = tr.row_tokens().tolist()
    bounds = tr.step_rows.tolist()
    step_of = []
    for s in range(tr.steps):
        step_of += [s] * (bounds[s + 1] - bounds[s])
    new_len = [lens.get(n, rt[n + 1] - rt[n]) for n in rows]
    if not rows:
        return None
    tok = torch.tensor([t for n, L in zip(rows, new_len) for t in range(rt[n], rt[n] + L)], dtype=torch.long)
    sel = torch.tensor(rows, dtype=torch.long)
    steps = [step_of[n] for n in rows]
    sr = [0] + [i + 1 for i in range(len(rows)) if i == len(rows) - 1 or steps[i + 1] != steps[i]]
    acc = tr.accepted[sel].clone()
    for i, n in enumerate(rows):
        if int(tr.row_phase[n]) != 2:
            acc[i] = new_len[i]
    H, HV = tr.H, tr.HV
    hv = list(range(HV)) if heads is None else list(heads)
    group = HV // H
    hq = sorted({h // group for h in hv})
    if heads is not None and len(hv) > 1 and len(hv) != len(hq) * group:
        return None

    def take(t, hs):
        return t.index_select(0, tok).index_select(1, torch.tensor(hs)).contiguous()
    cache = tr.cache
    if len(hv) != HV:
        pad = cache.stride - cache.slot_numel
        new_numel = len(hv) * cache.K * cache.V
        cache = dataclasses.replace(cache, HV=len(hv), slot_stride=None if cache.slot_stride is None else new_numel + pad)
    dt = tr.dt_bias
    if dt is not None and len(hv) != HV:
        d2 = dt.reshape(HV, tr.K).index_select(0, torch.tensor(hv))
        dt = (d2 if dt.dim() == 2 else d2.reshape(-1)).contiguous()
    new = Trace(cache=cache, q=take(tr.q, hq), k=take(tr.k, hq), v=take(tr.v, hv), g=take(tr.g, hv),
                beta=tr.beta.index_select(0, tok).index_select(1, torch.tensor(hv)).contiguous(),
                step_rows=torch.tensor(sr, dtype=tr.step_rows.dtype),
                row_len=torch.tensor(new_len, dtype=tr.row_len.dtype), row_request=tr.row_request[sel].clone(),
                row_phase=tr.row_phase[sel].clone(), state_indices=tr.state_indices[sel].clone(),
                has_initial_state=tr.has_initial_state[sel].clone(),
                num_accepted_tokens=tr.num_accepted_tokens[sel].clone(), accepted=acc,
                A_log=None if tr.A_log is None else tr.A_log.reshape(-1)[hv].reshape(
                    (len(hv),) + tuple(tr.A_log.shape[1:])).contiguous(),
                dt_bias=dt, scale=tr.scale, lower_bound=tr.lower_bound, gate=tr.gate, beta_kind=tr.beta_kind,
                qk_l2norm=tr.qk_l2norm, meta=dict(tr.meta))
    try:
        return validate_trace(new)
    except (ProblemError, ValueError, IndexError):
        return None


def _rows(tr: Trace) -> list:
    return list(range(tr.rows))


def step_steps(tr: Trace) -> list:
    b = tr.step_rows.tolist()
    S = tr.steps
    out = []
    if S >= 4:
        h = S // 2
        out.append((f"keep steps 0-{h - 1} of {S}", list(range(0, b[h]))))
    for s in reversed(range(S)):
        if S > 1:
            out.append((f"drop step {s} of {S}", [n for n in range(tr.rows) if not b[s] <= n < b[s + 1]]))
    return [(d, (lambda r=r: subtrace(tr, r))) for d, r in out]


def request_steps(tr: Trace) -> list:
    reqs = sorted(set(tr.row_request.tolist()) - {-1})
    if len(reqs) < 2:
        return []
    rr = tr.row_request.tolist()
    return [(f"drop request {r}", (lambda r=r: subtrace(tr, [n for n in range(tr.rows) if rr[n] != r])))
            for r in reversed(reqs)]


def padding_steps(tr: Trace) -> list:
    ph = tr.row_phase.tolist()
    return [(f"drop padding row {n}", (lambda n=n: subtrace(tr, [m for m in range(tr.rows) if m != n])))
            for n in reversed(range(tr.rows)) if ph[n] == PAD]


def token_steps(tr: Trace) -> list:
    ph, ln = tr.row_phase.tolist(), tr.row_len.tolist()
    out = []
    for n in sorted(range(tr.rows), key=lambda n: -ln[n]):
        if ph[n] != PREFILL or ln[n] < 2:
            continue
        for new in dict.fromkeys((ln[n] // 2, ln[n] - 1)):
            if 1 <= new < ln[n]:
                out.append((f"cut row {n} (prefill) to {new} of its {ln[n]} tokens",
                            (lambda n=n, new=new: subtrace(tr, _rows(tr), lens={n: new}))))
    return out


def head_steps(tr: Trace) -> list:
    if tr.HV < 2:
        return []
    return [(f"keep value head {h} of {tr.HV}", (lambda h=h: subtrace(tr, _rows(tr), heads=[h])))
            for h in range(tr.HV)]


FAMILIES = (("steps", step_steps), ("requests", request_steps), ("padding", padding_steps),
            ("tokens", token_steps), ("heads", head_steps))


# ----------------------------------------------------------------------------------------
# The shrink
# ----------------------------------------------------------------------------------------
@dataclass
class TraceAttempt:
    trace: Trace
    result: object                  # execute.PairingResult
    signature: TraceSignature


@dataclass
class TraceShrinkResult:
    original: TraceAttempt
    final: TraceAttempt
    trace: list = field(default_factory=list)     # accepted steps
    runs: int = 0
    seconds: float = 0.0
    stopped: str = ""


class TraceShrinker:
    """Runs one pairing on a trace and its reductions through ``execute.run_pairing``."""

    def __init__(self, pairing, baseline, db, device: str = "cpu", log: Optional[Callable[[str], None]] = None):
        self.pairing, self.baseline, self.db, self.device = pairing, baseline, db, device
        self.log = log or (lambda s: None)
        self.runs = 0

    def attempt(self, tr: Trace) -> TraceAttempt:
        self.runs += 1
        why = pairing_refusal(tr, self.pairing)
        if why:
            res = PairingResult(status="not-applicable", reason=why)
        else:
            res = run_pairing(tr, self.pairing, tolerances_for(self.db, self.pairing, dtype_name(tr.v.dtype)),
                              baseline=self.baseline, device=self.device)
        return TraceAttempt(tr, res, signature_of(res))

    def shrink(self, tr: Trace, max_runs: int = DEFAULT_MAX_RUNS) -> TraceShrinkResult:
        t0 = time.perf_counter()
        first = self.attempt(tr)
        out = TraceShrinkResult(first, first)
        if not first.signature.failing:
            out.runs, out.seconds, out.stopped = self.runs, time.perf_counter() - t0, "the cell does not fail"
            return out

        def candidates(steps, cur):
            for desc, make in steps(cur.trace):
                def attempt(make=make):
                    cand = make()
                    return self.attempt(cand) if cand is not None and smaller(cand, cur.trace) else None
                yield desc, attempt

        def on_step(fam, desc, cur):
            step = {"step": len(out.trace) + 1, "family": fam, "op": desc, "size": size_of(cur.trace),
                    "failure": cur.signature.describe(), "run": self.runs}
            out.trace.append(step)
            self.log(f"  step {step['step']} (run {self.runs}): {desc} -> {describe_size(cur.trace)}")

        cur, out.stopped = greedy_reduce(first, FAMILIES, candidates, lambda: self.runs >= max_runs, on_step)
        out.final, out.runs, out.seconds = cur, self.runs, time.perf_counter() - t0
        return out


def describe_size(tr: Trace) -> str:
    s = size_of(tr)
    return (f"{s['steps']} steps, {s['requests']} requests, {s['rows']} live rows + {s['padding_rows']} padding, "
            f"{s['tokens']} tokens, HV {s['HV']}")


# ----------------------------------------------------------------------------------------
# The bundle
# ----------------------------------------------------------------------------------------
MAX_CHECKS = 12


def checks_and_truth(att: TraceAttempt) -> tuple:
    """(checks, truth tensors) of repro.py from the final attempt's failing items: the first
    MAX_CHECKS, each with what the verdict recorded (threshold, observed) and the references the
    repro needs (o rows and slot contents, float64, from the oracle)."""
    items = [att.result.first_failure] + [i for i in att.result.failures if i is not att.result.first_failure]
    items = [i for i in items if i is not None][:MAX_CHECKS]
    want = {i.step for i in items}
    truth, checks = {}, []
    for st in trace_oracle(att.trace):
        if st.step not in want:
            if st.step > max(want):
                break
            continue
        live = st.o[st.token_live]
        ms = float((live * live).sum()) / max(live.numel(), 1)
        for it in (i for i in items if i.step == st.step):
            c = {"kind": it.kind, "step": it.step, "where": it.where, "threshold": it.threshold,
                 "observed": it.err, "failed": True, "written": list(st.written)}
            if it.kind == "o":
                rp = next(r for r in st.plan.rows if r.row == it.row)
                a = rp.tok0 - st.plan.tok0
                key = f"o.step{it.step}.row{it.row}"
                truth[key] = st.o[a:a + rp.T].clone()
                c.update(request=it.request, tok0=a, tokens=rp.T, truth=key,
                         floor_sq=NEGLIGIBLE_SLICE ** 2 * ms * truth[key].numel())
            elif it.kind == "state":
                key = f"state.step{it.step}.slot{it.slot}"
                truth[key] = st.expected(it.slot).contiguous().clone()     # the cache's layout
                c.update(slot=it.slot, truth=key)
            else:
                c.update(slot=it.slot, observed=it.err)
            checks.append(c)
    return checks, truth


REPRO = r'''#!/usr/bin/env python3
"""Standalone repro: a serving trace on prefill {prefill_label}, decode {decode_label}.

Needs: torch, safetensors, kda-verify's kda_ref and kda_kernels (the adapters that make each call
as a serving engine does){needs}.  Run from anywhere:  python repro.py [--device DEVICE]
Replays trace.safetensors step by step from cache-initial.safetensors, each step split into its
prefill / decode / spec calls (kda_kernels.trace_calls.split_step), and holds the failing items
below to the thresholds the verdict recorded (references in truth.safetensors, float64).
Exit 1 when a check fails (REPRODUCED), 0 when every check holds (NOT REPRODUCED), 2 when the
kernel cannot be called here.
"""
import json
import math
import os
import sys

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = json.loads({sides!r})
CHECKS = json.loads({checks!r})
INT = {{torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}}


def main(argv):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "--device" in argv:
        device = argv[argv.index("--device") + 1]
    if device == "cpu" and any(s["backend"] == "triton" for s in SIDES.values()):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kda_kernels.base import load_backend
    from kda_kernels.trace_calls import assemble, split_step
    from kda_ref.trace import load_trace
    tr = load_trace(os.path.join(HERE, "trace.safetensors"))
    truth = load_file(os.path.join(HERE, "truth.safetensors"))
    cache = load_file(os.path.join(HERE, "cache-initial.safetensors"))["cache"].to(device)
    sides = {{}}
    try:
        for which, s in SIDES.items():
            b = load_backend(s["spec"])
            ok, why = b.available()
            if not ok:
                raise ImportError(why)
            sides[which] = (b, next(r for r in b.trace_routes() if r.name == s["route"]))
    except ImportError as e:
        print(f"repro: cannot load the kernel: {{e}}", file=sys.stderr)
        return 2
    spec = tr.cache
    last = max(c["step"] for c in CHECKS)
    failed = []
    for s in range(last + 1):
        before = cache.clone()
        calls = split_step(tr, s, cache)
        outs = []
        raised = None
        for c in calls:
            b, r = sides["prefill" if c.group == "prefill" else "decode"]
            try:
                outs.append(b.run_call(c, r))
            except Exception as e:  # noqa: BLE001 - a raise is what an error check holds the kernel to
                raised = f"{{type(e).__name__}}: {{e}}"
                break
        mine = [c for c in CHECKS if c["step"] == s]
        if raised:
            print(f"step {{s}}: the kernel raised {{raised}}")
            failed += mine or [{{"kind": "error", "step": s, "where": raised}}]
            break
        if not mine:
            continue
        T = int(tr.row_tokens()[int(tr.step_rows[s + 1])] - tr.row_tokens()[int(tr.step_rows[s])])
        o = assemble(calls, outs, T).double().cpu()
        view = spec.view(cache)
        for c in mine:
            if c["kind"] == "untouched":
                it = INT[cache.dtype]
                ch = before.view(it) != cache.view(it)
                written = torch.zeros(spec.buffer_numel, dtype=torch.bool, device=cache.device)
                for slot in c["written"]:
                    spec.view(written)[slot] = True
                n = int((ch & ~written).sum())
                bad = n > 0
                print(f"check step {{s}}: elements the step does not write changed: {{n}} (the bundle recorded "
                      f"{{c['where']}}) -> {{'FAILS' if bad else 'holds'}}")
            elif c["kind"] == "o":
                x = o[c["tok0"]:c["tok0"] + c["tokens"]]
                ref = truth[c["truth"]]
                d = x - ref
                e2 = float((d * d).sum()) if bool(torch.isfinite(x).all()) else math.inf
                den = max(float((ref * ref).sum()), c["floor_sq"])
                err = 0.0 if e2 == 0 else (math.inf if den == 0 else math.sqrt(e2 / den))
                bad = not err <= c["threshold"]
                print(f"check o {{c['where']}}: rel_l2 {{err:.4g}} vs threshold {{c['threshold']:.4g}} -> "
                      f"{{'FAILS' if bad else 'holds'}}")
            else:
                x = view[c["slot"]].double().cpu()
                ref = truth[c["truth"]]                      # in the cache's layout already
                num = float(torch.linalg.vector_norm(x - ref)) if bool(torch.isfinite(x).all()) else math.inf
                den = float(torch.linalg.vector_norm(ref))
                err = 0.0 if num == 0 else (math.inf if den == 0 else num / den)
                bad = not err <= c["threshold"]
                print(f"check state {{c['where']}}: rel_l2 {{err:.4g}} vs threshold {{c['threshold']:.4g}} -> "
                      f"{{'FAILS' if bad else 'holds'}}")
            failed += [c] if bad else []
    print("REPRODUCED" if failed else "NOT REPRODUCED")
    return 1 if failed else 0

'''


def write_trace_bundle(out_dir, res: TraceShrinkResult, prefill_lb, decode_lb, rp, rd, case_id: str,
                       device: str, command: str) -> dict:
    """Write the bundle of a TraceShrinkResult (module docstring); returns the shrink.json dict."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fin, orig = res.final, res.original
    write_dump(out, fin.trace, prefill_lb, decode_lb, rp, rd, case_id + "~shrunk", device=device)
    checks, truth = checks_and_truth(fin)
    save_file({k: v.contiguous() for k, v in truth.items()}, str(out / "truth.safetensors"),
              metadata={"what": "float64 oracle (kda_ref.trace_oracle) of the checked items"})
    sides = {"prefill": {"backend": prefill_lb.name, "spec": prefill_lb.spec, "route": rp.name},
             "decode": {"backend": decode_lb.name, "spec": decode_lb.spec, "route": rd.name}}
    libs = sorted({s["backend"] for s in sides.values()} & {"fla", "aiter", "moonshot", "cudnn"})
    src = REPRO.format(prefill_label=f"{prefill_lb.name}:{rp.name}", decode_label=f"{decode_lb.name}:{rd.name}",
                       sides=json.dumps(sides), checks=json.dumps(jsonable(checks)),
                       needs=f" and the kernel's library ({', '.join(libs)})" if libs else "") + REPRO_MAIN
    (out / "repro.py").write_text(src, encoding="utf-8")
    data = {"case": case_id, "prefill": sides["prefill"], "decode": sides["decode"], "device": str(device),
            "original": {"size": size_of(orig.trace), "status": orig.result.status, "reason": orig.result.reason,
                         "failure": orig.signature.describe()},
            "final": {"size": size_of(fin.trace), "status": fin.result.status, "reason": fin.result.reason,
                      "failure": fin.signature.describe(), "describe": fin.trace.describe()},
            "checks": checks, "trace": res.trace, "runs": res.runs, "seconds": res.seconds, "stopped": res.stopped,
            "environment": environment(f"{prefill_lb.version} / {decode_lb.version}", device),
            "command": command, "check_command": "kda-verify check .", "repro_command": "python repro.py"}
    data["repro_check"] = verify_repro(out, device, checks)
    (out / "shrink.json").write_text(json.dumps(jsonable(data), indent=1, allow_nan=False), encoding="utf-8")
    (out / "REPORT.md").write_text(report_md(data, fin.trace), encoding="utf-8")
    return data


def report_md(d: dict, tr: Trace) -> str:
    fin, orig = d["final"], d["original"]
    a, b = orig["size"], fin["size"]
    rc = d.get("repro_check") or {}
    L = [f"# prefill {d['prefill']['backend']}:{d['prefill']['route']}, decode {d['decode']['backend']}:"
         f"{d['decode']['route']}: {fin['failure']}", "",
         f"A serving trace of {b['steps']} step(s), {b['requests']} request(s), {b['tokens']} token(s) "
         f"({tr.describe()}) fails: {fin['reason']}", "",
         "## Shrink", "",
         f"Original: {d['case']}: {a['steps']} steps, {a['requests']} requests, {a['rows']} live rows + "
         f"{a['padding_rows']} padding rows, {a['tokens']} tokens, HV {a['HV']}: {orig['failure']}", ""]
    for s in d["trace"]:
        L.append(f"{s['step']}. {s['op']}")
    L += ["", f"Final: {b['steps']} steps, {b['requests']} requests, {b['rows']} live rows + {b['padding_rows']} "
          f"padding rows, {b['tokens']} tokens, HV {b['HV']}; {d['runs']} runs, {d['seconds']:.1f} s; stopped: "
          f"{d['stopped']}.", "", "## Checks (repro.py)", "", "| kind | where | observed | threshold |", "|---|---|---|---|"]
    for c in d["checks"]:
        L.append(f"| {c['kind']} | {c['where']} | {c['observed']:.4g} | {c['threshold']:.4g} |"
                 if c["kind"] != "untouched" else f"| untouched | {c['where']} | {int(c['observed'])} elements changed "
                 f"| bitwise unchanged |")
    sw = d["environment"]["software"]
    L += ["", "## Environment", "", f"- device: {d['device']}; library: {d['environment']['library']}",
          f"- torch {sw.get('torch')}, python {sw.get('python')}, kda-verify commit "
          f"{d['environment']['kda_verify_git'].get('commit')}", "",
          "## Reproduce", "", "From the bundle's directory:", "", "```bash",
          f"python repro.py          # when written: exit {rc.get('exit')}: {rc.get('last_line', '')}",
          f"{d['check_command']}       # judges the dumped outputs as run --suite serving does",
          f"{d['command']}", "```", ""]
    return "\n".join(L)


def shrink_command(prefill_lb, decode_lb, rp, rd, case_id: str, out: str = ".") -> str:
    argv = ["kda-verify", "shrink", "--backend", prefill_lb.spec, "--route", rp.name]
    if decode_lb.spec != prefill_lb.spec:
        argv += ["--decode-backend", decode_lb.spec]
    argv += ["--decode-route", rd.name, "--suite", "serving", "--case", case_id, "--out", out]
    return " ".join(shlex.quote(x) for x in argv)


