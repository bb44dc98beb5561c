"""The catalogue of mutants of our Triton FlashKDA (kda_kernels/triton/): realistic slips of a
kernel engineer, each a small source patch, for ``kda-verify mutate`` (verification/investigating/mutate.py,
which imports this module; this one imports nothing of it: where a mutant's anchors lie is
``verification.investigating.mutate.mutant_file``).

A mutant is a list of edits ``(anchor, find, replace)``.  ``anchor`` names a marker comment
``# mutant-anchor: NAME`` in the package's source, on the first line of a statement or on a
comment line of its own just above it; the marker must occur exactly once in the package, so a
mutant follows its code when the code moves to another file.  Then, in that statement:

    find = an expression   every subtree of the statement's syntax tree equal to ``find``'s (there
                           must be exactly one) becomes ``replace`` (an expression)
    find = WHOLE (None)    the whole statement becomes ``replace`` (statements; "pass" deletes it)
    find = AFTER           ``replace`` (statements) is inserted after the statement

Matching is on the syntax tree, not the text, so reformatting (spacing, line breaks, comments,
parentheses) does not break a mutant; a marker that is missing or not unique, or a ``find``
that does not occur exactly once, is an ``AnchorError`` (the catalogue cannot silently stop
mutating anything when the kernels change).  ``pass_name`` is the pass the patched code belongs
to (K1, A, B or C, as the per-pass debugger names them); ``routes`` are the routes on which that
code runs (an unsegmented route for K1 and pass C, segmented ones for passes A and B).
``equivalent`` holds the reason when a mutant is numerically equivalent on the harness's cases:
its survival is then expected, not a gap; a mutant so marked that is killed anyway shows the
reason to be wrong.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

UNSEG = "unseg:BW=32"
SEG = "seg:cps=2:A=fused:B=prefetch:BW=32"          # fused pass A (MODE_AB), prefetching scan
SEG_TWO = "seg:cps=2:A=two:B=prefetch:BW=32"        # pass A in two launches (MODE_B and MODE_A)
SEG_PLAIN = "seg:cps=2:A=fused:B=plain:BW=32"       # the scan without prefetch
HALVES = "unseg:BW=32:k1=halves"                    # K1 on the tile's two 16-row halves
PASSES = ("K1", "A", "B", "C")
WHOLE = None                 # find: replace the whole anchored statement
AFTER = "<after>"            # find: insert the replacement after the anchored statement


@dataclass(frozen=True)
class Mutant:
    name: str
    pass_name: str                 # K1 | A | B | C: where the patched code runs
    edits: tuple                   # ((anchor, find, replace), ...)
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
        d = {k: v for k, v in d.items() if k != "file"}
        d["edits"] = tuple(tuple(e) for e in d["edits"])
        d["routes"] = tuple(d.get("routes") or (UNSEG,))
        return cls(**d)


def _m(name, pass_name, edits, what, routes=(UNSEG,), equivalent=None, gap=None) -> Mutant:
    if pass_name not in PASSES:
        raise ValueError(f"mutant {name}: pass_name: expected one of {'|'.join(PASSES)}, got {pass_name!r}")
    for e in edits:
        if len(e) != 3:
            raise ValueError(f"mutant {name}: edits: expected (anchor, find, replace) triples, got {e!r}")
    return Mutant(name=name, pass_name=pass_name, edits=tuple(tuple(e) for e in edits), what=what,
                  routes=tuple(routes), equivalent=equivalent, gap=gap)


CATALOGUE: tuple = (
    # ------------------------------------------------------------------ K1 (prepare)
    _m("l2norm_eps_outside_sqrt", "K1",
       [("k1-l2norm-k", "tl.sqrt(tl.sum(k * k, 1) + 1e-6)", "tl.sqrt(tl.sum(k * k, 1)) + 1e-6")],
       "k / (sqrt(sum k^2) + 1e-6) instead of k / sqrt(sum k^2 + 1e-6); only rows of small norm tell the "
       "two apart (stress/small-norm-qk-lb-1 exists for this)"),
    _m("gate_lower_bound_sign", "K1",
       [("k1-gate", "lower_bound * tl.sigmoid(rate * g)", "-lower_bound * tl.sigmoid(rate * g)")],
       "a = -lb sigmoid(...): the decay becomes a growth"),
    _m("tail_gate_not_zeroed", "K1",
       [("k1-gate", "tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)", "lower_bound * tl.sigmoid(rate * g)")],
       "the gate of the tail rows past Lc left at lb sigmoid(rate dt_bias): their G keeps falling, and "
       "k1_prepare_kernel, which does not mask its tail rows, multiplies their zero k by 2^-(G - G_pivot)"),
    _m("one_head_decay_scaled", "K1",
       [("k1-gate", "tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0)",
        "tl.where(m2, lower_bound * tl.sigmoid(rate * g), 0.0) * tl.where(h == 1, 1.05, 1.0)")],
       "head 1's log-decay a scaled by 1.05 (its decay exp(a) raised to 1.05): one head of many off by "
       "a few percent"),
    _m("gate_rate_not_exponentiated", "K1",
       [("k1-rate", "tl.exp(tl.load(alog_ptr + h).to(tl.float32))", "tl.load(alog_ptr + h).to(tl.float32)")],
       "A_log used as the rate instead of exp(A_log)"),
    _m("cumsum_missing_log2e", "K1", [("k1-cumsum", "tl.cumsum(a, 0) * 1.4426950408889634", "tl.cumsum(a, 0)")],
       "the natural-log cumsum used as a log2 cumsum (exp2 of ln units)"),
    _m("ws_gt_off_by_one_row", "K1", [("k1-g-last", "Lc - 1", "Lc - 2")],
       "G_last taken from row Lc-2: the chunk's decay misses its last token"),
    _m("kr_decay_sign", "K1", [("k1-store-kr", "G_last[None, :] - G", "G - G_last[None, :]")],
       "ws_kr = k 2^(G - G_last) instead of k 2^(G_last - G)"),
    _m("scale_applied_twice", "K1", [("k1-store-qd", "scale * q", "scale * scale * q")],
       "ws_qd scaled twice (a host that pre-scales q, and the kernel again)"),
    _m("scale_missing_in_mqk_diagonal_blocks", "K1", [("k1-qp-diag", "(scale * q) * up", "q * up")],
       "Mqk's diagonal 16-blocks without the scale"),
    _m("pivot_block_boundary_off_by_one", "K1", [("k1-pivot-select", "ri < BC", "ri <= BC")],
       "row 16 takes the first block's pivot: its factors no longer match the second block's"),
    _m("pivot_row_off_by_one", "K1", [("k1-pivot-p0", "ri == p0", "ri == p0 + 1")],
       "the first diagonal block pivots on row 9 instead of row 8",
       equivalent="the pivot cancels in kp ki^T (2^(G_i-G_p) 2^(G_p-G_j)); one row further keeps every "
                  "factor within 2^(+-72) at lb -5.5, far inside bf16's normal range, and a bf16 rounding "
                  "is relative, so only the rounding pattern changes (and past the tail G is flat)"),
    _m("wrong_sign_of_L", "K1", [("k1-L", "-beta[:, None] * kk", "beta[:, None] * kk")],
       "L = +beta kk^T: the kernel builds (I + L)^-1"),
    _m("beta_missing_in_L", "K1", [("k1-L", "-beta[:, None] * kk", "-kk")],
       "L without its row scaling by beta"),
    _m("L_includes_diagonal", "K1", [("k1-L", "ri > cj", "ri >= cj")],
       "L keeps its diagonal (i >= j): not strictly lower any more"),
    _m("mqk_diagonal_dropped", "K1", [("k1-mqk", "ri >= cj", "ri > cj")],
       "Mqk strictly lower: each token's own contribution to o is lost"),
    _m("tail_beta_not_zeroed", "K1", [("k1-beta", "tl.where(rmask, tl.sigmoid(braw), 0.0)", "tl.sigmoid(braw)")],
       "beta of the tail rows past Lc left at sigmoid(0) = 0.5",
       equivalent="the tail rows' k are loaded as 0 and their v masked to 0, so u = beta (v - kd S) and "
                  "the tail rows of L are 0 whatever beta is; the kernel zeroes the tail twice"),
    _m("inverse_stored_bf16", "K1", [("k1-store-inv", "inv.to(tl.float16)", "inv.to(tl.bfloat16)")],
       "the inverse rounded to bf16 (8 bits) before its fp16 store"),
    _m("merge_step_missing", "K1",
       [("k1-merge", "inv + _dot_f32(inv, _dot_f32(L_off, inv, INV_PREC), INV_PREC)", "inv")],
       "the block merge skipped: the inverse is block diagonal"),
    _m("inverse_reads_L_transposed", "K1",
       [("k1-load-L", "l_ptr + sq_off", "l_ptr + tl.program_id(0).to(tl.int64) * (C * C) + ri + cj * C")],
       "K1's second launch reads ws_L with its row and column strides swapped: the inverse of I - L^T"),
    _m("neumann_doubling_step_missing", "K1", [("k1-num-doubling", "BC.bit_length() - 2", "BC.bit_length() - 3")],
       "three doubling steps instead of four: sum_{n<8} D^n, D^8..D^15 missing"),
    _m("varlen_boundary_off_by_one", "K1",
       [("plan-tile-rows", "min(C, t1 - t0 - c * C)", "min(C, t1 - t0 - c * C + 1)")],
       "a partial last chunk takes one token past its sequence's end"),
    # ------------------------------------------------------------------ pass C (chunk step, outputs)
    _m("beta_missing_in_u", "C", [("walk-u", "beta[:, None] * (v - tl.dot(kd, Sb))", "v - tl.dot(kd, Sb)")],
       "u = v - kd S without beta"),
    _m("decay_applied_after_update", "C",
       [("walk-state-update", "S * gt[:, None] + tl.dot(tl.trans(kr), U.to(tl.bfloat16))",
        "(S + tl.dot(tl.trans(kr), U.to(tl.bfloat16))) * gt[:, None]")],
       "S <- (S + kr^T U) gt instead of S gt + kr^T U"),
    _m("final_state_stored_transposed", "C",
       [("walk-final-dense", "_state_offsets(n, h, sfn, sfh, sfk, sfv, kk, cols)",
        "_state_offsets(n, h, sfn, sfh, sfv, sfk, kk, cols)")],
       "the dense final state written with its K and V strides swapped"),
    _m("initial_state_read_transposed", "C",
       [("h0-dense-load", "_state_offsets(row, h, sn, sh, sk, sv, kk, cols)",
        "_state_offsets(row, h, sn, sh, sv, sk, kk, cols)")],
       "a dense initial state read with its K and V strides swapped"),
    _m("has_initial_state_ignored", "C", [("h0-paged-load", "has & (off >= 0)", "off >= 0")],
       "a paged slot read although has_initial_state is false"),
    _m("paged_slot_offset_wrong", "C", [("h0-paged-slot", "tl.load(idx_ptr + row)", "row")],
       "the paged state of sequence n read from slot n, not state_indices[n]"),
    _m("last_segment_final_state_not_written", "C", [("walk-store-final", "is_last != 0", "is_last == 0")],
       "the final state written by every segment but the last"),
    _m("paged_final_written_to_sequence_row", "C", [("walk-final-paged", "tl.load(fidx_ptr + n)", "n")],
       "the paged final state written to slot n, not state_indices[n]"),
    _m("segment_starts_from_zero", "C", [("walk-h0-seg", "H0_SEG", "H0_NONE")],
       "pass C drops the carry h_in at every segment boundary (starts from 0)", routes=(SEG,)),
    # ------------------------------------------------------------------ pass A (segment maps)
    _m("fused_A_sign_of_u", "A", [("maps-uA", "-beta[None, :]", "beta[None, :]")],
       "fused pass A: u of the A_seg part with the wrong sign", routes=(SEG,)),
    _m("fused_A_uses_b_update", "A", [("maps-SA-update", "UA.to(tl.bfloat16)", "U.to(tl.bfloat16)")],
       "fused pass A: the A_seg part updated with the b_seg part's U (copy-paste slip)", routes=(SEG,)),
    _m("two_launch_A_beta_missing", "A",
       [("maps-u-A-only", "-beta[None, :] * tl.dot(S.to(tl.bfloat16), kdT)", "-tl.dot(S.to(tl.bfloat16), kdT)")],
       "pass A in two launches: A_seg's u without beta", routes=(SEG_TWO,)),
    _m("map_A_seg_stored_transposed", "A",
       [("maps-a-off", "(s * H + h).to(tl.int64) * K * K + kk[None, :] * K + cols[:, None]",
        "(s * H + h).to(tl.int64) * K * K + kk[None, :] + cols[:, None] * K")],
       "pass A's transposed walk stores S^T where A_seg wants S (row and column offsets swapped)", routes=(SEG,)),
    _m("map_b_seg_stored_transposed", "A",
       [("maps-store-b", "bseg_ptr + (s * H + h).to(tl.int64) * K * V + kk[None, :] * V + cols[:, None]",
        "bseg_ptr + (s * H + h).to(tl.int64) * K * V + kk[None, :] + cols[:, None] * V")],
       "pass A's transposed walk stores b_seg transposed", routes=(SEG,)),
    # ------------------------------------------------------------------ pass B (scan)
    _m("scan_carry_dropped", "B",
       [("scan-split-update", "tl.dot(Alo, hi, tl.dot(Ahi, lo, tl.dot(Ahi, hi, bb)))", "bb")],
       "the scan forgets the carry: h <- b_seg instead of A_seg h + b_seg", routes=(SEG,)),
    _m("scan_reads_wrong_segment", "B", [("scan-load-b-plain", "cur", "(s0 * H + h).to(tl.int64)")],
       "the plain scan reads the sequence's first b_seg for every segment", routes=(SEG_PLAIN,)),
    _m("scan_stores_h_in_after_update", "B",
       [("scan-store-h-in", WHOLE, "pass"),
        ("scan-update", AFTER, "tl.store(hin_ptr + cur * K * V + v_tile, S)")],
       "the scan stores h_in[s] after the update (the outgoing state, one segment late)", routes=(SEG,)),
    _m("scan_not_reset_at_sequence_start", "B",
       [("scan-s0", WHOLE, "s0 = tl.load(seg_off_ptr + tl.maximum(n - 1, 0))\nown0 = tl.load(seg_off_ptr + n)"),
        ("scan-store-h-in", "tl.store(hin_ptr + cur * K * V + v_tile, S)",
        "tl.store(hin_ptr + cur * K * V + v_tile, S, mask=(s >= own0) & (v_tile >= 0))")],
       "no state reset at a sequence start: the scan of sequence n walks sequence n-1's segments first, "
       "so n's first h_in carries n-1's segment maps (one request's state leaking into the next)",
       routes=(SEG,)),
    _m("prefetch_reads_wrong_next_segment", "B", [("scan-next", "(s + 1) * H + h", "s * H + h")],
       "the prefetching scan loads the current segment again instead of the next", routes=(SEG,)),
    # ------------------------------------------------------------------ K1 on halves (k1=halves)
    _m("halves_bottom_cumsum_misses_top", "K1",
       [("halves-Gb", "tl.cumsum(ab, 0) + tl.sum(at, 0)[None, :]", "tl.cumsum(ab, 0)")],
       "the bottom half's gate cumsum restarts at row 16 (the top half's decay is lost)", routes=(HALVES,)),
    _m("halves_merge_order_swapped", "K1",
       [("halves-X10", "_dot_f32(X1, _dot_f32(L10, X0, INV_PREC), INV_PREC)",
        "_dot_f32(X0, _dot_f32(L10, X1, INV_PREC), INV_PREC)")],
       "the off-diagonal block of the inverse multiplied in the wrong order (X0 L10 X1)", routes=(HALVES,)),
    _m("halves_off_block_sign", "K1", [("halves-L10", "-bb[:, None] * kk10", "bb[:, None] * kk10")],
       "L's off-diagonal block without its minus sign", routes=(HALVES,)),
    _m("halves_off_block_pivot_from_top", "K1", [("halves-kk10", "Gb - G_po", "Gb - G_p0")],
       "the off-diagonal block's row factors pivot on row 8, its column factors on row 16", routes=(HALVES,)),
    _m("halves_mqk_off_block_dropped", "K1",
       [("halves-store-mqk10", "qk10.to(tl.float16)", "tl.zeros([BC, BC], dtype=tl.float16)")],
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
