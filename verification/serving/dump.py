"""Trace dumps: a kernel's run of a serving trace, saved so ``kda-verify check DIR`` can judge it
anywhere with the judge of ``run --suite serving`` (docs/traces.md, "Dumps").

A dump is a directory:

    manifest.json                  {"format": "kda-verify-trace-dump/1", "trace": "trace.safetensors",
                                    "initial_cache": "cache-initial.safetensors", "steps": S,
                                    "step_files": "steps/step-{:06d}.safetensors",
                                    "prefill": {"backend", "route", "recipe"}, "decode": {...},
                                    "case": id, "device", "versions", "error": null | {step, call, message}}
    trace.safetensors              the trace (kda_ref.trace.save_trace, kda-verify-trace/1)
    cache-initial.safetensors      "cache": the flat cache buffer [buffer_numel] before step 0, cache dtype:
                                   verification.serving.execute.fresh_cache's (slots NaN, a fixed pattern
                                   in the guard rows, the padding and the NULL block), which a dumper
                                   loads as its cache so a read of an unwritten slot and a padding row's
                                   write show; check refuses another
    steps/step-000000.safetensors  per call of the step (kda_kernels.trace_calls.split_step: groups
                                   prefill, decode, spec, in that order), keys prefixed by the group:
                                     "{group}.o"       [1, T_call, HV, V] what the call returned
                                     "{group}.index"   int64 [n] flat buffer elements the call changed
                                     "{group}.values"  [n] cache dtype: their bits after the call
                                   or, instead of index / values, "{group}.cache" [buffer_numel]: the
                                   whole buffer after the call

The cache record is the elements whose bits a call changed (index and bits), against the buffer
before the call: lossless (the buffer after every call is rebuilt bit for bit from the initial
buffer), so ``check`` judges every untouched slot, guard row and padding element bitwise and names
the region, the step and the call that changed it, as ``run`` does; a checksum of the untouched
part could only say that something changed, not where; and a decode step's record is its written
slots (HV*K*V elements a slot), where whole snapshots would be the whole cache per call (10^4
decode steps x the cache).  A dumper that keeps whole buffers may write "{group}.cache" instead.

``check_dump(dir)`` replays the recorded calls through ``verification.serving.cells.run_serving_cell``
(``ReplayBackend``: its run_call applies the call's record to the live buffer and returns the
recorded o), so the oracle, the emulator baseline, ``judge.judge_step``, the diagnosis, the
tolerance lookup and the known-failure register are those of ``run`` itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from kda_kernels.base import Route
from kda_kernels.trace_calls import group_rows
from kda_ref.files import UnreadableFile, read_safetensors
from kda_ref.problem import ProblemError
from kda_ref.trace import load_trace, save_trace
from kda_ref.trace_oracle import trace_oracle
from verification.errors import UsageError
from verification.judging.tolerances import load_tolerances
from verification.running.run_cell import SELF_JUDGED
from verification.running.run_select import LoadedBackend
from verification.serving.cases import get_serving_suite
from verification.serving.cells import TraceCache, baseline_pairing, run_serving_cell
from verification.serving.execute import CallFailed, Pairing, Side, TraceRun, compact, fresh_cache
from verification.serving.judge import changed_mask, measure

DUMP_FORMAT = "kda-verify-trace-dump/1"
MANIFEST = "manifest.json"
TRACE_FILE = "trace.safetensors"
INITIAL_FILE = "cache-initial.safetensors"
STEP_FILES = "steps/step-{:06d}.safetensors"


def is_dump(path) -> bool:
    """Whether ``path`` is a directory holding a trace dump's manifest."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _bad(msg: str):
    raise UsageError(msg)


# ----------------------------------------------------------------------------------------
# Writing: a recording wrapper around each side's backend
# ----------------------------------------------------------------------------------------
class RecordingSide:
    """A RunsTraces backend that runs ``inner`` and keeps, per call, o and the elements of the
    flat buffer whose bits the call changed (``calls``: {(step, group): (o, index, values)})."""

    def __init__(self, inner, sink: dict):
        self.inner, self.sink = inner, sink
        self.name = str(getattr(inner, "name", type(inner).__name__))

    def trace_accepts(self, trace, route):
        return self.inner.trace_accepts(trace, route)

    def run_call(self, call, route):
        before = call.cache.clone()
        out = self.inner.run_call(call, route)
        idx = torch.nonzero(changed_mask(before, call.cache)).flatten()
        self.sink[(call.step, call.group)] = (out.detach().cpu().contiguous() if isinstance(out, torch.Tensor) else out,
                                              idx.cpu().to(torch.int64), call.cache[idx].detach().cpu().contiguous())
        return out


def write_dump(out_dir, tr, prefill_lb, decode_lb, rp, rd, case_id: str, device: str = "cpu",
               params: Optional[dict] = None, log=None) -> dict:
    """Run trace ``tr`` on the pairing (prefill_lb, rp) x (decode_lb, rd) and write the dump into
    ``out_dir`` (module docstring).  A call that raises ends the run: the manifest's ``error``
    names it (check then records the cell as ``error``, as run does).  Returns the manifest."""

    out = Path(out_dir)
    (out / "steps").mkdir(parents=True, exist_ok=True)
    sink: dict = {}
    a = RecordingSide(prefill_lb.backend, sink)
    b = a if decode_lb is prefill_lb else RecordingSide(decode_lb.backend, sink)
    run = TraceRun(tr, Pairing(Side(a, rp), Side(b, rd)), device=device, record_writers=False)
    save_trace(str(out / TRACE_FILE), tr)
    save_file({"cache": run.cache.detach().cpu().contiguous()}, str(out / INITIAL_FILE),
              metadata={"format": DUMP_FORMAT})
    error = None
    done = 0
    for s in range(tr.steps):
        sink.clear()
        try:
            run.step(s)
        except CallFailed as e:
            error = {"step": e.step, "call": e.call, "message": str(e)}
        tensors = {}
        for (_, group), (o, idx, vals) in sink.items():
            if isinstance(o, torch.Tensor):
                tensors[f"{group}.o"] = o
            tensors[f"{group}.index"], tensors[f"{group}.values"] = idx, vals
        save_file(tensors, str(out / STEP_FILES.format(s)), metadata={"format": DUMP_FORMAT, "step": str(s)})
        done = s + 1
        if error is not None:
            break
        if log is not None and tr.steps >= 2000 and done % 2000 == 0:
            log(f"  step {done}/{tr.steps}")

    def side(lb, r):
        return {"backend": lb.name, "spec": lb.spec, "route": r.name, "recipe": r.recipe,
                "groups": list(r.flag("groups", ()) or ()), "version": str(lb.version)}
    manifest = {"format": DUMP_FORMAT, "trace": TRACE_FILE, "initial_cache": INITIAL_FILE, "steps": done,
                "trace_steps": tr.steps, "step_files": STEP_FILES, "prefill": side(prefill_lb, rp),
                "decode": side(decode_lb, rd), "case": case_id, "params": params or {}, "device": str(device),
                "error": error}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str), encoding="utf-8")
    return manifest


# ----------------------------------------------------------------------------------------
# Reading: validation up front, then a replaying backend
# ----------------------------------------------------------------------------------------
SIDE_KEYS = ("backend", "route", "recipe")


@dataclass
class Dump:
    path: Path
    manifest: dict
    trace: object
    initial: torch.Tensor
    calls: dict = field(default_factory=dict)     # (step, group) -> the step file's keys, validated

    def step_file(self, s: int) -> Path:
        return self.path / self.manifest["step_files"].format(s)


def _read_st(path: Path, what: str) -> dict:
    try:
        return read_safetensors(path)[0]
    except UnreadableFile as e:
        _bad(f"{path}: expected {what}, got no such file" if e.missing
             else f"{path}: expected {what} (safetensors), got a file that cannot be read ({e.reason})")


def load_dump(path) -> Dump:
    """Read and validate every file of a dump before anything runs; a bad or missing file is one
    UsageError line naming the file, what was expected and what came."""
    root = Path(path)
    mpath = root / MANIFEST
    if not mpath.is_file():
        _bad(f"{mpath}: expected a trace dump manifest (kda-verify capture --suite serving --out DIR), got no such file")
    try:
        man = json.loads(mpath.read_text(encoding="utf-8"))
    except ValueError as e:
        _bad(f"{mpath}: expected JSON, got text that does not parse ({e})")
    if not isinstance(man, dict) or man.get("format") != DUMP_FORMAT:
        got = man.get("format") if isinstance(man, dict) else type(man).__name__
        _bad(f"{mpath}: expected format {DUMP_FORMAT!r}, got {got!r}")
    for key in ("trace", "initial_cache", "steps", "step_files", "prefill", "decode"):
        if key not in man:
            _bad(f"{mpath}: expected the key {key!r}, got none")
    for which in ("prefill", "decode"):
        sd = man[which]
        if not isinstance(sd, dict) or any(not isinstance(sd.get(k), str) or not sd.get(k) for k in SIDE_KEYS):
            _bad(f"{mpath}: expected {which} to be an object with the strings {', '.join(SIDE_KEYS)}, got {sd!r}")
    try:
        tr = load_trace(str(root / man["trace"]))
    except ProblemError as e:
        _bad(f"{root / man['trace']}: {e}")
    steps = man["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= tr.steps:
        _bad(f"{mpath}: expected steps to be an integer in 1..{tr.steps} (the trace's steps), got {steps!r}")
    if steps < tr.steps and not man.get("error"):
        _bad(f"{mpath}: expected {tr.steps} steps (the trace's) or an error naming where the run stopped, got "
             f"{steps} steps and no error")
    spec = tr.cache
    ini = _read_st(root / man["initial_cache"], "the initial cache buffer 'cache'")
    c = ini.get("cache")
    if c is None or tuple(c.shape) != (spec.buffer_numel,) or c.dtype != spec.torch_dtype:
        got = "none" if c is None else f"{str(c.dtype).replace('torch.', '')} {list(c.shape)}"
        _bad(f"{root / man['initial_cache']}: expected 'cache' {spec.dtype} [{spec.buffer_numel}] (the trace's "
             f"cache buffer), got {got}")
    differ = int(changed_mask(fresh_cache(spec), c).sum())
    if differ:
        _bad(f"{root / man['initial_cache']}: expected the buffer verification.serving.execute.fresh_cache makes "
             f"(slots NaN, a fixed pattern in the guard rows, the padding and the NULL block: what shows a read of "
             f"an unwritten slot and a padding row's write), got {differ} element(s) differing")
    d = Dump(path=root, manifest=man, trace=tr, initial=c)
    phases, bounds, rt = tr.row_phase.tolist(), tr.step_rows.tolist(), tr.row_tokens().tolist()
    for s in range(steps):
        f = d.step_file(s)
        t = _read_st(f, f"step {s}'s calls")
        groups = group_rows(phases[bounds[s]:bounds[s + 1]])
        last = s == steps - 1 and man.get("error")
        for g, pos in groups.items():
            T = sum(rt[bounds[s] + p + 1] - rt[bounds[s] + p] for p in pos)
            o = t.get(f"{g}.o")
            want = (1, T, tr.HV, tr.V)
            if o is None and last:
                continue                            # the call that raised: no output
            if o is None or tuple(o.shape) != want or not o.is_floating_point():
                got = "none" if o is None else f"{str(o.dtype).replace('torch.', '')} {list(o.shape)}"
                _bad(f"{f}: expected '{g}.o' a float tensor {list(want)} (step {s}'s {g} call), got {got}")
            if f"{g}.cache" in t:
                x = t[f"{g}.cache"]
                if tuple(x.shape) != (spec.buffer_numel,) or x.dtype != spec.torch_dtype:
                    _bad(f"{f}: expected '{g}.cache' {spec.dtype} [{spec.buffer_numel}], got "
                         f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}")
                continue
            idx, val = t.get(f"{g}.index"), t.get(f"{g}.values")
            if idx is None or val is None:
                _bad(f"{f}: expected '{g}.index' and '{g}.values' (or '{g}.cache') for step {s}'s {g} call, got "
                     f"{'neither' if idx is None and val is None else 'only one'}")
            if idx.dim() != 1 or idx.dtype != torch.int64 or (idx.numel() and (int(idx.min()) < 0 or
                                                                               int(idx.max()) >= spec.buffer_numel)):
                _bad(f"{f}: expected '{g}.index' int64 [n] in [0, {spec.buffer_numel}), got "
                     f"{str(idx.dtype).replace('torch.', '')} {list(idx.shape)}"
                     + (f" from {int(idx.min())} to {int(idx.max())}" if idx.numel() and idx.dim() == 1 else ""))
            if tuple(val.shape) != tuple(idx.shape) or val.dtype != spec.torch_dtype:
                _bad(f"{f}: expected '{g}.values' {spec.dtype} {list(idx.shape)} (one per index), got "
                     f"{str(val.dtype).replace('torch.', '')} {list(val.shape)}")
        extra = sorted(k for k in t if k.split(".", 1)[0] not in groups)
        if extra:
            _bad(f"{f}: expected only the calls {', '.join(groups)} of step {s}, got {extra[0]!r} too")
    return d


class ReplayBackend:
    """A RunsTraces backend that replays a dump: ``run_call`` applies the recorded changes of the
    call to the live buffer and returns the recorded o (it raises what the manifest's error
    recorded, at that call).  ``name`` is the recorded backend's, so the tolerance lookup, the
    labels and the known-failure register are those of ``run``."""

    def __init__(self, dump: Dump, name: str):
        self.dump, self.name = dump, name
        self._file = (None, None)

    def available(self):
        return True, ""

    def version(self):
        return ""

    def trace_accepts(self, trace, route):
        return True, ""

    def _step(self, s: int) -> dict:
        if self._file[0] != s:
            self._file = (s, _read_st(self.dump.step_file(s), f"step {s}'s calls"))
        return self._file[1]

    def run_call(self, call, route):
        err = self.dump.manifest.get("error")
        if call.step >= self.dump.manifest["steps"]:
            raise RuntimeError("the dump ends before this step")
        t = self._step(call.step)
        g = call.group
        if err and call.step == err.get("step") and f"{g}.o" not in t:
            raise RuntimeError(f"(recorded by capture) {err.get('message', '')}")
        if f"{g}.cache" in t:
            call.cache.copy_(t[f"{g}.cache"].to(call.cache.device))
        else:
            idx = t[f"{g}.index"].to(call.cache.device)
            call.cache[idx] = t[f"{g}.values"].to(call.cache.device)
        return t[f"{g}.o"].to(call.cache.device)


@dataclass
class DumpCase:
    """What run_serving_cell needs of a case: the dump's trace, its id and parameters (those of the
    built-in serving case it names, when it names one)."""
    id: str
    trace: object
    seed: Optional[int] = None
    params: dict = field(default_factory=dict)
    drift: bool = False
    reference: str = ""
    suite: str = "serving"

    def build(self):
        return self.trace


def _case_of(d: Dump) -> DumpCase:
    cid = str(d.manifest.get("case") or f"serving/{d.path.name}")
    params = d.manifest.get("params") if isinstance(d.manifest.get("params"), dict) else {}
    for c in get_serving_suite(long=True):
        if c.id == cid:
            return DumpCase(id=cid, trace=d.trace, seed=c.seed, params=dict(c.params), drift=c.drift,
                            reference=c.reference)
    return DumpCase(id=cid, trace=d.trace, params=params)


def check_dump(path, db=None, device: str = "cpu") -> dict:
    """The cell record of a dump, judged as run judges a serving cell (module docstring)."""
    d = load_dump(path)
    db = load_tolerances(None) if db is None else db
    lbs, routes = {}, {}
    for which in ("prefill", "decode"):
        sd = d.manifest[which]
        spec = sd.get("spec") or sd["backend"]
        if spec not in lbs:
            lbs[spec] = LoadedBackend(spec=spec, backend=ReplayBackend(d, sd["backend"]), available=True, reason="",
                                      version=str(sd.get("version", "")), from_spec=False)
        groups = tuple(sd.get("groups") or (("prefill",) if which == "prefill" else ("decode", "spec")))
        routes[which] = (lbs[spec], Route(sd["route"], recipe=sd["recipe"], flags=(("groups", groups),)))
    (la, rp), (lb, rd) = routes["prefill"], routes["decode"]
    case = _case_of(d)
    cache = TraceCache()
    cache.get(case)
    rows = baseline_rows(d.trace, rp, rd, device)
    if rows is not None:                  # the baseline always runs: a dump is never its own baseline
        cache.baselines[(rp.recipe, rd.recipe)] = rows
    rec = run_serving_cell(la, lb, rp, rd, case, db, cache, device=device)
    rec["repro"] = f"kda-verify check {d.path}"
    if rec.pop("self_judged", None):      # the dump was judged against an independent emulator run, not itself
        rec["reason"] = rec.get("reason", "").replace(f"{SELF_JUDGED}; ", "").replace(SELF_JUDGED, "")
    if d.manifest["steps"] < d.trace.steps and rec.get("status") == "pass":   # never a pass on part of a trace
        rec.update(status="error", reason=f"the dump holds {d.manifest['steps']} of {d.trace.steps} steps")
    return rec


def baseline_rows(tr, rp, rd, device: str = "cpu") -> Optional[list]:
    """The baseline's compact per-step errors on ``tr`` (execute.measure / execute.compact of the
    emulator pairing cells.baseline_pairing names), or None where there is no baseline (the cell
    then says why, as run does).  check computes them itself so that a dump recorded from the
    emulator is judged against an independent emulator run, not against itself (run's
    ``same_pairing`` shortcut would make the dump its own baseline and let any error pass)."""
    base, why = baseline_pairing(rp, rd)
    if base is None:
        return None
    br = TraceRun(tr, base, device=device, record_writers=False)
    rows = []
    try:
        for st in trace_oracle(tr):
            b = br.step(st.step)
            rows.append(compact(measure(st, b.o, b.after)))
    except CallFailed:
        return None
    return rows


def verdict_line(rec: dict) -> str:
    """The line run prints for a cell (verification.running.run_progress.Progress without a terminal)."""
    reason = rec.get("reason") or ""
    return f"{rec.get('status', '?'):10} {rec.get('backend')} {rec.get('route')} {rec.get('case')}" + (
        f" - {reason}" if reason and rec.get("status") != "pass" else "")
