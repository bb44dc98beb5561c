"""Problem and output files (safetensors).

A problem file holds the tensors ``q k v g beta`` and, when present, ``A_log dt_bias
cu_seqlens initial_state state_cache state_indices has_initial_state out_gate norm_weight``
(each in its own dtype), and string metadata:

    format              kda-verify-problem/1
    scale               a number, or "none" (K^-1/2)
    lower_bound         a number, or "none"
    gate                lower_bound | softplus | pregated
    beta                the beta kind: sigmoid | sigmoid2 | pregated
    qk_l2norm           true | false
    state_layout        kv | vk | paged
    output_final_state  true | false
    norm_eps            a number > 0 (written with out_gate / norm_weight, the fused output norm)
    meta                (optional) Problem.meta as a JSON object ({...}; an array or a scalar is refused)

A missing metadata key takes the Problem's default, but the block itself is required: a
file with no string metadata at all (``save_file(tensors)``) is refused naming the block, and
``gate=lower_bound`` (the default gate) needs the ``lower_bound`` key.  An output (truth) file
holds ``o`` and ``final_state`` (or ``state_cache`` when paged), plus any extra tensors (ws_*,
segments), and string metadata (``format`` kda-verify-outputs/1 and whatever the writer adds).
``load_outputs(path, problem)`` also holds the tensors it judges to the problem's shapes:

    o            [B, T, HV, V]
    final_state  [N, HV, K, V] (kv) or [N, HV, V, K] (vk), when output_final_state
    state_cache  the problem's state_cache shape (paged)
    ws_inv       [HV*tiles, C, C], C in 16/32/64, tiles = sum over sequences of ceil(len / C)

(ws_inv's own form, 3 dims, square, C in 16/32/64, is checked without a problem too).

Bad files raise UsageError (file, metadata) or ProblemError (tensors) naming the key.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

from safetensors.torch import save_file

from kda_ref.files import UnreadableFile, read_safetensors
from kda_ref.problem import (BETA_KINDS, FLOAT_DTYPES, FLOAT_NAMES, GATE_KINDS, Problem, ProblemError,
                             STATE_LAYOUTS, shape_of)
from kda_ref.workspace import SUPPORTED_C
from verification.errors import UsageError

PROBLEM_FORMAT = "kda-verify-problem/1"
OUTPUTS_FORMAT = "kda-verify-outputs/1"
REQUIRED_TENSORS = ("q", "k", "v", "g", "beta")
OPTIONAL_TENSORS = ("A_log", "dt_bias", "cu_seqlens", "initial_state", "state_cache", "state_indices",
                    "has_initial_state", "out_gate", "norm_weight")
META_KEYS = ("scale", "lower_bound", "gate", "beta", "qk_l2norm", "state_layout", "output_final_state", "norm_eps")


def _usage(msg: str) -> Exception:
    return UsageError(msg)


def _num(x) -> str:
    return "none" if x is None else repr(float(x))


def _bool(x: bool) -> str:
    return "true" if x else "false"


def _save(path: str, tensors: dict, metadata: dict):
    clean = {n: t.detach().contiguous().clone() for n, t in tensors.items() if t is not None}
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    save_file(clean, path, metadata={k: str(v) for k, v in metadata.items()})


def _open(path: str, what: str):
    """(tensors, metadata) of a safetensors file, with one-line errors."""
    try:
        return read_safetensors(path)
    except UnreadableFile as e:
        raise _usage(e.line(what)) from None


def save_problem(path: str, problem: Problem) -> None:
    """Write a Problem (tensors in their own dtypes, options as string metadata)."""
    tensors = {n: getattr(problem, n) for n in REQUIRED_TENSORS + OPTIONAL_TENSORS}
    meta = {"format": PROBLEM_FORMAT, "scale": _num(problem.scale), "lower_bound": _num(problem.lower_bound),
            "gate": problem.gate, "beta": problem.beta_kind, "qk_l2norm": _bool(problem.qk_l2norm),
            "state_layout": problem.state_layout, "output_final_state": _bool(problem.output_final_state)}
    if problem.fused_norm:
        meta["norm_eps"] = _num(problem.norm_eps)
    if problem.meta:
        meta["meta"] = json.dumps(problem.meta, default=str, sort_keys=True)
    _save(path, tensors, meta)


def _parse_num(key: str, s: str, path: str):
    if s.strip().lower() == "none":
        return None
    try:
        x = float(s)
    except ValueError:
        raise _usage(f"{key}: expected a number or 'none' in the metadata of {path}, got {s!r}") from None
    if not math.isfinite(x):
        raise _usage(f"{key}: expected a finite number or 'none' in the metadata of {path}, got {s!r}")
    return x


def _parse_bool(key: str, s: str, path: str) -> bool:
    v = s.strip().lower()
    if v not in ("true", "false"):
        raise _usage(f"{key}: expected true or false in the metadata of {path}, got {s!r}")
    return v == "true"


def _parse_choice(key: str, s: str, choices, path: str) -> str:
    if s not in choices:
        raise _usage(f"{key}: expected one of {'|'.join(choices)} in the metadata of {path}, got {s!r}")
    return s


_JSON_KIND = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def load_problem(path: str) -> Problem:
    """Read a problem file back into a Problem (not validated: call kda_ref.validate)."""
    tensors, meta = _open(path, "inputs")
    fmt = meta.get("format", PROBLEM_FORMAT)
    if fmt != PROBLEM_FORMAT:
        raise _usage(f"format: expected {PROBLEM_FORMAT!r} in the metadata of {path}, got {fmt!r}")
    for n in REQUIRED_TENSORS:
        if n not in tensors:
            raise ProblemError(f"{n}: expected a tensor {n!r} in {path}, got none "
                               f"(it holds {', '.join(sorted(tensors)) or 'no tensors'})")
    known = set(REQUIRED_TENSORS + OPTIONAL_TENSORS)
    extra = sorted(set(tensors) - known)
    if extra:
        raise _usage(f"{extra[0]}: expected only the tensors {', '.join(REQUIRED_TENSORS + OPTIONAL_TENSORS)} "
                     f"in {path}, got an unknown tensor {extra[0]!r}")
    if not meta:
        raise _usage(f"metadata: expected the string metadata block of a {PROBLEM_FORMAT} file in {path} "
                     f"(keys {', '.join(('format',) + META_KEYS)}), got none: the file holds tensors only "
                     f"(write it with verification.reporting.problem_file.save_problem or kda-verify export)")
    kw = {n: tensors.get(n) for n in REQUIRED_TENSORS + OPTIONAL_TENSORS}
    kw["scale"] = _parse_num("scale", meta.get("scale", "none"), path)
    kw["lower_bound"] = _parse_num("lower_bound", meta.get("lower_bound", "none"), path)
    kw["gate"] = _parse_choice("gate", meta.get("gate", "lower_bound"), GATE_KINDS, path)
    kw["beta_kind"] = _parse_choice("beta", meta.get("beta", "sigmoid"), BETA_KINDS, path)
    kw["qk_l2norm"] = _parse_bool("qk_l2norm", meta.get("qk_l2norm", "true"), path)
    kw["state_layout"] = _parse_choice("state_layout", meta.get("state_layout", "kv"), STATE_LAYOUTS, path)
    kw["output_final_state"] = _parse_bool("output_final_state", meta.get("output_final_state", "true"), path)
    if "norm_eps" in meta:
        eps = _parse_num("norm_eps", meta["norm_eps"], path)
        if eps is None or not eps > 0:
            raise _usage(f"norm_eps: expected a number > 0 in the metadata of {path}, got {meta['norm_eps']!r}")
        kw["norm_eps"] = eps
    if kw["gate"] == "lower_bound" and "lower_bound" not in meta:
        raise _usage(f"lower_bound: expected a number < 0 in the metadata of {path} for gate=lower_bound"
                     f"{'' if 'gate' in meta else ' (the default gate)'}, got no 'lower_bound' key")
    if "meta" in meta:
        try:
            kw["meta"] = json.loads(meta["meta"])
        except json.JSONDecodeError:
            raise _usage(f"meta: expected JSON in the metadata of {path}, got {meta['meta'][:40]!r}") from None
        if not isinstance(kw["meta"], dict):
            raise _usage(f"meta: expected a JSON object ({{...}}) in the metadata of {path}, got a JSON "
                         f"{_JSON_KIND.get(type(kw['meta']), type(kw['meta']).__name__)} {meta['meta'][:40]!r}")
    return Problem(**kw)


def save_outputs(path: str, tensors: dict, meta: dict) -> None:
    """Write output tensors (``o``, ``final_state`` or ``state_cache``, extras) with string metadata."""
    if "o" not in tensors or tensors["o"] is None:
        raise _usage(f"tensors: expected an 'o' tensor to write to {path}, got {', '.join(sorted(tensors))}")
    md = {"format": OUTPUTS_FORMAT}
    md.update({k: (v if isinstance(v, str) else json.dumps(v, default=str)) for k, v in (meta or {}).items()})
    _save(path, tensors, md)


def load_outputs(path: str, problem: Optional[Problem] = None) -> dict:
    """The tensors of an output file (``o`` always; ``final_state`` or ``state_cache``; extras).
    With ``problem`` the tensors that are judged are held to its shapes (``check_outputs``)."""
    tensors, meta = _open(path, "outputs")
    fmt = meta.get("format", OUTPUTS_FORMAT)
    if fmt != OUTPUTS_FORMAT:
        raise _usage(f"format: expected {OUTPUTS_FORMAT!r} in the metadata of {path}, got {fmt!r}")
    if "o" not in tensors:
        raise ProblemError(f"o: expected a tensor 'o' in {path}, got none "
                           f"(it holds {', '.join(sorted(tensors)) or 'no tensors'})")
    check_outputs(tensors, problem, path)
    return tensors


def _tiles(problem: Problem, C: int) -> int:
    """Tiles of the chunk grid at chunk size C: sum over sequences of ceil(len / C)."""
    return sum(-(-(e - b) // C) for b, e in problem.seq_bounds())


def check_outputs(tensors: dict, problem: Optional[Problem], path: str) -> None:
    """Raise ProblemError naming the first output tensor of ``path`` whose dtype is not a float
    one or whose shape is not the one the problem gives it (the table in the module docstring);
    without a problem only ws_inv's own form is checked.  Tensors that are not judged pass."""
    for name in ("o", "final_state", "state_cache", "ws_inv"):
        t = tensors.get(name)
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise ProblemError(f"{name}: expected a {FLOAT_NAMES} tensor in {path}, got {shape_of(t)}")
    inv = tensors.get("ws_inv")
    Cs = "|".join(str(c) for c in SUPPORTED_C)
    if inv is not None and not (inv.dim() == 3 and inv.shape[1] == inv.shape[2] and inv.shape[2] in SUPPORTED_C):
        raise ProblemError(f"ws_inv: expected [HV*tiles,C,C] with C = {Cs} in {path}, got {shape_of(inv)}")
    if problem is None:
        return
    p = problem
    want = {"o": ((p.B, p.T, p.HV, p.V), "[B,T,HV,V]")}
    if p.paged:
        want["state_cache"] = (tuple(p.state_cache.shape), "the problem's state_cache")
    elif p.output_final_state:
        want["final_state"] = (((p.N, p.HV, p.K, p.V), "[N,HV,K,V], layout kv") if p.state_layout == "kv"
                               else ((p.N, p.HV, p.V, p.K), "[N,HV,V,K], layout vk"))
    if inv is not None:
        C = int(inv.shape[-1])
        tiles = _tiles(p, C)
        want["ws_inv"] = ((p.HV * tiles, C, C), f"[HV*tiles,C,C]: HV={p.HV} x {tiles} tiles at C={C}")
    for name, (shape, what) in want.items():
        t = tensors.get(name)
        if t is not None and tuple(t.shape) != shape:
            raise ProblemError(f"{name}: expected {list(shape)} ({what}) in {path}, got {shape_of(t)}")


def load_outputs_metadata(path: str) -> dict:
    """The string metadata of an output file."""
    return _open(path, "outputs")[1]
