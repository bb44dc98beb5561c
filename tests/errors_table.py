"""The bad-input table of docs/errors.md, made from the messages the real entry points print.

Each row runs one bad input through the entry point a user meets (``kda-verify``'s ``main``
in-process for the CLI, ``pytest -m verify`` in a child process for the plugin, the function
itself for the Python API) inside a scratch directory, so file names read ``P.safetensors``,
and takes the one line it printed: for the CLI the text after ``kda-verify <command>: error: ``,
which must come with exit 2 and be the only line on stderr.  A row whose entry point answers
otherwise (another exit code, a traceback, two lines) is an error of the table, not a row.

    python tests/errors_table.py            # print the table
    python tests/errors_table.py --write    # replace the table in docs/errors.md
    python tests/errors_table.py --check    # exit 1 when docs/errors.md's table differs

tests/test_errors_table.py fails when docs/errors.md's table is not the one this module makes.
Test code, not shipped: it lives in tests/ and the wheel has no copy (tests/test_wheel.py).
Run as a script it puts its checkout first on sys.path, so the table is this checkout's.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path[:1]:   # as a script: this checkout's packages
    sys.path.insert(0, str(ROOT))
BEGIN = "<!-- bad-input table: made by `python tests/errors_table.py --write`; do not edit by hand -->"
END = "<!-- end of the bad-input table -->"
DOC = ROOT / "docs" / "errors.md"


class TableError(RuntimeError):
    """A row's entry point did not answer with one line and exit 2."""


@dataclass
class Row:
    situation: str
    where: str                       # the entry point as the user types it
    produce: Callable[[], str]       # runs in the scratch directory; returns the message
    quoted: str = ""                 # the message's tail from this text on is another library's words,
                                     # which change with its version: shown as "...)"
    alike: tuple = ()                # (prefix, produce) of the other inputs the situation names: each must
                                     # exit 2 with one line beginning with prefix (None: the row's own message)


# ----------------------------------------------------------------------------- entry points
def cli(argv: list[str]) -> str:
    """The message of ``kda-verify ARGV`` (in-process), which must exit 2 with one stderr line."""
    from verification.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:          # argparse's own errors
            rc = e.code
        except Exception as e:           # noqa: BLE001 - a traceback is what the table must not show
            raise TableError(f"kda-verify {' '.join(argv)}: raised {type(e).__name__}: {e}") from e
    lines = err.getvalue().strip().splitlines()
    prefix = f"kda-verify {argv[0]}: error: "
    if rc != 2 or len(lines) != 1 or not lines[0].startswith(prefix):
        raise TableError(f"kda-verify {' '.join(argv)}: expected exit 2 and one line '{prefix}...', "
                         f"got exit {rc} and {lines!r}")
    return lines[0][len(prefix):]


def no_cuda():
    """This machine as one without a GPU, whatever it has."""
    return contextlib.ExitStack() if not torch.cuda.is_available() else _patched_no_cuda()


@contextlib.contextmanager
def _patched_no_cuda():
    with mock.patch("torch.cuda.is_available", lambda: False), mock.patch("torch.cuda.device_count", lambda: 0):
        yield


def pytest_verify(options: list[str]) -> str:
    """The message of the failing ``verify[options]`` item of ``pytest -m verify OPTIONS`` (bad input: exit 2)."""
    Path("test_matrix.py").write_text("from verification.pytest_plugin import verify  # noqa: F401\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "verify", "-rf",
                        *options, "test_matrix.py"], capture_output=True, text=True, timeout=300)
    key = "kda-verify options: "
    hits = [ln[ln.index(key) + len(key):] for ln in r.stdout.splitlines() if key in ln]
    if r.returncode != 2 or not hits or "Traceback" in r.stdout + r.stderr:
        raise TableError(f"pytest -m verify {' '.join(options)}: expected exit 2 and a 'verify[options]' item, "
                         f"got exit {r.returncode}: {(r.stdout + r.stderr)[-400:]!r}")
    return hits[0]


def python_api(call: Callable[[], object]) -> str:
    """``Type: message`` of the error a Python API call raises."""
    try:
        call()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    raise TableError(f"{call}: expected an error, got none")


# ----------------------------------------------------------------------------- problems and files
def base(name: str = "varlen-partial-empty"):
    """A selfcheck problem: varlen-partial-empty is B=1 T=119 H=2 HV=2 K=16 V=16, 7 sequences."""
    from verification.investigating.selfcheck import RECIPES, build
    return build({r.name: r for r in RECIPES}[name], 0)


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _cu(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def write_problem(problem, path: str = "P.safetensors", meta: Optional[dict] = None, drop=(), add=None) -> str:
    """Save ``problem``; ``meta`` overrides metadata keys (None drops one; {} as a whole writes no
    metadata block), ``drop`` leaves tensors out, ``add`` adds tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from verification.reporting.problem_file import save_problem
    save_problem(path, problem)
    if meta is None and not drop and not add:
        return path
    with safe_open(path, framework="pt") as f:
        md, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys() if n not in drop}
    tensors.update(add or {})
    if meta == {}:
        md = None
    else:
        for k, v in (meta or {}).items():
            if v is None:
                md.pop(k, None)
            else:
                md[k] = v
    save_file(tensors, path, metadata=md)
    return path


def oracle_of(change: Callable) -> Callable[[], str]:
    """A row through ``kda-verify oracle`` on the base problem changed by ``change``."""
    def produce() -> str:
        write_problem(change(base()))
        return cli(["oracle", "--inputs", "P.safetensors", "--out", "T.safetensors"])
    return produce


def _oracle_outputs(problem, chunk: int = 32) -> None:
    """P.safetensors holding ``problem`` and O.safetensors its truth, workspace at ``chunk``."""
    from verification.cli import main
    write_problem(problem)
    with contextlib.redirect_stdout(io.StringIO()):
        if main(["oracle", "--inputs", "P.safetensors", "--out", "O.safetensors", "--workspace",
                 "--chunk-size", str(chunk)]) != 0:
            raise TableError("oracle: could not write the outputs the row changes")


def _changed_outputs(change: Callable) -> None:
    from verification.reporting.problem_file import load_outputs, save_outputs
    save_outputs("O.safetensors", change(load_outputs("O.safetensors")), {})


def check_outputs_of(change: Callable) -> Callable[[], str]:
    """A row through ``kda-verify check`` on the oracle's outputs of the base problem changed by
    ``change`` (a function of the dict of output tensors)."""
    def produce() -> str:
        _oracle_outputs(base())
        _changed_outputs(change)
        return cli(["check", "--inputs", "P.safetensors", "--outputs", "O.safetensors", "--recipe", "flashkda"])
    return produce


def _load_outputs_of(change: Callable) -> Callable[[], str]:
    """A row through ``load_outputs(path, problem)`` on the oracle's outputs changed by ``change``."""
    def produce() -> str:
        from verification.reporting.problem_file import load_outputs
        p = base()
        _oracle_outputs(p)
        _changed_outputs(change)
        return python_api(lambda: load_outputs("O.safetensors", p))
    return produce


def _empty_T(p):
    return p.replace(q=p.q[:, :0], k=p.k[:, :0], v=p.v[:, :0], g=p.g[:, :0], beta=p.beta[:, :0],
                     cu_seqlens=torch.zeros_like(p.cu_seqlens))


def _empty_check() -> str:
    from verification.reporting.problem_file import save_outputs
    p = _empty_T(base())
    write_problem(p)
    save_outputs("O.safetensors", {"o": torch.zeros(p.v.shape)}, {})
    return cli(["check", "--inputs", "P.safetensors", "--outputs", "O.safetensors", "--recipe", "flashkda"])


def _paged_nan_read(p):
    p = base("paged")
    return p.replace(state_cache=_set(p.state_cache, int(p.state_indices[0]), float("nan")))


def _paged_dup(p):
    p = base("paged")
    return p.replace(state_indices=_set(p.state_indices, 1, int(p.state_indices[0])))


def _file_row(meta=None, drop=(), add=None, text: Optional[bytes] = None, path="P.safetensors"):
    def produce() -> str:
        if text is not None:
            Path(path).write_bytes(text)
        else:
            write_problem(base(), meta=meta, drop=drop, add=add)
        return cli(["oracle", "--inputs", path, "--out", "T.safetensors"])
    return produce


def _run(*flags: str) -> Callable[[], str]:
    return lambda: cli(["run", "--backend", "emulator", "--suite", "smoke", "--out", "R", "--no-report", *flags])


def _resume_other(flags: list[str]) -> Callable[[], str]:
    """``run --resume`` into R, which a run of emulator flashkda on smoke/dense-T64-lb-5 wrote, with
    ``flags`` changing its selection."""
    def produce() -> str:
        from verification.cli import main
        first = {"--backend": "emulator", "--route": "flashkda", "--suite": "smoke", "--case": "smoke/dense-T64-lb-5"}
        argv = ["run", "--out", "R", "--no-report", "--device", "cpu"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if main(argv + [x for kv in first.items() for x in kv]) != 0:
                raise TableError("run: could not write the run the row resumes")
        again = dict(first)
        for opt, value in zip(flags[::2], flags[1::2]):
            again[opt] = value
        return cli(argv + [x for kv in again.items() for x in kv] + ["--resume"])
    return produce


def _no_gpu(argv: list[str]) -> Callable[[], str]:
    def produce() -> str:
        with no_cuda():
            return cli(argv)
    return produce


TOLERANCES_WITH_AN_UNKNOWN_FIELD = """schema: 1
entries:
  - backend: emulator
    route: "*"
    dtype: "*"
    tensor: "*"
    m: 1.0
    margin: 3
    floor: 1.0e-9
    cap: 5.0e-2
    reason: one entry
"""


def _tolerance_field() -> str:
    Path("t.yaml").write_text(TOLERANCES_WITH_AN_UNKNOWN_FIELD)
    return cli(["run", "--backend", "emulator", "--suite", "smoke", "--out", "R", "--no-report", "--tolerances", "t.yaml"])


def _out_existing_file() -> str:
    Path("afile").write_text("")
    return cli(["run", "--backend", "emulator", "--suite", "smoke", "--out", "afile", "--no-report"])


def _out_under_a_file(argv: list[str], problem: bool = False) -> Callable[[], str]:
    def produce() -> str:
        Path("afile").write_text("")
        if problem:
            write_problem(base())
        return cli(argv)
    return produce


def _invariance_varlen():
    from verification.investigating.invariance import varlen_slice
    return python_api(lambda: varlen_slice(None, None, base("dense")))


def _invariance_split():
    from verification.investigating.invariance import split_carry
    return python_api(lambda: split_carry(None, None, base("dense"), 80, chunk_size=64))


P = "oracle --inputs P.safetensors"


def rows() -> list[Row]:
    """Every row of the table, in the order of docs/errors.md."""
    return [
        # ----- problem tensors (kda_ref.validate), through the CLI
        Row("k with another K than q, g, dt_bias", P, oracle_of(lambda p: p.replace(k=p.k[..., :-1]))),
        Row("q with another K than k, g, dt_bias", P, oracle_of(lambda p: p.replace(q=p.q[..., :-1]))),
        Row("K without a majority", P, oracle_of(lambda p: p.replace(q=p.q[..., :-1], k=p.k[..., :-1]))),
        Row("k with another B, T or H than q", P, oracle_of(lambda p: p.replace(k=p.k[:, :-1]))),
        Row("v with another B or T", P, oracle_of(lambda p: p.replace(v=p.v[:, :-1]))),
        Row("H = 0", P, oracle_of(lambda p: p.replace(q=p.q[:, :, :0], k=p.k[:, :, :0]))),
        Row("HV not a multiple of H", P, oracle_of(lambda p: p.replace(v=torch.zeros(1, 119, 3, 16)))),
        Row("g with another B, T or HV", P, oracle_of(lambda p: p.replace(g=p.g[:, :-1]))),
        Row("beta shape", P, oracle_of(lambda p: p.replace(beta=p.beta[..., :1]))),
        Row("A_log shape", P, oracle_of(lambda p: p.replace(A_log=p.A_log[:1]))),
        Row("dt_bias size", P, oracle_of(lambda p: p.replace(dt_bias=p.dt_bias[:-1]))),
        Row("dt_bias shaped [K,HV]", P, oracle_of(lambda p: p.replace(dt_bias=p.dt_bias.reshape(2, 16).T.contiguous()))),
        Row("float8 inputs (k, v, g, beta, A_log, dt_bias alike)", P,
            oracle_of(lambda p: p.replace(q=p.q.to(torch.float8_e4m3fn))),
            alike=tuple((f"{n}: expected a float16, bfloat16, float32 or float64 tensor, got ",
                         oracle_of(lambda p, n=n: p.replace(**{n: getattr(p, n).to(torch.float8_e5m2)})))
                        for n in ("k", "v", "g", "beta", "A_log", "dt_bias"))),
        Row("integer initial state (state_cache alike)", P,
            oracle_of(lambda p: p.replace(initial_state=p.initial_state.to(torch.int64))),
            alike=(("state_cache: expected a float16, bfloat16, float32 or float64 tensor, got [7, 2, 16, 16] int32",
                    oracle_of(lambda p: base("paged").replace(
                        state_cache=torch.zeros(base("paged").state_cache.shape, dtype=torch.int32)))),)),
        Row("initial_state with another N, HV, K or V", P,
            oracle_of(lambda p: p.replace(initial_state=p.initial_state[..., :-1]))),
        Row("initial_state in the other layout", P, oracle_of(lambda p: base("gva").replace(state_layout="vk"))),
        Row("cu_seqlens not starting at 0", P,
            oracle_of(lambda p: p.replace(cu_seqlens=_cu([1, 17, 50, 50, 114, 119, 119, 119])))),
        Row("cu_seqlens decreasing", P,
            oracle_of(lambda p: p.replace(cu_seqlens=_cu([0, 17, 50, 40, 114, 119, 119, 119])))),
        Row("cu_seqlens not ending at T", P,
            oracle_of(lambda p: p.replace(cu_seqlens=_cu([0, 17, 50, 50, 114, 118, 118, 118])))),
        Row("cu_seqlens bool (float alike)", P, oracle_of(lambda p: p.replace(cu_seqlens=p.cu_seqlens.bool())),
            alike=(("cu_seqlens: expected an integer tensor [N+1] with N >= 1, got [8] float64",
                    oracle_of(lambda p: p.replace(cu_seqlens=p.cu_seqlens.double()))),)),
        Row("varlen with B != 1", P, oracle_of(
            lambda p: base("dense").replace(cu_seqlens=_cu([0, 70]), initial_state=base("dense").initial_state[:1]))),
        Row("NaN in q (NaN or Inf in k, v, g, beta, A_log, dt_bias, initial_state alike)", P,
            oracle_of(lambda p: p.replace(q=_set(p.q, (0, 3, 1, 2), float("nan")))),
            alike=tuple((f"{n}: expected finite values, got 1 NaN/Inf (first at index ",
                         oracle_of(lambda p, n=n, x=x: p.replace(**{n: _set(getattr(p, n), (0,) * getattr(p, n).dim(), x)}))) for n, x in (
                ("k", float("inf")), ("v", float("nan")), ("g", -float("inf")), ("beta", float("nan")),
                ("A_log", float("nan")), ("dt_bias", float("inf")), ("initial_state", float("nan"))))),
        Row("NaN/Inf in a cache slot that is read", P, oracle_of(_paged_nan_read)),
        Row("state_indices out of range", P,
            oracle_of(lambda p: base("paged").replace(state_indices=_set(base("paged").state_indices, 2, 7)))),
        Row("state_indices duplicated", P, oracle_of(_paged_dup)),
        Row("lower_bound not negative", P, oracle_of(lambda p: p.replace(lower_bound=2.0))),
        Row("softplus gate without A_log", P, oracle_of(lambda p: p.replace(gate="softplus", A_log=None))),
        Row("gate=pregated with g > 0 (a decay > 1)", P,
            oracle_of(lambda p: p.replace(gate="pregated", g=_set(-p.g.abs(), (0, 9, 1, 4), 0.25)))),
        # ----- problem files (verification.reporting.problem_file)
        Row("a file without its metadata block", P, _file_row(meta={})),
        Row("lower_bound key missing (gate=lower_bound)", P, _file_row(meta={"lower_bound": None})),
        Row("lower_bound none for gate=lower_bound", P, _file_row(meta={"lower_bound": "none"})),
        Row("unknown metadata value (beta, state_layout, qk_l2norm, output_final_state, scale, lower_bound, "
            "format alike)", P, _file_row(meta={"gate": "tanh"}),
            alike=tuple((f"{k}: expected ", _file_row(meta={k: v})) for k, v in (
                ("beta", "relu"), ("state_layout", "kvv"), ("qk_l2norm", "yes"), ("output_final_state", "1"),
                ("scale", "nan"), ("lower_bound", "-five"), ("format", "other/9")))),
        Row("meta not a JSON object (an array, a string, a number)", P, _file_row(meta={"meta": "[1, 2]"}),
            alike=(("meta: expected a JSON object ({...}) in the metadata of P.safetensors, got a JSON string ",
                    _file_row(meta={"meta": '"case"'})),)),
        Row("tensor missing from a file", P, _file_row(drop=("beta",))),
        Row("unknown tensor in a file", P, _file_row(add={"gamma": torch.zeros(3)})),
        Row("missing file", P, lambda: cli(["oracle", "--inputs", "none.safetensors", "--out", "T.safetensors"])),
        Row("unreadable file", P, _file_row(text=b"not a safetensors file"), quoted="(SafetensorError: "),
        # ----- check
        Row("an empty problem (T = 0 or B = 0)", "check --inputs P.safetensors --outputs O.safetensors",
            _empty_check),
        Row("ws_inv of no chunk size in an outputs file", "check --inputs P.safetensors --outputs O.safetensors",
            check_outputs_of(lambda t: dict(t, ws_inv=t["ws_inv"][:, :, :16].contiguous()))),
        Row("an integer o in an outputs file", "check --inputs P.safetensors --outputs O.safetensors",
            check_outputs_of(lambda t: dict(t, o=t["o"].to(torch.int32)))),
        Row("o of another shape in an outputs file", "problem_file.load_outputs(path, problem)",
            _load_outputs_of(lambda t: dict(t, o=t["o"][:, :-1].contiguous()))),
        Row("ws_inv with another tile count in an outputs file", "problem_file.load_outputs(path, problem)",
            _load_outputs_of(lambda t: dict(t, ws_inv=t["ws_inv"][:-1].contiguous()))),
        # ----- flags
        Row("`--device cuda` without a GPU", "oracle --device cuda",
            _no_gpu(["oracle", "--inputs", "none.safetensors", "--out", "T.safetensors", "--device", "cuda"])),
        Row("`--chunk-size 48`", "oracle --chunk-size 48",
            lambda: write_problem(base()) and cli(["oracle", "--inputs", "P.safetensors", "--out", "T.safetensors",
                                                   "--chunk-size", "48"])),
        Row("bad `--shapes`", "oracle-bench --shapes 1x2",
            lambda: cli(["oracle-bench", "--shapes", "1x2", "--device", "cpu"])),
        Row("a count below 1 (`--chunks-per-seg` of oracle and oracle-bench alike)", "oracle-bench --repeat 0",
            lambda: cli(["oracle-bench", "--repeat", "0", "--device", "cpu"]),
            alike=(("--chunks-per-seg: expected an integer >= 1, got 0",
                    lambda: cli(["oracle-bench", "--chunks-per-seg", "0", "--device", "cpu"])),
                   ("--chunks-per-seg: expected an integer >= 1, got 0",
                    lambda: write_problem(base()) and cli(["oracle", "--inputs", "P.safetensors", "--out",
                                                           "T.safetensors", "--chunks-per-seg", "0"])))),
        Row("an option of the other backend's kernels (`--kernels`, `--kernel-timeout` with triton alike)",
            "isa --backend aiter --routes seg", lambda: cli(["isa", "--backend", "aiter", "--routes", "seg"]),
            alike=(("--kernels: expected only with --backend aiter, got it with --backend triton",
                    lambda: cli(["isa", "--kernels", "walk"])),
                   ("--kernel-timeout: expected only with --backend aiter",
                    lambda: cli(["isa", "--kernel-timeout", "60"])))),
        Row("unknown suite (`calibrate` alike)", "run --suite nope", _run("--suite", "nope"),
            alike=((None, lambda: cli(["calibrate", "--backend", "emulator", "--suite", "nope"])),)),
        Row("unknown route", "run --route nope", _run("--route", "nope")),
        Row("unknown backend", "run --backend nope",
            lambda: cli(["run", "--backend", "nope", "--suite", "smoke", "--out", "R", "--no-report"])),
        Row("a case of no suite", "run --case smoke/nope", _run("--case", "smoke/nope")),
        Row("`--resume` of another selection (backends, routes, suites, cases, fuzz draw alike)",
            "run --resume --case smoke/paged-lb-5", _resume_other(["--case", "smoke/paged-lb-5"]),
            alike=tuple(("--resume: expected the selection of the run in R (", _resume_other(flags)) for flags in (
                ["--backend", "emulator,emulator-bad"], ["--route", "fla"], ["--suite", "smoke,stress"],
                ["--suite", "fuzz", "--case", "fuzz/*", "--fuzz-n", "3"]))),
        Row("`--timeout` without `--isolate`", "run --timeout 5", _run("--timeout", "5")),
        Row("not a torch device", "run --device tpu", _run("--device", "tpu")),
        Row("`--device cuda` without a GPU", "run --device cuda", _no_gpu(
            ["run", "--backend", "emulator", "--suite", "smoke", "--out", "R", "--no-report", "--device", "cuda"])),
        Row("`--max-cells 0`", "run --max-cells 0", _run("--max-cells", "0")),
        Row("`--fuzz-n 0` (`--fuzz-seed -1`, `calibrate`, `export` alike)", "run --fuzz-n 0",
            lambda: cli(["run", "--backend", "emulator", "--suite", "fuzz", "--out", "R", "--no-report",
                         "--fuzz-n", "0"]),
            alike=(("--fuzz-seed: expected an integer >= 0, got '-1'", lambda: cli(
                      ["run", "--backend", "emulator", "--suite", "fuzz", "--out", "R", "--no-report", "--fuzz-seed", "-1"])),
                   (None, lambda: cli(["calibrate", "--backend", "emulator", "--suite", "fuzz", "--fuzz-n", "0"])),
                   (None, lambda: cli(["export", "--case", "fuzz/fuzz0-000", "--fuzz-n", "0", "--out", "P.safetensors"])))),
        Row("`--fuzz-n` without the fuzz suite", "run --suite smoke --fuzz-n 50", _run("--fuzz-n", "50")),
        Row("a fuzz case without the draw's n", "export --case fuzz/fuzz0-123",
            lambda: cli(["export", "--case", "fuzz/fuzz0-123", "--out", "P.safetensors"])),
        Row("a case id without a suite", "export --case nope/x",
            lambda: cli(["export", "--case", "nope/x", "--out", "P.safetensors"])),
        Row("`--tolerances` file missing", "run --tolerances none.yaml", _run("--tolerances", "none.yaml")),
        Row("unknown field in a tolerance file", "run --tolerances t.yaml", _tolerance_field),
        Row("`--out` (a directory) an existing file", "run --out afile", _out_existing_file),
        Row("`--out` that cannot be created", "run --out afile/sub",
            _out_under_a_file(["run", "--backend", "emulator", "--suite", "smoke", "--out", "afile/sub", "--no-report"])),
        Row("an `--out` file whose directory is a file (`oracle`, `capture` alike)", "export --out afile/P.safetensors",
            _out_under_a_file(["export", "--case", "smoke/dense-T64-lb-5", "--out", "afile/P.safetensors"]),
            alike=tuple(("--out: expected a file in a directory, got 'afile/T.safetensors' ('afile' is a file)",
                         _out_under_a_file(argv, problem=True)) for argv in (
                ["oracle", "--inputs", "P.safetensors", "--out", "afile/T.safetensors"],
                ["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", "P.safetensors",
                 "--out", "afile/T.safetensors"]))),
        Row("unknown route (emulator)", "capture --route nope", lambda: cli(
            ["capture", "--backend", "emulator", "--route", "nope", "--inputs", "P.safetensors", "--out", "O"])),
        Row("a backend without passes", "debug --backend emulator", lambda: cli(
            ["debug", "--backend", "emulator", "--route", "flashkda", "--case", "smoke/dense-T64-lb-5", "--pass", "all"])),
        Row("`report DIR` not a directory", "report runs/none", lambda: cli(["report", "runs/none"])),
        Row("`report` of several DIRs without `--out` (or with one of them, or one holding results)",
            "report runs/a runs/b", _report_merge(["report", "runs/a", "runs/b"]),
            alike=(("--out: expected a directory other than the DIRs merged",
                    _report_merge(["report", "runs/a", "runs/b", "--out", "runs/a"])),
                   ("--out: expected a directory without results files",
                    _report_merge(["report", "runs/a", "runs/b", "--out", "runs/c"])))),
        Row("a bad option of the pytest plugin: one failing item `verify[options]` with the message of the "
            "matching `run` flag", "pytest -m verify --kda-suite nope",
            lambda: pytest_verify(["--kda-backend", "emulator", "--kda-suite", "nope"]),
            alike=((None, _run("--suite", "nope")),)),
        Row("an invariance on the wrong kind of problem", "invariance.varlen_slice(backend, route, p)",
            _invariance_varlen),
        Row("a split outside the sequence", "invariance.split_carry(backend, route, p, 80)", _invariance_split),
    ]


def _report_merge(argv: list[str]) -> Callable[[], str]:
    """``cli(argv)`` with runs/a, runs/b and runs/c results directories of one cell each."""
    def produce():
        from verification.judging.record import RESULTS_FILE, append_record
        for d in ("runs/a", "runs/b", "runs/c"):
            os.makedirs(d, exist_ok=True)
            append_record(Path(d) / RESULTS_FILE, {"key": "emulator|flashkda|smoke/dense-T64-lb-5", "status": "pass"})
        return cli(argv)
    return produce


# ----------------------------------------------------------------------------- the table
def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{_cell(text)}{pad}{fence}"


HEADER = ("| situation | where | message |", "|---|---|---|")


def row_head(row: Row) -> str:
    """The row's first two cells as the table writes them: ``| situation | where |``."""
    return f"| {_cell(row.situation)} | {_code(row.where)} |"


def _in_scratch(produce: Callable[[], str]) -> str:
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="kda-errors-") as d:
        os.chdir(d)
        try:
            return produce()
        finally:
            os.chdir(cwd)


def make_line(row: Row) -> str:
    """The table line of ``row``: its message produced in a fresh scratch directory."""
    msg = _in_scratch(row.produce)
    if "\n" in msg:
        raise TableError(f"{row.situation}: expected one line, got {msg!r}")
    for prefix, produce in row.alike:
        other = _in_scratch(produce)
        if not other.startswith(msg if prefix is None else prefix):
            raise TableError(f"{row.situation}: expected an input it names alike to print "
                             f"{'the same message' if prefix is None else repr(prefix + '...')}, got {other!r}")
    if row.quoted:
        if row.quoted not in msg:
            raise TableError(f"{row.situation}: expected {row.quoted!r} in the message, got {msg!r}")
        msg = msg[:msg.index(row.quoted) + len(row.quoted)] + "...)"
    return f"{row_head(row)} {_code(msg)} |"


def make_table(selected: Optional[list[Row]] = None) -> str:
    """The markdown table of ``selected`` rows (default: every row)."""
    lines = list(HEADER) + [make_line(row) for row in (selected if selected is not None else rows())]
    return "\n".join(lines) + "\n"


def doc_table(text: str) -> str:
    """The table between the markers of docs/errors.md's text."""
    if BEGIN not in text or END not in text:
        raise TableError(f"docs/errors.md: expected the markers {BEGIN!r} and {END!r}, got none")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def replace_table(text: str, table: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + table + rest[rest.index(END):]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/errors_table.py", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the table in docs/errors.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/errors.md's table differs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        table = make_table()
    except TableError as e:
        print(f"errors_table: error: {e}", file=sys.stderr)
        return 1
    if args.write:
        DOC.write_text(replace_table(DOC.read_text(), table))
        print(f"wrote the bad-input table ({len(table.splitlines()) - 2} rows) to {DOC}")
    elif args.check:
        same = doc_table(DOC.read_text()) == table
        print("docs/errors.md's bad-input table is current" if same else
              "docs/errors.md's bad-input table differs: run python tests/errors_table.py --write")
        return 0 if same else 1
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
