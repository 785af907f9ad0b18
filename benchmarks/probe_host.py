"""Host-overhead probe: where do the µs of one fxfuse forward go? (development tool)"""
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fxfuse import codegen, ops  # noqa: E402
from fxfuse.kernels import run_stage  # noqa: E402

torch.set_grad_enabled(False)


def wall(fn, n=100):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


dt = torch.bfloat16
x = torch.randn(1, 1024, device="cuda", dtype=dt)
w1 = torch.randn(4096, 1024, device="cuda", dtype=dt) / 32
b1 = torch.randn(4096, device="cuda", dtype=dt)
w2 = torch.randn(1024, 4096, device="cuda", dtype=dt) / 64
b2 = torch.randn(1024, device="cuda", dtype=dt)
spec = "1b:gelu_tanh(a0);1b:a0"
args = (x, [w1, w2], [b1, b2], [], spec)
print("eager 2xlinear+gelu   ", wall(lambda: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)))
print("torch.ops.fxfuse.mlp  ", wall(lambda: torch.ops.fxfuse.mlp(*args)))
print("ops._dispatch         ", wall(lambda: ops._dispatch(*args)))
print("2x run_stage unchecked", wall(lambda: run_stage(run_stage(x, [w1], [b1], [], "gelu_tanh(a0)", check=False),
                                                      [w2], [b2], [], "a0", check=False)))
print("2x run_stage checked  ", wall(lambda: run_stage(run_stage(x, [w1], [b1], [], "gelu_tanh(a0)"), [w2], [b2], [], "a0")))
k = codegen.generated_kernel(1, "a0").fused_stage_kernel
print("autotuner cache entries (a0):", len(k.cache), list(k.cache)[:4])
import cProfile  # noqa: E401,E402
import pstats

prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    torch.ops.fxfuse.mlp(*args)
torch.cuda.synchronize()
prof.disable()
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "host_profile.txt"), "w") as f:
    pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
gc.disable()
print("torch.ops.fxfuse.mlp gc off", wall(lambda: torch.ops.fxfuse.mlp(*args)))
gc.enable()
# big shape: per-call wall of run_stage (was 0.8 s/call in probe.py)
xb = torch.randn(8192, 768, device="cuda", dtype=dt)
wb = torch.randn(3072, 768, device="cuda", dtype=dt) / 28
bb = torch.randn(3072, device="cuda", dtype=dt)
t = time.perf_counter(); run_stage(xb, [wb], [bb], [], "gelu_tanh(a0)"); torch.cuda.synchronize()
print("big first call s", time.perf_counter() - t)
for i in range(3):
    t = time.perf_counter(); run_stage(xb, [wb], [bb], [], "gelu_tanh(a0)"); torch.cuda.synchronize()
    print("big call s", time.perf_counter() - t)
k = codegen.generated_kernel(1, "gelu_tanh(a0)").fused_stage_kernel
print("cache:", list(k.cache))
from triton.testing import do_bench  # noqa: E402

print("do_bench big us", do_bench(lambda: run_stage(xb, [wb], [bb], [], "gelu_tanh(a0)"), return_mode="median") * 1e3)
print("cache after:", list(k.cache))
