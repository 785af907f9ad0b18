"""``autotune``: ``triton.autotune`` that caches its results on disk and logs its progress.

The generated kernels use ``@autotune(configs=..., key=..., prune_configs_by=...)`` where they would use
``@triton.autotune(...)``. Differences:

* ``cache_results=True`` where Triton has it (3.4 on; the GPU machine runs 3.6): each tuning result is
  written to Triton's cache folder (``$TRITON_CACHE_DIR``, keyed by Triton, the GPU, the kernel source,
  the key values and the configs), so a new process at known shapes compiles one config instead of
  benchmarking all. Triton reads that file without a guard (a corrupt one raises in the launch); here
  such a file is logged at WARNING and the configs are benchmarked as if there were none.
* A config whose compilation fails for any reason (not only Triton's out-of-resources errors: an MLIR pass
  that rejects a warp-specialized variant raises ``RuntimeError``) is logged and timed as infinitely slow, so
  the others still compete.
* Never inside a CUDA graph capture: a benchmark there (events, synchronizations, launches of every config)
  would invalidate the capture. A key that needs tuning while the current stream captures raises
  :class:`TuningDuringCapture` before anything reaches the GPU, so the caller's fallback (the region's original
  ops) is what gets captured. (A key tuned before, or found in the disk cache, launches as usual.)
* Progress at INFO: ``tuning <kernel> for M_BUCKET=16, N=4096, K=1024 (4 configs)`` before the
  benchmark, ``tuned <kernel>: best <config> in 3.2 s`` after (or ``... from Triton's disk cache``).
* Before the benchmark, the configs are compiled in parallel threads (``triton.AsyncCompileMode`` where
  Triton has it): a first call at a new shape otherwise compiles them one at a time, seconds each on the
  GPU machine, while the compiler's work (MLIR passes, ptxas) runs largely outside the GIL.
* Then, when there are more than ``SCREEN_KEEP + 1`` configs, each is timed briefly (``do_bench`` with
  ``SCREEN_REP_MS`` of repetitions instead of Triton's 100 ms); Triton's own benchmark then times only the
  ``SCREEN_KEEP`` fastest and any within ``SCREEN_TOLERANCE`` of the fastest (the others read as infinitely
  slow), over ``FINAL_REP_MS`` each instead of its 100 ms. Triton's disk cache and its key (all the configs)
  are as before.
* Both time each call after a *clean* L2 (:func:`clean_l2_bench`: a 256 MB buffer read, not written, before
  each call), where Triton's ``do_bench`` zeroes that buffer and leaves 50 MB of dirty lines that the timed
  kernel must write back as it loads. A stage of an MLP runs after the stage before it, which leaves L2 clean;
  the dirty flush instead charged every ``tl.dot`` config ~8 µs that the software pipeline's ``cp.async``
  loads (which drop the ``evict_first`` policy) pay and the register stream does not, and so picked the stream at
  two rows where the tiles are faster in a model (``CLEAN_L2``; ``benchmarks/probes/probe_clean_tuning.py``).

The object returned is the ``Autotuner`` Triton built, with its class switched to a subclass that wraps
``run``, ``prune_configs`` and ``check_disk_cache`` (methods of every Triton 3.x ``Autotuner``): the
constructor's signature, which changes between releases, is never called here. If Triton's decorator
returns something else than a plain ``Autotuner``, it is returned as it is (no progress log).

Example:
    >>> @autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["N"])
    ... @triton.jit
    ... def kernel(x_ptr, N, BLOCK: tl.constexpr): ...              # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import inspect
import json
import logging
import os
import time

import torch
import triton
import triton.testing
from triton.runtime.autotuner import Autotuner

from .template import interpreting

__all__ = ["CACHES_RESULTS", "ProgressAutotuner", "TuningDuringCapture", "autotune"]

log = logging.getLogger(__name__)

CACHES_RESULTS = "cache_results" in inspect.signature(triton.autotune).parameters
_ASYNC_COMPILE = getattr(triton, "AsyncCompileMode", None)
_MAX_COMPILE_THREADS = 16
# The screening before Triton's benchmark (see the module doc). H200, fresh caches
# (benchmarks/probes/probe_first_call.py): the benchmark of 22-25 small-M configs took ~2.8 s of each decode stage's
# ~4.4 s of tuning.
SCREEN_KEEP = 3
SCREEN_TOLERANCE = 0.10
SCREEN_WARMUP_MS, SCREEN_REP_MS = 5, 20
# Triton's benchmark of the configs left after screening: a 60 µs decode stage still gets ~400 timed calls (each
# after do_bench's 256 MB L2 flush), ~800 with Triton's 100 ms; what is left to tell apart is a median.
FINAL_WARMUP_MS, FINAL_REP_MS = 10, 50
# Time configs after a clean L2 (clean_l2_bench) rather than after Triton's dirty flush (see the module doc).
CLEAN_L2 = True
_L2_SWEEP_BYTES = 256 << 20  # as Triton's flush buffer: more than any GPU's L2


class TuningDuringCapture(RuntimeError):
    """A kernel would have to benchmark its configs while the current CUDA stream is capturing a graph."""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def autotune(**kwargs):
    """``triton.autotune(**kwargs, cache_results=True)`` (when Triton has it), logging each new tuning."""
    if CACHES_RESULTS:
        kwargs.setdefault("cache_results", True)
    decorate = triton.autotune(**kwargs)

    def wrap(fn):
        tuner = decorate(fn)
        if type(tuner) is Autotuner:
            tuner.__class__ = ProgressAutotuner
        return tuner

    return wrap


class ProgressAutotuner(Autotuner):
    """Triton's ``Autotuner``, logging when it benchmarks and tolerating a corrupt disk-cache entry."""

    _tuning_since = None  # perf_counter() when a benchmark of several configs began in this run
    _disk_hit = False
    _call = None  # (args, kwargs) of the run() in progress
    _screened_out: frozenset = frozenset()  # configs Triton's benchmark in progress skips (see screen())

    def prune_configs(self, kwargs):
        # Triton calls this on a key it has not tuned yet, right before benchmarking what it returns.
        configs = super().prune_configs(kwargs)
        if len(configs) > 1:
            args = {**(self.nargs or {}), **kwargs}
            key = ", ".join(f"{k}={args[k]}" for k in self.keys if k in args)
            log.info("fxfuse: tuning %s for %s (%d configs)", self._name(), key, len(configs))
            self._tuning_since = time.perf_counter()
            self._disk_hit = False
        return configs

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        def compile_then_bench():
            self._refuse_during_capture()
            self.precompile(configs)
            self._screened_out = self.screen(configs)
            try:
                with self._benchmarking(FINAL_WARMUP_MS, FINAL_REP_MS):
                    bench_fn()
            finally:
                self._screened_out = frozenset()

        try:
            self._disk_hit = super().check_disk_cache(tuning_key, configs, compile_then_bench)
        except (OSError, ValueError, KeyError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            log.warning("fxfuse: Triton's autotune cache entry for %s is unreadable (%s: %s); tuning again "
                        "(clear $TRITON_CACHE_DIR to rewrite it)", self._name(), type(err).__name__, err)
            if tuning_key not in self.cache:  # the failure came before the benchmark
                bench_fn()
            self._disk_hit = False
        return self._disk_hit

    def _refuse_during_capture(self) -> None:
        if _capturing():
            raise TuningDuringCapture(f"fxfuse: {self._name()} has not been tuned for this shape, and a CUDA graph "
                                      "is being captured on this stream (tuning would invalidate it)")

    def _bench(self, *args, config, **meta):
        if config in self._screened_out:
            return [float("inf")] * 3
        self._refuse_during_capture()  # (not caught below: no config can be timed here)
        try:
            return super()._bench(*args, config=config, **meta)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # any config that cannot run here is simply not a candidate
            log.warning("fxfuse: %s config %s failed (%s: %s); not using it", self._name(), config,
                        type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            return [float("inf")] * 3

    def precompile(self, configs) -> None:
        """Compile ``configs`` for the current call's arguments in parallel threads, so that the benchmark that
        follows only loads them. Best effort: a config that fails here is compiled (and fails) again there."""
        call = self._call
        if _ASYNC_COMPILE is None or call is None or len(configs) < 2 or interpreting():
            return  # (the interpreter compiles nothing)
        args, kwargs = call
        base = {**dict(zip(self.arg_names, args)), **kwargs}
        for launch_only in ("grid", "warmup"):  # ``kernel[grid](...)`` passes these to the autotuner's run
            base.pop(launch_only, None)
        launches = []
        for config in configs:
            # A config's pre-hook writes into its arguments (a TMA descriptor's block shape): give each its copies.
            launch = {name: copy.copy(v) if type(v).__name__ == "TensorDescriptor" else v for name, v in base.items()}
            launch.update(config.all_kwargs())
            if config.pre_hook is not None:
                config.pre_hook(launch)
            launches.append(launch)
        threads = min(len(launches), os.cpu_count() or 1, _MAX_COMPILE_THREADS)
        t0 = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool, _async_compile(pool):
                for launch in launches:
                    self.fn.warmup(grid=(1,), **launch)
        except Exception as err:  # the benchmark compiles whatever is missing, one by one
            log.info("fxfuse: parallel compile of %s stopped (%s: %s); the benchmark compiles the rest",
                     self._name(), type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            return
        log.info("fxfuse: compiled %d configs of %s in %.1f s (%d threads)", len(launches), self._name(),
                 time.perf_counter() - t0, threads)

    def screen(self, configs) -> frozenset:
        """The configs Triton's benchmark need not time: all but the ``SCREEN_KEEP`` fastest (and those within
        ``SCREEN_TOLERANCE`` of the fastest) by a brief ``do_bench`` of each, for the current call's arguments."""
        call = self._call
        if len(configs) <= SCREEN_KEEP + 1 or call is None or interpreting():
            return frozenset()
        args, kwargs = call
        t0 = time.perf_counter()
        with self._benchmarking(SCREEN_WARMUP_MS, SCREEN_REP_MS) as shortened:
            if not shortened:  # Triton's benchmark times every config
                return frozenset()
            times = {c: self._bench(*args, config=c, **kwargs)[0] for c in configs}
        ranked = sorted(configs, key=times.get)
        best = times[ranked[0]]
        kept = {c for i, c in enumerate(ranked) if i < SCREEN_KEEP or times[c] <= best * (1 + SCREEN_TOLERANCE)}
        log.info("fxfuse: screened %d configs of %s in %.1f s; timing the %d fastest", len(configs), self._name(),
                 time.perf_counter() - t0, len(kept))
        return frozenset(c for c in configs if c not in kept)

    @contextlib.contextmanager
    def _benchmarking(self, warmup_ms: int, rep_ms: int):
        """Time configs with ``do_bench(warmup=warmup_ms, rep=rep_ms)`` inside; yields False (and changes nothing)
        where this release's ``Autotuner.do_bench`` cannot be replaced."""
        full = self.do_bench  # Triton's benchmarker (an attribute or a cached property, depending on the release)
        bench = clean_l2_bench if CLEAN_L2 else triton.testing.do_bench
        try:
            self.do_bench = lambda fn, quantiles: bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles)
        except AttributeError:  # a read-only property in some release
            yield False
            return
        try:
            yield True
        finally:
            self.do_bench = full

    def run(self, *args, **kwargs):
        self._tuning_since = None
        self._call = (args, kwargs)  # what precompile() compiles for, should this call tune
        try:
            out = super().run(*args, **kwargs)
        finally:
            self._call = None
        if self._tuning_since is not None:
            how = "from Triton's disk cache" if self._disk_hit else \
                f"in {time.perf_counter() - self._tuning_since:.1f} s"
            log.info("fxfuse: tuned %s: best %s %s", self._name(), getattr(self, "best_config", "?"), how)
            self._tuning_since = None
        return out

    def _name(self) -> str:
        fn = getattr(self, "base_fn", None) or self.fn
        what = getattr(fn, "__globals__", {}).get("EPILOGUE") or getattr(fn, "__globals__", {}).get("EPILOGUES")
        return f"{fn.__name__} {json.dumps(what)}" if what else fn.__name__


def clean_l2_bench(fn, warmup: int, rep: int, quantiles) -> list[float]:
    """``triton.testing.do_bench(fn, warmup, rep, quantiles)`` (ms at each quantile), but before each timed call
    L2 is refilled by *reading* a 256 MB buffer: the call finds none of its data cached and no dirty lines to
    write back (Triton's ``do_bench`` zeroes the buffer instead, leaving L2 full of dirty lines).

    Example:
        >>> clean_l2_bench(lambda: torch.mm(a, b), warmup=5, rep=20, quantiles=(0.5, 0.2, 0.8))  # doctest: +SKIP
        [0.061, 0.060, 0.062]
    """
    sweep_from = torch.empty(_L2_SWEEP_BYTES // 8, dtype=torch.int64, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")

    def sweep() -> None:
        torch.sum(sweep_from, dim=0, out=sink)  # reads every line, writes 8 bytes

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        sweep()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / estimate_ms))):
        fn()
    n = max(1, int(rep / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        sweep()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    return torch.quantile(times, torch.tensor(quantiles, dtype=torch.float64)).tolist()


def _async_compile(pool):
    """``triton.AsyncCompileMode(pool)``, failures left to the benchmark (``ignore_errors`` where Triton has it)."""
    if "ignore_errors" in inspect.signature(_ASYNC_COMPILE).parameters:
        return _ASYNC_COMPILE(pool, ignore_errors=True)
    return _ASYNC_COMPILE(pool)
