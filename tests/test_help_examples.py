"""Every example of every command's --help runs, as written, in a scratch directory.

Each example line of ``kda-verify COMMAND --help`` is run as ``python -m verification ARGS`` in a
fresh copy of a scratch directory holding the files the examples name (SEED below, each made by a
kda-verify command line of its own), with this checkout first on PYTHONPATH, and must end with
exit 0 or the exit code its note states (``exits 1: ...``).  An example whose note says
``needs: cuda, MODULE`` is skipped, with that reason, where there is no CUDA device or the module
is not installed (and is a ``gpu`` test when it needs CUDA).  Nothing sets TRITON_INTERPRET: the
commands that run the triton backend turn the interpreter on themselves without CUDA.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verification.cli import build_parser, example_parts

ROOT = Path(__file__).resolve().parents[1]
PARSER = build_parser()
SUB = next(a for a in PARSER._actions if a.__class__.__name__ == "_SubParsersAction")

# the files the examples name: (what, the command line that makes it)
SEED = [
    ("p.safetensors, a problem", "export --case smoke/dense-T64-lb-5 --out p.safetensors"),
    ("o.safetensors, its outputs", "capture --backend emulator --route flashkda --inputs p.safetensors --out o.safetensors"),
    ("problems/, two problems", "export --case smoke/dense-T64-lb-5 --case smoke/paged-lb-5 --out problems/"),
    ("outputs/, their outputs", "capture --backend emulator --route flashkda --inputs problems/ --out outputs/"),
    ("runs/emu, a results directory", "run --backend emulator --suite smoke --case smoke/dense-T64-lb-5 --out runs/emu"),
    ("runs/bad, one failing cell", "run --backend emulator-bad --route wrong_L_sign --suite smoke "
                                   "--case smoke/initial-state-kv-lb-5 --out runs/bad"),
    ("dump/, a serving trace dump", "capture --suite serving --backend emulator --route flashkda --decode-route "
                                    "fla-recurrent --case serving/short-prompts --out dump/"),
]


def help_examples(name: str) -> list[str]:
    """The example lines of ``kda-verify NAME --help``."""
    text = SUB.choices[name].format_help()
    assert "\nExamples:\n" in text, f"kda-verify {name} --help has no Examples section"
    return [ln.strip() for ln in text.split("\nExamples:\n", 1)[1].splitlines() if ln.strip()]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KDA_TOLERANCES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    return env


def _kda(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verification", *argv], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _params():
    out = []
    for name in sorted(SUB.choices):
        for i, line in enumerate(help_examples(name)):
            command, needs, code = example_parts(line)
            marks = [pytest.mark.gpu] if "cuda" in needs else []
            out.append(pytest.param(command, needs, code, id=f"{name}-{i}", marks=marks))
    return out


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    d = tmp_path_factory.mktemp("examples-seed")
    for what, line in SEED:
        r = _kda(line.split(), d)
        assert r.returncode in (0, 1), f"making {what}: kda-verify {line} exited {r.returncode}: {r.stderr[-1500:]}"
    shutil.copy2(ROOT / "verification" / "judging" / "tolerances.yaml", d / "my-tolerances.yaml")
    return d


def _missing(needs: tuple) -> list[str]:
    miss = []
    for need in needs:
        if need == "cuda":
            if not torch.cuda.is_available():
                miss.append("a CUDA device")
        elif importlib.util.find_spec(need.split(".")[0]) is None:
            miss.append(f"the Python module {need}")
    return miss


@pytest.mark.parametrize("command,needs,code", _params())
@pytest.mark.slow
def test_the_help_example_runs(command, needs, code, seed, tmp_path):
    miss = _missing(needs)
    if miss:
        pytest.skip(f"the example needs {' and '.join(miss)}: {command}")
    work = tmp_path / "w"
    shutil.copytree(seed, work)
    import shlex
    argv = shlex.split(command)
    assert argv[0] == "kda-verify"
    r = _kda(argv[1:], work)
    assert r.returncode == code, (f"{command}\n  expected exit {code}, got {r.returncode}\n"
                                  f"--- stdout (tail)\n{r.stdout[-2000:]}\n--- stderr (tail)\n{r.stderr[-2000:]}")


def test_an_example_note_is_needs_or_exits():
    assert example_parts("kda-verify x --a b   # needs: cuda, fla") == ("kda-verify x --a b", ("cuda", "fla"), 0)
    assert example_parts("kda-verify x   # exits 1: a control; needs: aiter") == ("kda-verify x", ("aiter",), 1)
    with pytest.raises(ValueError, match="expected 'needs: cuda, MODULE' or 'exits N: why', got 'need cuda'"):
        example_parts("kda-verify x   # need cuda")
