"""``torch.ops.fxfuse.mlp``: the op every fused region becomes.

Registered with ``torch.library.triton_op`` so torch.compile and torch.export understand it:

* GPU (and the CPU under ``TRITON_INTERPRET=1``): the generated Triton kernels, one per stage
  (``fxfuse.kernels.run_stage``), launched through ``wrap_triton``.
* CPU otherwise: the reference composite (the same torch ops the region replaced), so an optimized
  model runs correctly on a machine without a GPU.
* Inputs the kernels do not take (float64, mixed dtypes or devices, a shape eager would reject): the
  reference composite too, logged once per reason, so the result (or the error) is eager's.
* Fake: the output's shape and dtype, without running anything.
* An input on another GPU than the current one (a model split across GPUs, ``device_map="auto"``): the call runs
  under that GPU (:func:`on_its_device`), since Triton launches on the current device.
* Autograd: a narrow chain's gradients come from one fused backward kernel that recomputes the forward on
  chip (:mod:`fxfuse.backward`); any other region's are the vjp of the reference composite, so gradients
  are always those of the original ops. A region of the second kind that has been trained runs its
  gradient-recording calls as the original ops (``fused_mlp``); with ``FXFUSE_GATED_TRAINING=1`` a region that is
  exactly a gated MLP as one autograd node with one kernel each way for its middle (:mod:`fxfuse.gated_mlp_training`),
  and any other gated middle ``act(g) * u`` as one kernel each way (:mod:`fxfuse.gated_training`).

Example:
    >>> import torch, fxfuse.ops
    >>> x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    >>> y = torch.ops.fxfuse.mlp(x, [w1, w2], [], [], "1:relu(a0);1:a0")  # biases: only those that exist
    >>> torch.allclose(y, torch.relu(x @ w1.T) @ w2.T, atol=1e-5)
    True
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._functorch.utils import unwrap_dead_wrappers
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import triton_op
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import epilogue as ep
from . import replay
from .autocast import any_autocast, autocast_args, records_grad, weight_casts
from .backward import forward_for_walk, fused_chain_gradients, walk_reads_output
from .gated_mlp_training import gated_mlp
from .gated_training import gated_form, gated_product, gated_training_enabled
from .kernels import fastlaunch
from .kernels.chain_backward_template import walks
from .kernels.template import choice_bucket
from .kernels.template import interpreting as _interpreting
from .kernels.tuning import TuningDuringCapture
from .spec import MLPSpec
from .strategy import (
    DECODE,
    DECODE_GRID_SYNC,
    DECODE_MAX_M,
    FUSED_CHAIN,
    GATED_GEMM_EPILOGUE,
    GEMM_EPILOGUE,
    ONE_LAUNCH,
    ORIGINAL_OPS,
    cached_choice,
    fastest,
    forget,
    kernel_candidates,
    measured_choice_enabled,
    times_bucket_top,
    top_input,
)
from .strategy import (
    failed_keys as strategy_failures,
)
from .transforms import transformed

__all__ = ["FUSED_TARGETS", "fused_mlp", "is_fused_call", "kernel_fallback_reason", "mlp", "reference_mlp"]

log = logging.getLogger(__name__)

# The current CUDA device (the public call: its lazy-init check costs well under a microsecond once CUDA is up).
current_cuda_device = torch.cuda.current_device


def on_its_device(x: Tensor) -> bool:
    """Whether ``x`` is a CUDA tensor on the current device, or a tensor of another kind: what a Triton launch on
    its data needs (Triton launches on the current device; Liger-Kernel guards its launches the same way).

    Example:
        >>> on_its_device(torch.zeros(2))
        True
    """
    return not x.is_cuda or x.get_device() == current_cuda_device()

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_logged_fallbacks: set[str] = set()


def expand_biases(biases: Sequence[Tensor], spec: MLPSpec) -> list[Optional[Tensor]]:
    """The op takes only the biases that exist; put ``None`` back where ``spec`` says there is none."""
    it = iter(biases)
    return [next(it) if flag else None for flag in spec.has_bias]


def reference_mlp(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor],
                  operands: Sequence[Tensor], spec: str, trained: bool = False) -> Tensor:
    """What the region computed before fusion, op by op (eager semantics, errors included).

    ``trained``: a trained region's gradient-recording call (see :func:`fused_mlp`). Under
    ``FXFUSE_GATED_TRAINING=1``, if the kernels take the tensors, a region that is exactly a gated MLP runs as one
    autograd node (:func:`fxfuse.gated_mlp_training.gated_mlp`), and otherwise a gated stage's ``act(g) * u`` as one
    kernel each way (:func:`fxfuse.gated_training.gated_product`).
    """
    if not (trained and gated_training_enabled()):
        return _reference(spec)(x, weights, biases, operands)
    out = gated_mlp(x, weights, biases, spec)
    if out is not None:
        return out
    h = x
    for stage in _plan(spec)[0]:  # parsed once per spec string: this also runs on the forward path
        accs = [F.linear(h, weights[w], None if b is None else biases[b]) for w, b in stage.linears]
        fused = None
        if stage.gated is not None:
            gate, up, act = stage.gated
            fused = gated_product(accs[gate], accs[up], act)
        h = fused if fused is not None else ep.evaluate(stage.expr, accs, operands[stage.operands])
    return h


@dataclass(frozen=True)
class _StagePlan:
    num_linears: int
    epilogue: str
    num_operands: int
    has_bias: tuple[bool, ...]
    expr: ep.Expr
    linears: tuple[tuple[int, Optional[int]], ...]  # per linear: (index in weights, index in biases or None)
    operands: slice  # this stage's operands in the op's operand list
    gated: Optional[tuple[int, int, str]]  # (gate acc, up acc, activation) of a gated stage (gated_form)


def _reference_added_biases(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor],
                            operands: Sequence[Tensor], spec: str) -> Tensor:
    """:func:`reference_mlp` for biases that are not ``[N]``: a ``F.linear(x, w) + b`` that normalize folded into
    the linear, whose ``b`` was replaced since by a tensor that broadcasts beyond the output's rows (``[3, 1, N]``),
    which ``F.linear`` does not take: added after the product, as the original code adds it."""
    h = x
    for stage in _plan(spec)[0]:
        accs = [F.linear(h, weights[w]) if b is None else F.linear(h, weights[w]) + biases[b]
                for w, b in stage.linears]
        h = ep.evaluate(stage.expr, accs, operands[stage.operands])
    return h


@functools.cache
def _reference(spec: str) -> Callable[[Tensor, Sequence[Tensor], Sequence[Tensor], Sequence[Tensor]], Tensor]:
    """:func:`reference_mlp`'s ops as closures built once per spec: ``(x, weights, biases, operands) -> out``.

    A region whose planner kept the original ops runs them on every call, and at host-bound sizes their Python is
    the call's time: the loop over the stages' plans cost ~4.5 µs more than eager's three calls (gpt2m's MLP at
    24 rows read 1.7 µs slower than eager on the H200, ``bench_sweep.py``); these closures cost ~0.5.
    """
    steps = [_stage_reference(stage) for stage in _plan(spec)[0]]
    if len(steps) == 2:
        first, second = steps
        return lambda x, w, b, o: second(first(x, w, b, o), w, b, o)

    def run(x: Tensor, w: Sequence[Tensor], b: Sequence[Tensor], o: Sequence[Tensor]) -> Tensor:
        for step in steps:
            x = step(x, w, b, o)
        return x

    return run


def _stage_reference(stage: _StagePlan) -> Callable[..., Tensor]:
    """One stage of :func:`_reference`: ``(h, weights, biases, operands) -> the stage's output``."""
    linear = F.linear
    if stage.num_linears == 1 and not stage.num_operands:
        ((wi, bi),) = stage.linears
        if isinstance(stage.expr, ep.Acc):  # no epilogue: the linear itself
            if bi is None:
                return lambda h, w, b, o: linear(h, w[wi])
            return lambda h, w, b, o: linear(h, w[wi], b[bi])
        fn = ep.compiled_reference(stage.expr)
        if bi is None:
            return lambda h, w, b, o: fn((linear(h, w[wi]),), ())
        return lambda h, w, b, o: fn((linear(h, w[wi], b[bi]),), ())
    fn, linears, operands = ep.compiled_reference(stage.expr), stage.linears, stage.operands

    def general(h: Tensor, w: Sequence[Tensor], b: Sequence[Tensor], o: Sequence[Tensor]) -> Tensor:
        accs = [linear(h, w[wi], None if bi is None else b[bi]) for wi, bi in linears]
        # (operands as they are, not flattened: eager's broadcasting and type promotion, or its error, for one
        # whose shape or dtype changed since the plan took it, a 0-d scalar included)
        return fn(accs, o[operands])

    return general


@functools.cache
def _plan(spec: str) -> tuple[tuple[_StagePlan, ...], int, int, int]:
    """Everything the forward needs from ``spec``, parsed once: (stages, #weights, #biases, #operands).

    Each stage also says where its weights, biases and operands sit in the op's flat argument lists, so
    the forward path indexes them instead of counting.
    """
    parsed = MLPSpec.loads(spec)
    stages, w, b, o = [], 0, 0, 0
    for s in parsed.stages:
        linears = []
        for has_bias in s.has_bias:
            linears.append((w, b if has_bias else None))
            w, b = w + 1, b + has_bias
        gated = gated_form(s.expr) if s.num_linears == 2 and not s.num_operands else None
        stages.append(_StagePlan(s.num_linears, s.epilogue, s.num_operands, s.has_bias, s.expr, tuple(linears),
                                 slice(o, o + s.num_operands), gated))
        o += s.num_operands
    return tuple(stages), parsed.num_linears, sum(parsed.has_bias), parsed.num_operands


def _compute_dtype(x: Tensor, weights: Sequence[Tensor]) -> torch.dtype:
    """The dtype a region's kernels compute in: x's, or under autocast the weights' (their casts'), to which the
    kernels round an fp32 x as autocast's first Linear would (:mod:`fxfuse.autocast`)."""
    if x.dtype is torch.float32 and weights and weights[0].dtype is not torch.float32 and _autocast_on(x):
        return weights[0].dtype
    return x.dtype


def kernel_fallback_reason(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor],
                           operands: Sequence[Tensor], spec: str) -> Optional[str]:
    """Why these inputs must take the reference path, or None when the Triton kernels take them.

    Runs on every forward: plain attribute checks only.
    """
    stages, n_weights, n_biases, n_operands = _plan(spec)
    if len(weights) != n_weights or len(biases) != n_biases or len(operands) != n_operands:
        return "argument counts do not match the spec"
    device, dtype = x.device, _compute_dtype(x, weights)
    # The interpreter takes plain CPU tensors only: while torch.compile traces (fake/functional
    # tensors) a CPU region decomposes into the reference ops, which Inductor compiles for the CPU.
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting() and type(x) is Tensor):
        return f"{device.type} tensors run the reference ops (the kernels need CUDA)"
    if dtype not in _KERNEL_DTYPES:
        return f"dtype {dtype} is not supported by the kernels"
    if device.type == "cpu" and dtype == torch.bfloat16:  # the interpreter's tl.dot is wrong on bf16
        return "bfloat16 on the CPU runs the reference ops (the Triton interpreter cannot multiply bf16)"
    if x.numel() == 0 or x.dim() == 0:
        return "empty input"
    if x.layout is not torch.strided:
        return f"a {x.layout} input (the kernels take strided tensors)"
    for t in (*weights, *biases):
        if t.dtype != dtype or t.device != device:
            return f"a weight is {t.dtype} on {t.device}, the input {dtype} on {device}"
    for t in operands:
        # (an fp32 operand beside another dtype only as a 0-d tensor: eager promotes h to fp32 with any other)
        if t.device != device or not (t.dtype is dtype or (t.dtype is torch.float32 and t.dim() == 0)):
            return f"an operand is {t.dtype} on {t.device}, the input {dtype} on {device}"
    # Shapes: anything eager would reject goes to the reference, which raises eager's own error.
    k = x.shape[-1]
    w = b = o = 0
    for stage in stages:
        n = weights[w].shape[0]
        for j in range(stage.num_linears):
            if weights[w + j].shape != (n, k):
                return "shapes do not chain"
            if stage.has_bias[j]:
                if biases[b].shape != (n,):
                    return "shapes do not chain"
                b += 1
        for t in operands[o:o + stage.num_operands]:
            # (as the plan took it, fxfuse.plan: a buffer replaced since may have another shape, which eager
            # broadcasts over rows, rejects, or lets add dims to the output)
            if t.dim() > max(1, x.dim()) or (t.dim() and t.shape[-1] not in (1, n)) \
                    or any(d != 1 for d in t.shape[:-1]):
                return "an operand does not broadcast along the last dim"
        k = n
        w += stage.num_linears
        o += stage.num_operands
    return None


@functools.lru_cache(maxsize=4096)
def _candidates(spec: str, widths: tuple[int, ...], small: Optional[int], elem_size: int,
                deterministic: bool) -> tuple[str, ...]:
    # ``small``: M itself when it is at most DECODE_MAX_M (the decode kernel's limit), else None (many rows).
    return tuple(kernel_candidates(MLPSpec.loads(spec), widths, small if small is not None else 1 << 30, elem_size,
                                   deterministic))


def _candidates_of(args: tuple) -> tuple[str, ...]:
    """:func:`_candidates` for a call's ``(x, weights, biases, operands, spec)``."""
    x, weights, _, _, spec = args
    m = x.numel() // x.shape[-1]
    return _candidates(spec, (x.shape[-1], *(w.shape[0] for w in weights)), m if m <= DECODE_MAX_M else None,
                       weights[0].element_size(), torch.are_deterministic_algorithms_enabled())


def _run_kernels(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], operands: Sequence[Tensor],
                 spec: str, strategy: str) -> Tensor:
    """The region with the kernels of ``strategy`` (one of :func:`fxfuse.strategy.kernel_candidates`)."""
    from .kernels import run_chain, run_decode, run_grid_sync
    from .stages import run_best_stage

    lead = x.shape[:-1]
    h = x.reshape(-1, x.shape[-1])  # a view when it can be; the kernels take any 2-D strides
    if h.dtype is not weights[0].dtype and strategy != FUSED_CHAIN:
        # An fp32 input under autocast (the chain kernel rounds it as it loads it): cast first, as a replay step.
        h = _cast_step(weights[0].dtype)(h)
        if fastlaunch.recording_open():
            fastlaunch.record(_cast_step(weights[0].dtype))
    stages = _plan(spec)[0]
    per_stage_biases = [[None if b is None else biases[b] for _, b in s.linears] for s in stages]
    per_stage_ops = [[t.reshape(-1) for t in operands[s.operands]] for s in stages]
    if strategy == FUSED_CHAIN:
        h = run_chain(h, weights, [bs[0] for bs in per_stage_biases], per_stage_ops,
                      tuple(s.epilogue for s in stages))
    elif strategy in (DECODE, DECODE_GRID_SYNC):
        run = run_decode if strategy == DECODE else run_grid_sync
        h = run(h, weights, [b for bs in per_stage_biases for b in bs], per_stage_ops,
                tuple(s.epilogue for s in stages), check=False)
    else:  # one GEMM + epilogue per stage, each by its fastest implementation
        timed = h.device.type == "cuda" and type(h) is Tensor and measured_choice_enabled()
        ran = None
        for stage, stage_biases, ops in zip(stages, per_stage_biases, per_stage_ops):
            stage_weights = [weights[w] for w, _ in stage.linears]
            h, ran = run_best_stage(h, stage_weights, stage_biases, ops, stage.epilogue, timed=timed,
                                    after_gemv=ran == "gemv")
    return h.reshape(*lead, h.shape[-1])


@functools.lru_cache(maxsize=8)
def _cast_step(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    return lambda h: h.to(dtype)


_failed: set[tuple[str, str, str]] = set()
# Strategies whose launches leave replay steps (fxfuse.replay): one per stage, or one for the whole region (the
# one-launch kernels, and the original ops: their full call path costs a host-bound region more than the ops).
_REPLAYED = (GEMM_EPILOGUE, GATED_GEMM_EPILOGUE, DECODE_GRID_SYNC, FUSED_CHAIN, ORIGINAL_OPS)


def _replay_steps(spec: str, strategy: str, cast_input: bool = False) -> int:
    """Steps a replay of ``strategy`` records; one more when the input is cast first (``_run_kernels``)."""
    if strategy == ORIGINAL_OPS:
        return 1
    steps = 1 if strategy in ONE_LAUNCH else len(_plan(spec)[0])
    return steps + (cast_input and strategy != FUSED_CHAIN)


def _timing_runners(args: tuple, candidates: Sequence[str], replayed: bool) -> tuple[dict, Callable[[], Tensor]]:
    """The planner's runners for ``args`` (strategy -> call, and the original ops), as their calls will run:
    through a replay where ``replayed``."""
    x, spec = args[0], args[-1]
    cast_input = x.dtype is not args[1][0].dtype
    runners = {s: functools.partial(_run_kernels, *args, s) for s in candidates}
    original = functools.partial(reference_mlp, *args)
    if replayed:
        for s in runners.keys() & set(_REPLAYED):
            runners[s] = replay.replaying(x, runners[s], _replay_steps(spec, s, cast_input))
        original = replay.replaying(x, functools.partial(_run_original, *args), 1)
    return runners, original


def _run_original(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], operands: Sequence[Tensor],
                  spec: str) -> Tensor:
    """:func:`reference_mlp`, leaving one replay step (its tensors held weakly) when a recording is open."""
    if fastlaunch.recording_open():
        fastlaunch.record(replay.weak_step(reference_mlp, weights, biases, operands, spec))
    return reference_mlp(x, weights, biases, operands, spec)


def _try_replay(x, weights, biases, operands, spec) -> tuple[Optional[tuple], Optional[Tensor]]:
    """A call like one already run replays its stages (:mod:`fxfuse.replay`): (its replay key, or None when this
    call cannot be replayed; the replay's output, or None when there is none yet)."""
    if not (type(x) is Tensor and x.is_cuda and x.dim() > 0 and x.numel() > 0 and replay.may_replay(spec, x)):
        return None, None
    replay_key = replay.replay_key(x, weights, biases, operands, spec)
    run = replay.lookup(replay_key)
    if run is not None:
        try:
            return replay_key, run(x)
        except ReferenceError:  # a parameter it held weakly is gone: record it again
            replay.replays.pop(replay_key, None)
        except Exception as err:  # never expected; the full path decides again
            log.warning("fxfuse: replaying %s failed (%s: %s); dropped", spec, type(err).__name__, err)
            replay.replays.pop(replay_key, None)
    return replay_key, None


def _dispatch(x, weights, biases, operands, spec):
    replay_key, out = _try_replay(x, weights, biases, operands, spec)
    if out is not None:
        return out
    reason = kernel_fallback_reason(x, weights, biases, operands, spec)
    if reason is not None:
        if reason not in _logged_fallbacks:
            _logged_fallbacks.add(reason)
            log.info("fxfuse.mlp falls back to the reference ops: %s", reason)
        if any(b.dim() != 1 for b in biases):
            return _reference_added_biases(x, weights, biases, operands, spec)
        return reference_mlp(x, weights, biases, operands, spec)
    args = (x, weights, biases, operands, spec)
    cast_input = x.dtype is not weights[0].dtype  # (an fp32 input under autocast: see _run_kernels)
    timed = x.device.type == "cuda" and type(x) is Tensor and measured_choice_enabled()
    # (untimed calls look up only a strategy that failed: strategy.forget)
    strategy = cached_choice(args) if timed or strategy_failures else None
    settled = strategy is not None or not timed  # this call only runs (it times nothing)
    if strategy is None:
        m = x.numel() // x.shape[-1]
        candidates = _candidates_of(args)
        if timed:
            replayed = replay_key is not None  # timed as they will run: replayed after the first calls
            runners, original = _timing_runners(args, candidates, replayed)
            path = 0.0
            if replayed and not torch.cuda.is_current_stream_capturing():  # the path a replayed call pays
                path = replay.path_us(replay_key, functools.partial(_try_replay, *args))
            at_top = None
            if times_bucket_top(m):
                def at_top():  # the same runners on a random input of the bucket's largest M
                    return _timing_runners((top_input(choice_bucket(m), x), *args[1:]), candidates, replayed)
            strategy = fastest(args, runners, original, path_us=path, at_top=at_top)
        else:
            strategy = candidates[0]
    if replay_key is not None and settled and strategy not in _REPLAYED:
        replay.will_not_replay(spec, x)  # only these strategies leave steps
    if strategy == ORIGINAL_OPS:
        if replay_key is not None and settled:
            return replay.build(replay_key, x, functools.partial(_run_original, *args), 1)
        return reference_mlp(*args)
    try:
        if replay_key is not None and settled and strategy in _REPLAYED:
            return replay.build(replay_key, x, lambda: _run_kernels(*args, strategy),
                                _replay_steps(spec, strategy, cast_input))
        return _run_kernels(*args, strategy)
    except torch.OutOfMemoryError:
        raise
    except TuningDuringCapture as err:  # the graph records the original ops; plain calls keep their choice
        log.info("%s; the graph runs the original ops of %s", err, spec)
        return reference_mlp(*args)
    except Exception as err:  # a kernel that fails here must not fail the user's forward: eager's ops run
        then = forget(args, strategy, _candidates_of(args))
        where = (spec, strategy, type(err).__name__)
        if where not in _failed:
            _failed.add(where)
            log.warning("fxfuse: the %s kernels of %s failed (%s: %s); running the original ops instead, and %s "
                        "from the next call of this shape", strategy, spec, type(err).__name__, err,
                        "the original ops" if then == ORIGINAL_OPS else f"the {then} kernels")
        return reference_mlp(*args)


@triton_op("fxfuse::mlp", mutates_args=())
def mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], operands: list[Tensor], spec: str) -> Tensor:
    """A fused MLP region: ``spec`` (see :mod:`fxfuse.spec`) over ``x``.

    ``biases`` holds only the biases that exist, in the order of ``spec``'s bias flags.
    """
    if not on_its_device(x):
        with torch.cuda.device(x.device):
            return mlp(x, weights, biases, operands, spec)
    if _autocast_on(x):
        return reference_mlp(x, weights, biases, operands, spec)
    return _not_a_view(_dispatch(x, weights, biases, operands, spec))


def _autocast_on(x: Tensor) -> bool:
    """Autocast is on for x's device: the op called as such (a function mode, tracing) runs the original ops, which
    autocast as eager's do (``fused_mlp`` decides itself, :mod:`fxfuse.autocast`)."""
    return any_autocast() and torch.is_autocast_enabled(x.device.type)


def _traced_or_watched(x: Tensor) -> bool:
    """Whether something must see this call as the op: tracing, export, or a mode watching torch.ops (or
    ``torch.jit.trace`` recording it: :func:`fused_mlp` then runs the original ops, the trace records those)."""
    if type(x) is not Tensor or torch.compiler.is_compiling() or _jit_tracing() is not None:
        return True  # FakeTensor, FunctionalTensor, Proxy, a subclass; Dynamo / export / TorchScript tracing
    # make_fx, FakeTensorMode, a profiler or counter watching torch.ops calls
    return _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled()


_jit_tracing = torch._C._get_tracing_state  # not None while torch.jit.trace records: sizes are traced tensors


def _eager_subclass(x) -> bool:
    """A tensor subclass of the user's, called eagerly (no compile, mode or fake tensor): its
    ``__torch_function__`` / ``__torch_dispatch__`` must see the region's original ops, as in eager (a subclass that
    rounds each linear's output, or handles a fixed set of functions, knows no ``fxfuse::mlp``)."""
    return isinstance(x, Tensor) and type(x) not in _PLAIN_TYPES and not isinstance(x, _COMPILER_TENSORS) \
        and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None \
        and not torch._C._is_torch_function_mode_enabled()


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)  # (a Parameter fed to a region: a learned query table)
_COMPILER_TENSORS = (FakeTensor, FunctionalTensor)


# Regions (:func:`region_key`: the spec, dtype and widths) whose op backward has run: they are being trained (see
# ``fused_mlp``). By dtype and widths too: a 256-wide SIREN (generic backward) must not send a 64-wide one of the
# same spec, whose backward is the fused kernel, to the original ops (nor an fp32 chain the same one in fp16).
_trained: set[tuple] = set()
# Regions whose backward was the walk (wide narrow chains, fxfuse.backward): from then on their gradient-recording
# forwards store the layer inputs the walk reads, so its backward does not run the forward again. (Not before:
# a forward whose gradients nobody asks for would pay the stores for nothing.)
_walked: set[tuple] = set()


def region_key(spec: str, x: Tensor, weights: Sequence[Tensor], dtype: Optional[torch.dtype] = None) \
        -> Optional[tuple]:
    """A region's key in :data:`_trained` / :data:`_walked`: its spec, the dtype it computes in (``dtype``, else
    x's: whether the fused backward takes a chain depends on it), its input width and each weight's rows; None for
    symbolic sizes (fake tensors under ``torch.library.opcheck`` or a trace: nothing to mark there)."""
    key = (spec, dtype or x.dtype, x.shape[-1], *[w.shape[0] for w in weights])
    return key if all(type(d) is int for d in key[2:]) else None


_queued: set[tuple[int, tuple]] = set()  # (id of the marks, region key) waiting for their backward pass to end


def _mark_after_backward(marks: set[tuple], region: Optional[tuple]) -> bool:
    """Add ``region`` (:func:`region_key`) to ``marks`` when the backward pass in progress ends (at once outside
    one): under activation checkpointing each layer's forward runs again inside the backward, and must save what
    its first run saved, so no mark may change a forward's path before the step's backward is over. Returns
    whether this call marked or queued it (False: marked or queued already)."""
    key = (id(marks), region)
    if region is None or region in marks or key in _queued:
        return False

    def mark() -> None:
        marks.add(region)
        _queued.discard(key)

    try:
        torch.autograd.Variable._execution_engine.queue_callback(mark)
        _queued.add(key)
    except RuntimeError:  # ("Final callbacks can only be installed during backward pass")
        marks.add(region)
    return True


def fused_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], operands: list[Tensor], spec: str) -> Tensor:
    """What a fused graph calls: ``torch.ops.fxfuse.mlp``, without the dispatcher when nothing needs it.

    The op's dispatch (autograd wrapper, custom-op checks, device redispatch) costs tens of microseconds
    per call, as much as a decode-size MLP takes on the GPU. Plain inference on plain tensors runs the
    op's implementation directly; anything that needs the op (gradients, torch.compile / export, a
    dispatch or function mode) calls it.

    Training: the op saves only its inputs, so its backward recomputes the forward with the original
    ops. That is cheap for a forward whose gradients are never asked for (inference without
    ``torch.no_grad()``), but a training step would pay a second forward. So once a region of this
    ``spec`` has run a backward, calls that record gradients run the original ops instead: autograd
    keeps their intermediates, and the step costs what eager's does. Calls without gradients stay fused.

    Inside ``torch.func`` transforms (``vmap``, ``grad``) the region runs its original ops.

    Under autocast the region runs fused in the autocast dtype (fp32 weights replaced by kept casts, or by casts
    made with autograd in a call that records gradients; an fp32 input rounded by the kernels in a call that
    records none), or as the original ops (:mod:`fxfuse.autocast`).

    Example:
        >>> x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
        >>> with torch.no_grad():
        ...     y = fused_mlp(x, [w1, w2], [], [], "1:relu(a0);1:a0")
        >>> torch.allclose(y, torch.relu(x @ w1.T) @ w2.T, atol=1e-5)
        True

    Under ``torch.jit.trace`` the region runs its original ops, so that the TorchScript graph records plain aten
    ops (sizes are traced tensors there, which the kernels' choice cannot take; a recorded ``fxfuse::mlp`` would
    tie the ScriptModule to this process's registration of the op).
    """
    if _traced_or_watched(x):
        if _jit_tracing() is not None or _eager_subclass(x):
            return reference_mlp(x, weights, biases, operands, spec)
        return torch.ops.fxfuse.mlp.default(x, weights, biases, operands, spec)
    if transformed():  # torch.func.vmap / grad, forward AD: batched or dual tensors, which only ops take
        return reference_mlp(x, weights, biases, operands, spec)
    if not on_its_device(x):  # another GPU's input: launches, streams and replays under that GPU
        with torch.cuda.device(x.device):
            return fused_mlp(x, weights, biases, operands, spec)
    if any_autocast():  # the region follows autocast (fxfuse/autocast.py): fused on cast tensors, or eager's ops
        # (the key in the dtype the region would compute in: autocast's, as the op's backward marks it)
        if _trained and records_grad(x, weights, biases, operands) and \
                region_key(spec, x, weights, torch.get_autocast_dtype(x.device.type)) in _trained:
            # A trained region runs its original ops (see below): autocast casts their inputs itself, in C++ and
            # with its per-context cache, which costs the host less than casting them here first.
            return reference_mlp(x, weights, biases, operands, spec, trained=True)
        cast = autocast_args(x, weights, biases, operands, spec)
        if cast is None:
            return reference_mlp(x, weights, biases, operands, spec,
                                 trained=records_grad(x, weights, biases, operands))
        x, weights, biases = cast
    elif weight_casts:  # the first call after autocast: its weight casts go, as autocast's own do at its exit
        weight_casts.clear()
    if records_grad(x, weights, biases, operands):
        if _trained and region_key(spec, x, weights) in _trained:  # (no key to build while nothing is trained)
            return reference_mlp(x, weights, biases, operands, spec, trained=True)
        if x.is_inference():  # autograd cannot save it (the op saves its inputs); eager's ops may not need it saved
            return reference_mlp(x, weights, biases, operands, spec)
        # The op's autograd, in a plain autograd.Function: the custom op's wrapper flattens and checks its
        # list arguments on every call and in the backward (~0.3 ms of host time per training step on the
        # H200 machine, more than nerf64's fused backward kernel leaves the host).
        sizes = (1, len(weights), len(biases), len(operands))
        return _FusedMLPFunction.apply(spec, sizes, x, *weights, *biases, *operands)[0]
    return _dispatch(x, weights, biases, operands, spec)


def is_fused_call(node) -> bool:
    """Whether an FX node is a fused region's call (``fused_mlp`` or the op itself)."""
    return node.op == "call_function" and node.target in FUSED_TARGETS


@mlp.register_kernel("cpu")
def _mlp_cpu(x, weights, biases, operands, spec):
    # Without a GPU the reference ops run, unless the Triton interpreter is on (tests use it to run
    # the real kernels on the CPU).
    if not _interpreting() or _autocast_on(x):
        return reference_mlp(x, weights, biases, operands, spec)
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):  # plain tensors: launch directly, as triton_op does on CUDA
        return _not_a_view(_dispatch(x, weights, biases, operands, spec))


@mlp.register_fake
def _mlp_fake(x, weights, biases, operands, spec):
    return x.new_empty((*x.shape[:-1], weights[-1].shape[0]))


def _save_inputs(ctx, spec: str, sizes: tuple[int, ...], flat: Sequence[Tensor],
                 stored: Sequence[Tensor] = (), copy_frozen_input: bool = False) -> None:
    """What ``_backward`` reads: the spec, how ``flat`` splits into (x, weights, biases, operands), which of
    them want gradients, and the tensors themselves: the inputs, and ``stored`` (what the
    walk reads from the forward: :func:`fxfuse.backward.forward_for_walk`'s layer inputs, and its output where the
    walk reads it). ``copy_frozen_input``: keep a copy of x where the first stage's weights are frozen (not in a
    compiled graph, whose functionalized x is never written in place)."""
    ctx.spec, ctx.sizes, ctx.num_stored = spec, sizes, len(stored)
    ctx.wanted = [i for i, t in enumerate(flat) if t.requires_grad]
    if copy_frozen_input and not any(flat[1 + i].requires_grad for i in range(_plan(spec)[0][0].num_linears)):
        # Eager's first linear keeps no x when its weights are frozen, so x may be written in place before the
        # backward (``x += mlp(x)``, partial fine-tuning); this backward reads x (to recompute the chain, or as the
        # original ops' input): a copy, which the write leaves alone.
        flat = [flat[0].detach().clone(), *flat[1:]]
    # (the biases too, which eager's backward does not read: a bias written in place between the forward and the
    # backward raises autograd's error here, not in eager. Copies would cost a launch per step and new addresses,
    # which the backward's bound launches are keyed by: a new binding every step.)
    ctx.save_for_backward(*flat, *stored)


def _saved(ctx) -> tuple[list[Tensor], list[Tensor]]:
    """The saved inputs (flat) and what the forward stored for the walk."""
    saved = list(ctx.saved_tensors)
    n = len(saved) - ctx.num_stored
    return saved[:n], saved[n:]


def _setup_context(ctx, inputs, output):
    x, weights, biases, operands, spec = inputs
    _save_inputs(ctx, spec, (1, len(weights), len(biases), len(operands)), [x, *weights, *biases, *operands],
                 copy_frozen_input=not torch.compiler.is_compiling())


def _split(flat: list, sizes: tuple[int, ...]) -> list[list]:
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out


def _fused_backward(ctx, grad, flat: list[Tensor], stored: list[Tensor]) -> Optional[tuple]:
    """The op's gradients from the fused chain backward kernel (:mod:`fxfuse.backward`), or None. ``flat``,
    ``stored``: the saved tensors (:func:`_saved`)."""
    (x,), weights, biases, operands = _split(flat, ctx.sizes)
    if operands:
        return None
    result = fused_chain_gradients(ctx.spec, x, weights, expand_biases(biases, MLPSpec.loads(ctx.spec)), grad,
                                   need_dx=0 in ctx.wanted, stored=stored)
    if result is None:
        return None
    if not stored and not torch.compiler.is_compiling() and walks((x.shape[-1], *(w.shape[0] for w in weights))):
        _mark_after_backward(_walked, region_key(ctx.spec, x, weights))
    dx, grad_w, grad_b = result
    wanted = set(ctx.wanted)
    gw = [g if 1 + i in wanted else None for i, g in enumerate(grad_w)]
    present = [g for g in grad_b if g is not None]  # the op's biases are the ones that exist
    gb = [g if 1 + len(weights) + i in wanted else None for i, g in enumerate(present)]
    return dx, gw, gb, [], None


def _saved_region(ctx, flat: list[Tensor]) -> Optional[tuple]:
    (x,), weights, _, _ = _split(flat, ctx.sizes)
    return region_key(ctx.spec, x, weights)


def _backward(ctx, grad):
    """Gradients: the fused chain backward kernel where it takes the region (:mod:`fxfuse.backward`), else
    those of the reference composite (the original ops), via ``torch.func.vjp``."""
    # (read once: under activation checkpointing a second read of ctx.saved_tensors is an error)
    flat, stored = _saved(ctx)
    fused = _fused_backward(ctx, grad, flat, stored)
    if fused is not None:
        return fused
    if not torch.compiler.is_compiling() and _mark_after_backward(_trained, _saved_region(ctx, flat)):
        log.info("fxfuse: a region %s is being trained; from now on its calls that record gradients run the "
                 "original ops, which keep the intermediates the backward needs (calls without gradients stay "
                 "fused)", ctx.spec)
    wanted = ctx.wanted  # differentiate only what needs it; the rest is closed over as constants

    def f(*diff):
        args = list(flat)
        for i, t in zip(wanted, diff):
            args[i] = t
        (x,), weights, biases, operands = _split(args, ctx.sizes)
        return reference_mlp(x, weights, biases, operands, ctx.spec)

    grads: list[Optional[Tensor]] = [None] * len(flat)
    if wanted:
        _, vjp = torch.func.vjp(f, *[flat[i] for i in wanted])
        for i, g in zip(wanted, vjp(grad)):
            grads[i] = g
    (gx,), gw, gb, gops = _split(grads, ctx.sizes)
    return gx, gw, gb, gops, None


mlp.register_autograd(_backward, setup_context=_setup_context)


def _not_a_view(out: Tensor) -> Tensor:
    # The kernels' [M, N] result reshaped to x's leading dims is a view, and autograd forbids modifying in place
    # a view made inside a custom Function's forward (the op's autograd or _FusedMLPFunction); eager's linear
    # output may be (``out += residual``). The same memory as a plain tensor. (Traced values stay as they are.)
    return out.detach() if type(out) is Tensor and out._is_view() else out


class _FusedMLPFunction(torch.autograd.Function):
    """The op's forward and backward for eager calls that record gradients (see :func:`fused_mlp`): the same
    ``_dispatch`` and ``_backward``, with the tensors as flat arguments (``sizes`` splits them back).

    Returns ``(out, *stored)``: for a region in ``_walked``, the forward is the chain kernel storing every layer's
    input (:func:`fxfuse.backward.forward_for_walk`), returned as outputs (non-differentiable, never
    materialized as gradients) so ``setup_context`` can save them; otherwise just ``(out,)``.
    """

    @classmethod
    def apply(cls, *args):
        # ``Function.apply`` binds the arguments to ``forward``'s signature through ``inspect`` on every call when
        # the Function has a ``setup_context`` (for functorch): 56 instead of 17 µs of host per call on this
        # project's CPU machine. Outside functorch transforms that apply ends in the base class's, called here.
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    @staticmethod
    def forward(spec: str, sizes: tuple[int, ...], *flat: Tensor) -> tuple[Tensor, ...]:
        (x,), weights, biases, operands = _split(list(flat), sizes)
        if _walked and not operands and region_key(spec, x, weights) in _walked:
            stored = forward_for_walk(spec, x, weights, expand_biases(biases, MLPSpec.loads(spec)))
            if stored is not None:
                return (_not_a_view(stored[0]), *stored[1])
        return (_not_a_view(_dispatch(x, weights, biases, operands, spec)),)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # (a separate method: torch.func can use it)
        spec, sizes, *flat = inputs
        stored = output[1:]
        if stored and walk_reads_output(spec):  # saved only then: eager lets a user modify it in place
            stored = (*stored, output[0])
        _save_inputs(ctx, spec, sizes, flat, stored, copy_frozen_input=True)
        if len(output) > 1:
            ctx.mark_non_differentiable(*output[1:])
            ctx.set_materialize_grads(False)  # no [M, width] zeros for the stored tensors' "gradients"

    @staticmethod
    def backward(ctx, grad: Optional[Tensor], *_unused) -> tuple:
        if grad is None:  # (with set_materialize_grads(False): the output took no part in the loss)
            return (None,) * (2 + sum(ctx.sizes))
        gx, gw, gb, gops, _ = _backward(ctx, grad)
        return (None, None, gx, *gw, *gb, *gops)


FUSED_TARGETS = (fused_mlp, torch.ops.fxfuse.mlp.default)
