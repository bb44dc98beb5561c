"""Backends for the harness's own tests (loaded as ``kda_test_backends:<factory>``).

    exact        returns the float64 truth rounded to the production dtypes (o bf16, states fp32)
    zeros        returns all-zero outputs (a mostly-zero output: never a pass)
    nan          returns the truth with one NaN in o
    raising      raises inside run()
    crashing     kills its own process: os.abort() (route "abort") or os._exit(3) (route "exit")
    unavailable  available() is False with a reason
    dense_only   accepts only problems without cu_seqlens (varlen: "not applicable")
    leak         the truth of a forward whose sequences after the first start from the previous
                 one's final state (tests/planted.py's "leak"), route "flashkda"
    raising_passes  kda-verify debug's passes (debug_plan, run_pass), run_pass raising
    held         routes "fast" (exact) and "held": "held" writes $KDA_TEST_HOLD.waiting, then waits,
                 before answering exactly, while the file named by $KDA_TEST_HOLD exists (at most
                 600 s): a cell that is running when a test sends SIGINT
    norm_mutant  aiter-gfx1250 with a slip in its fused output norm: routes "eps1e-3", "no_gate"
"""
from __future__ import annotations

import os

import torch

from kda_kernels.base import Outputs, Route
from kda_ref.truth import truth


class _TestBackend:
    mode = "exact"

    def __init__(self, mode: str = "exact", routes=("r1",)):
        self.mode = mode
        self.name = f"test-{mode}"
        self._routes = [Route(name=r, recipe="flashkda", description=f"{mode} {r}") for r in routes]

    def available(self):
        if self.mode == "unavailable":
            return False, "this test backend is never available"
        return True, ""

    def version(self):
        return "test-0"

    def routes(self):
        return list(self._routes)

    def accepts(self, problem, route):
        if self.mode == "dense_only" and problem.cu_seqlens is not None:
            return False, "not applicable: varlen problems are not supported by this test backend"
        return True, ""

    def run(self, problem, route):
        if self.mode == "raising":
            raise RuntimeError("deliberate failure inside run()")
        if self.mode == "crashing":
            if route.name == "abort":
                os.abort()
            os._exit(3)
        if self.mode == "leak":
            from planted import plant
            out = plant(problem, "leak")
            out.info = {"route_ran": route.name}
            return out
        t = truth(problem)
        o = t.o.to(torch.bfloat16)
        fs = None if t.final_state is None else t.final_state.to(torch.float32)
        sc = None if t.state_cache is None else t.state_cache.to(torch.float32)
        if self.mode == "zeros":
            o = torch.zeros_like(o)
            fs = None if fs is None else torch.zeros_like(fs)
        if self.mode == "nan":
            o = o.clone()
            o.view(-1)[0] = float("nan")
        return Outputs(o=o, final_state=fs, state_cache=sc, info={"route_ran": route.name})


class _RaisingPasses(_TestBackend):
    """A backend with kda-verify debug's passes whose run_pass raises."""

    def debug_plan(self, problem, route):
        return {"form": "flashkda", "chunk_size": 64, "chunks_per_seg": None, "passes": ["K1", "C"]}

    def run_pass(self, problem, route, pass_name, feed=None):
        raise RuntimeError(f"deliberate failure inside run_pass({pass_name!r})")


class _Held(_TestBackend):
    """Route "held" waits while $KDA_TEST_HOLD names a file that exists, then answers exactly."""

    def run(self, problem, route):
        if route.name == "held":
            import time
            hold = os.environ.get("KDA_TEST_HOLD")
            if hold:
                with open(f"{hold}.waiting", "a") as f:     # the marker: every earlier cell has finished
                    f.write(f"{problem.T}\n")
            t0 = time.monotonic()
            while hold and os.path.exists(hold) and time.monotonic() - t0 < 600:
                time.sleep(0.05)
        return super().run(problem, route)


def exact():
    return _TestBackend("exact", routes=("r1", "r2"))


def raising_passes():
    return _RaisingPasses("raising", routes=("r1",))


def held():
    b = _Held("exact", routes=("fast", "held"))
    b.name = "test-held"
    return b


def zeros():
    return _TestBackend("zeros")


def nan():
    return _TestBackend("nan")


def raising():
    return _TestBackend("raising")


def crashing():
    return _TestBackend("crashing", routes=("abort", "exit"))


def unavailable():
    return _TestBackend("unavailable")


def dense_only():
    return _TestBackend("dense_only")


def leak():
    return _TestBackend("leak", routes=("flashkda",))


TEST_TOLERANCES = """\
schema: 1
entries:
  - backend: "*"
    route: "*"
    dtype: "*"
    tensor: "*"
    m: 2.0
    floor: 1.0e-6
    cap: 1.0e+3
    reason: harness tests only - every cell judged by FlashAttention's rule with m = 2, no effective cap
    calibrated_on: not calibrated (the tests check statuses, not kernels)
"""


def write_tolerances(directory) -> str:
    """A tolerance file whose one entry matches every cell; returns its path."""
    import pathlib
    p = pathlib.Path(directory) / "test-tolerances.yaml"
    p.write_text(TEST_TOLERANCES)
    return str(p)


class _NormMutant:
    """aiter-gfx1250's walk with its fused output norm mutated (route "eps1e-3": eps 1e-3 in place
    of the problem's; "no_gate": the gate's sigmoid left out): the emulated kernel's o before the
    norm, then the walk's fp32 norm with the slip, rounded to o's dtype.  Routes flagged
    fused_norm, so they take the problems of the norm suite."""
    name = "test-norm-mutant"

    def available(self):
        return True, ""

    def version(self):
        return "test-0"

    def routes(self):
        return [Route(name=n, recipe="aiter-gfx1250", flags=(("fused_norm", True),), description=n)
                for n in ("eps1e-3", "no_gate")]

    def accepts(self, problem, route):
        return True, ""

    def run(self, problem, route):
        from kda_kernels.emulator import emulate
        out = emulate(problem.replace(out_gate=None, norm_weight=None), "aiter-gfx1250")
        of = out.o.to(torch.float32)
        eps = 1e-3 if route.name == "eps1e-3" else problem.norm_eps
        of = of * (torch.rsqrt((of * of).sum(-1, keepdim=True) / of.shape[-1] + eps)
                   * problem.norm_weight.to(torch.float32))
        if route.name != "no_gate":
            of = of * torch.sigmoid(problem.out_gate.to(torch.float32))
        out.o = of.to(out.o.dtype)
        out.info = {"route_ran": route.name}
        return out


def norm_mutant():
    return _NormMutant()
