"""The benchmark's workload table, its pass/fail logic and its time bound (CPU only, no fxfuse call)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import bench_workloads as bench  # noqa: E402
from benchmarks.limits import limit_fns  # noqa: E402
from benchmarks.workloads import EAGER_SLACK, WORKLOADS, build_module, count_work, judge, target_text  # noqa: E402

# The "Targets" table of /work/shared/workloads.md: (GPU median µs, wall µs per call); None: no target.
TARGETS = {
    "seed_geglu": (180, None),
    "gpt2_mlp": (118, None),
    "llama_swiglu_m1": (92, None),
    "llama_swiglu_m16": (92, None),
    "llama_swiglu_4096": (1900, None),
    "gpt2m_mlp_m1": (8, 15),
    "gpt2m_mlp_m8": (None, None),
    "nerf64": (60, None),
    "nerf128": (220, None),
}


def test_every_workload_has_its_target():
    assert [w.name for w in WORKLOADS] == list(TARGETS)
    for w in WORKLOADS:
        assert (w.target_us, w.target_wall_us) == TARGETS[w.name], w.name
    decode = {w.name for w in WORKLOADS if w.decode}
    assert decode == {"llama_swiglu_m1", "llama_swiglu_m16", "gpt2m_mlp_m1", "gpt2m_mlp_m8"}


def test_target_text():
    assert target_text(180) == "≤ 180"
    assert target_text(8, 15) == "≤ 8, wall ≤ 15"
    assert target_text(None) == "—"


def test_judge_target_and_eager():
    v = judge(170, 240, 180)
    assert (v.meets_target, v.not_slower_than_eager, v.passed, v.why) == (True, True, True, "")
    assert judge(180, 240, 180).passed  # the target is inclusive
    v = judge(190, 240, 180)
    assert v.meets_target is False and v.not_slower_than_eager and not v.passed and "190 > 180" in v.why
    # faster than the target but slower than eager: fails ("no workload gets slower than eager")
    v = judge(50, 40, 60)
    assert v.meets_target and not v.not_slower_than_eager and not v.passed and "slower than eager" in v.why
    # within the noise allowance of eager passes, beyond it fails
    assert judge(100 * (1 + EAGER_SLACK) - 0.01, 100, 118).passed
    assert not judge(100 * (1 + EAGER_SLACK) + 0.01, 100, 118).passed
    assert judge(103, 100, 118, eager_slack=0.05).passed


def test_judge_row_without_target():
    v = judge(20, 22, None)
    assert v.meets_target is None and v.passed
    v = judge(30, 22, None)
    assert v.meets_target is None and not v.passed


def test_judge_wall_target_and_decode_wall():
    ok = dict(target_wall_us=15, fxfuse_wall_us=14, eager_wall_us=50)
    assert judge(7, 20, 8, **ok).passed
    v = judge(7, 20, 8, **{**ok, "fxfuse_wall_us": 16})
    assert v.meets_target is False and not v.passed and "wall 16 > 15" in v.why
    v = judge(7, 20, 8, **{**ok, "fxfuse_wall_us": None})
    assert v.meets_target is False and not v.not_slower_than_eager and not v.passed
    # a decode row with no wall target still must not be slower than eager on the wall clock
    v = judge(90, 100, 92, fxfuse_wall_us=150, eager_wall_us=105)
    assert v.meets_target and not v.not_slower_than_eager and not v.passed and "wall slower" in v.why


def test_judge_failures():
    v = judge(100, 200, 180, correct=False)
    assert v.meets_target is False and not v.not_slower_than_eager and not v.passed and v.why == "wrong results"
    for missing in (None, "ERR: boom", "skipped (budget)", float("nan")):
        v = judge(missing, 200, 180)
        assert not v.passed and "no fxfuse time" in v.why, missing
    v = judge(100, None, 180)  # eager not measured: cannot claim "not slower"
    assert not v.passed and "no eager time" in v.why


def _row(name: str, fxfuse_us, eager_us=100.0, wall=None, correct=True) -> dict:
    w = next(w for w in WORKLOADS if w.name == name)
    row = bench.new_row(w)
    row["floor"] = {"floor_us": 50.0, "flops": 1e9, "bytes": 1e6, "bound": "compute"}
    row["gpu_us"] = {"eager": eager_us, "cudagraph": eager_us, "compile_default": 120.0,
                     "compile_max_autotune": bench.SKIPPED_BUDGET, "compile_fxfuse": 110.0, "fxfuse": fxfuse_us}
    row["gpu_rounds"] = {"eager": [eager_us] * 3}
    row["wall_us"] = dict(wall or {})
    row["rel_err"] = {"eager": 3e-3, "fxfuse": 3e-3}
    row["check"] = {"pass": correct, "deterministic": True}
    bench.derive(row)
    return row


def test_results_table_has_verdict_columns():
    args = bench.parse_args(["--skip-max-autotune"])
    rows = [
        _row("seed_geglu", 170.0, eager_us=240.0),
        _row("gpt2m_mlp_m8", 90.0, eager_us=20.0, wall={"eager": 50.0, "fxfuse": 120.0, "fxfuse_cuda_graphs": "n/a"}),
    ]
    env = {"gpu": "test", "torch": "x", "cuda": None, "triton": "y", "python": "3", "date": "today", "argv": "bench"}
    md = bench.render_md(env, {}, rows, args)
    header = next(line for line in md.splitlines() if line.startswith("| name | floor"))
    for col in ("compile default", "compile max-autotune", "compile backend=fxfuse", "vs eager",
                "fxfuse CUDA graphs wall", "target",
                "meets target", "not slower than eager", "pass"):
        assert f"| {col} |" in header, col
    geglu = next(line for line in md.splitlines() if line.startswith("| seed_geglu |"))
    m8 = next(line for line in md.splitlines() if line.startswith("| gpt2m_mlp_m8 |"))
    assert "skipped (budget)" in geglu and geglu.endswith("| ≤ 180 | yes | yes | PASS |")
    assert "| n/a |" in m8 and "| — | — | no | FAIL: slower than eager" in m8
    assert "**Verdict: 1/2 rows pass** (targets met 1/1, not slower than eager 1/2); every row passes: no." in md


@pytest.mark.parametrize("name", ["seed_geglu", "gpt2m_mlp_m8", "nerf64"])
def test_limits_run_every_linear_with_its_own_weight_and_read_the_minimum_bytes(name):
    w = next(w for w in WORKLOADS if w.name == name)
    mod = build_module(w, device="cpu").float()  # float: exact products to compare against
    linears = [m for m in mod.modules() if isinstance(m, torch.nn.Linear)]
    m = 3
    fns = limit_fns(mod, m)
    outs = fns["gemms_alone"]()
    assert len(outs) == len(linears)
    # a plain GEMM per linear, of the module's own weight (not a copy), with no bias and no activation
    steps = fns["gemms_alone"].steps
    for (a, weight, out), lin, o in zip(steps, linears, outs):
        assert weight is lin.weight and o is out and a.shape == (m, lin.in_features)
        torch.testing.assert_close(o, a @ lin.weight.t())
    # read once: one buffer of exactly the bytes the floor counts (input + weights + biases + output)
    buf = fns["read_once"].buf
    _, nbytes = count_work(mod, m, linears[0].in_features, linears[-1].out_features, 4)
    assert buf.numel() * buf.element_size() == nbytes and buf.dtype == torch.float32
    torch.testing.assert_close(fns["read_once"](), buf.sum())


def test_read_kernel_reads_every_element_once():
    # the streaming read behind "read once" on the GPU (here in the interpreter): a ragged last program included
    from benchmarks.limits import _read_sum_kernel

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3 * 2048 * 4 + 77, device=dev).to(torch.float16)
    partial = torch.empty(4, device=dev)
    _read_sum_kernel[(4,)](x, partial, x.numel(), BLOCK=2048, STEPS=4, num_warps=4)
    torch.testing.assert_close(partial.sum(), x.float().sum(), rtol=1e-4, atol=1e-2)


def test_limits_table_and_ratios():
    args = bench.parse_args(["--skip-max-autotune"])
    row = _row("llama_swiglu_m1", 93.0, eager_us=114.0)
    row["gpu_us"].update(read_once=90.0, gemms_alone=100.0)
    bench.derive(row)
    assert row["derived"]["fxfuse_over_read_once"] == pytest.approx(93 / 90)
    assert row["derived"]["fxfuse_over_gemms_alone"] == pytest.approx(0.93)
    env = {"gpu": "test", "torch": "x", "cuda": None, "triton": "y", "python": "3", "date": "today", "argv": "bench"}
    md = bench.render_md(env, {}, [row], args)
    line = next(line for line in md.splitlines() if line.startswith("| llama_swiglu_m1 | compute |"))
    assert line == "| llama_swiglu_m1 | compute | 50.0 | 90.0 | 100 | 93.0 | 1.03× | 0.93× | ≤ 92 |"
    # a run without limits (--skip-limits) prints no such table
    del row["gpu_us"]["read_once"], row["gpu_us"]["gemms_alone"]
    assert "Measured limits" not in bench.render_md(env, {}, [row], args)
    assert bench.parse_args(["--skip-limits"]).skip_limits


def test_time_rounds_interleaves_and_keeps_the_median():
    row = bench.new_row(next(w for w in WORKLOADS if w.name == "seed_geglu"))
    row["floor"] = {"floor_us": 50.0}
    order = []

    def variant(name, values):
        it = iter(values)

        def fn():
            order.append(name)
            v = next(it)
            if isinstance(v, Exception):
                raise v
            return v

        return fn

    fns = {"eager": variant("eager", [100.0, 103.0, 101.0]), "fxfuse": variant("fxfuse", [90.0, 80.0, 95.0]),
           "broken": variant("broken", [50.0, RuntimeError("boom")])}
    bench.time_rounds(row, "gpu_us", "gpu_rounds", fns, lambda fn: fn(), 3)
    # one call per variant per round, each round starting one further along the list (3 variants, 3 rounds);
    # a variant that failed (broken, in round 2) leaves the rounds
    assert order == ["eager", "fxfuse", "broken", "fxfuse", "broken", "eager", "eager", "fxfuse"]
    assert row["gpu_rounds"] == {"eager": [100.0, 103.0, 101.0], "fxfuse": [90.0, 80.0, 95.0], "broken": [50.0]}
    assert row["gpu_us"]["eager"] == 101.0 and row["gpu_us"]["fxfuse"] == 90.0  # the medians of the rounds
    assert row["gpu_us"]["broken"].startswith("ERR: RuntimeError: boom") and "gpu_us.broken" in row["errors"]
    bench.derive(row)
    assert row["derived"]["eager_spread"] == pytest.approx(0.03)  # (max - min) / min of eager's rounds
    assert row["derived"]["speedup_vs_eager"] == pytest.approx(101 / 90)


def test_rounds_flag():
    assert bench.parse_args([]).rounds == bench.ROUNDS == 3
    assert bench.parse_args(["--rounds", "5"]).rounds == 5


def test_max_autotune_bound():
    args = Namespace(skip_max_autotune=False, deadline=420.0, max_autotune_reserve=45.0, max_autotune_budget=300.0)
    assert bench.max_autotune_skip(args, 100, 0, 0) == (None, None)
    assert bench.max_autotune_skip(args, 375, 100, 30) == (None, None)  # 375 + 45 = 420 still fits
    cell, why = bench.max_autotune_skip(args, 376, 100, 30)
    assert cell == "skipped (budget)" and "deadline" in why
    assert bench.max_autotune_skip(args, 370, 100, 30) == (None, None)
    cell, why = bench.max_autotune_skip(args, 370, 100, 60)  # a compile of this run took 60 s: reserve 60
    assert cell == "skipped (budget)" and "60 s reserve" in why
    cell, why = bench.max_autotune_skip(args, 200, 301, 40)
    assert cell == "skipped (budget)" and "budget" in why
    args.skip_max_autotune = True
    assert bench.max_autotune_skip(args, 0, 0, 0)[0] == "skipped (--skip-max-autotune)"


def test_defaults_fit_the_device_limit():
    args = bench.parse_args([])
    # ~420 s for the whole run leaves room for install and the device's 600 s limit per command
    assert args.deadline <= 420 and args.max_autotune_reserve >= 43 and not args.skip_max_autotune


@pytest.mark.parametrize("flag", ["--help", "--dry-run"])
def test_cli_runs_on_cpu(flag):
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_workloads.py"), flag, "--only", "nerf64"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("--max-autotune-budget" in res.stdout) if flag == "--help" else ("dry run OK" in res.stdout)


def test_workload_bench_runs_a_row_on_cpu(tmp_path):
    # The whole row pipeline in the interpreter (--cpu-smoke: tiny M, host timer): every variant built and timed,
    # the limits timed in the same rounds, max-autotune after a dropped timing and in rounds beside eager.
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_workloads.py"), "--cpu-smoke", "--only",
                          "gpt2m_mlp_m8", "--max-autotune-rows", "gpt2m_mlp_m8", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    g, rounds = row["gpu_us"], row["gpu_rounds"]
    for key in ("eager", "fxfuse", "read_once", "gemms_alone", "compile_max_autotune", "eager_beside_max_autotune"):
        assert isinstance(g[key], float), (key, g[key])
    assert len(rounds["read_once"]) == len(rounds["fxfuse"]) == len(rounds["compile_max_autotune"]) == 3
    assert isinstance(row["check"]["gpu_warmup"], float) and isinstance(row["check"]["max_autotune_warmup"], float)
    assert "read_once" not in row["wall_us"]  # a limit is a GPU bound: no wall time
    md = (tmp_path / "results.md").read_text()
    assert "| gpt2m_mlp_m8 | memory |" in md and "Measured limits" in md and row["check"]["pass"]


@pytest.mark.parametrize("cache, family", [("dynamic", "llama"), ("static", "llama"), ("static", "qwen3_moe")])
def test_decode_model_bench_runs_on_cpu(tmp_path, cache, family):
    # The whole-model decode benchmark on a tiny config in the interpreter: both variants decode (into a
    # DynamicCache, or a StaticCache with explicit positions), fxfuse's logits match the fp32 model's (the model is
    # fp32 here), and the table is written. (Qwen3-MoE: its experts run fxfuse's MoE kernels; its head_dim is not
    # hidden / heads.)
    static = cache == "static"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_decode_model.py"), "--tiny", "--layers", "1",
                          "--steps", "2", "--rounds", "1", "--prompt", "4", "--out", str(tmp_path),
                          "--family", family] + (["--static"] if static else []),
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    name = "decode_model" if family == "llama" else f"decode_{family}"
    table = (tmp_path / (name + ("_static.md" if static else ".md"))).read_text()
    assert ("StaticCache" if static else "DynamicCache") in table
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines()
            if line.startswith("| eager") or line.startswith("| fxfuse")}
    assert set(rows) == {"eager", "fxfuse"}
    assert float(rows["fxfuse"][-1].strip(" |")) < 1e-4  # rel err against the fp32 model


def test_decode_model_busy_time_merges_overlapping_kernels():
    from benchmarks.bench_decode_model import busy_us

    class Span:
        def __init__(self, a, b):
            self.time_range = Namespace(start=a, end=b)
            self.device_type = torch.autograd.DeviceType.CUDA
            self.is_user_annotation = False

    # (a launch waiting beside the kernel before it overlaps it: counted once)
    assert busy_us([Span(0, 10), Span(5, 12), Span(20, 25), Span(21, 22)]) == 17


def test_generate_bench_runs_on_cpu(tmp_path):
    # model.generate() with a static cache and CompileConfig(backend="fxfuse") on a tiny config in the interpreter:
    # the backend's variant fuses the decode step's MLP and makes eager's greedy tokens.
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_generate.py"), "--tiny", "--layers", "1",
                          "--new-tokens", "3", "--prompt", "4", "--rounds", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split(" | ") for line in (tmp_path / "generate.md").read_text().splitlines()
            if line.startswith("| static cache")]
    assert len(rows) == 2
    backend = next(r for r in rows if "backend='fxfuse'" in r[0])
    assert int(backend[-2]) >= 1 and backend[-1].strip(" |") == "3 / 3"  # (fp32 here: the same tokens)


def test_moe_bench_runs_on_cpu(tmp_path):
    # The MoE experts benchmark on tiny stand-ins of transformers' experts classes in the interpreter: every point
    # correct against float64, the optimized module's kernels checked and running, a floor, one table line a point.
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_moe.py"), "--cpu-smoke", "--no-compile",
                          "--families", "mixtral,gpt_oss", "--tokens", "1,5", "--rounds", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [(r["family"], r["tokens"]) for r in rows] == [("mixtral", 1), ("mixtral", 5), ("gpt_oss", 1),
                                                          ("gpt_oss", 5)]
    for r in rows:
        assert r["kernels_agreed"] is True and r["floor"] > 0 and r["gflop"] > 0
        assert set(r["err"]) == {"eager", "fxfuse"} and max(r["err"].values()) < 1e-4
        assert all(isinstance(r["us"][name], float) for name in ("eager", "fxfuse"))
    table = [line for line in (tmp_path / "moe.md").read_text().splitlines() if line.startswith("| mixtral")
             or line.startswith("| gpt_oss")]
    assert len(table) == 4
    # --train: a training step's gradients against float64, its do_bench time, its steps back to back and its peak
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_moe.py"), "--cpu-smoke", "--no-compile",
                          "--train", "--families", "mixtral", "--tokens", "5", "--rounds", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    [row] = json.loads((tmp_path / "moe_train.json").read_text())["rows"]
    assert max(row["err"].values()) < 1e-4 and set(row["wall"]) == set(row["us"]) == {"eager", "fxfuse"}
    assert all(isinstance(v, float) and v > 0 for v in row["wall"].values())


def test_sweep_bench_runs_on_cpu(tmp_path):
    # The batch-size sweep on tiny stand-ins in the interpreter: every point fused, correct against float64, and
    # written with its strategy; sweep.json keeps each shape's rows in the order visited.
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_sweep.py"), "--cpu-smoke", "--shapes",
                          "gpt2m,nerf64", "--ms", "1,3,4", "--rounds", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert list(data["shapes"]) == ["gpt2m", "nerf64"]
    for shape in data["shapes"].values():
        assert [r["m"] for r in shape["rows"]] == [1, 3, 4]
        for r in shape["rows"]:
            assert r["correct"] and r["rel_err"]["fxfuse"] < 1e-4 and r["running"] != "nothing fused"
            # A point read slower (here: the interpreter's kernels) is timed again, and the second reading decides.
            read_slower = all(pick(r["rounds"]["fxfuse"]) > pick(r["rounds"]["eager"]) * 1.02
                              for pick in (statistics.median, min))
            assert ("recheck" in r) == read_slower
            if read_slower:
                assert len(r["recheck"]["rounds"]["fxfuse"]) == 1 and r["slower"] == r["recheck"]["slower"]
    md = (tmp_path / "sweep.md").read_text()
    n_slower = sum(r["slower"] for s in data["shapes"].values() for r in s["rows"])
    assert f"6 points: fxfuse correct at 6, slower than eager at {n_slower}**" in md
