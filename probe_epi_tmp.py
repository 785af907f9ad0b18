"""How much the GeGLU epilogue's activation costs the gated TMA stage (seed shape), and tanh.approx instead."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from fxfuse import epilogue as ep
from fxfuse.kernels import run_stage_tma
import torch.nn.functional as F

ep.OPS["gelu_tanh_hw"] = ep.OpDef(
    "gelu_tanh_hw", 1,
    "(0.5 * {0} * (1.0 + tl.inline_asm_elementwise('tanh.approx.f32 $0, $1;', '=r,r', "
    "[0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0})], dtype=tl.float32, is_pure=True, pack=1)))",
    lambda x: F.gelu(x, approximate="tanh"))
ep.OPS["silu_hw"] = ep.OpDef(
    "silu_hw", 1,
    "({0} * (0.5 + 0.5 * tl.inline_asm_elementwise('tanh.approx.f32 $0, $1;', '=r,r', [0.5 * {0}], "
    "dtype=tl.float32, is_pure=True, pack=1)))", F.silu)
torch.manual_seed(0)
d = dict(device="cuda", dtype=torch.bfloat16)
for (m, k, n) in [(8192, 768, 3072), (4096, 4096, 14336)]:
    x = torch.randn(m, k, **d)
    wg, wu = (torch.randn(n, k, **d) * k**-0.5 for _ in range(2))
    ref = (F.gelu(x.float() @ wg.float().T, approximate="tanh") * (x.float() @ wu.float().T))
    epis = ["mul(a0,a1)", "mul(gelu_tanh(a0),a1)", "mul(gelu_tanh_hw(a0),a1)", "mul(silu(a0),a1)", "mul(silu_hw(a0),a1)"]
    fns = {e: (lambda e=e: run_stage_tma(x, [wg, wu], [None, None], [], e, check=False)) for e in epis}
    for e, f in fns.items():
        out = f(); torch.cuda.synchronize()
        if "gelu" in e:
            print(e, "rel err", ((out.float() - ref).norm() / ref.norm()).item(), flush=True)
    res = {e: [] for e in fns}
    for r in range(5):
        for e in (epis if r % 2 == 0 else epis[::-1]):
            res[e].append(do_bench(fns[e], warmup=25, rep=100, return_mode="median") * 1e3)
    print(f"M={m} K={k} N={n}:", {e: round(statistics.median(v), 1) for e, v in res.items()}, flush=True)
    gemm = do_bench(lambda: (x @ wg.T, x @ wu.T), warmup=25, rep=100, return_mode="median") * 1e3
    print("  cuBLAS two plain GEMMs", round(gemm, 1), flush=True)
