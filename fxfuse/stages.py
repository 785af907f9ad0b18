"""One stage of a per-stage strategy, run by the fastest of its implementations.

A stage (``epilogue(x @ W0^T + b0 [, x @ W1^T + b1], v...)``) can run as

* ``gemv``: for a few rows (M ≤ ``GEMV_ONLY_M``, and timed up to ``GEMV_MAX_M``), the small-M kernel that streams
  the weights once (split-K), :func:`fxfuse.kernels.run_stage_gemv`;
* ``tma``: the persistent TMA kernel (Hopper; row strides 16-byte aligned), :func:`fxfuse.kernels.run_stage_tma`;
* ``triton``: the pointer-based GEMM + epilogue kernel, :func:`fxfuse.kernels.run_stage`;
* ``torch``: the original ops of the stage (cuBLAS ``F.linear`` + the eager pointwise ops);
* ``cublaslt``: for ``gelu_tanh`` / ``relu`` after a linear with bias, cuBLASLt's own fused bias+activation
  epilogue (``torch._addmm_activation``), the fastest library path for such a stage (CUDA only).

On a GPU each is timed once per (stage, M bucket, shapes, dtype) and the fastest kept (also on disk), so a
region whose first GEMM is fastest with the fused epilogue and whose second is fastest in cuBLAS gets
both. Above 64 rows a bucket is timed at both ends (the call's M and the bucket's largest, on a random input)
and where the two ends' fastest differ, each runs on its side of the M where their times cross: the tiled
kernels' time steps with whole row tiles, cuBLAS's grows with M. A few rows (M ≤ 16) choose between ``gemv``
and the library paths (outside CUDA graphs a library path must beat ``gemv`` by ``LIBRARY_MARGIN``: its host
path costs a decode call more than the bound kernel's), more rows between ``tma``, ``triton``, ``gemv`` (up to
64 rows) and the library paths (16-bit stages of ``TMA_ONLY_FROM_M`` rows or more that the TMA kernel takes:
``tma`` and the library paths). Without timing (``FXFUSE_AUTOTUNE=0``, the interpreter) a kernel runs: ``gemv``
for a few rows, else ``tma`` where it applies, else ``triton`` (the GPU tests check the kernels, not cuBLAS).

Example:
    >>> h, ran = run_best_stage(x, [w], [b], [], "gelu_tanh(a0)", timed=True)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import epilogue as ep
from .kernels import GEMV_MAX_M, fastlaunch, run_stage, run_stage_gemv, run_stage_tma
from .kernels.template import bucket_range, choice_bucket
from .kernels.tma_launch import tma_applicable
from .replay import weak_step
from .strategy import Split, decide, for_cuda_graphs, resolve, timed_at_top, times_bucket_top, top_input

__all__ = ["STAGE_IMPLEMENTATIONS", "run_best_stage", "stage_choices"]

log = logging.getLogger(__name__)

STAGE_IMPLEMENTATIONS = ("gemv", "tma", "triton", "torch", "cublaslt")
# Epilogues cuBLASLt fuses into the GEMM (with the bias): epilogue -> ``use_gelu`` of ``torch._addmm_activation``
# (its GELU is the tanh approximation; without it, ReLU).
_CUBLASLT_EPILOGUES = {"gelu_tanh(a0)": True, "relu(a0)": False}
_choices: dict[tuple, str | Split] = {}
# From this many rows a 16-bit stage the TMA kernel takes does not time the pointer kernel: it was the fastest of
# no such stage measured (H100, session 28: seed, gpt2 and Llama stages at 4096 and 8192 rows; the TMA kernel,
# cuBLAS or cuBLASLt was), and compiling and tuning it took 3.6 of seed_geglu's 9.6 s first call. (At 2048 rows it
# still won seed's gate+up, whose TMA launch was host-bound when timed outside a replay.)
TMA_ONLY_FROM_M = 4096
# Up to this many rows the small-M kernel is a stage's only kernel candidate (and its pick without timing); from here
# to GEMV_MAX_M (64) it is timed beside the GEMM kernels.
GEMV_ONLY_M = 16


def stage_choices() -> dict[tuple, str]:
    """What each stage shape was measured to run with in this process (key: epilogue, M bucket, K, N, dtype), e.g.
    ``"tma"``, or ``"torch below M=426, tma from it"`` where the fastest changes inside the bucket."""
    return {key: str(choice) for key, choice in _choices.items()}


@functools.lru_cache(maxsize=512)
def _epilogue_reference(epilogue: str) -> Callable[[Sequence[Tensor], Sequence[Tensor]], Tensor]:
    # (keyed by the string: hashing a parsed expression on every call cost as much as the pointwise op's launch)
    return ep.compiled_reference(ep.parse(epilogue))


def _torch_stage(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                 operands: Sequence[Tensor], epilogue: str) -> Tensor:
    """The stage as eager PyTorch runs it: cuBLAS GEMMs (bias in the GEMM), then the pointwise ops."""
    accs = [F.linear(x, w, b) for w, b in zip(weights, biases)]
    return _epilogue_reference(epilogue)(accs, operands)


def _cublaslt_stage(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                    operands: Sequence[Tensor], epilogue: str) -> Tensor:
    """``act(x @ W^T + b)`` in one cuBLASLt call (bias and activation in its epilogue)."""
    return torch._addmm_activation(biases[0], x, weights[0].t(), use_gelu=_CUBLASLT_EPILOGUES[epilogue])


def run_best_stage(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                   operands: Sequence[Tensor], epilogue: str, *, timed: bool,
                   after_gemv: bool = False) -> tuple[Tensor, str]:
    """The stage on 2-D ``x`` (arguments already checked), by the fastest implementation (``timed``) or a kernel:
    ``(output, the implementation that ran)``, a key of ``STAGE_IMPLEMENTATIONS``.

    ``after_gemv``: the region's previous stage ran ``"gemv"`` (the small-M kernel) just before this one, which
    lets a small-M launch start loading its weights early (:func:`fxfuse.kernels.run_stage_gemv`).
    """
    (M, K), N = x.shape, weights[0].shape[0]
    # A region being recorded for replays will run its stages as their recorded steps: time them so. Under
    # deterministic algorithms a region's first call (not recorded) and its replays must run the same
    # implementation (each sums in its own order): one choice for both, timed as replayed.
    deterministic = torch.are_deterministic_algorithms_enabled()
    replayed = timed and (deterministic or fastlaunch.recording_open())
    # (the last three fields are read by position in _measure)
    key = (len(weights), epilogue, choice_bucket(M), K, N, x.dtype, x.device, x.stride(1) == 1,
           tuple(b is not None for b in biases), deterministic, replayed, for_cuda_graphs())
    choice = resolve(_choices.get(key), M) if timed else None
    if choice is None:
        runners = _runners(x, weights, biases, operands, epilogue, timed, replayed)
        if timed:
            at_top = None
            if times_bucket_top(M) and x.stride(1) == 1:
                def at_top():  # built only if the stage is timed now (not from the disk cache, not in a capture)
                    return _runners(top_input(key[2], x), weights, biases, operands, epilogue, timed, replayed)
            choice = _measure(key, runners, at_top, M)
        else:
            choice = next(iter(runners))
    if choice == "gemv":
        return run_stage_gemv(x, weights, biases, operands, epilogue, check=False, after_gemv=after_gemv), choice
    if choice == "tma":
        out = run_stage_tma(x, weights, biases, operands, epilogue, check=False)
        if out is not None:  # None: this x does not suit TMA (alignment); the pointer kernel takes it
            return out, choice
        choice = "triton"
    if choice == "triton":
        return run_stage(x, weights, biases, operands, epilogue, check=False), choice
    impl = _cublaslt_stage if choice == "cublaslt" else _torch_stage
    if fastlaunch.recording_open():
        fastlaunch.record(weak_step(impl, weights, biases, operands, epilogue))
    return impl(x, weights, biases, operands, epilogue), choice


def _runners(x, weights, biases, operands, epilogue, timed: bool,
             replayed: bool = False) -> dict[str, Callable[[], Tensor]]:
    """The stage's implementations on ``x`` (name -> call); ``replayed``: the kernels as their replay steps."""
    runners = _implementations(x, weights, biases, operands, epilogue, timed)
    if replayed:
        for name in runners.keys() & {"gemv", "tma", "triton"}:
            runners[name] = _as_replayed(runners[name], x)
    return runners


def _as_replayed(run: Callable[[], Tensor], x: Tensor) -> Callable[[], Tensor]:
    """``run`` as a replay calls it once its first call has left a step (:mod:`fxfuse.replay`): the bound launch
    alone, without the launch path's checks and argument building. Outside a replay a TMA launch's host path
    (three descriptors, Triton's descriptor arguments) cost ~85-110 µs per call on an H100's host against ~45 for
    the pointer kernel, and decided mid-size stages by that (seed's gate+up at 2048 rows: the pointer kernel's
    46.7 against the TMA kernel's 72.9 µs, host-bound)."""
    step: Optional[Callable[[Tensor], Tensor]] = None

    def runner() -> Tensor:
        nonlocal step
        if step is not None:
            return step(x)
        with fastlaunch.recording() as steps:  # (nested in the region's: its own steps)
            out = run()
        if len(steps) == 1 and steps[0] is not None:
            step = steps[0]
        return out

    return runner


def _implementations(x, weights, biases, operands, epilogue, timed: bool) -> dict[str, Callable[[], Tensor]]:
    runners: dict[str, Callable[[], Tensor]] = {}
    gemv = functools.partial(run_stage_gemv, x, weights, biases, operands, epilogue, check=False)
    if x.shape[0] <= GEMV_ONLY_M:
        # A few rows: the weight-streaming kernel; the GEMM kernels' 64-128-row tiles would mostly multiply padding.
        runners["gemv"] = gemv
    else:
        tma = tma_applicable(x, weights)
        if tma:
            runners["tma"] = functools.partial(run_stage_tma, x, weights, biases, operands, epilogue, check=False)
        if not (tma and timed and x.shape[0] >= TMA_ONLY_FROM_M and x.element_size() == 2):
            runners["triton"] = functools.partial(run_stage, x, weights, biases, operands, epilogue, check=False)
        if timed and x.shape[0] <= GEMV_MAX_M:
            # Up to 64 rows it is timed beside them (padded to 32 or 64 rows): its bound launch against cuBLAS's
            # ATen path where the call is host-bound (gpt2m's MLP at 24-64 rows), a full grid where theirs is not.
            runners["gemv"] = gemv
    if timed:
        runners["torch"] = functools.partial(_torch_stage, x, weights, biases, operands, epilogue)
        # CUDA only: on the CPU ATen's use_gelu is the exact (erf) GELU, not the tanh one.
        if x.is_cuda and epilogue in _CUBLASLT_EPILOGUES and len(weights) == 1 and biases[0] is not None \
                and not operands:
            runners["cublaslt"] = functools.partial(_cublaslt_stage, x, weights, biases, operands, epilogue)
    return runners


# A library stage must beat the gemv kernel's time by this share to run instead of it (outside CUDA graphs). Its
# call keeps ATen's dispatch and cuBLASLt's heuristics in a replay (``aten::addmm`` ~20-30 µs of host on the H200
# machine) where the gemv kernel's is a bound launch (~5); a decode-size call pays that end to end, and its timing
# does not reliably see it (GPU time alone for a replayed stage, a host that has slow stretches). gpt2m_mlp_m8,
# H200 (``benchmarks/probes/probe_stage_host.py``): its down projection timed cuBLAS 10.9 against gemv 11.8 µs
# and ran cuBLAS; the module with gemv forced there read 33.8 µs per call back to back against 55.6 (do_bench
# 17.9 against 34.1).
LIBRARY_MARGIN = 0.9
_LIBRARY = ("torch", "cublaslt")


def _with_host_margin(times: dict[str, float], graphed: bool) -> dict[str, float]:
    """``times`` with the library stages' scaled by ``1 / LIBRARY_MARGIN`` where they compete with ``gemv``.

    Example:
        >>> _with_host_margin({"gemv": 11.8, "torch": 10.9}, graphed=False)["torch"] > 11.8
        True
    """
    if graphed or "gemv" not in times:
        return times
    return {name: t / LIBRARY_MARGIN if name in _LIBRARY else t for name, t in times.items()}


def _measure(key: tuple, runners: dict[str, Callable[[], Tensor]],
             at_top: Optional[Callable[[], dict[str, Callable[[], Tensor]]]] = None, m: int = 0) -> str:
    """The stage's implementation at ``m`` rows, choosing for ``key``: the fastest of ``runners`` (on the call's
    input), or, with ``at_top`` (it builds the same runners on an input of the bucket's largest M), a
    :class:`fxfuse.strategy.Split` where the two ends' fastest differ (:func:`fxfuse.strategy.decide`)."""
    from . import tuning_cache
    from .strategy import time_candidates

    x_dtype, device = key[5], key[6]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return next(iter(runners))  # nothing can be timed inside a capture; a later eager call decides
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    dtype = str(x_dtype).replace("torch.", "")
    disk_key = f"stage {key[0]}:{key[1]} | M {bucket_range(key[2])} | K={key[3]} N={key[4]} | {dtype}" \
        + (" | deterministic" if key[-3] else "") + (" | CUDA graph" if key[-1] else "") \
        + (" | replayed" if key[-2] else "") + (" | both ends" if at_top else "")
    stored = tuning_cache.lookup(disk_key, device_name)
    if stored is not None and all(s in runners for s, _ in stored.times + stored.top_times):
        times, top_times = dict(stored.times), dict(stored.top_times)
        m_timed, top_m = (stored.m, stored.top_m) if top_times else (m, 0)
    else:
        times = time_candidates(f"stage {key[1]}", key[2], runners, gpu_only=key[-2])
        m_timed, top_m, top_times = m, 0, {}
        if at_top is not None:
            top_times = timed_at_top(lambda: time_candidates(f"stage {key[1]} (at M={key[2]}, the bucket's top)",
                                                             key[2], at_top(), gpu_only=key[-2]),
                                     f"stage {key[1]}", key[2])
            top_m = key[2] if top_times else 0
        tuning_cache.store(disk_key, device_name, tuning_cache.TunedChoice.of(times, m_timed, top_m, top_times))
    graphed = key[-1]
    choice = _choices[key] = decide(_with_host_margin(times, graphed), m_timed,
                                    _with_host_margin(top_times, graphed), top_m)
    log.info("fxfuse: stage %s at M~%d, K=%d, N=%d%s: %s%s -> %s", key[1], key[2], key[3], key[4],
             " (for a CUDA graph: GPU time only)" if key[-1] else "",
             ", ".join(f"{s} {t:.1f} us" for s, t in sorted(times.items(), key=lambda kv: kv[1])),
             f" at M={m_timed}; at M={top_m}: " + ", ".join(
                 f"{s} {t:.1f} us" for s, t in sorted(top_times.items(), key=lambda kv: kv[1])) if top_times else "",
             choice)
    return resolve(choice, m)
