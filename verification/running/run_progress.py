"""A run's progress line (``Progress``: a bar with ETA on a tty, one line per cell otherwise)
and its summary (``RunSummary``: the records, counts, exit code)."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from verification.judging.policy import FAILING, JUDGED, exit_code
from verification.judging.record import Record


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def clip_words(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters at a word boundary, with "…" where it was cut
    (never mid-word; a single word longer than n is cut at n - 1)."""
    text = str(text)
    if len(text) <= n:
        return text
    cut = text[:n - 1]
    space = cut.rfind(" ")
    if space > n // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "…"


class Progress:
    """A progress bar with ETA on a stream (stderr): redrawn in place on a tty, one plain
    line per cell otherwise (logs, CI); a long reason is cut at a word boundary ("…")."""

    def __init__(self, total: int, stream=None, tty: Optional[bool] = None, width: int = 24):
        self.total, self.done, self.width = int(total), 0, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.t0 = time.perf_counter()
        self.counts: dict[str, int] = {}

    def eta(self) -> float:
        if self.done == 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / self.done * (self.total - self.done)

    def step(self, rec: Record) -> None:
        self.done += 1
        st = rec.status or "?"
        self.counts[st] = self.counts.get(st, 0) + 1
        label = f"{rec.backend} {rec.route} {rec.case}"
        frac = self.done / self.total if self.total else 1.0
        eta = _fmt_s(self.eta())
        if self.tty:
            fill = int(round(frac * self.width))
            bar = "#" * fill + "." * (self.width - fill)
            tally = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            line = f"\r[{bar}] {self.done}/{self.total} {frac:4.0%} ETA {eta} | {tally} | {st}: {label}"
            self.stream.write(clip_words(line, 200).ljust(120))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{self.done}/{self.total} {frac:4.0%} ETA {eta}] {st:<10} {label}"
                              f"{(' - ' + clip_words(rec.reason, 240)) if st != 'pass' and rec.reason else ''}\n")
        self.stream.flush()


@dataclass
class RunSummary:
    out_dir: Optional[Path]
    records: list[Record] = field(default_factory=list)  # every record of the run (resumed ones included)
    fresh: list[Record] = field(default_factory=list)    # the records of cells run by this invocation
    ran: int = 0                                      # cells executed by this invocation
    resumed: int = 0                                  # cells found finished and skipped
    stopped_early: bool = False                       # --max-cells reached
    selected: int = 0                                 # cells of the run's selection (resumed ones included)
    not_run: Optional[int] = None                     # interrupted (Ctrl-C): selected cells without a record
    oracle_runs: dict = field(default_factory=dict)  # case id -> truth evaluations (1 each)
    baseline_runs: dict = field(default_factory=dict)  # (case id, recipe) -> baseline evaluations

    def counts(self) -> dict:
        c: dict[str, int] = {}
        for r in self.records:
            c[r.status or "?"] = c.get(r.status or "?", 0) + 1
        return c

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if r.status in FAILING]

    @property
    def exit_code(self) -> int:
        """verification.judging.policy.exit_code of the run's cells: 130 when interrupted, 1 when a cell
        failed, was mistrusted, crashed or errored, 2 when the harness ran out of memory on a
        cell or no cell was judged, else 0."""
        return exit_code([r.status for r in self.records], interrupted=self.not_run is not None)

    @property
    def verified(self) -> int:
        """How many cells reached a verdict (pass, known-fail, fail, mistrusted)."""
        return sum(r.status in JUDGED for r in self.records)
