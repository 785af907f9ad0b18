"""Which kernels run a fused region, and the measured choice between them and the original ops.

Candidates (:func:`kernel_candidates`), by structure, widths and rows M:

* ``fused_chain``: the whole chain in one kernel (every stage one linear, each layer's weight tile small enough to
  stay on chip: :func:`fxfuse.kernels.chain_template.chain_fits`);
* ``decode_split_hidden``: a two-stage MLP on 2 ≤ M ≤ ``DECODE_MAX_M`` rows in one launch, split over the hidden
  dim (its programs add their partial sums with fp32 atomics, in arrival order: not a candidate while
  ``torch.use_deterministic_algorithms(True)`` is on, and choices are kept apart by that flag);
* ``decode_grid_sync``: a two-stage MLP on one row in one persistent launch, a grid barrier between the stages and
  the second stage's weights prefetched during the first (:mod:`fxfuse.kernels.grid_sync_template`);
* ``gemm_epilogue`` / ``gated_gemm_epilogue``: one GEMM+epilogue per stage (always possible), each stage by the
  fastest of the small-M kernel (M ≤ 16), the TMA kernel, the pointer kernel, cuBLASLt's epilogue and its
  original ops (:mod:`fxfuse.stages`).

On a GPU each candidate and the original ops are timed once per shape bucket and the fastest runs
(:func:`fastest`), so fusing never makes a region slower; above 64 rows a bucket is timed at its largest M too,
and split where its fastest changes (:func:`times_bucket_top`, :func:`decide`); a candidate the cost model puts
above twice the best time measured before it is not even built (``SKIP_ABOVE_BEST``); without timing
(``FXFUSE_AUTOTUNE=0``, the interpreter) the first candidate runs. :func:`choose_strategy` is that first
candidate, which the report shows before anything was measured.

Example:
    >>> from fxfuse.spec import MLPSpec
    >>> choose_strategy(MLPSpec.loads("1b:relu(a0);1b:relu(a0);1b:a0"), (32, 64, 64, 16))
    'fused_chain'
    >>> choose_strategy(MLPSpec.loads("1b:gelu_tanh(a0);1b:a0"), (768, 3072, 768))
    'gemm_epilogue'
    >>> kernel_candidates(MLPSpec.loads("1b:gelu_tanh(a0);1b:a0"), (1024, 4096, 1024), m=1)
    ['gemm_epilogue', 'decode_grid_sync']
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from .kernels.chain_template import chain_fits
from .kernels.decode_template import DECODE_BLOCK_M as DECODE_MAX_M
from .kernels.template import autotune_enabled, bucket_range, choice_bucket
from .spec import MLPSpec

__all__ = ["DECODE", "DECODE_GRID_SYNC", "FUSED_CHAIN", "GATED_GEMM_EPILOGUE", "GEMM_EPILOGUE", "ONE_LAUNCH",
           "ORIGINAL_OPS", "Measurement", "Split", "choose_strategy", "decide", "fastest", "for_cuda_graphs",
           "kernel_candidates", "kernels_are_faster", "launches", "measured_choice_enabled", "measurements", "resolve",
           "scoring_for_cuda_graphs", "time_candidates", "timed_at_top", "times_bucket_top", "top_input"]

log = logging.getLogger(__name__)

FUSED_CHAIN = "fused_chain"  # the whole chain in one kernel, intermediates on chip
GEMM_EPILOGUE = "gemm_epilogue"  # one GEMM kernel per stage, bias + epilogue fused
GATED_GEMM_EPILOGUE = "gated_gemm_epilogue"  # the same, gate and up in one kernel
DECODE = "decode_split_hidden"  # a two-stage MLP on a few rows in one launch, split over the hidden dim
DECODE_GRID_SYNC = "decode_grid_sync"  # a two-stage MLP on ONE row in one launch, a grid barrier between stages
ORIGINAL_OPS = "original_ops"  # the ops the region replaced (cuBLAS GEMMs + eager pointwise): always a candidate
ONE_LAUNCH = (FUSED_CHAIN, DECODE, DECODE_GRID_SYNC)  # strategies that run the whole region as one kernel

_scoring = threading.local()


@contextlib.contextmanager
def scoring_for_cuda_graphs() -> Iterator[None]:
    """Within it, the calls being planned will be captured into a CUDA graph: candidates are scored by their GPU
    time alone (a replay pays no host time), under choice keys of their own (:func:`fxfuse.cuda_graphed` plans
    and captures inside it). At gpt2m_mlp_m1 the two small-M launches (11.9 µs GPU, 16.6 host with the call path)
    lose to the one-launch grid-sync kernel (15.0 GPU) in a plain call and win in a graph.

    Example:
        >>> with scoring_for_cuda_graphs():
        ...     for_cuda_graphs()
        True
    """
    before = for_cuda_graphs()
    _scoring.graphs = True
    try:
        yield
    finally:
        _scoring.graphs = before


def for_cuda_graphs() -> bool:
    """Whether this thread is planning calls for a CUDA graph (see :func:`scoring_for_cuda_graphs`)."""
    return getattr(_scoring, "graphs", False)


def kernel_candidates(spec: MLPSpec, widths: Sequence[int], m: Optional[int] = None,
                      elem_size: int = 2, deterministic: Optional[bool] = None) -> list[str]:
    """The kernel strategies that can run ``spec``, in the order tried when nothing is measured.

    ``widths``: the input width, then each stage's output width; ``m``: rows (None: unknown, assume many);
    ``elem_size``: bytes per element of the input dtype (the chain kernel holds a layer's weights on chip);
    ``deterministic``: only kernels that give the same bits on every call (None: whether
    ``torch.are_deterministic_algorithms_enabled()``).

    Example:
        >>> spec = MLPSpec.loads("2:mul(silu(a0),a1);1:a0")
        >>> kernel_candidates(spec, (4096, 14336, 4096), m=8, deterministic=False)
        ['gated_gemm_epilogue', 'decode_split_hidden']
        >>> kernel_candidates(spec, (4096, 14336, 4096), m=8, deterministic=True)
        ['gated_gemm_epilogue']
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    out = []
    if chain_fits(widths, elem_size) and all(s.num_linears == 1 for s in spec.stages):
        out.append(FUSED_CHAIN)
    # One GEMM+epilogue per stage comes before the one-launch decode kernel: at M <= 16 its stages run the
    # small-M split-K kernel, which streamed the weights faster than the decode kernel at every decode row
    # measured on the H200 (benchmarks/probes/probe_gemv_sweep.py; the decode kernel's fp32 atomics grow with M).
    out.append(GATED_GEMM_EPILOGUE if spec.is_gated else GEMM_EPILOGUE)
    # One row: the grid-synchronized kernel (both stages in one persistent launch, the second stage's weights
    # prefetched during the first) instead of the split-hidden kernel, whose atomics only pay off for more rows.
    small = m is not None and m <= DECODE_MAX_M
    if small and len(spec.stages) == 2 and spec.stages[1].num_linears == 1:
        if m == 1:
            out.append(DECODE_GRID_SYNC)
        elif deterministic:  # its fp32 atomics add in arrival order
            log.debug("fxfuse: %s at M=%d: %s left out, deterministic algorithms are on", spec, m, DECODE)
        else:
            out.append(DECODE)
    return out


def choose_strategy(spec: MLPSpec, widths: Sequence[int], m: Optional[int] = None) -> str:
    """The strategy that runs when nothing is measured: the first of :func:`kernel_candidates`."""
    return kernel_candidates(spec, widths, m)[0]


def launches(spec: MLPSpec, strategy: str) -> int:
    return 1 if strategy in ONE_LAUNCH else len(spec.stages)


# The original ops (cuBLAS GEMMs + eager pointwise) stay a candidate: the first time a region runs on
# the GPU at a new shape bucket, every candidate and the original ops are timed and the fastest is kept,
# so fusing never makes a region slower than it was. Keyed by (spec, M bucket, weight shapes, dtype,
# device); the choice is also kept on disk (fxfuse.tuning_cache), the times and the cost model's
# prediction in _measured (for the report).
_choices: dict[tuple, str | Split] = {}
_measured: dict[tuple, Measurement] = {}


@dataclass(frozen=True)
class Split:
    """A bucket timed at both ends whose fastest candidate differs between them: ``below`` under ``at_m`` rows,
    ``above`` from ``at_m`` on.

    Example:
        >>> s = Split("torch", "tma", 426); [s.pick(m) for m in (392, 426, 512)], str(s)
        (['torch', 'tma', 'tma'], 'torch below M=426, tma from it')
    """

    below: str
    above: str
    at_m: int

    def pick(self, m: int) -> str:
        return self.above if m >= self.at_m else self.below

    def __str__(self) -> str:
        return f"{self.below} below M={self.at_m}, {self.above} from it"


@dataclass(frozen=True)
class Measurement:
    """The fused kernels vs the original ops of one region shape, timed (or read from the tuning cache)."""

    spec: str
    m_bucket: int  # the key: M's planner bucket (its largest M: kernels.template.choice_bucket)
    m: int  # the rows of the call that decided
    widths: tuple[int, ...]  # input width, then each linear's N
    dtype: str
    device: str  # GPU name
    strategy: str  # the fastest fused kernels
    fused_us: float
    original_us: float
    source: str  # "timed" or "tuning cache"
    predicted_us: Optional[float] = None  # the cost model's time of ``strategy`` at ``m``
    predicted_original_us: Optional[float] = None  # ... and of the original ops
    predicted_regime: str = ""  # what bounds ``strategy`` in the cost model: "compute", "memory" or "launch"
    times: tuple[tuple[str, float], ...] = ()  # every candidate's time, fastest first
    for_cuda_graph: bool = False  # scored by GPU time alone, for a CUDA graph's replays
    skipped: tuple[tuple[str, float], ...] = ()  # candidates never built: (strategy, its predicted µs)
    top_times: tuple[tuple[str, float], ...] = ()  # every candidate's time at the bucket's largest M (both ends)
    split: Optional[Split] = None  # where the fastest changes inside the bucket (timed at both ends)

    @property
    def fused(self) -> bool:
        return self.fused_us <= self.original_us


def measurements() -> list[Measurement]:
    """Every measured choice of this process, in the order made.

    Example:
        >>> [(r.spec, r.m_bucket, r.strategy, r.fused_us, r.original_us) for r in measurements()]  # doctest: +SKIP
        [('1b:gelu_tanh(a0);1b:a0', 1, 'decode_split_hidden', 6.8, 20.1)]
    """
    return list(_measured.values())


def measured_choice_enabled() -> bool:
    """Off with ``FXFUSE_AUTOTUNE=0`` (then the first candidate always runs: what the GPU tests check)."""
    return autotune_enabled()


# Within this fraction of its bucket's largest M, the first M of a bucket stands for all of it.
TOP_TIMING_NEAR = 0.1


def times_bucket_top(m: int) -> bool:
    """Whether a choice first made at ``m`` rows is timed at its bucket's largest M too (on a random input), so
    that a winner that changes inside the bucket is found (:func:`decide`): above 64 rows, unless ``m`` is
    within ``TOP_TIMING_NEAR`` of the top.

    Above 64 rows a tiled kernel's time is a step in M (whole 128-row tiles) while cuBLAS picks its tiles for each
    M, so the winner can change inside a bucket, and a bucket planned at its first M alone kept that M's winner for
    all of it (Llama's gate+up on an H100: cuBLAS 168 against the TMA kernel's 178 µs at 392 rows, 207 against
    182 at 512).

    Example:
        >>> [times_bucket_top(m) for m in (16, 64, 65, 90, 300, 384, 392, 480)]
        [False, False, True, False, True, False, True, False]
    """
    return m > 64 and choice_bucket(m) > m * (1 + TOP_TIMING_NEAR)


def decide(times: dict[str, float], m: int, top_times: Optional[dict[str, float]] = None,
           top_m: int = 0) -> str | Split:
    """The fastest of ``times`` (µs at ``m`` rows); given the times at the bucket's largest M too, a
    :class:`Split` where the two ends' fastest differ, at the M where those two candidates' times cross (each
    taken as linear in M between the ends: the tiled kernel's time is flat across one row tile, cuBLAS's grows).

    Example:
        >>> decide({"tma": 178.0, "torch": 168.0}, 392, {"tma": 181.7, "torch": 207.4}, 512)
        Split(below='torch', above='tma', at_m=426)
        >>> decide({"tma": 178.0, "torch": 168.0}, 392, {"tma": 190.0, "torch": 180.0}, 512)
        'torch'
    """
    best = min(times, key=times.get)
    common = [s for s in times if top_times and s in top_times]
    if best not in common:
        return best
    best_top = min(common, key=top_times.get)
    if best_top == best:
        return best
    gap_low = times[best_top] - times[best]  # >= 0: how far the top's winner is behind at m
    gap_top = top_times[best] - top_times[best_top]  # > 0: how far the low end's winner is behind at the top
    cross = m + (top_m - m) * gap_low / (gap_low + gap_top)
    return Split(best, best_top, min(top_m, max(m + 1, math.ceil(cross))))


def top_input(rows: int, like: torch.Tensor) -> torch.Tensor:
    """A random ``[rows, like.shape[-1]]`` input in ``like``'s dtype and device, to time a bucket's largest M: from a
    generator of its own (the user's random stream is theirs)."""
    rng = torch.Generator(like.device).manual_seed(0)
    return torch.randn(rows, like.shape[-1], dtype=like.dtype, device=like.device, generator=rng)


def timed_at_top(time_top: Callable[[], dict[str, float]], what: str, top_m: int) -> dict[str, float]:
    """``time_top()`` (the candidates timed at a bucket's largest M), or nothing where that input and its outputs
    do not fit in the GPU's memory: the call's own M then decides for the bucket (logged)."""
    try:
        return time_top()
    except torch.OutOfMemoryError:
        log.info("fxfuse: %s not timed at M=%d (out of GPU memory there); its first M decides the bucket", what,
                 top_m)
        return {}


def resolve(choice: str | Split | None, m: int) -> Optional[str]:
    """The strategy a stored choice (a name or a :class:`Split`) runs at ``m`` rows."""
    return choice.pick(m) if isinstance(choice, Split) else choice


def choice_key(args: tuple) -> tuple:
    x, weights, _, _, spec = args
    m = x.numel() // x.shape[-1]
    # (for_cuda_graphs() stays last: Measurement.for_cuda_graph reads it from there)
    return (spec, choice_bucket(m), tuple(w.shape for w in weights), x.dtype, x.device,
            torch.are_deterministic_algorithms_enabled(), for_cuda_graphs())


def cached_choice(args: tuple) -> Optional[str]:
    """The strategy already chosen for inputs like ``args`` in this process (the forward path's lookup)."""
    choice = _choices.get(choice_key(args))
    if type(choice) is Split:  # (rows counted only for a split bucket: this runs on every unreplayed call)
        x = args[0]
        return choice.pick(x.numel() // x.shape[-1])
    return choice


# Choice keys whose strategy failed at run time (see forget): calls that time nothing look their choice up too.
failed_keys: set[tuple] = set()


def forget(args: tuple, failed: str, candidates: Sequence[str]) -> str:
    """Stop running ``failed`` (its kernels raised) for inputs like ``args``: their bucket runs the next fastest
    measured strategy, or where nothing was timed the next of ``candidates`` (the planner's order), or the original
    ops after the last; the bucket's record (what ``fxfuse.report`` reads as running) says so. Returns that one."""
    key = choice_key(args)
    x, weights, _, _, spec = args
    measured = _measured.get(key)
    timed = measured is not None and bool(measured.times)
    order = [s for s, _ in measured.times] if timed else [*candidates, ORIGINAL_OPS]  # (fastest first)
    after = order[order.index(failed) + 1:] if failed in order else order
    then = after[0] if after else ORIGINAL_OPS
    _choices[key] = then
    failed_keys.add(key)
    if timed:
        _measured[key] = dataclasses.replace(
            measured, strategy=measured.strategy if then == ORIGINAL_OPS else then, split=None,
            fused_us=math.inf if then == ORIGINAL_OPS else dict(measured.times)[then],
            source=f"{measured.source}; {failed} failed")
    else:  # nothing timed: no times to show (inf), only what runs
        m = x.numel() // x.shape[-1]
        widths = (x.shape[-1], *(w.shape[0] for w in weights))
        device = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
        _measured[key] = Measurement(spec, key[1], m, widths, str(x.dtype).replace("torch.", ""), device, then,
                                     math.inf, math.inf, f"not timed; {failed} failed", for_cuda_graph=key[-1])
    return then


def fastest(args: tuple, runners: dict[str, Callable[[], torch.Tensor]],
            run_reference: Callable[[], torch.Tensor], path_us: float = 0.0,
            at_top: Optional[Callable[[], tuple[dict, Callable[[], torch.Tensor]]]] = None) -> str:
    """The fastest of ``runners`` (strategy -> call) and the original ops, on inputs like ``args``.

    Timed once per key with ``triton.testing.do_bench`` (median) and remembered in memory and on disk.
    A candidate that raises is dropped (logged); inside a CUDA graph capture nothing can be timed, so the
    first candidate is returned and the choice is made on a later eager call. ``path_us``: host µs every call
    pays besides the candidate (see :func:`time_candidates`). ``at_top`` (see :func:`times_bucket_top`) builds
    the same runners and original ops on an input of the bucket's largest M, timed too: where the two ends'
    fastest differ, the bucket keeps a :class:`Split` between them (:func:`decide`).
    """
    key = choice_key(args)
    x, weights, _, _, spec = args
    m = x.numel() // x.shape[-1]
    choice = _choices.get(key)
    if choice is not None:
        return resolve(choice, m)
    from . import tuning_cache

    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    dtype = str(x.dtype).replace("torch.", "")
    device = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
    skipped: dict[str, float] = {}
    shapes = ",".join("x".join(map(str, w.shape)) for w in weights)
    disk_key = f"{spec} | M {bucket_range(key[1])} | {shapes} | {dtype}" + (" | deterministic" if key[5] else "") \
        + (" | CUDA graph" if for_cuda_graphs() else "") + (" | both ends" if at_top else "")
    stored = tuning_cache.lookup(disk_key, device)
    top_times: dict[str, float] = {}
    if stored is not None and ORIGINAL_OPS in dict(stored.times) \
            and {stored.strategy, *(s for s, _ in stored.top_times[:1])} <= {*runners, ORIGINAL_OPS}:
        times, source = dict(stored.times), "tuning cache"
        top_times = dict(stored.top_times)
        m_timed, top_m = (stored.m, stored.top_m) if top_times else (m, 0)
    elif x.is_cuda and torch.cuda.is_current_stream_capturing():
        return next(iter(runners))
    else:
        everything = {**runners, ORIGINAL_OPS: run_reference}
        predicted = {s: getattr(p, "predicted_us", None)
                     for s, p in zip(everything, _predict(spec, widths, m, dtype, device, list(everything)))}
        times = time_candidates(spec, key[1], everything, path_us=path_us, predicted=predicted, skipped=skipped)
        source = "timed"
        m_timed, top_m = m, 0
        if at_top is not None:
            def time_top() -> dict[str, float]:
                top_runners, top_reference = at_top()
                top = {s: r for s, r in {**top_runners, ORIGINAL_OPS: top_reference}.items() if s in times}
                return time_candidates(f"{spec} (at M={key[1]}, the bucket's top)", key[1], top, path_us=path_us)

            top_times = timed_at_top(time_top, spec, key[1])
            top_m = key[1] if top_times else 0
    decision = decide(times, m_timed, top_times, top_m)
    if stored is None or source == "timed":
        tuning_cache.store(disk_key, device, tuning_cache.TunedChoice.of(times, m_timed, top_m, top_times))
    kernels = {s: t for s, t in times.items() if s != ORIGINAL_OPS}
    fused_strategy = min(kernels, key=kernels.get) if kernels else next(iter(runners))
    (fused_pred, original_pred) = _predict(spec, widths, m, dtype, device, (fused_strategy, ORIGINAL_OPS))
    ranked = tuple(sorted(times.items(), key=lambda kv: kv[1]))
    _measured[key] = Measurement(spec, key[1], m_timed, widths, dtype, device, fused_strategy,
                                 kernels.get(fused_strategy, float("inf")), times[ORIGINAL_OPS], source,
                                 getattr(fused_pred, "predicted_us", None),
                                 getattr(original_pred, "predicted_us", None),
                                 getattr(fused_pred, "regime", ""), times=ranked, for_cuda_graph=key[-1],
                                 skipped=tuple(skipped.items()),
                                 top_times=tuple(sorted(top_times.items(), key=lambda kv: kv[1])),
                                 split=decision if isinstance(decision, Split) else None)
    _choices[key] = decision
    log.info("fxfuse: %s at M~%d (%s%s): %s%s -> %s", spec, key[1], source,
             ", for a CUDA graph: GPU time only" if for_cuda_graphs() else "",
             ", ".join(f"{s} {t:.1f} us" for s, t in ranked),
             f"; at M={top_m}: " + ", ".join(f"{s} {t:.1f} us" for s, t in sorted(top_times.items(),
                                                                                key=lambda kv: kv[1]))
             if top_times else "", decision)
    return resolve(decision, m)


def host_us(run: Callable[[], object], calls: int = 10, bursts: int = 3) -> float:
    """Host µs per call of ``calls`` calls issued back to back (the GPU queue does not fill at this count), the
    fastest of ``bursts`` such bursts.

    The fastest, because the host's noise only adds: on a shared host the same call's host time moved 1.5-2x
    between bursts a second apart (an H100 machine), more than two host-bound candidates differ, and a single
    burst let that noise pick between them (seed GeGLU at M=768: fused 72.4 vs original ops 72.1 µs, both
    host-bound, and the original ops ran).
    """
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    best = float("inf")
    for _ in range(bursts):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, time.perf_counter() - t)
    sync()
    return best / calls * 1e6


TIMING_ROUNDS = 2  # interleaved rounds over the candidates; each keeps its best
# A kernel candidate whose predicted time is above this many times the best time measured so far is not built.
# The cost model (fxfuse.cost) takes 80-95% of the measured ceilings, so such a candidate would have to run at
# about twice the GPU's copy bandwidth or matmul rate to win. (nerf64 at 2^20 rows: the per-stage kernels, predicted
# at 258 µs, against the fused chain's 54: their compiling and autotuning took 11.6 of the first call's 13.8 s.)
SKIP_ABOVE_BEST = 2.0


def time_candidates(what: str, bucket: int, runners: dict[str, Callable[[], torch.Tensor]],
                    path_us: float = 0.0, predicted: Optional[dict[str, Optional[float]]] = None,
                    skipped: Optional[dict[str, float]] = None, gpu_only: bool = False) -> dict[str, float]:
    """µs per call of each runner: the larger of its GPU median (``do_bench``, the best of ``TIMING_ROUNDS``
    rounds) and its host time per call (:func:`interleaved_host_us`) plus ``path_us``; the GPU median alone
    within :func:`scoring_for_cuda_graphs`, or with ``gpu_only``.

    ``predicted``: the cost model's µs per runner (None where it has none). Then every runner is timed once as
    soon as it is built, and a later kernel runner predicted above ``SKIP_ABOVE_BEST`` times the best of those
    times is never built (compiling and autotuning it costs seconds, and it cannot win); it goes into ``skipped``
    with its prediction (logged at INFO). These first timings only decide that: the rounds below time every
    built runner again.

    Every runner is called once first (compiling and autotuning), then all are timed in interleaved rounds:
    timing one candidate right after its own autotuning burst, or only once, let the GPU's clock and power
    state of the moment pick the winner (the seed GeGLU's gate+up kernel lost to a slower one that way in one
    H200 run). ``do_bench`` flushes L2 between calls, which hides up to the flush's duration of host time;
    calls in a loop do not, so a candidate whose launches cost more host time than its kernels take is as slow
    as its host path (at decode sizes a TMA launch's descriptors cost more than the kernel).
    ``path_us`` is the host time a call spends around the candidate (the op's checks and replay lookup): two
    candidates whose own host times both hide under their GPU times alone may not once it is added (at
    gpt2m_mlp_m1 a launch fewer is ~5 µs of host time, and the call is host-bound end to end).
    A runner that raises is left out (logged): a kernel that does not compile or launch here is not a candidate.
    """
    from triton.testing import do_bench

    log.info("fxfuse: %s at M~%d: first call at this shape bucket, compiling and timing %s", what, bucket,
             ", ".join(runners))
    graphed = for_cuda_graphs() or gpu_only

    def gpu_us(run: Callable[[], torch.Tensor]) -> float:
        return do_bench(run, warmup=5, rep=20, return_mode="median") * 1e3

    def timed(run: Callable[[], torch.Tensor]) -> float:  # (the skip rule's first timing: one runner alone)
        us = gpu_us(run)
        return us if graphed else max(us, host_us(run) + path_us)

    ready: dict[str, Callable[[], torch.Tensor]] = {}
    first: dict[str, float] = {}  # one timing of each runner as soon as it is built (for the skip rule)
    for name, run in runners.items():  # (fastest's order: the cost model's favourite first, the original ops last)
        guess = predicted.get(name) if predicted and name != ORIGINAL_OPS else None
        if guess is not None and first and guess > SKIP_ABOVE_BEST * min(first.values()):
            best = min(first, key=first.get)
            log.info("fxfuse: %s for %s not built: predicted %.1f us, above %g x the %.1f us measured for %s", name,
                     what, guess, SKIP_ABOVE_BEST, first[best], best)
            if skipped is not None:
                skipped[name] = guess
            continue
        try:
            run()
            if predicted:
                first[name] = timed(run)
            ready[name] = run
        except torch.OutOfMemoryError:
            raise
        except Exception as err:
            if name == ORIGINAL_OPS:
                raise  # the original ops failing is the user's error, not ours
            log.warning("fxfuse: %s for %s failed (%s: %s); not using it", name, what, type(err).__name__, err)
    gpu: dict[str, float] = {}
    for _ in range(TIMING_ROUNDS):
        for name, run in ready.items():
            gpu[name] = min(gpu.get(name, float("inf")), gpu_us(run))
    if graphed:
        return gpu
    host = interleaved_host_us(ready)
    return {name: max(gpu[name], host[name] + path_us) for name in ready}


def interleaved_host_us(runners: dict[str, Callable[[], object]], bursts: int = 3) -> dict[str, float]:
    """Each runner's host µs per call (:func:`host_us`) at the host's usual pace: the fastest of ``bursts``
    bursts, taken in turn over the runners, each round scaled by how much slower than its fastest pace in this
    process the host ran just then (:func:`host_pace`).

    The GPU machine's host has slow stretches of seconds in which every call takes 2-3x its usual host time. A
    stretch that covers some runners' measurements and not others', or all of them, can decide between a library
    stage (cuBLASLt: little GPU time, more host time) and a kernel with a leaner launch but 4x the GPU time by
    the stretch's host times: the likely cause of gpt2m M=96 (an H100 sweep) running 35 µs against eager's 26, in
    every round and when timed again, where a fresh process ran it in 22 with cuBLASLt's GELU epilogue.
    """
    global _fastest_pace
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(bursts):
        pace = host_pace()
        _fastest_pace = min(_fastest_pace, pace)
        slowdown = pace / _fastest_pace  # >= 1: this round's host against the fastest seen
        for name, run in runners.items():
            best[name] = min(best[name], host_us(run, bursts=1) / slowdown)
    return best


_fastest_pace = float("inf")  # the fastest host_pace() of this process
_pace_tensor: dict[str, torch.Tensor] = {}


def host_pace() -> float:
    """Host µs per call of a fixed workload like a runner's (a one-element in-place add: dispatch and a launch on
    CUDA), the fastest of three bursts of 10: the host's current pace."""
    device = "cuda" if torch.cuda.is_initialized() else "cpu"
    t = _pace_tensor.get(device)
    if t is None:
        t = _pace_tensor[device] = torch.zeros(1, device=device)
    return host_us(functools.partial(t.add_, 1), calls=10, bursts=3)


def kernels_are_faster(args: tuple, run_kernels: Callable[[], torch.Tensor],
                       run_reference: Callable[[], torch.Tensor]) -> bool:
    """Whether the first candidate's kernels beat the original ops on inputs like ``args``."""
    x, weights, _, _, spec = args
    m = x.numel() // x.shape[-1]
    strategy = choose_strategy(MLPSpec.loads(spec), (x.shape[-1], *(w.shape[0] for w in weights)), m)
    return fastest(args, {strategy: run_kernels}, run_reference) != ORIGINAL_OPS


def _predict(spec: str, widths: tuple[int, ...], m: int, dtype: str, device: str,
             strategies: Sequence[str]) -> list:
    """The cost model's prediction (:class:`fxfuse.cost.Prediction`) for each strategy (None where it has none:
    this runs on the forward path)."""
    from .cost import predict

    out: list = []
    for s in strategies:
        try:
            out.append(predict(spec, widths, m, dtype, s, device))
        except Exception as err:  # a model that cannot say must not stop the forward
            log.debug("fxfuse: no prediction for %s with %s: %s", spec, s, err)
            out.append(None)
    return out
