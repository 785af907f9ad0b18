"""Where the chain backward walk's time goes: the walk kernel at nerf128 with one thing changed at a time.

Renders :func:`fxfuse.kernels.chain_walk_template.render_chain_walk` for the NeRF chain, derives variants of its
source (some compute wrong gradients on purpose: they only say what a part costs), and times each at a few
configs with ``triton.testing.do_bench`` (median, L2 flushed), M = 2^20 fp16, beside the bytes it must move.

    python3 benchmarks/probes/probe_walk.py [--row nerf128|nerf64]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fxfuse.kernels import chain_backward_launch as launch  # noqa: E402
from fxfuse.kernels.chain_backward_template import gradient_layout  # noqa: E402
from fxfuse.kernels.chain_launch import run_chain  # noqa: E402
from fxfuse.kernels.chain_walk_template import _config, render_chain_walk, walk_inputs  # noqa: E402

ROWS = {"nerf64": (32, 64, 64, 64, 16), "nerf128": (64, 128, 128, 128, 64)}
EPILOGUES = ("relu(a0)", "relu(a0)", "relu(a0)", "a0")
CONFIGS = [(64, 4, 2, False), (64, 4, 2, False, 2), (128, 8, 1, False), (64, 4, 1, False, 2), (64, 4, 2, True)]


def loads_first(src: str) -> str:
    """Every stored-output load issued right after dy's, each into its own name and kept in the dtype (more
    registers, overlapped latencies; ReLU's derivative only compares it with 0)."""
    head, *layers = src.split("        # layer ")
    hoisted, out = [], []
    for part in layers:
        m = re.search(r"\n        h_out = (tl\.load\(hs(\d)_ptr.*)\n", part)
        if m:
            hoisted.append(f"        h_out{m.group(2)} = {m.group(1).replace('.to(tl.float32)', '')}\n")  # 16-bit
            part = part.replace(m.group(0), "\n").replace("h_out", f"h_out{m.group(2)}")
        out.append(part)
    start = head.rindex("g = tl.load(dy_ptr")  # dy's load (two lines), the loop's first statement
    at = head.index("\n", head.index("\n", start) + 1) + 1
    head = head[:at] + "".join(hoisted) + head[at:]
    return head + "".join("        # layer " + p for p in out)


def db_by_dot(src: str) -> str:
    """db_i accumulated by tl.dot(e0, d) into a [16, P] fp32 tile (e0: ones in row 0, zeros below), summed once
    at the end, instead of a per-block tl.sum into a [P] vector (replicated across the threads of a row)."""
    src = re.sub(r"db(\d) = tl\.zeros\(\(P(\d),\), dtype=tl\.float32\)",
                 r"db\1 = tl.zeros((16, P\2), dtype=tl.float32)", src)
    src = re.sub(r"db(\d) \+= tl\.sum\(d\.to\(tl\.float32\), axis=0\)", r"db\1 = tl.dot(e0, d, db\1)", src)
    src = src.replace("    num_tiles = tl.cdiv(M, BLOCK_M)\n",
                      "    num_tiles = tl.cdiv(M, BLOCK_M)\n"
                      "    e0 = tl.where(tl.arange(0, 16)[:, None] == 0, 1.0, 0.0).to(dtype)"
                      " + tl.zeros((16, BLOCK_M), dtype)\n")
    return re.sub(r"tl\.store\(row \+ OFF_B(\d) \+ n(\d), db(\d),",
                  r"tl.store(row + OFF_B\1 + n\2, tl.sum(db\3, axis=0),", src)


def variants(src: str) -> dict[str, str]:
    return {
        "shipped": src,
        "loads first": loads_first(src),
        "g in fp32 (template v1)": src.replace(".to(dtype)  # rounded", ".to(dtype).to(tl.float32)  # rounded").replace(
            "(n3[None, :] < D4), other=0.0)\n", "(n3[None, :] < D4), other=0.0).to(tl.float32)\n"),
        "db by tl.dot": db_by_dot(src),
        "db per block to memory": re.sub(
            r"db(\d) \+= (tl\.sum\([^\n]*\))",
            r"tl.store(part_ptr + tile.to(tl.int64) * TOTAL + OFF_B\1 + n\1, \2, mask=n\1 < D\1 + 1)", src
        ).replace("mask=n0 < D0 + 1", "mask=n0 < D1").replace("mask=n1 < D1 + 1", "mask=n1 < D2").replace(
            "mask=n2 < D2 + 1", "mask=n2 < D3").replace("mask=n3 < D3 + 1", "mask=n3 < D4"),
        "no db sums (wrong db)": re.sub(r"\n\s*db\d \+= [^\n]*", "", src),
        "no d stores (wrong dW)": re.sub(r"\n\s*tl\.store\(ds\d_ptr[^\n]*", "", src),
    }


SKIP = {"loads first", "db per block to memory", "g in fp32 (template v1)", "no d stores (wrong dW)"}  # measured


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", choices=sorted(ROWS), default="nerf128")
    ap.add_argument("--m", type=int, default=1 << 20)
    ap.add_argument("--all", action="store_true", help="also the variants measured before (SKIP)")
    args = ap.parse_args()
    widths, M = ROWS[args.row], args.m
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    x = torch.randn(M, widths[0], device=dev, dtype=dt)
    ws = [(torch.randn(o, i, device=dev) / i**0.5).to(dt) for i, o in zip(widths, widths[1:])]
    bs = [(0.1 * torch.randn(o, device=dev)).to(dt) for o in widths[1:]]
    dy = torch.randn(M, widths[-1], device=dev, dtype=dt)
    hidden = [torch.empty(M, d, device=dev, dtype=dt) for d in widths[1:-1]]
    run_chain(x, ws, bs, [[] for _ in ws], EPILOGUES, hidden=hidden)
    inputs = [x, *hidden]
    grads = [torch.empty(M, d, device=dev, dtype=dt) for d in widths[1:-1]]
    _, off_b, total = gradient_layout(widths, [True] * len(ws), weights=False)
    dx, partials, kargs = launch._common_args(x, ws, bs, dy, widths, off_b, total, True)
    # Room for one row per block: the "db per block to memory" variant writes there.
    kargs["part_ptr"] = torch.empty(triton.cdiv(M, 16), total, device=dev, dtype=torch.float32)
    kargs.update({f"hs{i}_ptr": inputs[i] for i in walk_inputs(EPILOGUES) if i > 0})
    kargs.update({f"ds{i}_ptr": g for i, g in enumerate(grads)})
    moved = (dy.numel() + sum(h.numel() for h in hidden) + sum(g.numel() for g in grads) + dx.numel()) * 2
    print(f"{args.row} walk, M={M}: {moved / 1e9:.2f} GB to move: {moved / 4.23e12 * 1e6:.0f} µs at 4.23 TB/s")
    src = render_chain_walk(EPILOGUES)
    folder = Path(tempfile.mkdtemp())
    ref_db = None
    for n, (name, text) in enumerate(variants(src).items()):
        if name in SKIP and not args.all:
            continue
        path = folder / f"walk_variant_{n}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        kernel = module.chain_backward_walk_kernel.fn
        for cfg in CONFIGS:
            config = _config(*cfg)
            programs = max(1, min(triton.cdiv(M, cfg[0]), 132 * cfg[2]))
            label = f"{name:26s} BLOCK_M {cfg[0]} w{cfg[1]} {cfg[2]}/SM s{config.kwargs['LOOP_STAGES']}"
            try:
                fn = lambda k=kernel, p=programs, c=config: k[(p,)](**kargs, **c.all_kwargs())  # noqa: E731
                compiled = fn()
                db = kargs["part_ptr"][:programs].sum(0)
                ref_db = db if ref_db is None else ref_db
                db_err = ((db - ref_db).norm() / ref_db.norm()).item()
                us = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
                print(f"  {label}: {us:7.1f} µs ({moved / us / 1e6:.2f} TB/s)  {compiled.n_regs} regs, "
                      f"{compiled.n_spills} spilled, {compiled.metadata.shared} B smem, db vs the first {db_err:.1e}",
                      flush=True)
            except Exception as e:
                print(f"  {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
