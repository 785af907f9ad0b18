"""Host µs of every layer of a decode-size module's call, for each replayed strategy, and its wall time.

    python3 benchmarks/probes/probe_call_path.py [name [M]]        (default gpt2m_mlp_m1 at its own rows)

For the row's module under ``fxfuse.optimize`` (no autograd), at ``M`` rows, each strategy that is replayed at this
shape (per-stage launches, the one-launch grid-sync kernel at one row, the original ops) is forced in turn; then, as
host µs per call (50 calls back to back, best of 20 loops): the module without its shortcut (``fxfuse.shortcut``)
and its wall time, the shortcut's hits after learning, the module, the host method without
``nn.Module.__call__``, ``fused_mlp``, ``_dispatch``, the replay key and lookup, the replay alone, and the small
pieces they are made of (``torch.empty``, stream and capture queries, autocast check). Then the wall µs per call
of 200 calls and the do_bench GPU median of the module, against eager, and the cProfile top of the module call.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_host import optimized_row  # noqa: E402
from benchmarks.timing import host_us, profile_top, wall_us  # noqa: E402
from fxfuse import install, ops, replay, strategy  # noqa: E402
from fxfuse.kernels import fastlaunch  # noqa: E402


def _gpu_us(fn) -> float:
    from triton.testing import do_bench

    return sorted(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3))[1]


def pieces(x: torch.Tensor) -> dict:
    n = x.shape[-1]
    return {
        "torch.empty": host_us(lambda: torch.empty((1, n), dtype=x.dtype, device=x.device)),
        "torch.empty(1, n)": host_us(lambda: torch.empty(1, n, dtype=x.dtype, device=x.device)),
        "x.new_empty": host_us(lambda: x.new_empty((1, n))),
        "torch.empty_like": host_us(lambda: torch.empty_like(x)),
        "is_current_stream_capturing": host_us(torch.cuda.is_current_stream_capturing),
        "_raw_stream": host_us(lambda: fastlaunch._raw_stream(0)),
        "autocast check": host_us(install._any_autocast),
        "traced_or_watched": host_us(lambda: ops._traced_or_watched(x)),
        "x.data_ptr": host_us(x.data_ptr),
    }


SHORTCUT = "_fxfuse_shortcut_forward"  # the module's fxfuse.shortcut.Shortcut


def probe(name: str, rows: Optional[int] = None) -> None:
    mod, x, opt, args, m = optimized_row(name, rows)
    torch.set_grad_enabled(False)
    print(f"== {name}: planner chose {strategy.cached_choice(args)}; timed {m.times if m else None}", flush=True)
    print("pieces: " + ", ".join(f"{k} {v:.2f}" for k, v in pieces(x).items()) + " us", flush=True)
    method = type(opt).forward
    forced_ones = (strategy.GEMM_EPILOGUE, strategy.DECODE_GRID_SYNC) if x.shape[0] == 1 else ()
    for forced in (*forced_ones, strategy.ORIGINAL_OPS):
        strategy._choices[strategy.choice_key(args)] = forced
        replay.forget_all()
        opt(x), opt(x)
        key = replay.replay_key(*args)
        run = replay.replays.get(key)
        shortcut = opt.__dict__.pop(SHORTCUT, None)  # the full path first, then with the module's shortcut
        row = {"module, full path": host_us(lambda: opt(x)), "wall, full path": wall_us(lambda: opt(x))}
        if shortcut is not None:
            opt.__dict__[SHORTCUT] = shortcut
            opt(x), opt(x)  # learn
            row["shortcut hits"] = float(shortcut.hits)
        row.update({"module": host_us(lambda: opt(x)), "host method": host_us(lambda: method(opt, x)),
               "fused_mlp": host_us(lambda: ops.fused_mlp(*args)), "_dispatch": host_us(lambda: ops._dispatch(*args)),
               "replay_key": host_us(lambda: replay.replay_key(*args)),
               "key+lookup": host_us(lambda: replay.lookup(replay.replay_key(*args)))})
        if run is not None:
            row["replay"] = host_us(lambda run=run: run(x))
        row["wall"] = wall_us(lambda: opt(x))
        row["GPU"] = _gpu_us(lambda: opt(x))
        err = ((opt(x).double() - mod(x).double()).norm() / mod(x).double().norm()).item()
        print(f"{forced} (replayed: {run is not None}, rel err vs eager {err:.1e}): "
              + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) + " us", flush=True)
        print(profile_top(lambda: opt(x), lines=18), flush=True)
    print(f"eager: module {host_us(lambda: mod(x)):.1f}, wall {wall_us(lambda: mod(x)):.1f}, "
          f"GPU {_gpu_us(lambda: mod(x)):.1f} us", flush=True)


if __name__ == "__main__":
    probe(sys.argv[1] if len(sys.argv) > 1 else "gpt2m_mlp_m1", int(sys.argv[2]) if len(sys.argv) > 2 else None)
