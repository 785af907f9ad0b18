"""Stage configs tuned after a dirty L2 (Triton's flush) or a clean one (``fxfuse.kernels.tuning.CLEAN_L2``).

For each case (an MLP shape of the workload table at M rows) and each way of tuning, a fresh process with empty
Triton and fxfuse caches optimizes the module and makes its first call (the stages' autotuners pick their
configs), then times the module three ways: ``do_bench`` as the workload benchmark (dirty flush), after a clean
L2 (``clean_l2_bench``), and back to back (wall µs per call of 200 calls). The picks are the autotuners' "tuned"
log lines.

    python3 benchmarks/probes/probe_clean_tuning.py [--cases llama:2,gpt2m:2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"llama": "llama_swiglu_m1", "gpt2m": "gpt2m_mlp_m1", "gpt2": "gpt2_mlp", "seed": "seed_geglu"}


def child(case: str, clean: bool, rounds: int) -> None:
    import statistics

    from triton.testing import do_bench

    import fxfuse
    from benchmarks.timing import wall_us
    from benchmarks.workloads import WORKLOADS, build_module, make_input
    from fxfuse.kernels import tuning

    tuning.CLEAN_L2 = clean
    picks: list[str] = []

    class Picks(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "tuned " in msg:
                picks.append(msg.split("tuned ", 1)[1].split(" in ")[0])

    log = logging.getLogger("fxfuse.kernels.tuning")
    log.setLevel(logging.INFO)
    log.addHandler(Picks())
    name, m = case.split(":")
    w = next(w for w in WORKLOADS if w.name == SHAPES[name])
    mod = build_module(w)
    x = make_input(w, m=int(m))
    opt = fxfuse.optimize(mod)
    with torch.no_grad():
        opt(x)
        torch.cuda.synchronize()
        fns = {"eager": lambda: mod(x), "fxfuse": lambda: opt(x)}
        out = {k: {"dirty": [], "clean": [], "wall": []} for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                out[k]["dirty"].append(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
                out[k]["clean"].append(tuning.clean_l2_bench(fn, warmup=25, rep=100, quantiles=(0.5,))[0] * 1e3)
                out[k]["wall"].append(wall_us(fn))
    summary = {k: {how: statistics.median(v) for how, v in d.items()} for k, d in out.items()}
    running = "; ".join(r.running_at(int(m)) for r in fxfuse.report(opt).regions)
    print("RESULT " + json.dumps({"case": case, "clean": clean, "us": summary, "picks": picks, "running": running}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="llama:2,llama:3,llama:16,gpt2m:2,gpt2m:4,gpt2m:8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None)
    ap.add_argument("--clean", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.clean, args.rounds)
        return
    rows = []
    for case in args.cases.split(","):
        for clean in (False, True):
            env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(), "FXFUSE_CACHE_DIR": tempfile.mkdtemp()}
            cmd = [sys.executable, __file__, "--child", case, "--rounds", str(args.rounds)] + (["--clean"] * clean)
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"{case} clean={clean}: failed\n{res.stderr[-2000:]}", flush=True)
                continue
            r = json.loads(lines[0][7:])
            rows.append(r)
            e, f = r["us"]["eager"], r["us"]["fxfuse"]
            print(f"{case:10} tuned {'clean' if clean else 'dirty'}: fxfuse dirty {f['dirty']:6.1f} clean "
                  f"{f['clean']:6.1f} wall {f['wall']:6.1f} | eager {e['dirty']:6.1f} {e['clean']:6.1f} "
                  f"{e['wall']:6.1f} | {r['running']} | {' / '.join(r['picks'])}", flush=True)


if __name__ == "__main__":
    main()
