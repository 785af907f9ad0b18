"""Both stages of a one-row MLP as ONE launch of small streaming programs, ordered by tickets (no grid barrier).

The decode rows run today as two launches of the one-row stream (``ONE_ROW``): gate+up, then down. Each launch
pays its own ramp (the first bytes arrive a latency after the start) and tail (the last programs finish alone);
back to back, with no flush between calls, the pair reads 80.8 µs per call at llama m1 against ~91 under do_bench.
The grid-sync kernel removed the second launch but runs one program per SM, which streams worse.

This probe's kernel keeps the small programs and puts both stages in one grid:

* each program takes a **ticket** (an atomic counter) instead of using its program id: tickets ``< NA`` compute
  ``XA`` hidden values (stage 0, stored to ``h``) and count themselves done; the others compute ``XB`` outputs;
* a stage-1 program issues the loads of its ``W2`` rows (the whole of H) FIRST, then waits until every stage-0
  ticket is done, then reads ``h`` from L2 and finishes. Tickets are handed out in order, so a waiting program
  only waits on programs that are already running: no deadlock, whatever order the GPU starts programs in, and
  (unlike a programmatic dependent launch) no stage-1 program holds an SM slot while stage-0 work is queued;
* the last stage-1 program to finish resets the counters for the next launch.

The interpreter runs programs one after another in order, which satisfies the waits.

    python3 benchmarks/probes/probe_two_phase.py [--rows llama,gpt2m] [--rounds 3] [--quick]
    TRITON_INTERPRET=1 python3 benchmarks/probes/probe_two_phase.py --check   # small shapes, CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


@triton.jit
def two_phase_kernel(x_ptr, wg_ptr, wu_ptr, bg_ptr, wd_ptr, bd_ptr, h_ptr, out_ptr, sync_ptr,
                     K: tl.constexpr, H: tl.constexpr, N: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                     XA: tl.constexpr, RA: tl.constexpr, XB: tl.constexpr, RB: tl.constexpr,
                     TICKETS: tl.constexpr, PREFETCH: tl.constexpr, SPIN_LOAD: tl.constexpr,
                     SHARDS: tl.constexpr = 1, BACKOFF: tl.constexpr = 0, NO_SYNC: tl.constexpr = False):
    """Stage 0: ``h = silu(x·Wg) * (x·Wu)`` (GATED) or ``gelu_tanh(x·Wg + bg)``; stage 1: ``out = h·Wd (+ bd)``.

    x ``[K]``, Wg/Wu ``[H, K]``, Wd ``[N, H]`` contiguous; h ``[H]`` in x's dtype; sync: 3 int32 (tickets handed
    out, stage-0 tickets done, stage-1 tickets done), zero on entry and left zero.
    XA, RA: hidden values per stage-0 ticket, K step; XB: outputs per stage-1 ticket; RB >= H (pow2).
    TICKETS: order work by an atomic ticket (else by program id); PREFETCH: stage 1 loads its W2 rows before the
    wait; SPIN_LOAD: spin on a volatile load (else on an atomic), one acquire after.
    SHARDS: stage-0 done counts spread over this many int32 (128 B apart, at sync + 32 ...): fewer same-address
    atomics; BACKOFF: ns of nanosleep between spins; NO_SYNC: no counting or waiting at all (WRONG results: the
    lower bound of the stream without the ordering).
    """
    NA: tl.constexpr = (H + XA - 1) // XA
    NB: tl.constexpr = (N + XB - 1) // XB
    if TICKETS:
        t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    else:
        t = tl.program_id(0)
    if t < NA:
        rows = t * XA + tl.arange(0, XA)[:, None]
        rmask = rows < H
        r = tl.arange(0, RA)[None, :]
        acc0 = tl.zeros([XA, RA], tl.float32)
        acc1 = tl.zeros([XA, RA], tl.float32)
        for k0 in range(0, K, RA):
            ks = k0 + r
            km = ks < K
            xv = tl.load(x_ptr + ks, km, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc0 += tl.load(wg_ptr + ks + K * rows, km & rmask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32) * xv
            if GATED:
                acc1 += tl.load(wu_ptr + ks + K * rows, km & rmask, other=0.0,
                                eviction_policy="evict_first").to(tl.float32) * xv
        a0 = tl.sum(acc0, 1)[:, None]
        if GATED:
            a1 = tl.sum(acc1, 1)[:, None]
            hv = a0 * tl.sigmoid(a0) * a1
        else:
            if HAS_BIAS:
                a0 += tl.load(bg_ptr + rows, rmask, other=0.0).to(tl.float32)
            inner = 0.7978845608028654 * (a0 + 0.044715 * a0 * a0 * a0)
            hv = a0 * tl.sigmoid(2.0 * inner)
        tl.store(h_ptr + rows, hv.to(h_ptr.dtype.element_ty), rmask)
        if not NO_SYNC:
            tl.debug_barrier()  # every thread's h stores before the release below
            if SHARDS == 1:
                tl.atomic_add(sync_ptr + 1, 1, sem="release")
            else:
                tl.atomic_add(sync_ptr + 32 + (t % SHARDS) * 32, 1, sem="release")
    else:
        cols = (t - NA) * XB + tl.arange(0, XB)[:, None]
        cmask = cols < N
        hs = tl.arange(0, RB)[None, :]
        hmask = hs < H
        if PREFETCH:
            w = tl.load(wd_ptr + cols * H + hs, cmask & hmask, other=0.0, eviction_policy="evict_first")
        if NO_SYNC:
            pass
        elif SHARDS > 1:
            shards = sync_ptr + 32 + tl.arange(0, SHARDS) * 32
            done = tl.sum(tl.load(shards, volatile=True), 0)
            while done < NA:
                if BACKOFF > 0:
                    tl.inline_asm_elementwise(f"nanosleep.u32 {BACKOFF}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                              is_pure=False, pack=1)
                done = tl.sum(tl.load(shards, volatile=True), 0)
            tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        elif SPIN_LOAD:
            done = tl.load(sync_ptr + 1, volatile=True)
            while done < NA:
                done = tl.load(sync_ptr + 1, volatile=True)
            tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        else:
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            while done < NA:
                done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        if not PREFETCH:
            w = tl.load(wd_ptr + cols * H + hs, cmask & hmask, other=0.0, eviction_policy="evict_first")
        h_all = tl.load(h_ptr + hs, hmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * h_all, 1)[:, None]
        if HAS_BIAS:
            acc += tl.load(bd_ptr + cols, cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), cmask)
        if not NO_SYNC:
            tl.debug_barrier()
            finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel")
            if finished == NB - 1:  # every ticket is taken and every program but this one has ended
                tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
                tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")
                tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed")
                if SHARDS > 1:
                    tl.store(sync_ptr + 32 + tl.arange(0, SHARDS) * 32, tl.zeros([SHARDS], tl.int32))


class TwoPhase:
    """The kernel bound to one MLP's tensors: ``call()`` runs one launch into ``out``."""

    def __init__(self, x, wg, wu, bg, wd, bd, *, xa, ra, xb, warps_note=None, tickets=True, prefetch=True,
                 spin_load=False, warps=16, shards=1, backoff=0, no_sync=False):
        self.x, self.wg, self.wu, self.bg, self.wd, self.bd = x, wg, wu, bg, wd, bd
        self.H, self.K = wg.shape
        self.N = wd.shape[0]
        self.h = torch.empty(self.H, device=x.device, dtype=x.dtype)
        self.out = torch.empty(1, self.N, device=x.device, dtype=x.dtype)
        self.sync = torch.zeros(32 + 32 * max(shards, 1), device=x.device, dtype=torch.int32)
        self.meta = dict(K=self.K, H=self.H, N=self.N, GATED=wu is not None, HAS_BIAS=bg is not None, XA=xa,
                         RA=min(ra, triton.next_power_of_2(self.K)), XB=xb, RB=triton.next_power_of_2(self.H),
                         TICKETS=tickets, PREFETCH=prefetch, SPIN_LOAD=spin_load, SHARDS=shards, BACKOFF=backoff,
                         NO_SYNC=no_sync, num_warps=warps)
        self.grid = (triton.cdiv(self.H, xa) + triton.cdiv(self.N, xb),)

    def call(self):
        wu = self.wu if self.wu is not None else self.wg
        bg = self.bg if self.bg is not None else self.wg
        bd = self.bd if self.bd is not None else self.wd
        two_phase_kernel[self.grid](self.x, self.wg, wu, bg, self.wd, bd, self.h, self.out, self.sync, **self.meta)
        return self.out


def reference(x, wg, wu, bg, wd, bd):
    xd = x.double().reshape(1, -1)
    a0 = xd @ wg.double().T
    if wu is not None:
        h = torch.nn.functional.silu(a0) * (xd @ wu.double().T)
    else:
        h = torch.nn.functional.gelu(a0 + bg.double(), approximate="tanh")
    h = h.to(x.dtype).double()  # rounded as eager rounds the intermediate
    out = h @ wd.double().T
    return out + bd.double() if bd is not None else out


def make(row: str, device: str, dtype, scale_small: bool = False):
    g = torch.Generator(device="cpu").manual_seed(0)
    if row == "llama":
        K, H, N, gated = (96, 200, 72, True) if scale_small else (4096, 14336, 4096, True)
    else:
        K, H, N, gated = (64, 136, 40, False) if scale_small else (1024, 4096, 1024, False)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = rnd(K)
    wg = rnd(H, K, scale=K ** -0.5)
    wu = rnd(H, K, scale=K ** -0.5) if gated else None
    bg = None if gated else rnd(H, scale=0.1)
    wd = rnd(N, H, scale=H ** -0.5)
    bd = None if gated else rnd(N, scale=0.1)
    return x, wg, wu, bg, wd, bd


def rel_err(out, ref) -> float:
    return ((out.double().reshape(ref.shape) - ref).norm() / ref.norm()).item()


def check() -> None:
    """Interpreter (or GPU) correctness at small odd shapes, every variant, three calls each (counters reset)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for row in ("llama", "gpt2m"):
        for dtype in (torch.float32, torch.float16):
            tensors = make(row, device, dtype, scale_small=True)
            ref = reference(*tensors)
            for tickets, shards in ((True, 1), (False, 1), (False, 4)):
                for prefetch in (True, False):
                    k = TwoPhase(*tensors, xa=4, ra=32, xb=2, tickets=tickets, prefetch=prefetch, warps=4,
                                 shards=shards)
                    for _ in range(3):
                        k.out.fill_(float("nan"))
                        err = rel_err(k.call(), ref)
                        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (row, dtype, tickets, err)
                    assert not k.sync.any(), k.sync
            print(f"{row} {dtype}: ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", default="llama,gpt2m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.check:
        check()
        return
    for row in args.rows.split(","):
        compare(row, args.rounds, args.quick)


def compare(row: str, rounds: int, quick: bool) -> None:
    """fxfuse's optimized module for ``row`` beside every two-phase variant (do_bench, then device µs)."""
    from triton.testing import do_bench

    from benchmarks.timing import kernels_after_flush
    from benchmarks.workloads import optimized_row

    def bench(fn) -> float:
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    name = {"llama": "llama_swiglu_m1", "gpt2m": "gpt2m_mlp_m1"}[row]
    w, mod, fast, x = optimized_row(name)
    sw = mod.state_dict()
    if row == "llama":
        tensors = (x.reshape(-1), sw["gate.weight"], sw["up.weight"], None, sw["down.weight"], None)
        base = dict(xa=1, ra=4096, xb=1, tickets=False)
        variants = [dict(base, no_sync=True), dict(base, no_sync=True, prefetch=False),
                    dict(base, shards=32), dict(base, shards=32, prefetch=False),
                    dict(base, shards=32, backoff=200), dict(base, shards=32, backoff=200, prefetch=False),
                    dict(base, shards=64, backoff=500), dict(base, prefetch=False)]
    else:
        tensors = (x.reshape(-1), sw["fc.weight"], None, sw["fc.bias"], sw["proj.weight"], sw["proj.bias"])
        base = dict(xa=4, ra=1024, xb=1, warps=8, tickets=False)
        variants = [dict(base, no_sync=True), dict(base, no_sync=True, prefetch=False),
                    dict(base, shards=32), dict(base, shards=32, prefetch=False),
                    dict(base, shards=32, backoff=200), dict(base, shards=32, backoff=200, prefetch=False),
                    dict(base, shards=16, backoff=100, xa=2), dict(base)]
    if quick:
        variants = variants[:2]
    ref = reference(*tensors)
    print(f"== {name}: fxfuse module (do_bench µs) vs one two-phase launch", flush=True)
    cands = {"fxfuse module": lambda: fast(x)}
    for v in variants:
        try:
            k = TwoPhase(*tensors, **v)
            k.out.fill_(float("nan"))
            err = rel_err(k.call(), ref)
            assert not k.sync.any(), k.sync.tolist()
            label = " ".join(f"{a}={b}" for a, b in v.items())
            print(f"  {label:48s} rel err {err:.1e}", flush=True)
            cands[label] = k.call
        except Exception as err:
            print(f"  {v}: failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
    times = {k: [] for k in cands}
    for _ in range(rounds):
        for label, fn in cands.items():
            times[label].append(bench(fn))
    for label, fn in cands.items():
        dev = kernels_after_flush(fn)
        dev_us = sum(t for _, t, _ in dev)
        print(f"  {label:48s} do_bench {statistics.median(times[label]):7.2f} µs "
              f"(rounds {', '.join(f'{t:.2f}' for t in times[label])})  device {dev_us:6.2f}", flush=True)




if __name__ == "__main__":
    main()
