"""Pin Triton autotuners to one config for the duration of a call (no autotuning inside a verdict).

A ``triton.autotune`` kernel benchmarks every config the first time it sees a new tuning key
(shape, dtype, flags), which on a GPU takes seconds to minutes per key and makes the config
that ran depend on timing noise.  With exactly one config, Triton 3.x's ``Autotuner.run``
launches that config directly: no pruning, no benchmarking, no in-memory or on-disk autotune
cache (``cache_results`` / ``TRITON_CACHE_AUTOTUNING`` are only consulted when there are
several configs), and fla's ``CachedAutotuner`` (``FLA_CACHE_MODE``) only fills the in-memory
cache that a single config bypasses.  So pinning = ``tuner.configs = [one of its configs]``,
restored afterwards.

The rule (``choose_config``), applied to the config list as the library built it on this
machine (fla filters some lists by the device's shared memory at import):

    1. num_warps == 4 first (Triton's default, and one Hopper warpgroup, so tl.dot can take the
       wgmma path as it would under fla's tuned configs); otherwise the fewest warps;
    2. then the fewest num_stages (least shared memory spent on software pipelining);
    3. then the smallest tile meta-parameters, compared in the order of their sorted names
       (least shared memory and registers per program);
    4. then the library's own order.

Steps 2 and 3 pick the least shared memory the library itself offers, so the choice fits any
device the library's own list was built for (an H200 has 228 KB per SM) and runs under
TRITON_INTERPRET=1, where warps and stages mean nothing.

A caller whose library states its own choice passes another rule (``rule=``, a sort key over
``(index, config)`` like ``rule_key``).  ``first_matching(**meta)`` is the one in use: the first
config in the library's own order whose meta-parameters include ``meta``, else the library's
first config.  kda_kernels.aiter pins with ``first_matching(BW=32)``: step 1's reason is a
Hopper one (aiter targets AMD GPUs: 64-lane wavefronts, no wgmma); BW=32 is the K2 tile width
aiter's own segmentation heuristic assumes ("the config the tuner usually lands on"); and
K1's list (no BW) begins with aiter's default config (2 warps, 1 stage).  On aiter's 2026-08
K2 list (BW 16/32/64) the default rule would pick BW=64 with 4 warps instead.

Whatever the rule, an autotuner with an ``early_config_prune`` is refused: which configs it would drop depends on the launch's
arguments, so a choice made ahead of the launch could be one it rejects.

While pinned, ``Autotuner.run`` itself is wrapped (class-wide, restored afterwards) so that every
autotuned launch is counted, and a launch of an autotuner that was *not* pinned and still holds
several configs raises instead of benchmarking: a path the caller did not know about is named,
never silently autotuned.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional

_MAX_WRAPPERS = 8  # heuristics wrappers are one or two deep; a loop guard, not a limit in practice


def find_autotuner(kernel) -> Optional[Any]:
    """The Autotuner inside a kernel object, or None: the kernel itself, or one reached through
    ``.fn`` from ``triton.heuristics`` wrappers (Heuristics -> Autotuner -> JITFunction, or
    Autotuner -> Heuristics -> JITFunction).  An object counts as an autotuner when it has
    ``configs``."""
    obj = kernel
    for _ in range(_MAX_WRAPPERS):
        if obj is None or hasattr(obj, "configs"):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _orderable(value) -> tuple:
    """Numbers before anything else, each kind in its own natural order."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return (1, str(value))
    return (0, value)


def rule_key(index: int, config) -> tuple:
    """Sort key of the pinning rule (module docstring); smaller is chosen."""
    warps = getattr(config, "num_warps", None) or 4
    stages = getattr(config, "num_stages", None) or 0
    tiles = tuple(_orderable(v) for _, v in sorted(getattr(config, "kwargs", {}).items()))
    return (warps != 4, warps, stages, tiles, index)


def first_matching(**meta) -> Callable[[int, Any], tuple]:
    """A rule (sort key over ``(index, config)``) for ``choose_config`` / ``pinned``: the first
    config in the library's own order whose meta-parameters include every ``name=value`` of
    ``meta``; when none does (or a kernel has no such meta-parameter), the library's first config."""
    if not meta:
        raise ValueError("meta: expected at least one meta-parameter to match (e.g. BW=32), got none")

    def key(index: int, config) -> tuple:
        kwargs = getattr(config, "kwargs", None) or {}
        matches = all(name in kwargs and kwargs[name] == value for name, value in meta.items())
        return (not matches, index)
    key.__name__ = "first_matching(" + ", ".join(f"{k}={v!r}" for k, v in meta.items()) + ")"
    return key


def choose_config(configs, rule: Callable[[int, Any], Any] = rule_key):
    """The config ``rule`` picks from a non-empty list (one of the list's own objects): the one
    with the smallest ``rule(index, config)``; by default the pinning rule of the module docstring."""
    if not configs:
        raise ValueError("configs: expected at least one autotune config, got none")
    return min(enumerate(configs), key=lambda ic: rule(*ic))[1]


_CHOSEN: dict = {}   # (id(configs list), rule) -> (that list, its length, the config chosen, its describe())


def _chosen(configs: list, rule) -> tuple:
    """(``choose_config(configs, rule)``, its ``describe``), computed once per (list, rule): a library keeps one list
    per autotuner, and a 10^4-step serving trace pins every fla autotuner on every decode call
    (0.5 ms of rule keys per call on the H200's host, against a 0.3 ms kernel call).  The entry
    holds the list itself, so a new list at a reused address is recomputed."""
    key = (id(configs), rule)
    hit = _CHOSEN.get(key)
    if hit is not None and hit[0] is configs and hit[1] == len(configs):
        return hit[2], hit[3]
    config = choose_config(list(configs), rule)
    _CHOSEN[key] = (configs, len(configs), config, describe(config))
    return _CHOSEN[key][2:]


def describe(config) -> str:
    """'BK=32 BV=64 warps=4 stages=2': the meta-parameters, then warps and stages."""
    parts = [f"{k}={v}" for k, v in sorted(getattr(config, "kwargs", {}).items())]
    parts.append(f"warps={getattr(config, 'num_warps', None)}")
    parts.append(f"stages={getattr(config, 'num_stages', None)}")
    return " ".join(parts)


def _tuner_name(tuner) -> str:
    fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
    return getattr(fn, "__name__", type(tuner).__name__)


class UnpinnedAutotuneError(RuntimeError):
    """An autotuner that was not pinned would have benchmarked its configs inside the call."""


@contextlib.contextmanager
def pinned(kernels: Mapping[str, Any], autotuner_class=None, context: str = "",
           rule: Callable[[int, Any], Any] = rule_key) -> Iterator[dict]:
    """Pin every autotuner among ``kernels`` (name -> kernel object, heuristics wrappers allowed)
    to the config ``rule`` picks (``choose_config``; the module docstring's rule by default) for
    the duration of the ``with`` block; restore each one's own list afterwards, also when the
    block raises.

    Yields a dict filled while the block runs, name -> {"config": describe(...), "of": number
    of configs it had, "launches": n}.  ``launches`` counts launches through the wrapped
    ``autotuner_class.run`` (Triton's Autotuner unless a test passes another class); an
    autotuner of that class that is not among ``kernels`` and holds several configs raises
    UnpinnedAutotuneError when launched.  ``context`` names the caller in that message.
    """
    if autotuner_class is None:
        # lazy: triton is imported only where a Triton path runs (docs/design.md, Imports)
        from triton.runtime.autotuner import Autotuner as autotuner_class
    record: dict = {}
    chosen: dict = {}
    saved: list = []
    for name, kernel in kernels.items():
        tuner = find_autotuner(kernel)
        if tuner is None:
            raise ValueError(f"kernels: {name!r} is no autotuned kernel (no .configs under its .fn chain)")
        if getattr(tuner, "early_config_prune", None) is not None:
            raise ValueError(f"kernels: {name!r} prunes its configs per launch (early_config_prune); "
                             "a config chosen ahead of the launch could be one it drops")
        config, described = _chosen(tuner.configs, rule)
        chosen[id(tuner)] = name
        record[name] = {"config": described, "of": len(tuner.configs), "launches": 0}
        saved.append((tuner, tuner.configs, config))
    original_run = autotuner_class.__dict__.get("run")
    inherited = original_run is None
    base_run = autotuner_class.run

    def guarded_run(self, *args, **kwargs):
        name = chosen.get(id(self))
        if name is not None:
            record[name]["launches"] += 1
        elif len(self.configs) > 1:
            where = f" in {context}" if context else ""
            raise UnpinnedAutotuneError(
                f"{_tuner_name(self)} would autotune among {len(self.configs)} configs{where}: "
                "it is not among the pinned kernels")
        return base_run(self, *args, **kwargs)

    try:
        for tuner, _, config in saved:
            tuner.configs = [config]
        autotuner_class.run = guarded_run
        yield record
    finally:
        if inherited:
            del autotuner_class.run
        else:
            autotuner_class.run = original_run
        for tuner, configs, _ in reversed(saved):
            tuner.configs = configs
