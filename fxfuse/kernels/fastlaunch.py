"""A lean launch path for autotuned kernels: after the first launch, call the compiled kernel directly.

``kernel[grid](**args)`` costs tens of microseconds of Python per launch (the autotuner's key, the JIT
binder over ~25 arguments, the grid callback). At decode sizes that is more than the kernel itself. Once
a launch has gone through Triton, everything its specialization depends on is known, so the next launch
with the same *signature* can hand the arguments straight to the compiled kernel's launcher.

The signature is what Triton specializes on, computed from the argument dict:

* tensors: dtype and whether the address is 16-byte aligned;
* ints: the value, except the ones named ``varying`` (M), which contribute only what Triton specializes
  on (``== 1``, divisibility by 16, needs 64 bits);
* everything else (constexpr flags, strings): the value.

A miss (new signature) takes Triton's own path, which compiles or autotunes as usual, and records the
compiled kernel and the chosen config for the next call. GPU only: the interpreter and tracers never
come here, and neither do launches while a Triton launch hook (a profiler) is installed.

Example:
    >>> launcher = LeanLauncher(kernel, varying=("M",))  # doctest: +SKIP
    >>> launcher.launch(lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),), args)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["Bindings", "LeanLauncher", "bind", "bound_key", "launch", "lean_launch_enabled", "may_bind", "new_output",
           "output_step", "record", "recording", "recording_open"]

try:  # triton >= 3.4 keeps the launch hooks here
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always the normal path
    _knobs = None

_MAX_ENTRIES = 256  # signatures per kernel; past it, the oldest half is dropped
_PLAIN = (int, float, bool, str)


def _unhooked(hook: Any) -> bool:
    # Triton >= 3.5 keeps an (empty) HookChain there rather than None.
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def lean_launch_enabled() -> bool:
    """False while a Triton launch hook is installed (profilers want every launch through Triton)."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    return _unhooked(runtime.launch_enter_hook) and _unhooked(runtime.launch_exit_hook)


# The current stream's handle, as Triton itself reads it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def launch(kernel: Any, grid: Callable[[dict], tuple], args: dict, varying: Sequence[str] = ("M",)) -> None:
    """``kernel[grid](**args)`` through the kernel's :class:`LeanLauncher` (one per kernel object)."""
    lean = getattr(kernel, "_fxfuse_lean", None)
    if lean is None:
        lean = kernel._fxfuse_lean = LeanLauncher(kernel, varying)
    lean.launch(grid, args)


class _Recording(threading.local):
    steps: Optional[list] = None  # the active recording's steps, per thread


# (per thread: two threads recording their first calls at once must not take each other's launches)
_recording = _Recording()


@contextlib.contextmanager
def recording():
    """Within it, each stage launcher that can be replayed appends one *step* (``h -> out``, the stage on a
    new input of the same layout; or None when it cannot be replayed) to the yielded list
    (:mod:`fxfuse.replay` records a region's stages this way). Recordings nest: an inner one takes the steps
    made within it, and the outer one goes on after it. Each thread records its own launches."""
    outer = _recording.steps  # a recording inside another (a stage timed while its region records) keeps its own
    _recording.steps = steps = []
    try:
        yield steps
    finally:
        _recording.steps = outer


_MAX_RECORDED = 64  # a recording that runs a timing loop (the first call at a shape) stops keeping steps here


def recording_open() -> bool:
    """Whether :func:`record` would keep a step now (a recording is active and not full): check before
    building a step that costs host time."""
    steps = _recording.steps
    return steps is not None and len(steps) <= _MAX_RECORDED


def record(step: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Append ``step`` to the active :func:`recording`, if any (a no-op otherwise: one thread-local read).

    Past ``_MAX_RECORDED`` steps nothing more is kept: such a recording timed its stages (hundreds of launches)
    and cannot become a replay anyway, and its steps would only hold memory until it ends."""
    steps = _recording.steps
    if steps is not None and len(steps) <= _MAX_RECORDED:
        steps.append(step)


def bound_key(tag: Any, x: torch.Tensor, *groups: Sequence[Optional[torch.Tensor]]) -> tuple:
    """What a launch bound by address (:func:`bind`) depends on, besides x's address: ``tag`` (the kernel's
    epilogue, a region's spec), x's shape, strides, dtype, device, 16-byte alignment and stream, the TF32 flag
    for fp32, and each tensor's address, shape, strides and dtype (``None`` entries allowed). Runs on every
    bound call: attribute reads only.

    Example:
        >>> w = torch.randn(4, 3)
        >>> bound_key("a0", torch.randn(2, 3), [w]) == bound_key("a0", torch.randn(2, 3), [w])
        True
    """
    device = x.get_device()  # an int: cheaper than ``x.device`` (-1 off CUDA, where no stream is read)
    key = [tag, x.shape, x.stride(), x.dtype, device, x.data_ptr() % 16 == 0,
           _raw_stream(device) if device >= 0 and x.is_cuda else 0]
    if x.dtype is torch.float32:
        key.append(torch.backends.cuda.matmul.allow_tf32)
    for group in groups:
        for t in group:
            key.append(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype))
    return tuple(key)


def may_bind(x: torch.Tensor) -> bool:
    """Whether a launch on ``x`` may go through a binding (:func:`bind`): on the GPU, with no Triton launch hook
    installed (a profiler wants every launch through Triton) and no CUDA graph being captured."""
    return x.is_cuda and lean_launch_enabled() and not torch.cuda.is_current_stream_capturing()


class Bindings(dict):
    """Bound launches (or steps made of them) by :func:`bound_key`. Past ``limit`` entries all are dropped: each
    is bound again on its next call. (A key holds the bound tensors' addresses, so it is only found while they
    are where they were.)"""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def keep(self, key: tuple, value: Any) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value


def new_output(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh ``[rows, cols]`` output for a bound launch. The sizes go to ``torch.empty`` unpacked: its argument
    parser takes that form ~0.7 µs faster than a size tuple (1.55 vs 2.25 µs on the H200 machine's host)."""
    return torch.empty(rows, cols, dtype=dtype, device=device)


def output_step(bound: Callable[..., None], rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                recorded: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A replay step (:func:`record`) of a launch bound to all but its input and output: ``h -> out``, a fresh
    ``[rows, cols]`` output each call.

    ``recorded``: the input of the launch being recorded. A replay calls the step only on inputs of its layout
    (the replay key fixes the region input's, and a later step's input is the fresh output of the one before),
    so when that layout is the output's (a ``[rows, cols]`` contiguous tensor of ``dtype``) the output is made
    with ``torch.empty_like`` (~0.5 µs less host time than ``torch.empty`` with sizes on the H200 machine)."""
    if recorded is not None and recorded.shape == (rows, cols) and recorded.dtype is dtype \
            and recorded.stride() == (cols, 1):
        def step_like(h: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(h)
            bound(h, out)
            return out

        return step_like

    def step(h: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows, cols, dtype=dtype, device=device)
        bound(h, out)
        return out

    return step


def bind(kernel: Any, grid: Callable[[dict], tuple], args: dict, slots: Sequence[str],
         varying: Sequence[str] = ("M",)) -> Optional[Callable[..., None]]:
    """A launch of ``kernel`` with ``args`` in which only the ``slots`` (tensor arguments) change: ``fn(*slots)``.

    Returns None until a launch with this signature went through :func:`launch` (the compiled kernel and its
    config are known only then), or while a launch hook is installed. The caller must only pass tensors
    that give ``args`` the same signature (dtype, 16-byte alignment), e.g. fresh ``torch.empty`` outputs
    and inputs of the same dtype whose alignment it checked.

    The other tensors are bound by address, not by reference (Triton's launcher takes an int as a pointer):
    the binding keeps no weight alive, so the caller must key it by those tensors' addresses (and shapes,
    strides, dtypes) and use it only while they match.
    """
    lean = getattr(kernel, "_fxfuse_lean", None)
    if lean is None:
        lean = kernel._fxfuse_lean = LeanLauncher(kernel, varying)
    return lean.bind(grid, args, slots)


# The argument layout of Triton 3.6's C launcher (``CudaLauncher.launch``): grid x/y/z, stream, function,
# cooperative, pdl, global scratch, profile scratch, kernel metadata, launch metadata, enter hook, exit hook.
_KNOWN_LAUNCH_FORMAT = "iiiKKppOOOOOO"


def _direct_launch(run: Any) -> Optional[Callable[..., None]]:
    """``run(gx, gy, gz, stream, function, packed_metadata, None, None, None, *args)`` without the Python
    ``CudaLauncher.__call__`` in front of the C launcher (it allocates no scratch for these kernels, yet costs
    ~1.5-2 µs of host time per launch on the H200 machine), or ``run`` itself when this Triton's launcher is not
    the one whose argument layout this code knows, or the kernel needs scratch memory.
    """
    try:
        from triton.backends.nvidia import driver
    except ImportError:  # pragma: no cover - not the NVIDIA backend
        return run
    launch = getattr(run, "launch", None)
    if getattr(driver, "_BASE_ARGS_FORMAT", None) != _KNOWN_LAUNCH_FORMAT or launch is None \
            or getattr(run, "global_scratch_size", 1) != 0 or getattr(run, "profile_scratch_size", 1) != 0:
        return run
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl

    def direct(gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        launch(gx, gy, gz, stream, function, coop, pdl, None, None, packed, launch_metadata, enter_hook, exit_hook,
               *args)

    direct.raw = (launch, coop, pdl)  # for bound launches, which call the C launcher with no frame between
    return direct


class _Entry:
    __slots__ = ("run", "function", "packed_metadata", "ordered", "meta", "tensor_name")

    def __init__(self, compiled: Any, order: list[str], meta: dict, tensor_name: str):
        compiled._init_handles()  # loads the module; ``run`` is the C launcher afterwards
        self.run = _direct_launch(compiled.run)
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        # full argument dict -> the kernel's arguments in order (one C call instead of a Python loop)
        getter = operator.itemgetter(*order)
        self.ordered = getter if len(order) > 1 else (lambda d, g=getter: (g(d),))
        self.meta = meta
        self.tensor_name = tensor_name  # an argument that is a tensor: its device picks the stream


class LeanLauncher:
    """Launches one autotuned Triton kernel, directly through its compiled launcher when it can.

    Args:
        kernel: the ``triton.autotune``-wrapped ``@triton.jit`` function, or a plain ``@triton.jit`` one (launch
            options such as ``num_warps`` then go in the arguments).
        varying: names of int arguments that change from call to call (the row count): they key the cache by
            Triton's specialization of them, not by value.
    """

    # A subclass sets this when its configs' pre-hooks change nothing the compiled launcher reads.
    pre_hook_is_launch_free = False

    def __init__(self, kernel: Any, varying: Sequence[str] = ("M",)):
        self.kernel = kernel
        self.varying = frozenset(varying)
        self.arg_names: list[str] = list(getattr(kernel, "arg_names", None) or kernel.fn.arg_names)
        self.entries: dict[tuple, _Entry] = {}
        self.hits = 0  # launches that skipped Triton's Python path (tests read it)

    def signature(self, args: dict) -> Optional[tuple]:
        """What Triton specializes on, or None when an argument is not a tensor, a plain value or one that
        :meth:`other_key` keys (by default nothing else: a TMA descriptor's block shape is set by a config's
        pre-hook, which only Triton's path runs; the TMA launcher knows it may skip it)."""
        # Runs on every launch: exact-type checks first (ints are most of the arguments), no generator.
        key = []
        append = key.append
        varying = self.varying
        for name, v in args.items():
            t = type(v)
            if t is int:
                append((v == 1, v % 16 == 0, v > 0x7FFFFFFF) if name in varying else v)
            elif isinstance(v, torch.Tensor):
                # (and its GPU: a compiled kernel's function is loaded on one device's context; a model split
                # across GPUs launches the same signature on each)
                append((v.dtype, v.data_ptr() % 16 == 0, v.get_device()))
            elif v is None or t in _PLAIN:
                append(v)
            else:
                other = self.other_key(v)
                if other is None:
                    return None
                append(other)
        return tuple(key)

    def other_key(self, value: Any) -> Optional[tuple]:
        """The signature entry of an argument that is neither a tensor nor a plain value, or None: then the
        launch takes Triton's path. A subclass that knows such an argument (a TMA descriptor) keys it here."""
        return None

    def launch(self, grid: Callable[[dict], tuple], args: dict) -> None:
        """Launch with ``args`` (every non-config argument, by name); ``grid(meta)`` as in ``kernel[grid]``."""
        if not lean_launch_enabled():
            self.kernel[grid](**args)
            return
        key = self.signature(args)
        entry = None if key is None else self.entries.get(key)
        if entry is None:
            compiled = self.kernel[grid](**args)
            if key is not None:
                self._record(key, compiled, args)
            return
        full = args.copy()
        full.update(entry.meta)
        g = grid(full)
        stream = _raw_stream(full[entry.tensor_name].device.index)
        entry.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, entry.function,
                  entry.packed_metadata, None, None, None, *entry.ordered(full))
        self.hits += 1

    def entry_meta(self, args: dict) -> Optional[dict]:
        """The config (its kwargs) that launches with ``args``' signature use, or None before the first."""
        key = self.signature(args)
        entry = None if key is None else self.entries.get(key)
        return None if entry is None else dict(entry.meta)

    def bind(self, grid: Callable[[dict], tuple], args: dict, slots: Sequence[str]) -> Optional[Callable[..., None]]:
        """See :func:`bind`."""
        if not lean_launch_enabled():
            return None
        key = self.signature(args)
        entry = None if key is None else self.entries.get(key)
        if entry is None:
            return None
        full = args.copy()
        full.update(entry.meta)
        g = grid(full)
        g0, g1, g2 = g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1
        ordered = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in entry.ordered(full)]
        positions = [self.arg_names.index(name) for name in slots]
        device_index = full[entry.tensor_name].device.index
        run, function, packed = entry.run, entry.function, entry.packed_metadata
        raw = getattr(run, "raw", None)
        if raw is not None:  # Triton 3.6's C launcher, directly (see _direct_launch)
            c_launch, coop, pdl = raw
            fn, head = c_launch, (function, coop, pdl, None, None, packed, None, None, None)
        else:  # the compiled kernel's launcher (``CudaLauncher.__call__``)
            fn, head = run, (function, packed, None, None, None)

        def launch_bound(*values):
            a = ordered.copy()  # a copy per call: two threads may launch the same binding
            for i, v in zip(positions, values):
                a[i] = v
            fn(g0, g1, g2, _raw_stream(device_index), *head, *a)

        return launch_bound

    def _record(self, key: tuple, compiled: Any, args: dict) -> None:
        if not hasattr(compiled, "packed_metadata"):
            return  # not a Triton version this path knows: keep Triton's own path
        if hasattr(self.kernel, "configs"):  # autotuned: the config it chose for this key
            config = getattr(self.kernel, "best_config", None)
            if config is None:
                return
            if config.pre_hook is not None and not self.pre_hook_is_launch_free:
                return  # a config's pre-hook must run before every launch: only Triton's path runs it
            meta = dict(config.kwargs)
        else:  # a plain @triton.jit kernel: its launch options (num_warps, ...) are in ``args``, so in the key
            meta = {}
        order = self.arg_names
        if any(n not in args and n not in meta for n in order):
            # an argument with a default we did not pass: let Triton bind it (every launch of this call site)
            logger.debug("fxfuse: no lean launch for %s: %s not passed", getattr(self.kernel, "fn", self.kernel),
                         [n for n in order if n not in args and n not in meta])
            return
        tensor_name = next((n for n, v in args.items() if isinstance(v, torch.Tensor)), None)
        if tensor_name is None:
            return  # nothing says which device's stream to launch on
        try:
            entry = _Entry(compiled, order, meta, tensor_name)
        except Exception as err:  # pragma: no cover - unexpected Triton internals: stay on the normal path
            logger.debug("fxfuse: no lean launch for %s (%s)", getattr(self.kernel, "fn", self.kernel), err)
            return
        if len(self.entries) >= _MAX_ENTRIES:
            for k in list(self.entries)[: _MAX_ENTRIES // 2]:
                del self.entries[k]
        self.entries[key] = entry
