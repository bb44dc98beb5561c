#!/usr/bin/env python3
"""Every Triton FlashKDA route's outputs on six fixed problems, saved or compared bit for bit.

Run once per source tree (its packages first on PYTHONPATH), then compare the two files:

    PYTHONPATH=<tree> python3 tools/device/bitwise_trees.py dump OUT.pt
    python3 tools/device/bitwise_trees.py compare BEFORE.pt AFTER.pt

The problems are built here from seeded float32 draws cast to bf16 (the same bits in any
tree): tail tiles (T = 1000 and T = 33), a varlen pack with initial states and an empty and a
one-token sequence, a paged state cache, and two long sequences whose chunks-per-segment the
route heuristic chooses (T = 16384 and a varlen 8192 + 3000 + 5000).  ``compare`` prints one
line per (problem, route, tensor) that differs and a summary; exit 1 if any differs or a
(problem, route) is missing from either file, 2 on bad arguments.  BITWISE_DEVICE (cuda) and
BITWISE_PROBLEMS (names, comma-separated; default all) are for a rehearsal under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os
import sys


def problems(dev):
    import torch

    from kda_ref.problem import Problem
    H, K = 4, 128

    def draw(seed, T, N=None, lens=None, state=False, paged=False):
        g = torch.Generator(device="cpu").manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        bf = lambda x: x.to(torch.bfloat16).to(dev)  # noqa: E731
        kw = dict(q=bf(r(1, T, H, K)), k=bf(r(1, T, H, K)), v=bf(r(1, T, H, K)), g=bf(r(1, T, H, K)),
                  beta=bf(r(1, T, H)), A_log=(0.5 * r(H).abs()).to(dev), dt_bias=(0.1 * r(H * K)).to(dev),
                  lower_bound=-5.0)
        n = 1
        if lens is not None:
            kw["cu_seqlens"] = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
            n = len(lens)
        if state:
            kw["initial_state"] = (0.5 * r(n, H, K, K)).to(dev)
            kw["output_final_state"] = True
        if paged:
            slots = n + 3
            kw.update(state_layout="paged", state_cache=(0.5 * r(slots, H, K, K)).to(dev),
                      state_indices=torch.arange(n, dtype=torch.int32, device=dev).flip(0) + 2,
                      has_initial_state=torch.tensor([i % 2 == 0 for i in range(n)], device=dev))
        return Problem(**kw)

    return {
        "tail-T1000": draw(1, 1000, state=True),
        "tail-T33": draw(2, 33, state=True),
        "varlen-states": draw(3, 1139, lens=[37, 300, 0, 1, 801], state=True),
        "paged": draw(4, 700, lens=[100, 0, 600], paged=True),
        "heuristic-T16384": draw(5, 16384, state=True),
        "heuristic-varlen": draw(6, 16192, lens=[8192, 3000, 5000], state=True),
    }


def dump(path: str) -> int:
    import torch

    from kda_kernels.triton.backend import TritonBackend
    dev = torch.device(os.environ.get("BITWISE_DEVICE", "cuda"))
    only = [n for n in os.environ.get("BITWISE_PROBLEMS", "").split(",") if n]
    b = TritonBackend()
    out = {}
    for pname, p in problems(dev).items():
        if only and pname not in only:
            continue
        for route in b.routes():
            ok, why = b.accepts(p, route)
            if not ok:
                out[(pname, route.name)] = {"refused": why}
                continue
            o = b.run(p, route)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out[(pname, route.name)] = {n: x.detach().cpu() for n, x in o.tensors().items()}
    torch.save(out, path)
    import kda_kernels
    print(f"dumped {len(out)} (problem, route) outputs of {os.path.dirname(kda_kernels.__file__)} to {path}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    import torch
    a, b = torch.load(a_path), torch.load(b_path)
    bad = 0
    keys = sorted(set(a) | set(b))
    tensors = 0
    for key in keys:
        if key not in a or key not in b:
            print(f"MISSING {key} in {'before' if key not in a else 'after'}")
            bad += 1
            continue
        x, y = a[key], b[key]
        if set(x) != set(y):
            print(f"DIFFER {key}: tensors {sorted(x)} vs {sorted(y)}")
            bad += 1
            continue
        for n in x:
            if n == "refused":
                continue
            tensors += 1
            u, v = x[n], y[n]
            same = u.dtype == v.dtype and u.shape == v.shape and bool(((u == v) | (u.isnan() & v.isnan())).all())
            if not same:
                bad += 1
                print(f"DIFFER {key} {n}")
    routes = len({r for _, r in keys})
    print(f"compared {len(keys)} (problem, route) pairs over {routes} routes, {tensors} tensors: "
          f"{'all bitwise equal' if bad == 0 else f'{bad} differ'}")
    return 0 if bad == 0 else 1


def main(argv) -> int:
    if len(argv) == 2 and argv[0] == "dump":
        return dump(argv[1])
    if len(argv) == 3 and argv[0] == "compare":
        return compare(argv[1], argv[2])
    print(f"bitwise_trees.py: expected 'dump OUT.pt' or 'compare BEFORE.pt AFTER.pt', got {' '.join(argv) or 'nothing'}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
