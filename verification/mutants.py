"""The catalogue of mutants of our Triton FlashKDA (kda_kernels/triton/): realistic slips of a
kernel engineer, each a small source patch, for ``kda-verify mutate`` (verification/mutate.py).

A mutant is a list of edits ``(find, replace)`` to one file of kda_kernels/triton/; every
``find`` must occur exactly once in that file, or applying the mutant fails with an
``AnchorError`` (so the catalogue cannot silently stop mutating anything when the kernels
change).  ``pass_name`` is the pass the patched code belongs to (K1, A, B or C, as the per-pass
debugger names them); ``routes`` are the routes on which that code runs (an unsegmented route
for K1 and pass C, segmented ones for passes A and B).  ``equivalent`` holds the reason when a
mutant is numerically equivalent on the harness's cases: its survival is then expected, not a
gap; a mutant so marked that is killed anyway shows the reason to be wrong.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

UNSEG = "unseg:BW=32"
SEG = "seg:cps=2:A=fused:B=prefetch:BW=32"          # fused pass A (MODE 3), prefetching scan
SEG_TWO = "seg:cps=2:A=two:B=prefetch:BW=32"        # pass A in two launches (MODE 1 and MODE 2)
SEG_PLAIN = "seg:cps=2:A=fused:B=plain:BW=32"       # the scan without prefetch
HALVES = "unseg:BW=32:k1=halves"                    # K1 on the tile's two 16-row halves
PASSES = ("K1", "A", "B", "C")


@dataclass(frozen=True)
class Mutant:
    name: str
    pass_name: str                 # K1 | A | B | C: where the patched code runs
    file: str                      # a file of kda_kernels/triton/
    edits: tuple                   # ((find, replace), ...): each find occurs exactly once
    what: str                      # the slip, in words
    routes: tuple = (UNSEG,)
    equivalent: Optional[str] = None   # why it cannot change any output on the cases (then survival is expected)
    gap: Optional[str] = None          # a known survivor: what would catch it (survival still fails the run)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["edits"] = [list(e) for e in self.edits]
        d["routes"] = list(self.routes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Mutant":
        d = dict(d)
        d["edits"] = tuple(tuple(e) for e in d["edits"])
        d["routes"] = tuple(d.get("routes") or (UNSEG,))
        return cls(**d)


def _m(name, pass_name, file, edits, what, routes=(UNSEG,), equivalent=None, gap=None) -> Mutant:
    if pass_name not in PASSES:
        raise ValueError(f"mutant {name}: pass_name: expected one of {'|'.join(PASSES)}, got {pass_name!r}")
    return Mutant(name=name, pass_name=pass_name, file=file, edits=tuple(edits), what=what, routes=tuple(routes),
                  equivalent=equivalent, gap=gap)


K = "kernels.py"
F = "forward.py"
P = "plan.py"

CATALOGUE: tuple = (
    # ------------------------------------------------------------------ K1 (prepare)
    _m("l2norm_eps_outside_sqrt", "K1", K,
       [("k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]",
         "k = k * (1.0 / (tl.sqrt(tl.sum(k * k, 1)) + 1e-6))[:, None]")],
       "k / (sqrt(sum k^2) + 1e-6) instead of k / sqrt(sum k^2 + 1e-6); only rows of small norm tell the "
       "two apart (stress/small-norm-qk-lb-1 exists for this)"),
    _m("gate_lower_bound_sign", "K1", K,
       [("a = tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)",
         "a = tl.where(m2, -lower_bound * tl.sigmoid(rate * g), 0.0)")],
       "a = -lb sigmoid(...): the decay becomes a growth"),
    _m("tail_gate_not_zeroed", "K1", K,
       [("a = tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)",
         "a = lower_bound * tl.sigmoid(rate * g)")],
       "the gate of the tail rows past Lc left at lb sigmoid(rate dt_bias): their G keeps falling, and "
       "k1_prepare_kernel, which does not mask its tail rows, multiplies their zero k by 2^-(G - G_pivot)"),
    _m("one_head_decay_scaled", "K1", K,
       [("a = tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)",
         "a = tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0) * tl.where(h == 1, 1.05, 1.0)")],
       "head 1's log-decay a scaled by 1.05 (its decay exp(a) raised to 1.05): one head of many off by "
       "a few percent"),
    _m("gate_rate_not_exponentiated", "K1", K,
       [("rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))",
         "rate = tl.load(alog_ptr + h).to(tl.float32)")],
       "A_log used as the rate instead of exp(A_log)"),
    _m("cumsum_missing_log2e", "K1", K,
       [("G = tl.cumsum(a, 0) * 1.4426950408889634", "G = tl.cumsum(a, 0)")],
       "the natural-log cumsum used as a log2 cumsum (exp2 of ln units)"),
    _m("ws_gt_off_by_one_row", "K1", K,
       [("G_last = tl.sum(tl.where(ri == Lc - 1, G, 0.0), 0)",
         "G_last = tl.sum(tl.where(ri == Lc - 2, G, 0.0), 0)")],
       "G_last taken from row Lc-2: the chunk's decay misses its last token"),
    _m("kr_decay_sign", "K1", K,
       [("k * tl.exp2(G_last[None, :] - G)", "k * tl.exp2(G - G_last[None, :])")],
       "ws_kr = k 2^(G - G_last) instead of k 2^(G_last - G)"),
    _m("scale_applied_twice", "K1", K,
       [("tl.store(qd_ptr + tile_off, ((scale * q) * eG)",
         "tl.store(qd_ptr + tile_off, ((scale * scale * q) * eG)")],
       "ws_qd scaled twice (a host that pre-scales q, and the kernel again)"),
    _m("scale_missing_in_mqk_diagonal_blocks", "K1", K,
       [("qp = ((scale * q) * up).to(tl.bfloat16)\n    kiT = tl.trans((k * tl.exp2(-Gd))",
         "qp = (q * up).to(tl.bfloat16)\n    kiT = tl.trans((k * tl.exp2(-Gd))")],
       "Mqk's diagonal 16-blocks without the scale"),
    _m("pivot_block_boundary_off_by_one", "K1", K,
       [("Gd = G - tl.where(ri < BC, G_p0, G_p1)", "Gd = G - tl.where(ri <= BC, G_p0, G_p1)")],
       "row 16 takes the first block's pivot: its factors no longer match the second block's"),
    _m("pivot_row_off_by_one", "K1", K,
       [("G_p0 = tl.sum(tl.where(ri == p0, G, 0.0), 0)[None, :]",
         "G_p0 = tl.sum(tl.where(ri == p0 + 1, G, 0.0), 0)[None, :]")],
       "the first diagonal block pivots on row 9 instead of row 8",
       equivalent="the pivot cancels in kp ki^T (2^(G_i-G_p) 2^(G_p-G_j)); one row further keeps every "
                  "factor within 2^(+-72) at lb -5.5, far inside bf16's normal range, and a bf16 rounding "
                  "is relative, so only the rounding pattern changes (and past the tail G is flat)"),
    _m("wrong_sign_of_L", "K1", K,
       [("L = tl.where(ri > cj, -beta[:, None] * kk, 0.0)", "L = tl.where(ri > cj, beta[:, None] * kk, 0.0)")],
       "L = +beta kk^T: the kernel builds (I + L)^-1"),
    _m("beta_missing_in_L", "K1", K,
       [("L = tl.where(ri > cj, -beta[:, None] * kk, 0.0)", "L = tl.where(ri > cj, -kk, 0.0)")],
       "L without its row scaling by beta"),
    _m("L_includes_diagonal", "K1", K,
       [("L = tl.where(ri > cj, -beta[:, None] * kk, 0.0)", "L = tl.where(ri >= cj, -beta[:, None] * kk, 0.0)")],
       "L keeps its diagonal (i >= j): not strictly lower any more"),
    _m("mqk_diagonal_dropped", "K1", K,
       [("mqk = tl.where(ri >= cj, qk, 0.0)", "mqk = tl.where(ri > cj, qk, 0.0)")],
       "Mqk strictly lower: each token's own contribution to o is lost"),
    _m("tail_beta_not_zeroed", "K1", K,
       [("beta = tl.where(rmask, tl.sigmoid(braw), 0.0)", "beta = tl.sigmoid(braw)")],
       "beta of the tail rows past Lc left at sigmoid(0) = 0.5",
       equivalent="the tail rows' k are loaded as 0 and their v masked to 0, so u = beta (v - kd S) and "
                  "the tail rows of L are 0 whatever beta is; the kernel zeroes the tail twice"),
    _m("inverse_stored_bf16", "K1", K,
       [("tl.store(inv_ptr + sq_off, inv.to(tl.float16))", "tl.store(inv_ptr + sq_off, inv.to(tl.bfloat16))")],
       "the inverse rounded to bf16 (8 bits) before its fp16 store"),
    _m("merge_step_missing", "K1", K,
       [("inv = inv + _dot_f32(inv, _dot_f32(L_off, inv, INV_PREC), INV_PREC)",
         "inv = inv")],
       "the block merge skipped: the inverse is block diagonal"),
    _m("inverse_reads_L_transposed", "K1", K,
       [("L = tl.load(l_ptr + sq_off)", "L = tl.load(l_ptr + tl.program_id(0).to(tl.int64) * (C * C) + ri + cj * C)")],
       "K1's second launch reads ws_L with its row and column strides swapped: the inverse of I - L^T"),
    _m("neumann_doubling_step_missing", "K1", F,
       [("NUM_DOUBLING = BC.bit_length() - 2", "NUM_DOUBLING = BC.bit_length() - 3")],
       "three doubling steps instead of four: sum_{n<8} D^n, D^8..D^15 missing"),
    _m("varlen_boundary_off_by_one", "K1", P,
       [("tiles.append((b, t0 + c * C, min(C, t1 - t0 - c * C), n))",
         "tiles.append((b, t0 + c * C, min(C, t1 - t0 - c * C + 1), n))")],
       "a partial last chunk takes one token past its sequence's end"),
    # ------------------------------------------------------------------ pass C (chunk step, outputs)
    _m("beta_missing_in_u", "C", K,
       [("u = beta[:, None] * (v - tl.dot(kd, Sb))", "u = v - tl.dot(kd, Sb)")],
       "u = v - kd S without beta"),
    _m("decay_applied_after_update", "C", K,
       [("S = S * gt[:, None] + tl.dot(tl.trans(kr), U.to(tl.bfloat16))",
         "S = (S + tl.dot(tl.trans(kr), U.to(tl.bfloat16))) * gt[:, None]")],
       "S <- (S + kr^T U) gt instead of S gt + kr^T U"),
    _m("final_state_stored_transposed", "C", K,
       [("off = _state_offsets(n, h, sfn, sfh, sfk, sfv, kk, cols)",
         "off = _state_offsets(n, h, sfn, sfh, sfv, sfk, kk, cols)")],
       "the dense final state written with its K and V strides swapped"),
    _m("initial_state_read_transposed", "C", K,
       [("S = tl.load(h0_ptr + _state_offsets(row, h, sn, sh, sk, sv, kk, cols)).to(tl.float32)",
         "S = tl.load(h0_ptr + _state_offsets(row, h, sn, sh, sv, sk, kk, cols)).to(tl.float32)")],
       "a dense initial state read with its K and V strides swapped"),
    _m("has_initial_state_ignored", "C", K,
       [("S = tl.load(h0_ptr + off, mask=has & (off >= 0), other=0.0)",
         "S = tl.load(h0_ptr + off, mask=(off >= 0), other=0.0)")],
       "a paged slot read although has_initial_state is false"),
    _m("paged_slot_offset_wrong", "C", K,
       [("slot = tl.load(idx_ptr + row)", "slot = row")],
       "the paged state of sequence n read from slot n, not state_indices[n]"),
    _m("last_segment_final_state_not_written", "C", K,
       [("tl.store(fs_ptr + off, S, mask=(is_last != 0) & (off >= 0))",
         "tl.store(fs_ptr + off, S, mask=(is_last == 0) & (off >= 0))")],
       "the final state written by every segment but the last"),
    _m("paged_final_written_to_sequence_row", "C", K,
       [("off = _state_offsets(tl.load(fidx_ptr + n), h, sfn, sfh, sfk, sfv, kk, cols)",
         "off = _state_offsets(n, h, sfn, sfh, sfk, sfv, kk, cols)")],
       "the paged final state written to slot n, not state_indices[n]"),
    _m("segment_starts_from_zero", "C", F,
       [("src, mode = StateRef(h_in, tuple(h_in.stride())), kn.H0_SEG",
         "src, mode = StateRef(h_in, tuple(h_in.stride())), kn.H0_NONE")],
       "pass C drops the carry h_in at every segment boundary (starts from 0)", routes=(SEG,)),
    # ------------------------------------------------------------------ pass A (segment maps)
    _m("fused_A_sign_of_u", "A", K,
       [("uA = -beta[None, :] * tl.dot(SA.to(tl.bfloat16), kdT)", "uA = beta[None, :] * tl.dot(SA.to(tl.bfloat16), kdT)")],
       "fused pass A: u of the A_seg part with the wrong sign", routes=(SEG,)),
    _m("fused_A_uses_b_update", "A", K,
       [("SA = SA * gt[None, :] + tl.dot(UA.to(tl.bfloat16), kr)",
         "SA = SA * gt[None, :] + tl.dot(U.to(tl.bfloat16), kr)")],
       "fused pass A: the A_seg part updated with the b_seg part's U (copy-paste slip)", routes=(SEG,)),
    _m("two_launch_A_beta_missing", "A", K,
       [("u = -beta[None, :] * tl.dot(S.to(tl.bfloat16), kdT)", "u = -tl.dot(S.to(tl.bfloat16), kdT)")],
       "pass A in two launches: A_seg's u without beta", routes=(SEG_TWO,)),
    _m("map_A_seg_stored_transposed", "A", K,
       [("a_off = (s * H + h).to(tl.int64) * K * K + kk[None, :] * K + cols[:, None]",
         "a_off = (s * H + h).to(tl.int64) * K * K + kk[None, :] + cols[:, None] * K")],
       "pass A's transposed walk stores S^T where A_seg wants S (row and column offsets swapped)", routes=(SEG,)),
    _m("map_b_seg_stored_transposed", "A", K,
       [("tl.store(bseg_ptr + (s * H + h).to(tl.int64) * K * V + kk[None, :] * V + cols[:, None], S)",
         "tl.store(bseg_ptr + (s * H + h).to(tl.int64) * K * V + kk[None, :] + cols[:, None] * V, S)")],
       "pass A's transposed walk stores b_seg transposed", routes=(SEG,)),
    # ------------------------------------------------------------------ pass B (scan)
    _m("scan_carry_dropped", "B", K,
       [("S = tl.dot(Alo, hi, tl.dot(Ahi, lo, tl.dot(Ahi, hi, bb)))", "S = bb")],
       "the scan forgets the carry: h <- b_seg instead of A_seg h + b_seg", routes=(SEG,)),
    _m("scan_reads_wrong_segment", "B", K,
       [("bb = tl.load(bseg_ptr + cur * K * V + v_tile)",
         "bb = tl.load(bseg_ptr + (s0 * H + h).to(tl.int64) * K * V + v_tile)")],
       "the plain scan reads the sequence's first b_seg for every segment", routes=(SEG_PLAIN,)),
    _m("scan_stores_h_in_after_update", "B", K,
       [("        tl.store(hin_ptr + cur * K * V + v_tile, S)\n", ""),
        ("            S = tl.dot(Alo, hi, tl.dot(Ahi, lo, tl.dot(Ahi, hi, bb)))",
         "            S = tl.dot(Alo, hi, tl.dot(Ahi, lo, tl.dot(Ahi, hi, bb)))\n"
         "        tl.store(hin_ptr + cur * K * V + v_tile, S)")],
       "the scan stores h_in[s] after the update (the outgoing state, one segment late)", routes=(SEG,)),
    _m("scan_not_reset_at_sequence_start", "B", K,
       [("    s0 = tl.load(seg_off_ptr + n)\n",
         "    s0 = tl.load(seg_off_ptr + tl.maximum(n - 1, 0))\n    own0 = tl.load(seg_off_ptr + n)\n"),
        ("        tl.store(hin_ptr + cur * K * V + v_tile, S)\n",
         "        tl.store(hin_ptr + cur * K * V + v_tile, S, mask=(s >= own0) & (v_tile >= 0))\n")],
       "no state reset at a sequence start: the scan of sequence n walks sequence n-1's segments first, "
       "so n's first h_in carries n-1's segment maps (one request's state leaking into the next)",
       routes=(SEG,)),
    _m("prefetch_reads_wrong_next_segment", "B", K,
       [("nxt = ((s + 1) * H + h).to(tl.int64)", "nxt = (s * H + h).to(tl.int64)")],
       "the prefetching scan loads the current segment again instead of the next", routes=(SEG,)),
    # ------------------------------------------------------------------ K1 on halves (k1=halves)
    _m("halves_bottom_cumsum_misses_top", "K1", K,
       [("Gb = (tl.cumsum(ab, 0) + tl.sum(at, 0)[None, :]) * 1.4426950408889634",
         "Gb = tl.cumsum(ab, 0) * 1.4426950408889634")],
       "the bottom half's gate cumsum restarts at row 16 (the top half's decay is lost)", routes=(HALVES,)),
    _m("halves_merge_order_swapped", "K1", K,
       [("X10 = _dot_f32(X1, _dot_f32(L10, X0, INV_PREC), INV_PREC)",
         "X10 = _dot_f32(X0, _dot_f32(L10, X1, INV_PREC), INV_PREC)")],
       "the off-diagonal block of the inverse multiplied in the wrong order (X0 L10 X1)", routes=(HALVES,)),
    _m("halves_off_block_sign", "K1", K,
       [("L10 = -bb[:, None] * kk10", "L10 = bb[:, None] * kk10")],
       "L's off-diagonal block without its minus sign", routes=(HALVES,)),
    _m("halves_off_block_pivot_from_top", "K1", K,
       [("kk10 = tl.dot(_pivoted(kb, Gb - G_po, mb), kiT)", "kk10 = tl.dot(_pivoted(kb, Gb - G_p0, mb), kiT)")],
       "the off-diagonal block's row factors pivot on row 8, its column factors on row 16", routes=(HALVES,)),
    _m("halves_mqk_off_block_dropped", "K1", K,
       [("tl.store(mqk_ptr + sq_off + BC * C, qk10.to(tl.float16))",
         "tl.store(mqk_ptr + sq_off + BC * C, tl.zeros([BC, BC], dtype=tl.float16))")],
       "Mqk's off-diagonal block stored as zeros (rows 16..31 stop seeing rows 0..15 of their chunk)",
       routes=(HALVES,)),
)


def by_name(names=None) -> list:
    """Catalogue entries by name (all when ``names`` is empty); an unknown name is a ValueError."""
    if not names:
        return list(CATALOGUE)
    known = {m.name: m for m in CATALOGUE}
    out = []
    for n in names:
        if n not in known:
            raise ValueError(f"--mutant: expected one of {', '.join(known)}, got {n!r}")
        out.append(known[n])
    return out
