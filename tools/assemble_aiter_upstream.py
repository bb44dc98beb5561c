#!/usr/bin/env python3
"""Assemble ROCm/aiter's own KDA kernels (chunked prefill and decode) from files the user provides.

No aiter code is part of this repository: this recipe names files (repository, commit, path,
sha256) and builds ``OUT`` (default ``.vendor/aiter-upstream``, git-ignored) from

  BASE  a copy of ROCm/aiter's ``aiter/`` tree (default ``.vendor/aiter-2026-08``, holding
        ``aiter/`` and ``COMMIT``; ROCm/aiter e4048607a5 is the tree this table was checked on), e.g.
            git --git-dir=<aiter clone>/.git archive e4048607a535ace3a2b51ded31b1c8c2d45c0879 aiter \\
                | tar -x -C .vendor/aiter-2026-08
  SRC   single files, each saved as ``SRC/<owner>+<repo>@<commit>/<path>`` byte for byte as
        published (default ``.vendor/aiter-src``); ``tools/export_aiter_src.py`` writes them from
        git clones and checks each sha256

Result: OUT/aiter = BASE/aiter overlaid with FILES below; OUT/ASSEMBLY.json records the base,
every file (repository, commit, path, destination, sha256, why) and what no public copy has.
Use it with ``PYTHONPATH=OUT AITER_TRITON_ONLY=1``.

No single ROCm/aiter commit in the public index holds every file, so each file is at the newest
commit that fits its callers (the host wrappers' kernel arguments and config keys were checked
against the kernels' signatures by compiling every variant, ``kda-verify isa --backend aiter``).
Fork copies stand in only where ROCm/aiter publishes no such file:

  chunk_kda DEFAULT.json (gfx1250, gfx950)  only yhl-amd/aiter 22f2e2dc has them
  gfx950-KDA_DECODE-DEFAULT.json            only yhl-amd/aiter 6c7a9958
  gfx1250-KDA_DECODE-DEFAULT.json           ROCm/aiter's only copy (df1723bd) predates kda.py's
                                            "fused" / "t_gt1_default" buckets and has an empty
                                            "default"; yhl-amd/aiter 22f2e2dc's nested-layout
                                            file has exactly kda.py's buckets and is placed at the
                                            flat path kda.py reads

    python tools/assemble_aiter_upstream.py [--base DIR] [--src DIR] [--out DIR]

Bad input (a missing tree or file, a file whose sha256 differs) is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assemble_aiter as core  # noqa: E402  (the shared recipe: checks, copies, record)

P = "aiter/ops/triton/"
G1250 = P + "_gluon_kernels/gfx1250/attention/"
G950 = P + "_gluon_kernels/gfx950/attention/"
CFG = P + "configs/"
TK = P + "_triton_kernels/kimi_delta_attn/"
BASE_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"

# (owner/repo, commit, path in that repo, path in OUT if not the same, sha256, why)
FILES = (
    ("ROCm/aiter", "4d306a447ad94284b351374a0838befac9a8cf6e", P + "attention/chunk_kda.py", None,
     "92537dd8572f9bfb470bbc0e1ff7e2b483e41ac25b85bfe2fe9eb1081e17ed54",
     "chunk_kda / chunk_kda_prepare / chunk_kda_walk: the host side of the chunked prefill, Gluon on "
     "gfx1250 and gfx950 (gfx950's walk in passes 1 / scan / 2), the Triton fallback elsewhere"),
    ("ROCm/aiter", "13cdcede35286a44ab3fe6d46e876d702b57437e", G1250 + "chunk_kda/prepare.py", None,
     "aa191991aef4b8909dcb22c15534b05b291ba22094b3a3cd9379e06f76e0acf9",
     "gfx1250 chunk_kda_prepare_kernel (WMMA, TDM), the pair chunk_kda.py @ 4d306a4 launches"),
    ("ROCm/aiter", "13cdcede35286a44ab3fe6d46e876d702b57437e", G1250 + "chunk_kda/walk.py", None,
     "0058aea9b4b33b7a4e56b0893588cc2e79942664451dd7f32fa5621058dc92cc",
     "gfx1250 chunk_kda_walk_kernel and its BV-tier _get_config(num_seqs, H, overrides)"),
    ("ROCm/aiter", "9c25252d1dc4a62f6c24f230c3e4ad3e89c366c0", G950 + "chunk_kda/prepare.py", None,
     "5ef5241078526b220719845b1bde051475555d13168b5b43350dca681446feeb",
     "gfx950 chunk_kda_prepare_kernel (MFMA)"),
    ("ROCm/aiter", "4d306a447ad94284b351374a0838befac9a8cf6e", G950 + "chunk_kda/walk.py", None,
     "39503105ed83d06c7015ffef6f3695c8a6de57128351ba71077f640576af596d",
     "gfx950 chunk_kda_walk_kernel (PASS 0 / 1 / 2), chunk_kda_scan_kernel and "
     "_get_config(num_seqs, H, num_chunks, overrides)"),
    ("ROCm/aiter", "2f91c4a4e1f546fa55a3a8d9f0a5963133baf2c2", P + "_gluon_kernels/common/utils.py", None,
     "9df7b4f6eebfe6c2f00cef73b36d5138a5cfa02540a2ad422f1853e40361ebfc",
     "sigmoid / softplus / exp_scaled the Gluon kernels import"),
    ("ROCm/aiter", "1e3f833a7db1f677ca73c72cf10925ee1656d603", P + "attention/kda.py", None,
     "1305ba29b180b704aceef9a27a0d773ba8c5605c813d5b1d77511040f4992de9",
     "fused_recurrent_kda (decode host: config buckets, paged / spec / cache_state_updates, "
     "fused conv and gated RMSNorm)"),
    ("ROCm/aiter", "1e3f833a7db1f677ca73c72cf10925ee1656d603", G1250 + "kda_decode.py", None,
     "abaaa90b8aed0df902d69dc8d9ec9db86ecb88085953d8c5733a65787cb85719",
     "gfx1250 fused_recurrent_kda_packed_decode_kernel, the one kda.py @ 1e3f833 launches"),
    ("ROCm/aiter", "1e3f833a7db1f677ca73c72cf10925ee1656d603", G950 + "kda_decode.py", None,
     "d82148ff09bb95012405441ba08456506cc09b39f1cd9ce64db05ac2c109b392",
     "gfx950 fused_recurrent_kda_packed_decode_kernel"),
    ("ROCm/aiter", "0d6eab25b9701807ac9206e1159a4af683fa4d47", P + "utils/config_utils.py", None,
     "00a6ec2abb7980ae063e003923bd2d9f7fcab52767bd85fd61af31e560296c77",
     "resolve_config_dir(op, name, backend) -> str and load_config_json, which the Gluon hosts "
     "import (absent from the base tree)"),
    ("yhl-amd/aiter", "22f2e2dc19e7806d49669dee799b80627b9d22cf",
     CFG + "gfx1250/gluon/attention/chunk_kda/DEFAULT.json", None,
     "be9500775b52562a328ca580ee21dc40f02cdb95b383175ec5eb83d998e55c11",
     "fork copy (ROCm/aiter publishes none): the gfx1250 prepare config and the walk's BV tiers"),
    ("yhl-amd/aiter", "22f2e2dc19e7806d49669dee799b80627b9d22cf",
     CFG + "gfx950/gluon/attention/chunk_kda/DEFAULT.json", None,
     "c6a9638dc3ae951168c7b3a1731817f1dc000efb03827abfc2b753bdd8aeb4c3",
     "fork copy (ROCm/aiter publishes none): the gfx950 prepare config, the walk's pass-0 tiers, "
     "group split rule, pass-1 and scan configs"),
    ("yhl-amd/aiter", "22f2e2dc19e7806d49669dee799b80627b9d22cf",
     CFG + "gfx1250/gluon/attention/kda_decode/DEFAULT.json", CFG + "gfx1250-KDA_DECODE-DEFAULT.json",
     "28cfe79188564a32d395bcfdf2437185be853278ce5b3ec718d055bee697d698",
     "fork copy at the flat path kda.py reads: ROCm/aiter's only copy (df1723bd) lacks the 'fused' "
     "and 't_gt1_default' buckets kda.py @ 1e3f833 selects and has an empty 'default'"),
    ("yhl-amd/aiter", "6c7a9958aa3074a9c4ee3d66ed952e3274b19645", CFG + "gfx950-KDA_DECODE-DEFAULT.json", None,
     "9ed35b8c44c3106aca062e56674e6ab5439ac303891136f011ed1f1965a8ebce",
     "fork copy (ROCm/aiter publishes none): the gfx950 decode buckets"),
    # The Triton FlashKDA package chunk_kda.py's fallback calls (kimi_delta_attn, renamed from the
    # base's chunk_delta_attn): the host with out= / state_cache=, its forward and FlashKDA itself.
    ("ROCm/aiter", "15c56cc4831e93351e7086f514f44fe8f5192763", P + "kimi_delta_attn/__init__.py", None,
     "3865e1bb5af807ab546ea7ed3e6f7edc28e805dc5ead1110de9990f7d2676284",
     "exports chunk_kimi_delta_attn"),
    ("ROCm/aiter", "15c56cc4831e93351e7086f514f44fe8f5192763", P + "kimi_delta_attn/chunk_delta_attn.py", None,
     "d07a13b3182da74948190b3801a2bcf95dae8e4306228ccb305f1954da61aa9b",
     "chunk_kimi_delta_attn(..., out=, state_cache=, state_indices=, has_initial_state=, "
     "state_v_first=), the signature chunk_kda.py @ 4d306a4's fallback calls (c3434619, the newest "
     "stored version, has no out= / state_cache=)"),
    ("ROCm/aiter", "15c56cc4831e93351e7086f514f44fe8f5192763", TK + "__init__.py", None,
     "fa67cf21106ab4dddf7f80e12243b69d687d10aaad8e1012b3bdcbd478b02e10",
     "the kernels package: chunk_delta_attn_fwd / _bwd, flash_kda_fwd and the default pipeline's parts"),
    ("ROCm/aiter", "98b24361959fdc1c87df80ff1a445b599ce8d372", TK + "chunk_fwd.py", None,
     "868c0637bfcda4a703a34dbb77b8c494de2aa70a5e43840c2d8704a4c99572ee",
     "chunk_delta_attn_fwd: FlashKDA under AITER_FDA_ENABLE when flash_kda_supported, passing out= / "
     "state_cache= / state_indices= / has_initial_state= on"),
    ("ROCm/aiter", "c1397349419e0d8d56f6b0327dc9c31b5e6de0ff", TK + "flash_kda.py", None,
     "70ac0c9922870687bcf4a40bcfd0076e61de619faf6fa12777b2923e43687eff",
     "flash_kda_fwd(..., chunks_per_seg, out, state_cache, state_indices, has_initial_state): K1, the "
     "segment kernel (passes A / C), the segment scan; the newest of its 8 stored versions, whose "
     "keywords are the ones chunk_fwd.py @ 98b2436 passes"),
    ("yuychang/aiter", "ef61f69175d74dee92b9c53e1571d08e02589edb", TK + "fast_launch.py", None,
     "f279b3f1b5144bb84e6d7db183953592cb5c4c6798066c3e46fb4633410f6a06",
     "fork copy (ROCm/aiter publishes none at this path): fast_launch, which flash_kda.py wraps its "
     "three kernels in; the only stored copy under kimi_delta_attn/"),
    ("yuychang/aiter", "ef61f69175d74dee92b9c53e1571d08e02589edb", TK + "utils/index.py", None,
     "bca48618d0842b51157029035df838ba807da32e7defb4d10df7941174a61642",
     "fork copy (ROCm/aiter publishes none at this path): prepare_chunk_indices for varlen calls"),
)

# Written by this project (tools/aiter_shims), each recorded in ASSEMBLY.json: (shim, path in OUT, why)
STUBS = (
    ("kimi_delta_attn/chunk_delta_attn_utils.py", TK + "chunk_delta_attn_utils.py",
     "no stored copy (ROCm/aiter or fork) at this path: re-exports the base's chunk_delta_attn_utils "
     "and adds chunk_delta_attn_tuned_config(backend=), _tuned_config_shortlist and "
     "input_guard(skip=), which flash_kda.py imports"),
    ("kimi_delta_attn/chunk_bwd.py", TK + "chunk_bwd.py",
     "the backward (ROCm/aiter 15c56cc4, 69 kB) is not vendored: chunk_delta_attn_bwd raises; only a "
     "call that needs grad reaches it"),
) + tuple(
    (f"kimi_delta_attn/{m}.py", TK + f"{m}.py",
     f"re-exports the base's chunk_delta_attn/{m}.py (upstream's kimi_delta_attn copy is not vendored); "
     "only the default, non-FlashKDA pipeline calls it")
    for m in ("gate", "gla_output", "intra_attn", "wy_fast", "utils/cumsum", "utils/l2norm")
) + (
    ("kimi_delta_attn/utils/__init__.py", TK + "utils/__init__.py", "package marker"),
    ("gated_delta_net/__init__.py", P + "_triton_kernels/gated_delta_net/__init__.py", "package marker"),
    ("gated_delta_net/__init__.py", P + "_triton_kernels/gated_delta_net/prefill/__init__.py",
     "package marker"),
    ("gated_delta_net/chunk_delta_h.py", P + "_triton_kernels/gated_delta_net/prefill/chunk_delta_h.py",
     "chunk_fwd.py imports the renamed gated_delta_net: re-exports the base's "
     "gated_delta_rule/prefill/chunk_delta_h.py (default pipeline only)"),
)

# Appended to base files (tools/aiter_shims/<shim>): (shim, path in OUT, what, why)
APPENDS = (
    ("upstream_compat.py", P + "utils/tuned_config_utils.py",
     "autotune_configs(op, configs, default_config): every config when <op>_TRITON_AUTOTUNE is on, "
     "else the default (the base's chunk_delta_attn_autotune_configs rule)",
     "flash_kda.py @ c1397349 imports it; the base has none"),
    ("logger_compat.py", P + "utils/logger.py",
     "AiterTritonLogger's levels take %-style arguments",
     "flash_kda.py and chunk_delta_attn.py log with them; the base's take one message"),
)

NOT_PROVIDED = [
    "upstream's kimi_delta_attn chunk_bwd.py, gate.py, gla_output.py, intra_attn.py, wy_fast.py, "
    "utils/cumsum.py, utils/l2norm.py (stand-ins re-export the base's chunk_delta_attn ones; the "
    "FlashKDA routes and chunk_kda's fallback never call them) and a chunk_delta_attn_utils.py at "
    "the kimi_delta_attn path (no stored copy anywhere; a stand-in)",
    "the gfx950 Gluon K1 / K2 under _gluon_kernels/gfx950/kimi_delta_attn/ (flash_kda.py imports "
    "them only on gfx950); the CHUNK_DELTA_ATTN DEFAULT.json tuned configs (K1 / K2 fall back)",
    "utils/device_info.get_num_sms asks the GPU (the walk's config rule reads it): callers without "
    "one set it (kda-verify isa: 256 CUs)",
]


def main(argv=None) -> int:
    core.PROG = "assemble_aiter_upstream"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=core.ROOT / ".vendor" / "aiter-2026-08")
    ap.add_argument("--src", type=Path, default=core.ROOT / ".vendor" / "aiter-src")
    ap.add_argument("--out", type=Path, default=core.ROOT / ".vendor" / "aiter-upstream")
    a = ap.parse_args(argv)

    sources = core.check_sources(a.src, FILES)
    base_commit = core.start_tree(a.base, a.out)
    core.overlay(a.out, sources)
    stubs = core.add_stubs(a.out, STUBS)
    transforms = []
    for shim, dest, what, why in APPENDS:
        target = a.out / dest
        if not target.is_file():
            core.fail(f"--base: expected {dest} in the base tree (to append {shim} to), got no file")
        target.write_text(target.read_text() + (core.SHIMS / shim).read_text())
        transforms.append(dict(file=dest, what=f"appended tools/aiter_shims/{shim}: {what}", why=why))
    record = dict(base=dict(repo="ROCm/aiter", commit=base_commit, tree=str(a.base)),
                  files=[s[2] for s in sources], stubs=stubs, transforms=transforms,
                  not_provided=NOT_PROVIDED)
    core.finish(a.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
